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

``pipe2`` (experimental, ``FLASHQLA_TILELANG_BWD_WS_OPTS=pipe2``, off until measured).  The H200 runs this
kernel at ~3.2 us per chunk step whatever the number of CTAs (latency, not bandwidth), and by default three
things put other work on the chain's step (i counts the steps of the walk): the single ``a2_s`` / ``dos_s``
handoff lets the aux warpgroup publish step i only after the chain has finished step i - 1, the chain waits for
each TMA store of ``dSb`` and ``dv_new`` to read its tile before it goes on, and with two ring slots step
i + 1 is loaded only once step i - 1 is done, so the TMA latency and the aux work for i + 1 must fit in one
chain step.  ``pipe2`` gives the handoff two buffers (the aux warpgroup fills buffer ``i % 2`` while the
chain reads the other, and the chain frees a buffer right after ``q^T dOs``, its last reader), gives
``dSb`` two staging tiles whose TMA stores the chain never waits for on the spot (the only wait, before
``dv_new``'s single staging tile is rewritten, is for the store of the chunk before, long done), and takes
three ring slots at BV = 32.  The arithmetic and its rounding are unchanged.

Per step ``i`` of the walk (``s = i % R``, ``b = i % 2``; a barrier's phase ``j`` has parity ``j % 2`` and
a wait for the parity before phase 0 returns at once, which is how the first uses of ``free`` and
``aux_free`` pass)::

    barrier (arrivals)        arrives                          waits (parity)
    ready[s]    (32 + TMA)    producer, after its loads        chain, aux: (i // R) % 2
    free[s]     (256)         chain, aux: done with slot s     producer, before loading: (i // R + 1) % 2
    aux_ready[b] (128)        aux: a2_s[b], dos_s[b] written   chain: (i // 2) % 2
    aux_free[b]  (128)        chain: after q^T dOs[b]          aux, before writing: (i // 2 + 1) % 2
    (default: one aux buffer, b = 0 and parities i % 2 / (i + 1) % 2, aux_free after w^T dv_new)

    TMA store groups (pipe2; kept by the one chain thread that issues them): dh(i) at the top of step i,
    then wait_group.read 1 (all groups but dh(i) have read their tiles: dv_new(i - 1), and dh(i - 1) before
    it, so dSb[(i + 1) % 2], dh(i - 1)'s tile, is free for step i + 1), then dv_new(i); wait_group.read 0
    after the walk (shared memory must outlive the reads).

A barrier never runs two phases ahead of its waiter: the aux warpgroup publishes ``b`` for step i + 2 only
after the chain has released it for step i, and the producer refills slot s for step i + R only after both
consumers are done with step i.

Shared memory (K = V = 128, 16-bit, as compiled for sm_90a; each ring slot holds q, k, w 16 KB each, the dO
tile, G and the row factors): BV = 32: ~141 KB (2 slots), ``pipe2`` ~214 KB (3 slots, two dSb 8 KB, two fp32
``Pt dO`` 8 KB and two dOs 4 KB); BV = 64: ~177 KB, ``pipe2`` ~217 KB (2 slots; a third would not fit).
One CTA per SM either way.
"""

CHUNK = 64
L2_EPS = 1e-6


def build_bwd_state_ws(dtype: str, K: int, V: int, BV: int, l2norm: bool, has_dht: bool, need_dh0: bool,
                       pipe2: bool = False):
    """``pipe2`` (experimental, off until measured; ``ops.bwd_ws_options``): the pipelined hand-offs of the
    module docstring -- two buffers of the aux tiles, two dSb staging tiles with TMA stores that the chain
    does not wait for, and three ring slots at BV = 32."""
    import tilelang.language as T

    from ._common import make_l2_row_factors_ring, symbolic_sizes

    C = CHUNK
    acc = "float32"
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    DTN, DTH = (NS, Hv) if has_dht else T.dynamic("DTN, DTH")
    D0N, D0H = (NS, Hv) if need_dh0 else T.dynamic("D0N, D0H")
    assert V % BV == 0
    big = BV > 64
    # ring slots: a third lets the producer load a step ahead of the aux warpgroup's need; it fits only at
    # BV = 32 next to pipe2's second buffers (see the docstring's shared-memory budget)
    R = 3 if pipe2 and BV == 32 else 2

    # n_s[s, r] = 1 / sqrt(|x_s[s, r, :]|^2 + eps), x of ring slot s
    l2_row_factors = make_l2_row_factors_ring(C, K, acc, L2_EPS)

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
    ):
        with T.Kernel(V // BV, Hv, NS, threads=384) as (bv, h, n):
            q_s = T.alloc_shared((R, C, K), dtype)
            k_s = T.alloc_shared((R, C, K), dtype)
            w_s = T.alloc_shared((R, C, K), dtype)
            do_s = T.alloc_shared((R, C, BV), dtype)
            G_s = T.alloc_shared((R, C), acc)
            nq_s = T.alloc_shared((R, C), acc)
            nk_s = T.alloc_shared((R, C), acc)
            if pipe2:
                dS_s = T.alloc_shared((2, K, BV), dtype)
            else:
                dS_s = T.alloc_shared((K, BV), dtype)
            Pt_s = T.alloc_shared((C, C), dtype)
            if pipe2:
                a2_s = T.alloc_shared((2, C, BV), acc)
                dos_s = T.alloc_shared((2, C, BV), dtype)
            else:
                a2_s = T.alloc_shared((C, BV), acc)
                dos_s = T.alloc_shared((C, BV), dtype)
            # one dv_new staging tile under pipe2 too: its store left a whole step before it is rewritten (a
            # second tile would not fit at BV = 64); -dv_new is read only by the chain's own, waited-for wgmma
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
            if pipe2:
                aux_ready = T.alloc_barrier(arrive_count=[128, 128])
                aux_free = T.alloc_barrier(arrive_count=[128, 128])
            else:
                aux_ready = T.alloc_barrier(arrive_count=128)
                aux_free = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            hq = h // ratio
            bos0 = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            c0 = chunk_offsets[n]
            nchunks = chunk_offsets[n + 1] - c0
            v0 = bv * BV

            if tx < 128:
                # ---- gradient chain ----
                if big:
                    T.set_max_nreg(240, 1)
                if has_dht:
                    T.copy(dht[n, h, :, v0:v0 + BV], dS_f)
                else:
                    T.clear(dS_f)
                for i in T.serial(nchunks):
                    s = i % R
                    ci = nchunks - 1 - i
                    bos = bos0 + ci * C
                    T.barrier_wait(ready[s], (i // R) % 2)
                    if pipe2:
                        # (the buffer index i % 2 is written out at each use: a loop-level binding would change
                        # the default kernel's TIR too, and the carried compile cache is keyed on it.)
                        # dSb buffer i % 2 was last stored for step i - 2: that store finished reading it at the
                        # tma_store_wait of step i - 1 (below), so neither the copy nor the store waits here
                        T.copy(dS_f, dS_s[i % 2, :, :])
                        T.fence_proxy_async()
                        T.tma_copy(dS_s[i % 2, :, :], dh_out[c0 + ci, h, :, v0:v0 + BV])
                        T.gemm(k_s[s, :, :], dS_s[i % 2, :, :], a1_f, clear_accum=True)
                        T.barrier_wait(aux_ready[i % 2], (i // 2) % 2)
                    else:
                        T.copy(dS_f, dS_s)
                        T.fence_proxy_async()
                        T.copy(dS_s, dh_out[c0 + ci, h, :, v0:v0 + BV])
                        T.gemm(k_s[s, :, :], dS_s, a1_f, clear_accum=True)
                        T.barrier_wait(aux_ready, i % 2)
                    if l2norm:
                        for r in T.Parallel(C):
                            rowf_f[r] = nk_s[s, r] * T.exp(G_s[s, C - 1] - G_s[s, r])
                    else:
                        for r in T.Parallel(C):
                            rowf_f[r] = T.exp(G_s[s, C - 1] - G_s[s, r])
                    if pipe2:
                        for r, j in T.Parallel(C, BV):
                            a1_f[r, j] = T.if_then_else(bos + r < eos, a2_s[i % 2, r, j] + a1_f[r, j] * rowf_f[r], 0.0)
                        # dv_new's one staging tile: its store of step i - 1 must have read it (the most recent
                        # store group, dh of this step, may stay in flight).  Issued by every chain thread (only
                        # the thread that issued the stores has groups to wait for); the warpgroup barrier before
                        # the stmatrix below orders the other threads' writes after it
                        T.tma_store_wait(1)
                    else:
                        for r, j in T.Parallel(C, BV):
                            a1_f[r, j] = T.if_then_else(bos + r < eos, a2_s[r, j] + a1_f[r, j] * rowf_f[r], 0.0)
                    T.copy(a1_f, dvn_s)
                    for r, j in T.Parallel(C, BV):
                        ndvn_s[r, j] = -a1_f[r, j]
                    T.fence_proxy_async()
                    if pipe2:
                        T.tma_copy(dvn_s, dvn_out[c0 + ci, h, :, v0:v0 + BV])
                    else:
                        T.copy(dvn_s, dvn_out[c0 + ci, h, :, v0:v0 + BV])
                    glast[0] = T.exp(G_s[s, C - 1])
                    for a, b in T.Parallel(K, BV):
                        dS_f[a, b] = dS_f[a, b] * glast[0]
                    if pipe2:
                        T.gemm(q_s[s, :, :], dos_s[i % 2, :, :], dS_f, transpose_A=True)
                        # a2 and dOs of buffer i % 2 are read: the aux warpgroup may refill it for step i + 2
                        T.barrier_arrive(aux_free[i % 2])
                        T.gemm(w_s[s, :, :], ndvn_s, dS_f, transpose_A=True)
                    else:
                        T.gemm(q_s[s, :, :], dos_s, dS_f, transpose_A=True)
                        T.gemm(w_s[s, :, :], ndvn_s, dS_f, transpose_A=True)
                        T.barrier_arrive(aux_free)
                    T.barrier_arrive(free[s])
                if pipe2:
                    # the stores still in flight read shared memory, which must outlive them
                    T.tma_store_wait(0)
                if need_dh0:
                    T.copy(dS_f, dh0[n, h, :, v0:v0 + BV])
            elif tx < 256:
                # ---- state-free terms ----
                if big:
                    T.set_max_nreg(208, 1)
                for i in T.serial(nchunks):
                    s = i % R
                    ci = nchunks - 1 - i
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
                    if pipe2:
                        T.barrier_wait(aux_free[i % 2], (i // 2 + 1) % 2)
                        T.copy(a2_f, a2_s[i % 2, :, :])
                        if l2norm:
                            for r, j in T.Parallel(C, BV):
                                dos_s[i % 2, r, j] = T.if_then_else(
                                    bos + r < eos, T.cast(do_s[s, r, j], acc) * (scale * nq_s[s, r] * T.exp(G_s[s, r])),
                                    0.0)
                        else:
                            for r, j in T.Parallel(C, BV):
                                dos_s[i % 2, r, j] = T.if_then_else(
                                    bos + r < eos, T.cast(do_s[s, r, j], acc) * (scale * T.exp(G_s[s, r])), 0.0)
                        T.fence_proxy_async()
                        T.barrier_arrive(aux_ready[i % 2])
                    else:
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
                    for i in T.serial(nchunks):
                        s = i % R
                        ci = nchunks - 1 - i
                        bos = bos0 + ci * C
                        T.barrier_wait(free[s], (i // R + 1) % 2)
                        T.tma_copy(q[bos:bos + C, hq, :], q_s[s, :, :], barrier=ready[s])
                        T.tma_copy(k[bos:bos + C, hq, :], k_s[s, :, :], barrier=ready[s])
                        T.tma_copy(w[c0 + ci, h, :, :], w_s[s, :, :], barrier=ready[s])
                        T.tma_copy(do[bos:bos + C, h, v0:v0 + BV], do_s[s, :, :], barrier=ready[s])
                        T.tma_copy(G[c0 + ci, h, :], G_s[s, :], barrier=ready[s])
                        T.barrier_arrive(ready[s])

    return gdn_bwd_state_ws
