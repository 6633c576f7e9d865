"""Fused intra-chunk preparation: gate cumsum, A = beta k k^T decay, the UT inverse, the WY vectors w, u.

Grid: ``(total_chunks, Hv)``; one program per (chunk, value head), 4 warps (``ops._DEFAULTS``).

Per chunk (rows r, j in 0..63, key/query head ``h // (Hv // Hqk)``, keys L2-normalised when asked)::

    G      = cumsum(g)                                   chunk-local
    A[r,j] = beta_r (k_r . k_j) exp(G_r - G_j)          j < r
    Tinv   = (I + A)^-1
    w      = Tinv (beta exp(G) k)      u = Tinv (beta v)

Why one kernel: FLA runs cumsum, k k^T, solve_tril and w/u as four kernels with HBM round trips of
the [64, 64] matrices and gates; here everything stays on chip and the chunk is read once.

Cost model (H200 run 4: this kernel took 2.6 ms at 16/32 heads x 32k tokens, ~21 us per program at one
8-warp program per SM): a program is a serial chain of small steps, so its latency is what counts:
barriers, layout conversions, occupancy.  Hence:

* the inverse is block substitution by doubling (``ut_inverse``): five steps of two 64x64x64 tf32 dots,
  no row extraction (the previous batched 16x16 forward substitution: ~100 barriers and ~400
  shuffles per program);
* the L2 norm of k is read off the Gram matrix's diagonal (k^ = diag(rk) k, so A's scaling is
  rk_r rk_j and w's is folded into Tinv's columns): the normalised keys never exist as a tile;
* w and u are ``(Tinv diag(c)) @ X`` with the row scales on the [64, 64] side and the raw k / v column
  blocks (``BW``) as the other operand, straight from memory;
* 4 warps (two programs per SM at ~228 registers; ``prep.maxnreg`` caps them for tuning).

Decay: it stays inside A, and each ``exp(G_r - G_j)`` is taken of a non-positive exponent (the causal
mask is applied *before* the exp), so nothing overflows however strong the decay (g = -1e4 gives
exact zeros, g = 0 ones).  Precision: G is summed in fp64 (64 adds) and stored as two fp32 planes
``G [2, Hv, B*T]`` = (hi, lo), hi + lo = G to ~1e-15 relative; every kernel forms
``G_a - G_b = (hi_a - hi_b) + (lo_a - lo_b)``.  With a plain fp32 G a decay between nearby tokens after
a very strong gate (|G| ~ 1e5) would be off by ulp(|G|) ~ 1e-2 in the exponent.  Head-major, so a
chunk's 64 gates are contiguous.

Dots: full fp32 for fp32 inputs; otherwise k k^T and w/u in the input dtype (as FLA), the inverse's
products in tf32 (emulated against float64 on random / correlated / clustered keys with logsigmoid,
strong and zero gates: relative error of Tinv <= 7e-4, the same order as the previous exact-diagonal +
tf32 scheme, well under the bf16 rounding that Tinv gets before the w/u dots).  Writes
``w [B,T,Hv,K]``, ``u [B,T,Hv,V]`` (input dtype), G, and for the backward (``STORE_T``) the inverse
``[total_chunks, Hv, 64, 64]`` in the input dtype (fp32 for fp32 inputs).

``LOAD_T`` (the backward, ``ops.prep_from_t``): the inverse comes from ``Tm_ptr``, where the training forward
stored it (``STORE_T``); k k^T and the inverse are skipped, G, w and u are formed as above (with the L2 norm,
the key norms from the rows instead of the Gram diagonal).

``DV_LOCAL`` (with ``LOAD_T``, the backward): also ``dvl = scale P^T dO`` ``[B,T,Hv,V]`` (input dtype), the
chunk-local part of ``dv_new`` (``chunk_bwd_state``'s ``LOCAL_DV``), so the serial state-gradient kernel does not
form the 64x64 score tile once per V-block on its chain.  It costs this kernel a q and a dO read and two dots.

``TB_ONLY`` (the inference forward, ``ops.use_tb_forward``): G and ``Tb = Tinv diag(beta)``
``[total_chunks, Hv, 64, 64]`` (input dtype, into ``Tm_ptr``) only; v is not read and w, u are not
written.  The state kernel then forms ``u - w S = Tb (v - diag(exp(G)) k^ S)`` itself (``FROM_TB``):
8 KB of writes per chunk and head in bf16 instead of 16-32 KB, and no v read here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (BT, L2_EPS, chunk_coords, chunk_ptr, gate_plane, gdiff, load_cols, load_rows, load_tb, load_vec,
                     masked_decay, mm, mmf, row_offs, store_cols)


@triton.jit
def ut_inverse(A, IEEE: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular fp32 [64, 64] A (fp32 result).

    Block substitution by doubling: with X the inverse of the block diagonal of (I + A) in blocks of S
    rows and A_S the entries of A in the blocks of 2S rows below their diagonal S-blocks,
    ``X <- X - X (A_S X)`` is the exact inverse in blocks of 2S ([[X1, 0], [-X2 A21 X1, X2]]).  From
    S = 1 (X = I, so the first step is just I - A_1) to 64: five steps of two 64x64x64 dots and a
    mask, nothing else (the earlier batched 16x16 row substitution cost ~100 barriers).  Every
    intermediate X is a set of diagonal blocks of the final inverse, so nothing grows beyond the result's
    own entries.  A runtime loop (not static_range): unrolled, the compiler hoisted all five masked
    copies of A and ran out of registers.
    """
    r = tl.arange(0, BT)
    ri = r[:, None]
    ci = r[None, :]
    # (ri >> s) == (ci >> s) within one 2^s block; (ri ^ ci) >> s == 1: same 2^(s+1) block, different 2^s ones
    X = tl.where(ri == ci, 1.0, 0.0) - tl.where(((ri ^ ci) >> 1) == 0, A, 0.0)
    for s in range(1, 6):
        As = tl.where(((ri ^ ci) >> s) == 1, A, 0.0)
        X = X - mmf(X, mmf(As, X, IEEE), IEEE)
    return X


