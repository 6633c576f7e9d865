"""Fused intra-chunk preparation: gate cumsum, A = beta k k^T decay, the UT solve, the WY vectors w, u.

Grid: ``(total_chunks, Hv)``; one program per (chunk, value head), 4 warps.

Per chunk (rows r, j in 0..63, key/query head ``h // (Hv // Hqk)``, keys L2-normalised when asked)::

    G      = cumsum(g)                                   chunk-local
    A[r,j] = beta_r (k_r . k_j) exp(G_r - G_j)          j < r
    w      = (I + A)^-1 (beta exp(G) k)      u = (I + A)^-1 (beta v)

Why one kernel: FLA runs cumsum, k k^T, solve_tril and w/u as four kernels with HBM round trips of
the [64, 64] matrices and gates; here everything stays in registers and the chunk is read once.

How: the chunk is four 16-row blocks (Triton cannot slice register tiles, so blocks are loaded
separately).  The ten lower blocks A_ij come from 16xKx16 dots.  The four diagonal blocks are
inverted by row-wise forward substitution in exact fp32 (``X_ii = (I + A_ii)^-1``); w and u then follow
by *block* forward substitution ``x_i = X_ii (y_i - sum_{j<i} A_ij x_j)``, so the off-diagonal blocks of
the inverse are never formed in the forward (each live 16x16 tile costs a full MMA fragment, ~8
regs/thread whatever the warp count; forming all sixteen spilled).  The backward (``STORE_T``) also
needs the inverse itself: its off-diagonal blocks ``X_ij = -X_ii sum_{k=j}^{i-1} A_ik X_kj`` are formed
and stored ``[total_chunks, Hv, 64, 64]`` fp32 (lower blocks only; the upper part is never read).

Decay: it stays inside A, and each factor ``exp(G_r - G_j)`` is taken of a non-positive exponent
(diagonal blocks are masked *before* the exp), so nothing overflows however strong the decay (g = -1e4
gives exact zeros, g = 0 ones).  Precision: G is summed in fp64 and stored as two fp32 planes
``G [2, Hv, B*T]`` = (hi, lo), hi + lo = G to ~1e-15 relative; every kernel forms
``G_a - G_b = (hi_a - hi_b) + (lo_a - lo_b)``.  With a plain fp32 G, a decay between nearby tokens after
a very strong gate (|G| ~ 1e5) would be off by ulp(|G|) ~ 1e-2 in the exponent.  Head-major, so a
chunk's 64 gates are contiguous.

Dots: full fp32 for fp32 inputs; otherwise k k^T in the input dtype and the solves in tf32.
Writes: ``w [B,T,Hv,K]``, ``u [B,T,Hv,V]`` in the input dtype, G as above, the inverse when asked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import BT, L2_EPS, chunk_coords, gdiff, inv16x4, l2n, load_rows, load_vec, mm, mm32, mmf, store_rows


@triton.jit
def _a_block(ki, kj, bi, Hi, Li, Hj, Lj, IEEE: tl.constexpr, DT: tl.constexpr, DIAG: tl.constexpr):
    """A_ij = beta_i (k_i k_j^T) exp(G_i - G_j), strictly lower part only on a diagonal block."""
    s = mm(ki, tl.trans(kj), IEEE, DT)
    d = gdiff(Hi[:, None], Li[:, None], Hj[None, :], Lj[None, :])
    if DIAG:
        r = tl.arange(0, 16)
        m = r[:, None] > r[None, :]
        return tl.where(m, bi[:, None] * s * tl.exp(tl.where(m, d, 0.0)), 0.0)
    else:
        # rows of block i come after the columns of block j: G_i - G_j <= 0 always
        return bi[:, None] * s * tl.exp(d)


@triton.jit
def _gate_block(gb, off):
    """fp64 cumsum of one 16-row block on top of ``off`` (fp64), and its (hi, lo) fp32 split."""
    Gd = tl.cumsum(gb.to(tl.float64), 0) + off
    hi = Gd.to(tl.float32)
    lo = (Gd - hi.to(tl.float64)).to(tl.float32)
    last = tl.sum(tl.where(tl.arange(0, 16) == 15, Gd, 0.0), 0)
    return hi, lo, last


@triton.jit
def _store_g(G_ptr, hi, lo, t0, L, h, TT, GS, row0):
    r = row0 + tl.arange(0, 16)
    p = G_ptr + h.to(tl.int64) * TT + t0 + r
    tl.store(p, hi, mask=r < L)
    tl.store(p + GS, lo, mask=r < L)


@triton.jit
def _store_tblk(Tm_ptr, X, base, bi: tl.constexpr, bj: tl.constexpr):
    r = tl.arange(0, 16)
    tl.store(Tm_ptr + base + (bi * 16 + r)[:, None] * 64 + bj * 16 + r[None, :], X)


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

    # keys (normalised rows), gates and betas of the four 16-row blocks
    # (kept in the input dtype only: the fp32 copies would double the register footprint)
    kc0 = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, 16, 0), USE_L2, L2_EPS).to(DT)
    kc1 = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, 16, 16), USE_L2, L2_EPS).to(DT)
    kc2 = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, 16, 32), USE_L2, L2_EPS).to(DT)
    kc3 = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, 16, 48), USE_L2, L2_EPS).to(DT)
    g0 = load_vec(g_ptr, t0, L, h, Hv, 16, 0)
    g1 = load_vec(g_ptr, t0, L, h, Hv, 16, 16)
    g2 = load_vec(g_ptr, t0, L, h, Hv, 16, 32)
    g3 = load_vec(g_ptr, t0, L, h, Hv, 16, 48)
    b0 = load_vec(beta_ptr, t0, L, h, Hv, 16, 0)
    b1 = load_vec(beta_ptr, t0, L, h, Hv, 16, 16)
    b2 = load_vec(beta_ptr, t0, L, h, Hv, 16, 32)
    b3 = load_vec(beta_ptr, t0, L, h, Hv, 16, 48)

    # chunk-local cumulative gates, summed in fp64 (64 adds: cheap even at 1/64 fp64 rate) and kept
    # as fp32 (hi, lo) pairs; padded rows (g = 0) repeat the last real value
    H0, L0, c = _gate_block(g0, 0.0)
    H1, L1, c = _gate_block(g1, c)
    H2, L2, c = _gate_block(g2, c)
    H3, L3, c = _gate_block(g3, c)
    GS = Hv * TT
    _store_g(G_ptr, H0, L0, t0, L, h, TT, GS, 0)
    _store_g(G_ptr, H1, L1, t0, L, h, TT, GS, 16)
    _store_g(G_ptr, H2, L2, t0, L, h, TT, GS, 32)
    _store_g(G_ptr, H3, L3, t0, L, h, TT, GS, 48)

    A00 = _a_block(kc0, kc0, b0, H0, L0, H0, L0, IEEE, DT, True)
    A11 = _a_block(kc1, kc1, b1, H1, L1, H1, L1, IEEE, DT, True)
    A22 = _a_block(kc2, kc2, b2, H2, L2, H2, L2, IEEE, DT, True)
    A33 = _a_block(kc3, kc3, b3, H3, L3, H3, L3, IEEE, DT, True)
    A10 = _a_block(kc1, kc0, b1, H1, L1, H0, L0, IEEE, DT, False)
    A20 = _a_block(kc2, kc0, b2, H2, L2, H0, L0, IEEE, DT, False)
    A21 = _a_block(kc2, kc1, b2, H2, L2, H1, L1, IEEE, DT, False)
    A30 = _a_block(kc3, kc0, b3, H3, L3, H0, L0, IEEE, DT, False)
    A31 = _a_block(kc3, kc1, b3, H3, L3, H1, L1, IEEE, DT, False)
    A32 = _a_block(kc3, kc2, b3, H3, L3, H2, L2, IEEE, DT, False)

    # diagonal blocks of (I + A)^-1
    X00, X11, X22, X33 = inv16x4(A00, A11, A22, A33)

    if STORE_T:
        # backward only: the whole inverse, X_ij = -X_ii sum_{k=j}^{i-1} A_ik X_kj
        base = (pid.to(tl.int64) * Hv + h) * 4096
        X10 = -mm32(X11, mm32(A10, X00))
        X21 = -mm32(X22, mm32(A21, X11))
        X32 = -mm32(X33, mm32(A32, X22))
        _store_tblk(Tm_ptr, X00, base, 0, 0)
        _store_tblk(Tm_ptr, X11, base, 1, 1)
        _store_tblk(Tm_ptr, X22, base, 2, 2)
        _store_tblk(Tm_ptr, X33, base, 3, 3)
        _store_tblk(Tm_ptr, X10, base, 1, 0)
        _store_tblk(Tm_ptr, X21, base, 2, 1)
        _store_tblk(Tm_ptr, X32, base, 3, 2)
        X20 = -mm32(X22, mm32(A20, X00) + mm32(A21, X10))
        X31 = -mm32(X33, mm32(A31, X11) + mm32(A32, X21))
        _store_tblk(Tm_ptr, X20, base, 2, 0)
        _store_tblk(Tm_ptr, X31, base, 3, 1)
        X30 = -mm32(X33, mm32(A30, X00) + mm32(A31, X10) + mm32(A32, X20))
        _store_tblk(Tm_ptr, X30, base, 3, 0)

    # w = (I + A)^-1 (beta exp(G) k) by block forward substitution:
    #   w_i = X_ii (y_i - sum_{j<i} A_ij w_j)
    # only the diagonal inverses are needed, and few 16x16 tiles are live at once (each costs a
    # full MMA fragment, ~8 regs/thread, whatever the warp count)
    y0 = (b0 * tl.exp(H0 + L0))[:, None] * kc0.to(tl.float32)
    y1 = (b1 * tl.exp(H1 + L1))[:, None] * kc1.to(tl.float32)
    y2 = (b2 * tl.exp(H2 + L2))[:, None] * kc2.to(tl.float32)
    y3 = (b3 * tl.exp(H3 + L3))[:, None] * kc3.to(tl.float32)
    x0 = mmf(X00, y0, IEEE)
    store_rows(w_ptr, x0, t0, L, h, Hv, K, 16, 0)
    x1 = mmf(X11, y1 - mmf(A10, x0, IEEE), IEEE)
    store_rows(w_ptr, x1, t0, L, h, Hv, K, 16, 16)
    x2 = mmf(X22, y2 - mmf(A20, x0, IEEE) - mmf(A21, x1, IEEE), IEEE)
    store_rows(w_ptr, x2, t0, L, h, Hv, K, 16, 32)
    x3 = mmf(X33, y3 - mmf(A30, x0, IEEE) - mmf(A31, x1, IEEE) - mmf(A32, x2, IEEE), IEEE)
    store_rows(w_ptr, x3, t0, L, h, Hv, K, 16, 48)

    # u = (I + A)^-1 (beta v), the same way
    y0 = b0[:, None] * load_rows(v_ptr, t0, L, h, Hv, V, 16, 0)
    y1 = b1[:, None] * load_rows(v_ptr, t0, L, h, Hv, V, 16, 16)
    y2 = b2[:, None] * load_rows(v_ptr, t0, L, h, Hv, V, 16, 32)
    y3 = b3[:, None] * load_rows(v_ptr, t0, L, h, Hv, V, 16, 48)
    x0 = mmf(X00, y0, IEEE)
    store_rows(u_ptr, x0, t0, L, h, Hv, V, 16, 0)
    x1 = mmf(X11, y1 - mmf(A10, x0, IEEE), IEEE)
    store_rows(u_ptr, x1, t0, L, h, Hv, V, 16, 16)
    x2 = mmf(X22, y2 - mmf(A20, x0, IEEE) - mmf(A21, x1, IEEE), IEEE)
    store_rows(u_ptr, x2, t0, L, h, Hv, V, 16, 32)
    x3 = mmf(X33, y3 - mmf(A30, x0, IEEE) - mmf(A31, x1, IEEE) - mmf(A32, x2, IEEE), IEEE)
    store_rows(u_ptr, x3, t0, L, h, Hv, V, 16, 48)
