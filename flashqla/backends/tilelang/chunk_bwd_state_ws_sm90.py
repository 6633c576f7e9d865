"""Backward stage 1 (Hopper), warp-specialised: the reverse state-gradient recurrence with the
state-independent half of each chunk's work moved off the serial chain.

Same contract as ``chunk_bwd_state_sm90.build_bwd_state`` (same arguments and outputs), so ``ops`` can run
either.  Grid ``(V / BV, Hv, N)``, BV = 32 or 64 (``ops.BWD_WS_BVS``); CTA ``(bv, h, n)`` owns columns
``bv*BV ..`` of ``dS`` (the gradient of the state) of value head ``h`` of sequence ``n`` and walks its chunks
from last to first.  384 threads:

* warpgroup 0 (threads 0-127), the **gradient chain**; with ``dS`` the gradient w.r.t. the state after
  the chunk and ``dSb`` its 16-bit copy (stored: stage 2 reads it)::

      dv_new = Pt dO + diag(nk exp(G_last - G)) (k dSb)     rows past the end forced to 0 (stored)
      dS     = exp(G_last) dS + q^T dOs - w^T dv_new

  three wgmma per chunk (``k dSb``, ``q^T dOs``, ``w^T dv_new``);
* warpgroup 1 (threads 128-255), the **aux** warpgroup, the state-free terms, running ahead of the chain:
  the L2 row factors, ``Pt = scale (k q^T) nk_j nq_r exp(G_r - G_j)`` (``j <= r < eos``), ``Pt dO`` (fp32,
  handed over in shared memory) and ``dOs = diag(scale nq exp(G)) dO`` (rows past the end zero);
* warpgroup 2, the **producer**: one warp streams q, k, w, the dO tile and G into a ring of R slots
  with TMA.

Barriers as in the forward (``chunk_fwd_ws_sm90``): ``ready[s]`` / ``free[s]`` for the ring,
``aux_ready`` / ``aux_free`` for the ``Pt dO`` / ``dOs`` handoff (the row factors travel in the ring slot).
After the first chunk ``dh0 = dS``.  Only differences ``G_r - G_j``, ``G_last - G_r`` (<= 0) and ``G_r``
are exponentiated (finite for g = -1e4).

Per step ``i`` of the walk (``s = i % R``; a barrier's phase ``j`` has parity ``j % 2`` and a wait for the
parity before phase 0 returns at once, which is how the first uses of ``free`` and ``aux_free`` pass)::

    barrier (arrivals)        arrives                          waits (parity)
    ready[s]    (32 + TMA)    producer, after its loads        chain, aux: (i // R) % 2
    free[s]     (256)         chain, aux: done with slot s     producer, before loading: (i // R + 1) % 2
    aux_ready   (128)         aux: a2_s, dos_s written         chain: i % 2
    aux_free    (128)         chain: after w^T dv_new          aux, before writing: (i + 1) % 2

The chain step takes ~3.2 us on the H200 whatever the number of CTAs (latency, not bandwidth).  Session 10
tried double-buffering the aux hand-off and the dh staging tile with three ring slots (``pipe2``); session 11
measured no gain (1.632 vs 1.624 ms at 16/32 x 32k, 1.645 vs 1.662 at 4/8; ``benchmarks/results/
h200_2026-12-03_s11run1_sweep_bwd_opts.json``), so the chain step is not spent waiting on those, and the option
was removed.

``halo`` (in-kernel context parallelism, the backward of :mod:`flashqla.backends.tilelang.segments`): the grid's
last axis runs over segments (``cu_seqlens`` / ``chunk_offsets`` are the segments' boundaries) and each walk
starts past its segment's end: ``seg_table[n] = (sequence, the sequence's end chunk, is-first, the sequence's
end token)`` and ``walk_end[n, h]``, the global chunk (exclusive) the gradient chain starts from, between the
segment's end and the sequence's.  The chunks between (the halo) run from ``dS = 0`` (from ``dht`` when the halo
reaches the sequence end) and store nothing; row masks use the sequence's end; only a sequence's first segment
writes ``dh0``.  The decay bound that sizes the halo is the forward's (the chain's map is the transpose of the
forward's).

Shared memory (K = V = 128, 16-bit, as compiled for sm_90a; each ring slot holds q, k, w 16 KB each, the dO
tile, G and the row factors): BV = 32: ~141 KB (2 slots); BV = 64: ~177 KB.  One CTA per SM either way.
"""

CHUNK = 64
L2_EPS = 1e-6


