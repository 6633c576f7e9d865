"""Per-chunk gradients, two kernels parallel over chunks: ``chunk_bwd_dqk_kernel`` then ``chunk_bwd_wy_kernel``.

Grid of both: ``(total_chunks, Hv)``; one program per (chunk, value head), 8 warps (``ops._DEFAULTS``).

Why two: each needs two [64, K] fp32 accumulators live across its pass over V; one fused kernel
needed four and spilled kilobytes per thread at K = 128 (compile-only survey, sm_80 and sm_90).  Split,
the sm_90 build has no spills and the sm_80 one at most ~160 B (``python -m flashqla.backends.triton.aot``).
What crosses between them: ``dk_a`` [B,T,Hv,K] fp32 and ``dG_a`` [B,T,Hv] fp32.

Math (hats = normalised q/k; ``L = exp(G_r - G_j)`` on ``j <= r``, ``D`` the same on ``j < r``; ``S`` the
chunk start state, ``dSn`` the gradient of the state at the chunk end, ``Tinv = (I + A)^-1``)::

  dqk kernel (pass over V: acc_q = dO S^T, acc_k = v_new dSn^T, ds = dO v_new^T, <S, dSn>):
    dP    = scale ds * L                                 gradient of the scores q.k
    dq    = scale exp(G) acc_q + dP k                    -> L2-norm Jacobian -> dq (final)
    dk_a  = dP^T q + exp(G_last - G) acc_k
    dG_a  = rowsum(q * dq) - rowsum(k * dk_a)
            + [last real row] exp(G_last) <S, dSn> + sum_r exp(G_last - G_r) k_r . acc_k_r

  wy kernel (pass over V: dYu = Tinv^T dv_new, dv = beta dYu, dYw = -dYu S^T, dA = -dYu u^T):
    dA   -= dYw w^T,  restricted to j < r                 (w = Tinv Yw, u = Tinv Yu: dTinv folded in)
    dk    = dk_a + beta exp(G) dYw + E k + E^T k,  E = beta_r dA D   -> L2-norm Jacobian -> dk
    dbeta = exp(G) (dYw . k) + (dYu . v) + rowsum(dA * (k k^T) D)
    dG    = dG_a + beta exp(G) (dYw . k) + rowsum(Z) - colsum(Z),  Z = dA * A
    dg    = reverse cumsum of dG within the chunk

The L2-norm Jacobian: ``dx = rsqrt(|x|^2 + eps) (dx_hat - x_hat (x_hat . dx_hat))``.  Under GVA each value
head writes its own dq/dk slot ``[B, T, Hv, K]`` (in the output dtype, fp32 when the L2 norm's backward
follows on the host) and the host sums the group in fp32 (``backends/gva.py``): deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (BT, L2_EPS, chunk_coords, gate_plane, gdiff, load_cols, load_gate, load_gate_last, load_rows,
                     load_state, load_vec, masked_decay, mm, mma, store_cols, store_rows, store_vec)


@triton.jit
def _load_qk_hat(ptr, t0, L, hk, Hqk, K: tl.constexpr, USE_L2: tl.constexpr, DT: tl.constexpr, TT):
    """(x_hat in the dot dtype DT, rsqrt(|x|^2 + eps) or ones) of a [64, K] q or k tile.

    Keeping x_hat in DT (bf16 [64, 128]: 16 regs/thread on 8 warps, half of fp32) is what lets these
    kernels fit; row reductions convert on the fly.
    """
    x = load_rows(ptr, t0, L, hk, Hqk, K, BT, 0, TT).to(tl.float32)
    if USE_L2:
        rx = tl.rsqrt(tl.sum(x * x, 1) + L2_EPS)
        x = x * rx[:, None]
    else:
        rx = tl.full([BT], 1.0, tl.float32)
    return x.to(DT), rx


@triton.jit
def _store_qk_grad(ptr, dx, x, rx, t0, L, h, hk, Hqk, Hv, K: tl.constexpr, USE_L2: tl.constexpr,
                   GRAD_PER_VHEAD: tl.constexpr, TT):
    """Store dx (w.r.t. x_hat) after the L2-norm Jacobian, in this value head's slot under GVA."""
    if USE_L2:
        xf = x.to(tl.float32)
        dx = rx[:, None] * (dx - xf * tl.sum(xf * dx, 1)[:, None])
    if GRAD_PER_VHEAD:
        store_rows(ptr, dx, t0, L, h, Hv, K, BT, 0, TT)
    else:
        store_rows(ptr, dx, t0, L, hk, Hqk, K, BT, 0, TT)


