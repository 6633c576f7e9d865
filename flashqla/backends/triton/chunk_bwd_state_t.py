"""Backward state recurrence with the state gradient held transposed (``dS^T [BV, K]``).

Same contract, grid and outputs as ``chunk_bwd_state.chunk_state_bwd_kernel`` (``ops.state_bwd`` runs
either; ``FLASHQLA_TRITON_TUNE=bstate.t=1`` picks this one).  The reason is that of ``chunk_state_t``: in
``dS [K, BV]`` form both products on the serial chain (``k dS`` and ``w^T dv_new``) take the state-side
operand as the tensor-core B operand, which a Hopper wgmma reads only from shared memory.  Transposed::

    dv_new^T = scale dO^T Pm  +  (dS^T k^T) diag(f)          f = exp(G_last - G) on real rows
    dS^T     = exp(G_last) dS^T + (dO^T diag(scale exp(G))) q - dv_new^T w

with ``Pm[r, j] = (q_r . k_j) exp(G_r - G_j)`` for ``j <= r``: the chain's A operands (``dS^T``,
``dv_new^T``) are register values, the B operands loaded tiles or ``Pm``, which does not depend on the
chain.  dh (the chunk's gradient, [K, V] layout) and dv_new ([T, Hv, V]) are stored as the row kernel
stores them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_state_t import load_state_t, load_t, store_state_t, store_t
from .common import BT, L2_EPS, gdiff, l2n, load_gate, load_gate_last, load_rows, mm, serial_program


@triton.jit(do_not_specialize=["T", "NT", "TT"])
def chunk_state_bwd_t_kernel(q_ptr, k_ptr, w_ptr, G_ptr, do_ptr, dht_ptr, dh0_ptr, dh_ptr, dvn_ptr, cu_ptr,
                             coff_ptr, scale, T, NT, TT, Hqk, Hv,
                             K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                             USE_L2: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                             IEEE: tl.constexpr):
    v0, h, hk, bos, eos, nt, cbase, sbase, GS = serial_program(cu_ptr, coff_ptr, T, NT, TT, Hqk, Hv, K, V, BV,
                                                                IS_VARLEN)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    r = tl.arange(0, BT)

    if HAS_DHT:
        dSt = load_state_t(dht_ptr, sbase, K, V, v0, BV).to(tl.float32)
    else:
        dSt = tl.zeros([BV, K], dtype=tl.float32)

    for j in range(0, nt):
        # never below 0, also in an iteration the pipeliner may prefetch (j = nt): see chunk_bwd_state
        i = tl.maximum(nt - 1 - j, 0)
        t0 = bos + i * BT
        L = tl.minimum(eos - t0, BT).to(tl.int32)
        valid = r < L
        store_state_t(dh_ptr, dSt, ((cbase + i) * Hv + h) * K * V, K, V, v0, BV)

        q = l2n(load_rows(q_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)
        k = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)
        w = load_rows(w_ptr, t0, L, h, Hv, K, BT, 0, TT)
        dot_ = load_t(do_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)                  # dO^T [BV, 64]
        gh, gl = load_gate(G_ptr, t0, L, h, TT, GS, BT, 0)
        lh, ll = load_gate_last(G_ptr, t0, L, h, TT, GS)

        # rows: queries r (real), columns: keys j <= r
        m = (r[:, None] >= r[None, :]) & valid[:, None]
        pm = mm(q, tl.trans(k), IEEE, DT)
        pm = tl.where(m, pm * tl.exp(tl.where(m, gdiff(gh[:, None], gl[:, None], gh[None, :], gl[None, :]), 0.0)),
                      0.0)
        fac = tl.where(valid, tl.exp(gdiff(lh, ll, gh, gl)), 0.0)
        dvnt = scale * mm(dot_, pm, IEEE, DT) + mm(dSt, tl.trans(k), IEEE, DT) * fac[None, :]
        store_t(dvn_ptr, dvnt, t0, L, h, Hv, V, BT, v0, BV, TT)
        dogt = dot_ * (scale * tl.exp(gh + gl))[None, :]
        dSt = dSt * tl.exp(lh + ll) + mm(dogt, q, IEEE, DT) - mm(dvnt, w, IEEE, DT)

    if STORE_DH0:
        store_state_t(dh0_ptr, dSt, sbase, K, V, v0, BV)
