"""Chunk output (forward, unfused path): parallel over chunks.

Used when few (sequence, head) pairs would leave the fused state+output kernel latency-bound (see
``ops.fuse_forward_output``); otherwise the state kernel produces o itself.

Grid: ``(total_chunks, Hv, V // BV)``; one program per (chunk, value head, V-block), 8 warps
at K = BV = 128, else 4.  With BV = V the [64, 64] score tile is computed once per (chunk, head).

    o = scale * ( exp(G) * (q S)  +  ((q k^T) * exp(G_r - G_j), j <= r) v_new )

``S`` is the chunk's start state (written by the state kernel, input dtype), ``v_new`` the corrected
values.  The causal mask is applied *before* the exp so the masked half never overflows.
Reads q, k [64, K], S [K, BV], v_new [64, BV]; writes o [64, BV] in v's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (BT, L2_EPS, chunk_coords, gate_plane, gdiff, l2n, load_cols, load_gate, load_rows, load_state,
                     masked_decay, mm, store_cols)


@triton.jit(do_not_specialize=["T", "NT", "TT"])
def chunk_output_kernel(q_ptr, k_ptr, G_ptr, h_ptr, vn_ptr, o_ptr, cu_ptr, cidx_ptr, scale,
                        T, NT, TT, Hqk, Hv,
                        K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                        USE_L2: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    hk = h // (Hv // Hqk)
    DT: tl.constexpr = vn_ptr.dtype.element_ty
    n, t0, L = chunk_coords(pid, cu_ptr, cidx_ptr, T, NT, IS_VARLEN, BT)
    r = tl.arange(0, BT)
    valid = r < L

    q = l2n(load_rows(q_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)
    k = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)
    gh, gl = load_gate(G_ptr, t0, L, h, TT, gate_plane(Hv, TT), BT, 0)
    S = load_state(h_ptr, (pid.to(tl.int64) * Hv + h) * K * V, K, V, v0, BV)
    vn = load_cols(vn_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)

    o = mm(q, S, IEEE, DT) * tl.exp(gh + gl)[:, None]
    m = (r[:, None] >= r[None, :]) & valid[:, None]
    a = mm(q, tl.trans(k), IEEE, DT)
    d = gdiff(gh[:, None], gl[:, None], gh[None, :], gl[None, :])
    a = masked_decay(a, m, d)
    o += mm(a, vn, IEEE, DT)
    store_cols(o_ptr, o * scale, t0, L, h, Hv, V, BT, v0, BV, TT)