@triton.jit(do_not_specialize=["T", "NT", "TT"])
def chunk_prep_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, G_ptr, Tm_ptr, cu_ptr, cidx_ptr,
                      q_ptr, do_ptr, dvl_ptr, scale, T, NT, TT, Hqk, Hv,
                      K: tl.constexpr, V: tl.constexpr, IS_VARLEN: tl.constexpr, USE_L2: tl.constexpr,
                      STORE_T: tl.constexpr, IEEE: tl.constexpr, BW: tl.constexpr, TB_ONLY: tl.constexpr = False,
                      LOAD_T: tl.constexpr = False, DV_LOCAL: tl.constexpr = False):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (Hv // Hqk)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    n, t0, L = chunk_coords(pid, cu_ptr, cidx_ptr, T, NT, IS_VARLEN, BT)
    r = tl.arange(0, BT)
    ri = r[:, None]
    ci = r[None, :]
    valid = r < L

    # chunk-local cumulative gate in fp64, kept as an fp32 (hi, lo) pair; padded rows (g = 0)
    # repeat the last real value
    g = load_vec(g_ptr, t0, L, h, Hv, BT, 0, TT)
    Gd = tl.cumsum(g.to(tl.float64), 0)
    gh = Gd.to(tl.float32)
    gl = (Gd - gh.to(tl.float64)).to(tl.float32)
    gp = chunk_ptr(G_ptr + h.to(tl.int64) * TT, t0, 0, 1, 1, TT) + row_offs(r, L, 1, 1)     # as load_gate reads it
    tl.store(gp, gh, mask=valid)
    tl.store(gp + gate_plane(Hv, TT), gl, mask=valid)
    beta = load_vec(beta_ptr, t0, L, h, Hv, BT, 0, TT)

    blk = pid.to(tl.int64) * Hv + h                      # this (chunk, head)'s [64, 64] tile of Tm
    kk = load_rows(k_ptr, t0, L, hk, Hqk, K, BT, 0, TT)
    if LOAD_T:
        # the training forward's inverse (saved by it, ``ops.prep_from_t``): only w and u are formed here
        Ti = load_tb(Tm_ptr, pid.to(tl.int64), h, Hv, False).to(tl.float32)
        if USE_L2:
            kf = kk.to(tl.float32)
            rk_r = tl.rsqrt(tl.sum(kf * kf, 1) + L2_EPS)
    else:
        # A = diag(beta) strict(k^ k^T * exp(G_r - G_j)) from the raw keys: with the L2 norm, k^ = diag(rk) k
        # and rk comes from the Gram matrix's diagonal, so the normalised keys never exist as a tile
        A = mm(kk, tl.trans(kk), IEEE, DT)
        if USE_L2:
            eye = ri == ci
            rk_r = tl.rsqrt(tl.sum(tl.where(eye, A, 0.0), 1) + L2_EPS)
            rk_c = tl.rsqrt(tl.sum(tl.where(eye, A, 0.0), 0) + L2_EPS)
            A = A * rk_r[:, None] * rk_c[None, :]
        strict = ri > ci
        d = gdiff(gh[:, None], gl[:, None], gh[None, :], gl[None, :])
        A = masked_decay(beta[:, None] * A, strict, d)
        Ti = ut_inverse(A, IEEE)
    cw = beta * tl.exp(gh + gl)
    if USE_L2:
        cw = cw * rk_r
    if TB_ONLY:
        # beta is 0 on rows past the end, so Tb's columns there are 0, and so are its rows (the inverse's
        # rows there are unit rows): v_new = Tb Y is 0 past the end whatever Y holds there
        tl.store(Tm_ptr + blk * 4096 + ri * 64 + ci, (Ti * beta[None, :]).to(Tm_ptr.dtype.element_ty))
    else:
        if STORE_T:
            tl.store(Tm_ptr + blk * 4096 + ri * 64 + ci, Ti.to(Tm_ptr.dtype.element_ty))

        # w = Tinv diag(beta exp(G) rk) k,  u = Tinv diag(beta) v: the row scales go on Tinv's columns (a
        # [64, 64] tile) and raw k / v column blocks are the other dot operand, straight from memory
        Tw = (Ti * cw[None, :]).to(DT)
        for c in tl.static_range(0, K, BW):
            store_cols(w_ptr, mm(Tw, load_cols(k_ptr, t0, L, hk, Hqk, K, BT, c, BW, TT), IEEE, DT),
                       t0, L, h, Hv, K, BT, c, BW, TT)
        Tu = (Ti * beta[None, :]).to(DT)
        for c in tl.static_range(0, V, BW):
            store_cols(u_ptr, mm(Tu, load_cols(v_ptr, t0, L, h, Hv, V, BT, c, BW, TT), IEEE, DT),
                       t0, L, h, Hv, V, BT, c, BW, TT)
        if DV_LOCAL:
            # the intra-chunk part of dv_new, scale P^T dO with P^T[j, r] = (k^_j . q^_r) exp(G_r - G_j) on
            # j <= r, r real: chunk-local, so it is formed here, in parallel over chunks, and the serial state
            # gradient kernel only adds (exp(G_last - G) k^) dS to it (LOCAL_DV there)
            qq = load_rows(q_ptr, t0, L, hk, Hqk, K, BT, 0, TT)
            pt = mm(kk, tl.trans(qq), IEEE, DT)
            if USE_L2:
                qf = qq.to(tl.float32)
                pt = pt * rk_r[:, None] * tl.rsqrt(tl.sum(qf * qf, 1) + L2_EPS)[None, :]
            m = (ri <= ci) & valid[None, :]
            pt = masked_decay(pt, m, gdiff(gh[None, :], gl[None, :], gh[:, None], gl[:, None]))
            pt = (pt * scale).to(DT)
            for c in tl.static_range(0, V, BW):
                store_cols(dvl_ptr, mm(pt, load_cols(do_ptr, t0, L, h, Hv, V, BT, c, BW, TT), IEEE, DT),
                           t0, L, h, Hv, V, BT, c, BW, TT)
