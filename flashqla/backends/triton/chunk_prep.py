"""Fused intra-chunk preparation: gate cumsum, A = beta k k^T decay, the UT inverse, the WY vectors w, u.

Grid: ``(total_chunks, Hv)``; one program per (chunk, value head), 8 warps (``ops._DEFAULTS``).

Per chunk (rows r, j in 0..63, key/query head ``h // (Hv // Hqk)``, keys L2-normalised when asked)::

    G      = cumsum(g)                                   chunk-local
    A[r,j] = beta_r (k_r . k_j) exp(G_r - G_j)          j < r
    Tinv   = (I + A)^-1
    w      = Tinv (beta exp(G) k)      u = Tinv (beta v)

Why one kernel: FLA runs cumsum, k k^T, solve_tril and w/u as four kernels with HBM round trips of
the [64, 64] matrices and gates; here everything stays in registers and the chunk is read once.

The inverse, on whole [64, 64] tiles (every dot has M = 64: Triton lays chained dots out with all warps
along M, so dots of 16-row tiles would be computed redundantly by every warp; an earlier 16-row-block
version of this kernel also spilled):

1. the four diagonal 16x16 blocks of A, as a [4, 16, 16] batch (a reshape and a masked sum), are
   inverted together by row-wise forward substitution in exact fp32: ``Xd = (I + A_diag)^-1``;
2. with ``N = Xd A_off`` (A_off: the blocks below the diagonal), ``(I + A) = (I + A_diag)(I + N)`` and N is
   nilpotent of index 4 at block level, so ``Tinv = Xd - N Tinv`` converges exactly in three steps from
   ``Tinv = Xd`` (block forward substitution in Horner form): four 64x64x64 dots.

Decay: it stays inside A, and each ``exp(G_r - G_j)`` is taken of a non-positive exponent (the causal
mask is applied *before* the exp), so nothing overflows however strong the decay (g = -1e4 gives
exact zeros, g = 0 ones).  Precision: G is summed in fp64 (64 adds) and stored as two fp32 planes
``G [2, Hv, B*T]`` = (hi, lo), hi + lo = G to ~1e-15 relative; every kernel forms
``G_a - G_b = (hi_a - hi_b) + (lo_a - lo_b)``.  With a plain fp32 G a decay between nearby tokens after
a very strong gate (|G| ~ 1e5) would be off by ulp(|G|) ~ 1e-2 in the exponent.  Head-major, so a
chunk's 64 gates are contiguous.

Dots: full fp32 for fp32 inputs; otherwise k k^T and w/u in the input dtype (as FLA), the inverse's
products in tf32.  Writes ``w [B,T,Hv,K]``, ``u [B,T,Hv,V]`` (input dtype), G, and for the backward
(``STORE_T``) the inverse ``[total_chunks, Hv, 64, 64]`` in the input dtype (fp32 for fp32 inputs).
Registers (K = V = 128, bf16, 8 warps): ~210 on sm_90, no spills.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import BT, L2_EPS, chunk_coords, gdiff, l2n, load_rows, load_vec, mm, mmf, store_rows, tok_rows


@triton.jit
def _inv_diag_blocks(A):
    """(I + A_diag)^-1 for the four diagonal 16x16 blocks of a strictly lower [64, 64] fp32 A.

    Returns the block-diagonal [64, 64] inverse.  Row-wise forward substitution, the four blocks in
    lock step ([4, 16, 16] batch): 15 steps of a masked row extraction and a 16x16 multiply-reduce.
    """
    A4 = tl.reshape(A, [4, 16, 4, 16])
    bi = tl.arange(0, 4)[:, None, None, None]
    bj = tl.arange(0, 4)[None, None, :, None]
    Ad = tl.sum(tl.where(bi == bj, A4, 0.0), 2)                     # [4, 16, 16]
    ri = tl.arange(0, 16)[None, :, None]
    ci = tl.arange(0, 16)[None, None, :]
    X = tl.where(ri == ci, 1.0, 0.0) + tl.zeros([4, 16, 16], tl.float32)
    for i in tl.static_range(1, 16):
        a = tl.sum(tl.where(ri == i, Ad, 0.0), 1)                   # row i of each block, [4, 16]
        xi = tl.sum(a[:, :, None] * X, 1)                           # sum_j A[i, j] X[j, :]
        X = tl.where(ri == i, tl.where(ci == i, 1.0, 0.0) - xi[:, None, :], X)
    return tl.reshape(tl.where(bi == bj, X[:, :, None, :], 0.0), [64, 64])


@triton.jit
def ut_inverse(kc, beta, gh, gl, IEEE: tl.constexpr, DT: tl.constexpr):
    """Tinv = (I + A)^-1, A[r, j] = beta_r (k_r . k_j) exp(G_r - G_j) for j < r; fp32 [64, 64]."""
    r = tl.arange(0, BT)
    strict = r[:, None] > r[None, :]
    d = gdiff(gh[:, None], gl[:, None], gh[None, :], gl[None, :])
    A = mm(kc, tl.trans(kc), IEEE, DT)
    A = tl.where(strict, beta[:, None] * A * tl.exp(tl.where(strict, d, 0.0)), 0.0)
    Xd = _inv_diag_blocks(A)
    N = mmf(Xd, tl.where((r // 16)[:, None] > (r // 16)[None, :], A, 0.0), IEEE)
    Ti = Xd - mmf(N, Xd, IEEE)
    Ti = Xd - mmf(N, Ti, IEEE)
    Ti = Xd - mmf(N, Ti, IEEE)
    return Ti


@triton.jit(do_not_specialize=["T", "NT", "TT"])
def chunk_prep_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, G_ptr, Tm_ptr, cu_ptr, cidx_ptr,
                      T, NT, TT, Hqk, Hv,
                      K: tl.constexpr, V: tl.constexpr, IS_VARLEN: tl.constexpr, USE_L2: tl.constexpr,
                      STORE_T: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (Hv // Hqk)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    n, t0, L = chunk_coords(pid, cu_ptr, cidx_ptr, T, NT, IS_VARLEN, BT)
    r = tl.arange(0, BT)
    valid = r < L

    # chunk-local cumulative gate in fp64, kept as an fp32 (hi, lo) pair; padded rows (g = 0)
    # repeat the last real value
    g = load_vec(g_ptr, t0, L, h, Hv, BT, 0, TT)
    Gd = tl.cumsum(g.to(tl.float64), 0)
    gh = Gd.to(tl.float32)
    gl = (Gd - gh.to(tl.float64)).to(tl.float32)
    gp = G_ptr + h.to(tl.int64) * TT + tok_rows(t0, r, TT)
    tl.store(gp, gh, mask=valid)
    tl.store(gp + Hv.to(tl.int64) * TT, gl, mask=valid)

    beta = load_vec(beta_ptr, t0, L, h, Hv, BT, 0, TT)
    kc = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)
    Ti = ut_inverse(kc, beta, gh, gl, IEEE, DT)
    if STORE_T:
        blk = pid.to(tl.int64) * Hv + h
        tl.store(Tm_ptr + blk * 4096 + r[:, None] * 64 + r[None, :], Ti.to(Tm_ptr.dtype.element_ty))
    Tc = Ti.to(DT)

    yw = (beta * tl.exp(gh + gl))[:, None] * kc.to(tl.float32)
    store_rows(w_ptr, mm(Tc, yw, IEEE, DT), t0, L, h, Hv, K, BT, 0, TT)
    yu = beta[:, None] * load_rows(v_ptr, t0, L, h, Hv, V, BT, 0, TT).to(tl.float32)
    store_rows(u_ptr, mm(Tc, yu, IEEE, DT), t0, L, h, Hv, V, BT, 0, TT)