def build_bwd_state_ws(dtype: str, K: int, V: int, BV: int, l2norm: bool, has_dht: bool, need_dh0: bool,
                       halo: bool = False):
    import tilelang.language as T

    from ._common import make_l2_row_factors_ring, make_start_state, symbolic_sizes

    C = CHUNK
    acc = "float32"
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    DTN, DTH = (NS, Hv) if has_dht else T.dynamic("DTN, DTH")
    D0N, D0H = (NS, Hv) if need_dh0 else T.dynamic("D0N, D0H")
    if halo:
        # dht / dh0 stay per sequence while the grid runs over segments
        DTN, D0N = T.dynamic("DTN"), T.dynamic("D0N")
    SGN, WEN, WEH = (NS, NS, Hv) if halo else T.dynamic("SGN, WEN, WEH")
    assert V % BV == 0
    big = BV > 64
    R = 2       # ring slots

    # n_s[s, r] = 1 / sqrt(|x_s[s, r, :]|^2 + eps), x of ring slot s
    l2_row_factors = make_l2_row_factors_ring(C, K, acc, L2_EPS)
    start_state = make_start_state(has_dht, halo)

    @T.prim_func
    def gdn_bwd_state_ws(
        q: T.Tensor((NT, Hqk, K), dtype),
        k: T.Tensor((NT, Hqk, K), dtype),
        w: T.Tensor((NC, Hv, C, K), dtype),
        G: T.Tensor((NC, Hv, C), acc),
        do: T.Tensor((NT, Hv, V), dtype),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_offsets: T.Tensor((NS + 1,), "int32"),
        dht: T.Tensor((DTN, DTH, K, V), acc),
        dh_out: T.Tensor((NC, Hv, K, V), dtype),
        dvn_out: T.Tensor((NC, Hv, C, V), dtype),
        dh0: T.Tensor((D0N, D0H, K, V), acc),
        scale: T.float32,
        ratio: T.int32,
        seg_table: T.Tensor((SGN, 4), "int32"),
        walk_end: T.Tensor((WEN, WEH), "int32"),
    ):
        with T.Kernel(V // BV, Hv, NS, threads=384) as (bv, h, n):
            q_s = T.alloc_shared((R, C, K), dtype)
            k_s = T.alloc_shared((R, C, K), dtype)
            w_s = T.alloc_shared((R, C, K), dtype)
            do_s = T.alloc_shared((R, C, BV), dtype)
            G_s = T.alloc_shared((R, C), acc)
            nq_s = T.alloc_shared((R, C), acc)
            nk_s = T.alloc_shared((R, C), acc)
            dS_s = T.alloc_shared((K, BV), dtype)
            Pt_s = T.alloc_shared((C, C), dtype)
            a2_s = T.alloc_shared((C, BV), acc)
            dos_s = T.alloc_shared((C, BV), dtype)
            # dv_new's staging tile for its store; -dv_new is read only by the chain's own, waited-for wgmma
            dvn_s = T.alloc_shared((C, BV), dtype)
            ndvn_s = T.alloc_shared((C, BV), dtype)

            dS_f = T.alloc_fragment((K, BV), acc)
            a1_f = T.alloc_fragment((C, BV), acc)
            # the chain's per-row decay factor and e^(G_last): computed once per row / chunk (see the forward's
            # rowf_f), not once per element
            rowf_f = T.alloc_fragment((C,), acc)
            glast = T.alloc_local((1,), acc)
            Pt_f = T.alloc_fragment((C, C), acc)
            a2_f = T.alloc_fragment((C, BV), acc)
            sq_f = T.alloc_fragment((C, K), acc)
            ss_f = T.alloc_fragment((C,), acc)

            ready = T.alloc_barrier(arrive_count=[32] * R)
            free = T.alloc_barrier(arrive_count=[256] * R)
            aux_ready = T.alloc_barrier(arrive_count=128)
            aux_free = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            hq = h // ratio
            bos0 = cu_seqlens[n]
            c0 = chunk_offsets[n]
            nchunks = chunk_offsets[n + 1] - c0
            v0 = bv * BV
            if halo:
                seq = seg_table[n, 0]
                eos = seg_table[n, 3]
                nhalo = walk_end[n, h] - (c0 + nchunks)
                from_src = walk_end[n, h] == seg_table[n, 1]       # (the walk starts at dht)
                is_first = seg_table[n, 2] != 0
            else:
                seq = n
                eos = cu_seqlens[n + 1]
                nhalo = 0
            nwalk = nchunks + nhalo if halo else nchunks

            if tx < 128:
                # ---- gradient chain ----
                if big:
                    T.set_max_nreg(240, 1)
                start_state(dht, dS_f, seq, h, v0, from_src if halo else True)
                for i in T.serial(nwalk):
                    s = i % R
                    # halo: ci >= nchunks for the halo's chunks, past the segment's end
                    ci = nwalk - 1 - i
                    bos = bos0 + ci * C
                    real = i >= nhalo if halo else True
                    T.barrier_wait(ready[s], (i // R) % 2)
                    T.copy(dS_f, dS_s)
                    T.fence_proxy_async()
                    if real:
                        T.copy(dS_s, dh_out[c0 + ci, h, :, v0:v0 + BV])
                    T.gemm(k_s[s, :, :], dS_s, a1_f, clear_accum=True)
                    T.barrier_wait(aux_ready, i % 2)
                    if l2norm:
                        for r in T.Parallel(C):
                            rowf_f[r] = nk_s[s, r] * T.exp(G_s[s, C - 1] - G_s[s, r])
                    else:
                        for r in T.Parallel(C):
                            rowf_f[r] = T.exp(G_s[s, C - 1] - G_s[s, r])
                    for r, j in T.Parallel(C, BV):
                        a1_f[r, j] = T.if_then_else(bos + r < eos, a2_s[r, j] + a1_f[r, j] * rowf_f[r], 0.0)
                    T.copy(a1_f, dvn_s)
                    for r, j in T.Parallel(C, BV):
                        ndvn_s[r, j] = -a1_f[r, j]
                    T.fence_proxy_async()
                    if real:
                        T.copy(dvn_s, dvn_out[c0 + ci, h, :, v0:v0 + BV])
                    glast[0] = T.exp(G_s[s, C - 1])
                    for a, b in T.Parallel(K, BV):
                        dS_f[a, b] = dS_f[a, b] * glast[0]
                    T.gemm(q_s[s, :, :], dos_s, dS_f, transpose_A=True)
                    T.gemm(w_s[s, :, :], ndvn_s, dS_f, transpose_A=True)
                    T.barrier_arrive(aux_free)
                    T.barrier_arrive(free[s])
                if need_dh0:
                    if halo:
                        if is_first:
                            T.copy(dS_f, dh0[seq, h, :, v0:v0 + BV])
                    else:
                        T.copy(dS_f, dh0[n, h, :, v0:v0 + BV])
            elif tx < 256:
                # ---- state-free terms ----
                if big:
                    T.set_max_nreg(208, 1)
                for i in T.serial(nwalk):
                    s = i % R
                    ci = nwalk - 1 - i
                    bos = bos0 + ci * C
                    T.barrier_wait(ready[s], (i // R) % 2)
                    if l2norm:
                        l2_row_factors(q_s, nq_s, s, sq_f, ss_f)
                        l2_row_factors(k_s, nk_s, s, sq_f, ss_f)
                    T.gemm(k_s[s, :, :], q_s[s, :, :], Pt_f, transpose_B=True, clear_accum=True)
                    # Pt[j, r]: key row j, query row r
                    if l2norm:
                        for j, r in T.Parallel(C, C):
                            Pt_s[j, r] = T.if_then_else(
                                (j <= r) & (bos + r < eos),
                                Pt_f[j, r] * scale * nk_s[s, j] * nq_s[s, r] * T.exp(G_s[s, r] - G_s[s, j]), 0.0)
                    else:
                        for j, r in T.Parallel(C, C):
                            Pt_s[j, r] = T.if_then_else(
                                (j <= r) & (bos + r < eos), Pt_f[j, r] * scale * T.exp(G_s[s, r] - G_s[s, j]), 0.0)
                    T.fence_proxy_async()
                    T.gemm(Pt_s, do_s[s, :, :], a2_f, clear_accum=True)
                    T.barrier_wait(aux_free, (i + 1) % 2)
                    T.copy(a2_f, a2_s)
                    if l2norm:
                        for r, j in T.Parallel(C, BV):
                            dos_s[r, j] = T.if_then_else(
                                bos + r < eos, T.cast(do_s[s, r, j], acc) * (scale * nq_s[s, r] * T.exp(G_s[s, r])), 0.0)
                    else:
                        for r, j in T.Parallel(C, BV):
                            dos_s[r, j] = T.if_then_else(
                                bos + r < eos, T.cast(do_s[s, r, j], acc) * (scale * T.exp(G_s[s, r])), 0.0)
                    T.fence_proxy_async()
                    T.barrier_arrive(aux_ready)
                    T.barrier_arrive(free[s])
            else:
                # ---- producer: one warp issues every TMA load of a slot ----
                if big:
                    T.set_max_nreg(40, 0)
                if tx < 288:
                    for i in T.serial(nwalk):
                        s = i % R
                        ci = nwalk - 1 - i
                        bos = bos0 + ci * C
                        T.barrier_wait(free[s], (i // R + 1) % 2)
                        T.tma_copy(q[bos:bos + C, hq, :], q_s[s, :, :], barrier=ready[s])
                        T.tma_copy(k[bos:bos + C, hq, :], k_s[s, :, :], barrier=ready[s])
                        T.tma_copy(w[c0 + ci, h, :, :], w_s[s, :, :], barrier=ready[s])
                        T.tma_copy(do[bos:bos + C, h, v0:v0 + BV], do_s[s, :, :], barrier=ready[s])
                        T.tma_copy(G[c0 + ci, h, :], G_s[s, :], barrier=ready[s])
                        T.barrier_arrive(ready[s])

    return gdn_bwd_state_ws