@triton.jit(do_not_specialize=["T", "NT", "TT"])
def chunk_bwd_dqk_kernel(q_ptr, k_ptr, G_ptr, h_ptr, dh_ptr, vn_ptr, do_ptr, dq_ptr, dka_ptr, dGa_ptr,
                         cu_ptr, cidx_ptr, scale, T, NT, TT, Hqk, Hv,
                         K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                         USE_L2: tl.constexpr, GRAD_PER_VHEAD: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (Hv // Hqk)
    DT: tl.constexpr = vn_ptr.dtype.element_ty
    n, t0, L = chunk_coords(pid, cu_ptr, cidx_ptr, T, NT, IS_VARLEN, BT)
    r = tl.arange(0, BT)
    valid = r < L
    sbase = (pid.to(tl.int64) * Hv + h) * K * V

    # pass over V; live: two [64, K] fp32 accumulators and one [64, 64]
    acc_q = tl.zeros([BT, K], dtype=tl.float32)      # dO S^T
    acc_k = tl.zeros([BT, K], dtype=tl.float32)      # v_new dSn^T
    ds = tl.zeros([BT, BT], dtype=tl.float32)        # dO v_new^T
    sdot = tl.sum(tl.zeros([BT], dtype=tl.float32), 0)   # <S, dSn>
    for v0 in range(0, V, BV):
        S = load_state(h_ptr, sbase, K, V, v0, BV)
        dSn = load_state(dh_ptr, sbase, K, V, v0, BV)
        do = load_cols(do_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)
        vn = load_cols(vn_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)
        acc_q = mma(do, tl.trans(S), acc_q, IEEE, DT)
        acc_k = mma(vn, tl.trans(dSn), acc_k, IEEE, DT)
        ds = mma(do, tl.trans(vn), ds, IEEE, DT)
        sdot += tl.sum(tl.sum(S.to(tl.float32) * dSn.to(tl.float32), 1), 0)

    gh, gl = load_gate(G_ptr, t0, L, h, TT, gate_plane(Hv, TT), BT, 0)
    lh, ll = load_gate_last(G_ptr, t0, L, h, TT, gate_plane(Hv, TT))
    incl = (r[:, None] >= r[None, :]) & valid[:, None]
    d = gdiff(gh[:, None], gl[:, None], gh[None, :], gl[None, :])          # G_r - G_j
    dP = masked_decay(ds, incl, d) * scale

    # dq (complete here)
    k, rk = _load_qk_hat(k_ptr, t0, L, hk, Hqk, K, USE_L2, DT, TT)
    dq = mma(dP, k, acc_q * (scale * tl.exp(gh + gl))[:, None], IEEE, DT)
    q, rq = _load_qk_hat(q_ptr, t0, L, hk, Hqk, K, USE_L2, DT, TT)
    dG = tl.sum(q.to(tl.float32) * dq, 1)
    _store_qk_grad(dq_ptr, dq, q, rq, t0, L, h, hk, Hqk, Hv, K, USE_L2, GRAD_PER_VHEAD, TT)

    # dk from the scores and the state update (the WY part is added by the next kernel)
    dks = acc_k * tl.where(valid, tl.exp(gdiff(lh, ll, gh, gl)), 0.0)[:, None]
    last = tl.exp(lh + ll) * sdot + tl.sum(tl.sum(k.to(tl.float32) * dks, 1), 0)
    dk = mma(tl.trans(dP), q, dks, IEEE, DT)
    dG -= tl.sum(k.to(tl.float32) * dk, 1)
    dG += tl.where(r == L - 1, last, 0.0)
    store_rows(dka_ptr, dk, t0, L, h, Hv, K, BT, 0, TT)
    store_vec(dGa_ptr, dG, t0, L, h, Hv, BT, TT)


@triton.jit(do_not_specialize=["T", "NT", "TT"])
def chunk_bwd_wy_kernel(k_ptr, v_ptr, beta_ptr, G_ptr, Tm_ptr, w_ptr, u_ptr, h_ptr, dvn_ptr, dka_ptr, dGa_ptr,
                        dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, cu_ptr, cidx_ptr, T, NT, TT, Hqk, Hv,
                        K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                        USE_L2: tl.constexpr, GRAD_PER_VHEAD: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (Hv // Hqk)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    n, t0, L = chunk_coords(pid, cu_ptr, cidx_ptr, T, NT, IS_VARLEN, BT)
    r = tl.arange(0, BT)
    blk = pid.to(tl.int64) * Hv + h
    sbase = blk * K * V

    beta = load_vec(beta_ptr, t0, L, h, Hv, BT, 0, TT)
    Tm = tl.load(Tm_ptr + blk * 4096 + r[:, None] * 64 + r[None, :], mask=r[:, None] >= r[None, :], other=0.0)
    TmT = tl.trans(Tm)
    # pass over V; live: one [64, K] fp32 accumulator, one [64, 64] and Tinv
    dyw = tl.zeros([BT, K], dtype=tl.float32)        # Tinv^T dw = -(Tinv^T dv_new) S^T
    dA = tl.zeros([BT, BT], dtype=tl.float32)        # -dYu u^T (dYw w^T added below)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        dvn = load_cols(dvn_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)
        dyu = mm(TmT, dvn, IEEE, DT)                       # Tinv^T du, du = dv_new
        store_cols(dv_ptr, beta[:, None] * dyu, t0, L, h, Hv, V, BT, v0, BV, TT)
        vv = load_cols(v_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)
        dbeta += tl.sum(dyu * vv.to(tl.float32), 1)
        uu = load_cols(u_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)
        S = load_state(h_ptr, sbase, K, V, v0, BV)
        ndyu = -dyu
        dA = mma(ndyu, tl.trans(uu), dA, IEEE, DT)
        dyw = mma(ndyu, tl.trans(S), dyw, IEEE, DT)

    ww = load_rows(w_ptr, t0, L, h, Hv, K, BT, 0, TT)
    dA = mma(-dyw, tl.trans(ww), dA, IEEE, DT)
    gh, gl = load_gate(G_ptr, t0, L, h, TT, gate_plane(Hv, TT), BT, 0)
    eg = tl.exp(gh + gl)
    k, rk = _load_qk_hat(k_ptr, t0, L, hk, Hqk, K, USE_L2, DT, TT)
    kdy = tl.sum(dyw * k.to(tl.float32), 1)
    dk = (beta * eg)[:, None] * dyw
    dbeta += eg * kdy
    dG = beta * eg * kdy

    # (ordered so that at most three [64, 64] fp32 tiles are live)
    strict = r[:, None] > r[None, :]
    d = gdiff(gh[:, None], gl[:, None], gh[None, :], gl[None, :])
    Dm = masked_decay(1.0, strict, d)
    dA = tl.where(strict, dA, 0.0)
    Bm = mm(k, tl.trans(k), IEEE, DT) * Dm                               # (k k^T) D, so A = beta Bm
    t = dA * Bm
    dbeta += tl.sum(t, 1)
    t = t * beta[:, None]                                                # dA * A
    dG += tl.sum(t, 1) - tl.sum(t, 0)
    E = dA * beta[:, None] * Dm
    dk = mma(E, k, dk, IEEE, DT)
    dk = mma(tl.trans(E), k, dk, IEEE, DT)
    dk += load_rows(dka_ptr, t0, L, h, Hv, K, BT, 0, TT)
    dG += load_vec(dGa_ptr, t0, L, h, Hv, BT, 0, TT)

    _store_qk_grad(dk_ptr, dk, k, rk, t0, L, h, hk, Hqk, Hv, K, USE_L2, GRAD_PER_VHEAD, TT)
    store_vec(dbeta_ptr, dbeta, t0, L, h, Hv, BT, TT)
    store_vec(dg_ptr, tl.cumsum(dG, 0, reverse=True), t0, L, h, Hv, BT, TT)
