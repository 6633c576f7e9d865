"""Backward state recurrence: serial over the chunks of a sequence, last to first.

Grid: ``(N * Hv, V // BV)``; one program per (sequence, value head, V-block), 4 warps.  The state
gradient block ``dS [K, BV]`` stays in fp32 registers for the whole sequence.

Per chunk, ``dS`` entering is the gradient w.r.t. the state at the chunk's *end* (``dht`` for the last
chunk).  With ``P^T[j, r] = (k_j . q_r) exp(G_r - G_j)`` for ``j <= r``::

    dh[chunk] = dS                                          (the per-chunk gradient kernel reads it)
    dv_new    = scale P^T dO + (exp(G_last - G) k) dS        (stored: it is du of the WY backward)
    dS        = exp(G_last) dS + scale (exp(G) q)^T dO - w^T dv_new

and after the first chunk ``dS`` is ``dh0``.  The score tile P^T is recomputed here (q, k and dO are
loaded for the dS update anyway), so no separate "local dv" pass over HBM is needed.

Reads per chunk: q, k, w [64, K], dO [64, BV]; writes dh [K, BV] and dv_new [64, BV] (input dtype).

``LOCAL_DV`` (the default when the forward kept its inverse: ``ops.state_bwd``): ``dvn_ptr`` comes holding
``scale P^T dO`` from the backward's prep (``chunk_prep``'s ``DV_LOCAL``), and each tile is read, completed with
``(exp(G_last - G) k) dS`` and written back in place (a tile is read and written by the same program, and the
pipeliner's prefetch reads the chunk before it, not yet written).  The chain then holds three dots per chunk,
not five, and no 64x64 exp tile.

``TRANSPOSED`` (``FLASHQLA_TRITON_TUNE=bstate.t=1``; off by default): the same recurrence with ``dS^T [BV, K]``,
so both products on the chain (``dS^T k^T``, ``dv_new^T w``) take the chain's value as the A operand, which
may stay in registers (see ``chunk_state``)::

    dv_new^T = scale dO^T Pm + (dS^T k^T) diag(f),    dS^T = exp(G_last) dS^T + (dO^T diag(scale exp(G))) q - dv_new^T w

with ``Pm[r, j] = (q_r . k_j) exp(G_r - G_j)``, ``j <= r``.  H200, session 5 run 10 (16/32, BV 64): 1.724 ->
1.428 ms at 4x8192, 1.690 -> 2.839 ms at 1x32768 (half the programs of the plain BV 32 kernel).

``HALO`` (in-kernel context parallelism, the forward's ``HALO`` of ``chunk_state`` run backwards): the programs run
over chunk-aligned *segments* (``cu`` / ``coff`` are the segments' boundaries, varlen form) and each walk starts at
global chunk ``walk[n, h] - 1``, *past* its segment's end, from ``dS = 0`` (from ``dht`` when ``walk[n, h]`` is its
sequence's end chunk).  The state gradient's map over a chunk is the transpose of the state's, with the same decay
bound, so the halo that ``segments.walk_starts(reverse=True)`` finds makes the dropped ``dS`` below fp32.  The
halo's chunks store nothing, and with ``LOCAL_DV`` recompute their intra-chunk ``dv_new`` rather than read it: that
tile belongs to the next segment's program, which completes it in place, maybe already.
``seg[n] = (sequence, its end chunk, is-first, its end token)`` (``SegmentTables.seg_table_bwd``); dht / dh0 stay
per sequence and only a sequence's first segment writes dh0.  Off, the two pointers are placeholders.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (BT, L2_EPS, gdiff, l2n, load_cols, load_gate, load_gate_last, load_rows, load_state,
                     load_state_t, load_t, masked_decay, mm, serial_program, store_cols, store_state, store_state_t,
                     store_t)


@triton.jit(do_not_specialize=["T", "NT", "TT"])
def chunk_state_bwd_kernel(q_ptr, k_ptr, w_ptr, G_ptr, do_ptr, dht_ptr, dh0_ptr, dh_ptr, dvn_ptr, cu_ptr, coff_ptr,
                           ord_ptr, seg_ptr, walk_ptr, scale, T, NT, TT, Hqk, Hv,
                           K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                           USE_L2: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                           IEEE: tl.constexpr, TRANSPOSED: tl.constexpr, LOCAL_DV: tl.constexpr = False,
                           ORDERED: tl.constexpr = False, HALO: tl.constexpr = False):
    v0, h, hk, bos, eos, nt, cbase, sbase, GS = serial_program(cu_ptr, coff_ptr, ord_ptr, T, NT, TT, Hqk, Hv, K, V,
                                                                BV, IS_VARLEN, ORDERED)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    r = tl.arange(0, BT)
    if HALO:
        # (the 2-D grid: program_id(0) = segment * Hv + head)
        n = tl.program_id(0) // Hv
        we = tl.load(walk_ptr + n * Hv + h)
        steps = we - tl.load(coff_ptr + n)          # the segment's chunks and the halo's past its end
        from_dht = we == tl.load(seg_ptr + 4 * n + 1)
        is_first = tl.load(seg_ptr + 4 * n + 2) != 0
        # the halo's chunks lie past the segment: their rows end at the sequence's end (segments are chunk-aligned,
        # so the segment's own chunks are whole up to there too)
        eos = tl.load(seg_ptr + 4 * n + 3)
        sbase = (tl.load(seg_ptr + 4 * n).to(tl.int64) * Hv + h) * K * V
    else:
        steps = nt
        is_first = True

    if TRANSPOSED:
        if HAS_DHT:
            dS = load_state_t(dht_ptr, sbase, K, V, v0, BV).to(tl.float32)
            if HALO:
                dS = tl.where(from_dht, dS, 0.0)
        else:
            dS = tl.zeros([BV, K], dtype=tl.float32)
    else:
        if HAS_DHT:
            dS = load_state(dht_ptr, sbase, K, V, v0, BV).to(tl.float32)
            if HALO:
                dS = tl.where(from_dht, dS, 0.0)
        else:
            dS = tl.zeros([K, BV], dtype=tl.float32)

    for j in range(0, steps):
        # never below 0, also in an iteration the pipeliner may prefetch (j = steps): i = -1 would address
        # the 64 tokens *before* the sequence, before the buffer for the first one
        i = tl.maximum(steps - 1 - j, 0)
        t0 = bos + i * BT
        L = tl.minimum(eos - t0, BT).to(tl.int32)
        valid = r < L
        if HALO:
            own = i < nt            # a chunk of the segment, not of the halo: the only ones stored
            Ls = tl.where(own, L, 0)
        else:
            own = True
            Ls = L
        if own:
            if TRANSPOSED:
                store_state_t(dh_ptr, dS, ((cbase + i) * Hv + h) * K * V, K, V, v0, BV)
            else:
                store_state(dh_ptr, dS, ((cbase + i) * Hv + h) * K * V, K, V, v0, BV)

        q = l2n(load_rows(q_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)
        k = l2n(load_rows(k_ptr, t0, L, hk, Hqk, K, BT, 0, TT), USE_L2, L2_EPS).to(DT)
        w = load_rows(w_ptr, t0, L, h, Hv, K, BT, 0, TT)
        if TRANSPOSED:
            dot_ = load_t(do_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)                  # dO^T [BV, 64]
        else:
            do = load_cols(do_ptr, t0, L, h, Hv, V, BT, v0, BV, TT)
        gh, gl = load_gate(G_ptr, t0, L, h, TT, GS, BT, 0)
        lh, ll = load_gate_last(G_ptr, t0, L, h, TT, GS)

        if TRANSPOSED:
            fac = tl.where(valid, tl.exp(gdiff(lh, ll, gh, gl)), 0.0)
            if LOCAL_DV and own:
                dvnt = load_t(dvn_ptr, t0, L, h, Hv, V, BT, v0, BV, TT).to(tl.float32)
            else:
                dvnt = _intra_dvn_t(q, k, dot_, gh, gl, valid, scale, IEEE, DT)
            dvnt = dvnt + mm(dS, tl.trans(k), IEEE, DT) * fac[None, :]
            store_t(dvn_ptr, dvnt, t0, Ls, h, Hv, V, BT, v0, BV, TT)
            dogt = dot_ * (scale * tl.exp(gh + gl))[None, :]
            dS = dS * tl.exp(lh + ll) + mm(dogt, q, IEEE, DT) - mm(dvnt, w, IEEE, DT)
        else:
            fac = tl.where(valid, tl.exp(gdiff(lh, ll, gh, gl)), 0.0)
            if LOCAL_DV and own:
                dvn = load_cols(dvn_ptr, t0, L, h, Hv, V, BT, v0, BV, TT).to(tl.float32)
            else:
                dvn = _intra_dvn(q, k, do, gh, gl, valid, scale, IEEE, DT)
            # gate factors go on the [64, BV] side of each product (diag(c) X) Y = diag(c) (X Y), etc.
            dvn = dvn + fac[:, None] * mm(k, dS, IEEE, DT)
            store_cols(dvn_ptr, dvn, t0, Ls, h, Hv, V, BT, v0, BV, TT)
            dog = do * (scale * tl.exp(gh + gl))[:, None]
            dS = dS * tl.exp(lh + ll) + mm(tl.trans(q), dog, IEEE, DT) - mm(tl.trans(w), dvn, IEEE, DT)

    if STORE_DH0:
        if is_first:
            if TRANSPOSED:
                store_state_t(dh0_ptr, dS, sbase, K, V, v0, BV)
            else:
                store_state(dh0_ptr, dS, sbase, K, V, v0, BV)


@triton.jit
def _intra_dvn(q, k, do, gh, gl, valid, scale, IEEE: tl.constexpr, DT: tl.constexpr):
    """``scale P^T dO`` [64, BV]: the intra-chunk part of dv_new (rows: keys j, columns: queries r >= j, r real)."""
    r = tl.arange(0, BT)
    m = (r[:, None] <= r[None, :]) & valid[None, :]
    pt = mm(k, tl.trans(q), IEEE, DT)
    pt = masked_decay(pt, m, gdiff(gh[None, :], gl[None, :], gh[:, None], gl[:, None]))
    return scale * mm(pt, do, IEEE, DT)


@triton.jit
def _intra_dvn_t(q, k, dot_, gh, gl, valid, scale, IEEE: tl.constexpr, DT: tl.constexpr):
    """Its transpose ``scale dO^T Pm`` [BV, 64] (rows of Pm: queries r (real), columns: keys j <= r)."""
    r = tl.arange(0, BT)
    m = (r[:, None] >= r[None, :]) & valid[:, None]
    pm = mm(q, tl.trans(k), IEEE, DT)
    pm = masked_decay(pm, m, gdiff(gh[:, None], gl[:, None], gh[None, :], gl[None, :]))
    return scale * mm(dot_, pm, IEEE, DT)
