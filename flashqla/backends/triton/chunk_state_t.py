"""Inter-chunk state recurrence (forward) with the state held transposed: the register-operand form.

Same contract, grid and outputs as ``chunk_state.chunk_state_fwd_kernel`` (``ops.state_fwd`` runs either;
``FLASHQLA_TRITON_TUNE=state.t=1`` / ``fused.t=1`` pick this one).  Grid ``(N * Hv, V // BV)``, BV >= 64.

Why transposed.  In ``S [K, BV]`` form both products of a step take the state-side operand as the
*B* operand of the tensor-core instruction (``w S`` and ``k^T (f v_new)``), and a Hopper wgmma reads B only
from shared memory: every step writes the state and the decayed ``v_new`` to shared memory, fences, and
only then multiplies -- on the serial chain.  Holding ``S^T [BV, K]`` instead turns both into products whose
*A* operand is computed in registers::

    v_new^T = u^T - bf16(S^T) w^T                        A = the state, in registers
    S^T     = exp(G_last) S^T + (v_new^T diag(f)) k      A = the decayed v_new, in registers

and the other operands (w, k; q for the output) are loaded tiles.  The accumulator layout of an
``[M, N]`` product is the register layout of an ``[M, K]`` A operand, so nothing goes through shared
memory on the chain (M = BV must be a multiple of 64 for wgmma; 4 warps).

With ``FUSE_OUTPUT`` the output is produced transposed as well::

    o^T = scale * ( bf16(S^T) q^T diag(exp(G))  +  v_new^T Pm^T ),   Pm^T[j, r] = (k_j . q_r) exp(G_r - G_j), j <= r

Loads of the transposed tiles (w^T, q^T, u^T) read the same bytes as the row tiles; their contiguous
axis is dim 0, which the compiler sees from the offsets.  Decay numerics are the row kernel's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (BT, L2_EPS, gdiff, l2n, load_gate, load_gate_last, load_rows, mm, mma, serial_program,
                     tok_rows)


@triton.jit
def load_t(ptr, t0, L, head, H, D: tl.constexpr, R: tl.constexpr, c0, BC: tl.constexpr, TT):
    """Tile [BC, R] (storage dtype): columns ``c0 .. c0+BC`` of the chunk's R rows, transposed."""
    r = tl.arange(0, R)
    d = c0 + tl.arange(0, BC)
    offs = (tok_rows(t0, r, TT)[None, :] * H + head) * D + d[:, None]
    return tl.load(ptr + offs, mask=(r < L)[None, :], other=0.0)


@triton.jit
def store_t(ptr, xt, t0, L, head, H, D: tl.constexpr, R: tl.constexpr, c0, BC: tl.constexpr, TT):
    """Store a [BC, R] tile transposed into columns ``c0 .. c0+BC`` of the chunk's rows (rows < L)."""
    r = tl.arange(0, R)
    d = c0 + tl.arange(0, BC)
    offs = (tok_rows(t0, r, TT)[None, :] * H + head) * D + d[:, None]
    tl.store(ptr + offs, xt.to(ptr.dtype.element_ty), mask=(r < L)[None, :])


@triton.jit
def load_state_t(ptr, base, K: tl.constexpr, V: tl.constexpr, v0, BV: tl.constexpr):
    """Tile [BV, K] = columns ``v0 ..`` of a [.., K, V] state, transposed."""
    dk = tl.arange(0, K)
    dv = v0 + tl.arange(0, BV)
    return tl.load(ptr + base + dk[None, :] * V + dv[:, None])


@triton.jit
def store_state_t(ptr, xt, base, K: tl.constexpr, V: tl.constexpr, v0, BV: tl.constexpr):
    dk = tl.arange(0, K)
    dv = v0 + tl.arange(0, BV)
    tl.store(ptr + base + dk[None, :] * V + dv[:, None], xt.to(ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["T", "NT", "TT"])
def chunk_state_fwd_t_kernel(q_ptr, k_ptr, w_ptr, u_ptr, G_ptr, h0_ptr, ht_ptr, h_ptr, vn_ptr, o_ptr, cu_ptr,
                             coff_ptr, scale, T, NT, TT, Hqk, Hv,
                             K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                             USE_L2: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                             STORE_H: tl.constexpr, FUSE_OUTPUT: tl.constexpr, IEEE: tl.constexpr):
    v0, h, hk, bos, eos, nt, cbase, sbase, GS = serial_program(cu_ptr, coff_ptr, T, NT, TT, Hqk, Hv, K, V, BV,
                                                                IS_VARLEN)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    r = tl.arange(0, BT)

    if HAS_H0:
        St = load_state_t(h0_ptr, sbase, K, V, v0, BV).to(tl.float32)
    else:
        St = tl.zeros([BV, K], dtype=tl.float32)

    for i in range(0, nt):
        t0 = bos + i * BT
        L = tl.minimum(eos - t0, BT).to(tl.int32)
        valid = r < L
        Sc = St.to(DT)
        if STORE_H:
            store_state_t(h_ptr, Sc, ((cbase + i) * Hv + h) * K * V, K, V, v0, BV)
        wt = load_t(w_ptr, t0, L, h, Hv, K, BT, 0, K, TT)                   # [K, 64]
        ut = load_t(u_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)                 # [BV, 64]
        vnt = ut.to(tl.float32) - mm(Sc, wt, IEEE, DT)                      # [BV, 64]
        if STORE_H:
            store_t(vn_ptr, vnt, t0, L, h, Hv, V, BT, v0, BV, TT)
        k = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)   # [64, K]
        gh, gl = load_gate(G_ptr, t0, L, h, TT, GS, BT, 0)
        lh, ll = load_gate_last(G_ptr, t0, L, h, TT, GS)
        if FUSE_OUTPUT:
            if USE_L2:      # the row norms need the rows
                qt = tl.trans(l2n(load_rows(q_ptr, t0, L, hk, Hqk, K, BT, 0, TT), True, L2_EPS).to(DT))
            else:
                qt = load_t(q_ptr, t0, L, hk, Hqk, K, BT, 0, K, TT)                    # [K, 64]
            # Pm^T[j, r] = (k_j . q_r) exp(G_r - G_j) for j <= r (rows r past the end are never stored)
            mt = (r[:, None] <= r[None, :]) & valid[None, :]
            at = mm(k, qt, IEEE, DT)
            at = tl.where(mt, at * tl.exp(tl.where(mt, gdiff(gh[None, :], gl[None, :], gh[:, None], gl[:, None]),
                                                   0.0)), 0.0)
            ot = mma(vnt, at, mm(Sc, qt, IEEE, DT) * tl.exp(gh + gl)[None, :], IEEE, DT)
            store_t(o_ptr, ot * scale, t0, L, h, Hv, V, BT, v0, BV, TT)
        fac = tl.where(valid, tl.exp(gdiff(lh, ll, gh, gl)), 0.0)
        St = mma(vnt * fac[None, :], k, St * tl.exp(lh + ll), IEEE, DT)

    if STORE_HT:
        store_state_t(ht_ptr, St, sbase, K, V, v0, BV)
