"""Inter-chunk state recurrence (forward): serial over the chunks of a sequence.

Grid: ``(N * Hv, V // BV)``; one program per (sequence, value head, V-block), 4 warps.  The state
block ``S [K, BV]`` lives in fp32 registers for the whole sequence (64 regs/thread at K=128, BV=64).

Per chunk, with ``S`` the state at the chunk's start::

    h[chunk]  = S                                    (for the output kernel / the backward)
    v_new     = u - w S                              (stored: the output kernel and backward read it)
    S         = exp(G_last) S + (exp(G_last - G) k)^T v_new

``G_last`` is the cumulative gate at the chunk's last real token (padded rows carry it too).  Every
exponent is <= 0: strong decay gives zeros, never inf.

Reads per chunk: w, k [64, K] and u [64, BV]; writes h [K, BV] and v_new [64, BV] in the input
dtype (fp32 for fp32 inputs), the final state in fp32.  Zero-length sequences run no iteration: the
final state is the initial state (or zeros).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (BT, L2_EPS, gdiff, l2n, load_cols, load_gate, load_gate_last, load_rows, load_state, mm,
                     seq_bounds, store_cols, store_state)


@triton.jit(do_not_specialize=["T", "NT", "TT"])
def chunk_state_fwd_kernel(k_ptr, w_ptr, u_ptr, G_ptr, h0_ptr, ht_ptr, h_ptr, vn_ptr, cu_ptr, coff_ptr,
                           T, NT, TT, Hqk, Hv,
                           K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                           USE_L2: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                           IEEE: tl.constexpr):
    pid = tl.program_id(0)
    v0 = tl.program_id(1) * BV
    n = pid // Hv
    h = pid % Hv
    hk = h // (Hv // Hqk)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    bos, eos, nt, cbase = seq_bounds(n, cu_ptr, coff_ptr, T, NT, IS_VARLEN, BT)
    r = tl.arange(0, BT)
    sbase = (n.to(tl.int64) * Hv + h) * K * V
    GS = Hv * TT

    if HAS_H0:
        S = load_state(h0_ptr, sbase, K, V, v0, BV).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)

    for i in range(0, nt):
        t0 = bos + i * BT
        L = tl.minimum(eos - t0, BT).to(tl.int32)
        store_state(h_ptr, S, ((cbase + i) * Hv + h) * K * V, K, V, v0, BV)
        w = load_rows(w_ptr, t0, L, h, Hv, K, BT, 0)
        u = load_cols(u_ptr, t0, L, h, Hv, V, BT, v0, BV)
        vn = u - mm(w, S, IEEE, DT)
        store_cols(vn_ptr, vn, t0, L, h, Hv, V, BT, v0, BV)
        k = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, BT, 0), USE_L2, L2_EPS).to(DT)
        gh, gl = load_gate(G_ptr, t0, L, h, TT, GS, BT, 0)
        lh, ll = load_gate_last(G_ptr, t0, L, h, TT, GS)
        fac = tl.where(r < L, tl.exp(gdiff(lh, ll, gh, gl)), 0.0)
        # (diag(fac) k)^T v_new = k^T (diag(fac) v_new): scale the smaller tile
        S = S * tl.exp(lh + ll) + mm(tl.trans(k), vn * fac[:, None], IEEE, DT)

    if STORE_HT:
        store_state(ht_ptr, S, sbase, K, V, v0, BV)
