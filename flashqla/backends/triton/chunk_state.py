"""Inter-chunk state recurrence (forward), serial over the chunks of a sequence; optionally fused output.

Grid: ``(N * Hv, V // BV)``; one program per (sequence, value head, V-block), 4 warps at BV = 32.
The state block ``S [K, BV]`` lives in fp32 registers for the whole sequence (32 regs/thread at
K = 128, BV = 32).

Per chunk, with ``S`` the state at the chunk's start::

    v_new = u - w S
    o     = scale * ( exp(G) * (q S) + ((q k^T) * exp(G_r - G_j), j <= r) v_new )   [FUSE_OUTPUT]
    S     = exp(G_last) S + k^T (exp(G_last - G) * v_new)

``FROM_TB`` (inference forward, ``ops.use_tb_forward``): ``w_ptr`` holds ``Tb = (I + A)^-1 diag(beta)``
``[chunks, Hv, 64, 64]`` from the Tb-only prep and ``u_ptr`` is v itself, and the first line becomes::

    Y     = v - exp(G) * (k S)          rows past the sequence end forced to 0, rounded to the input dtype
    v_new = Tb Y                        (= u - w S: w = Tb diag(exp(G)) k, u = Tb v)

one more 64 x BV x 64 dot on the serial chain, against the prep not writing w and u (nor this kernel
reading w).  Tb's rows past the end are 0, so v_new is 0 there as before; the mask on Y keeps a NaN
from ever meeting those zeros.  Everything after v_new is unchanged.

Two uses:

* ``FUSE_OUTPUT`` (forward): o is produced here and neither the chunk states nor v_new ever reach
  HBM (at K = V = 128 in bf16 that is 1.5 KB of writes and reads per token and head saved, ~45% of
  the forward's traffic).  The price is the score tile q k^T, recomputed once per V-block, and q
  loaded by every V-block program (from L2 after the first).
* ``STORE_H`` (backward recompute, or the unfused forward followed by ``chunk_output_kernel``): the
  chunk start states ``h`` and ``v_new`` are written in the input dtype.

``G_last`` is the cumulative gate at the chunk's last real token (padded rows carry it too).  Every
exponent is <= 0 (the causal mask is applied before the exp): strong decay gives zeros, never inf.
Zero-length sequences run no iteration: the final state is the initial state (or zeros).

``TRANSPOSED`` (``FLASHQLA_TRITON_TUNE=state.t=1`` / ``fused.t=1``; off by default): the same recurrence with
the state held as ``S^T [BV, K]``.  In ``S`` form both products of a step take the state-side operand as the
tensor-core *B* operand (``w S``, ``k^T (f v_new)``), which a Hopper wgmma reads only from shared memory;
transposed, both take it as the *A* operand, which may stay in registers::

    v_new^T = u^T - bf16(S^T) w^T                        S^T = exp(G_last) S^T + (v_new^T diag(f)) k
    o^T     = scale * ( bf16(S^T) q^T diag(exp(G)) + v_new^T Pm^T ),  Pm^T[j, r] = (k_j . q_r) exp(G_r - G_j), j <= r

(M = BV, a multiple of 64 for wgmma).  H200, session 5 run 10: no gain at 1-2 programs per SM (16/32 1x32768:
state 1.226 ms at BV 64 against 0.955 plain at BV 32); with the output fused, BV 128 and 8 warps, 1.820 ms
against 1.959 for the plain fused kernel at 4x8192.

``HALO`` (in-kernel context parallelism, as in the tilelang forward: ``backends/tilelang/segments.py``): the
grid's programs run over chunk-aligned *segments* (``cu`` / ``coff`` are the segments' boundaries, varlen form) and
each walk starts at global chunk ``walk[n, h]``, before its segment, from a zero state (from h0 when that is its
sequence's first chunk): the halo's chunks store nothing (with FUSE_OUTPUT
their o is computed and dropped).  ``seg[n] = (sequence, its
first chunk, is-last, 0)``; h0 / ht stay per sequence and only a sequence's last segment writes ht.  Off, the two
pointers are placeholders.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (BT, L2_EPS, gdiff, l2n, load_cols, load_gate, load_gate_last, load_rows, load_state,
                     load_state_t, load_t, load_tb, masked_decay, mm, mma, serial_program, store_cols, store_state,
                     store_state_t, store_t)


@triton.jit(do_not_specialize=["T", "NT", "TT"])
def chunk_state_fwd_kernel(q_ptr, k_ptr, w_ptr, u_ptr, G_ptr, h0_ptr, ht_ptr, h_ptr, vn_ptr, o_ptr, cu_ptr,
                           coff_ptr, ord_ptr, seg_ptr, walk_ptr, scale, T, NT, TT, Hqk, Hv,
                           K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                           USE_L2: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                           STORE_H: tl.constexpr, FUSE_OUTPUT: tl.constexpr, IEEE: tl.constexpr,
                           TRANSPOSED: tl.constexpr, FROM_TB: tl.constexpr = False, ORDERED: tl.constexpr = False,
                           HALO: tl.constexpr = False):
    v0, h, hk, bos, eos, nt, cbase, sbase, GS = serial_program(cu_ptr, coff_ptr, ord_ptr, T, NT, TT, Hqk, Hv, K, V,
                                                                BV, IS_VARLEN, ORDERED)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    r = tl.arange(0, BT)
    if HALO:
        # (the 2-D grid: program_id(0) = segment * Hv + head)
        n = tl.program_id(0) // Hv
        wf = tl.load(walk_ptr + n * Hv + h).to(tl.int64)
        first = (wf - cbase).to(tl.int32)          # minus the halo's chunk count: the walk's first i
        from_h0 = wf == tl.load(seg_ptr + 4 * n + 1)
        is_last = tl.load(seg_ptr + 4 * n + 2) != 0
        sbase = (tl.load(seg_ptr + 4 * n).to(tl.int64) * Hv + h) * K * V
    else:
        first = 0
        is_last = True

    if TRANSPOSED:
        if HAS_H0:
            S = load_state_t(h0_ptr, sbase, K, V, v0, BV).to(tl.float32)
            if HALO:
                S = tl.where(from_h0, S, 0.0)
        else:
            S = tl.zeros([BV, K], dtype=tl.float32)
    else:
        if HAS_H0:
            S = load_state(h0_ptr, sbase, K, V, v0, BV).to(tl.float32)
            if HALO:
                S = tl.where(from_h0, S, 0.0)
        else:
            S = tl.zeros([K, BV], dtype=tl.float32)

    for i in range(first, nt):
        t0 = bos + i * BT
        L = tl.minimum(eos - t0, BT).to(tl.int32)
        valid = r < L
        if HALO:
            # stores take Ls rows: none for the halo's chunks (i < 0), whose rows lie before the segment
            Ls = tl.where(i >= 0, L, 0)
        else:
            Ls = L
        if TRANSPOSED:
            Sc = S.to(DT)
            if STORE_H:
                if HALO:
                    if i >= 0:
                        store_state_t(h_ptr, Sc, ((cbase + i) * Hv + h) * K * V, K, V, v0, BV)
                else:
                    store_state_t(h_ptr, Sc, ((cbase + i) * Hv + h) * K * V, K, V, v0, BV)
            if FROM_TB:
                k = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)   # [64, K]
                gh, gl = load_gate(G_ptr, t0, L, h, TT, GS, BT, 0)
                yt = load_t(u_ptr, t0, L, h, Hv, V, BT, v0, BV, TT).to(tl.float32)            # [BV, 64]
                yt = tl.where(valid[None, :], yt - mm(Sc, tl.trans(k), IEEE, DT) * tl.exp(gh + gl)[None, :], 0.0)
                vnt = mm(yt, load_tb(w_ptr, cbase + i, h, Hv, True), IEEE, DT)
            else:
                wt = load_t(w_ptr, t0, L, h, Hv, K, BT, 0, K, TT)                   # [K, 64]
                ut = load_t(u_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)                 # [BV, 64]
                vnt = ut.to(tl.float32) - mm(Sc, wt, IEEE, DT)                      # [BV, 64]
            if STORE_H:
                store_t(vn_ptr, vnt, t0, Ls, h, Hv, V, BT, v0, BV, TT)
            if not FROM_TB:
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
                at = masked_decay(at, mt, gdiff(gh[None, :], gl[None, :], gh[:, None], gl[:, None]))
                ot = mma(vnt, at, mm(Sc, qt, IEEE, DT) * tl.exp(gh + gl)[None, :], IEEE, DT)
                store_t(o_ptr, ot * scale, t0, Ls, h, Hv, V, BT, v0, BV, TT)
            fac = tl.where(valid, tl.exp(gdiff(lh, ll, gh, gl)), 0.0)
            S = mma(vnt * fac[None, :], k, S * tl.exp(lh + ll), IEEE, DT)
        else:
            if STORE_H:
                if HALO:
                    if i >= 0:
                        store_state(h_ptr, S, ((cbase + i) * Hv + h) * K * V, K, V, v0, BV)
                else:
                    store_state(h_ptr, S, ((cbase + i) * Hv + h) * K * V, K, V, v0, BV)
            if FROM_TB:
                k = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)
                gh, gl = load_gate(G_ptr, t0, L, h, TT, GS, BT, 0)
                Sc = S.to(DT)
                y = load_cols(u_ptr, t0, L, h, Hv, V, BT, v0, BV, TT).to(tl.float32)
                y = tl.where(valid[:, None], y - mm(k, Sc, IEEE, DT) * tl.exp(gh + gl)[:, None], 0.0)
                vn = mm(load_tb(w_ptr, cbase + i, h, Hv, False), y, IEEE, DT)
            else:
                w = load_rows(w_ptr, t0, L, h, Hv, K, BT, 0, TT)
                u = load_cols(u_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)
                Sc = S.to(DT)
                vn = u - mm(w, Sc, IEEE, DT)
            if STORE_H:
                store_cols(vn_ptr, vn, t0, Ls, h, Hv, V, BT, v0, BV, TT)
            if not FROM_TB:
                k = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)
                gh, gl = load_gate(G_ptr, t0, L, h, TT, GS, BT, 0)
            lh, ll = load_gate_last(G_ptr, t0, L, h, TT, GS)
            if FUSE_OUTPUT:
                q = l2n(load_rows(q_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)
                m = (r[:, None] >= r[None, :]) & valid[:, None]
                a = mm(q, tl.trans(k), IEEE, DT)
                a = masked_decay(a, m, gdiff(gh[:, None], gl[:, None], gh[None, :], gl[None, :]))
                o = mma(a, vn, mm(q, Sc, IEEE, DT) * tl.exp(gh + gl)[:, None], IEEE, DT)
                store_cols(o_ptr, o * scale, t0, Ls, h, Hv, V, BT, v0, BV, TT)
            fac = tl.where(valid, tl.exp(gdiff(lh, ll, gh, gl)), 0.0)
            # (diag(fac) k)^T v_new = k^T (diag(fac) v_new): scale the smaller tile
            S = mma(tl.trans(k), vn * fac[:, None], S * tl.exp(lh + ll), IEEE, DT)

    if STORE_HT:
        if is_last:
            if TRANSPOSED:
                store_state_t(ht_ptr, S, sbase, K, V, v0, BV)
            else:
                store_state(ht_ptr, S, sbase, K, V, v0, BV)
