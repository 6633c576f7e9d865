"""Forward stage 2 (Hopper), warp-specialised: the state recurrence and the chunk output in two
consumer warpgroups, fed by a TMA producer warp.

Same contract as ``chunk_fwd_sm90.build_fwd`` (same arguments, same outputs, plus two trailing ones: the
trace buffer and the stage-1 scores, placeholders unless ``trace`` / ``pscores``), so ``ops`` can run either;
this one keeps only the state's own dependency chain on the serial path.  Variants (``build_fwd_ws``'s
docstring): ``fused`` (the default inference forward: v and a 64 x 64 ``Tb`` in place of u and w), ``tchain``,
``ostage``, ``pscores``, ``trace``.

Grid ``(V / BV, Hv, N)``; CTA ``(bv, h, n)`` owns state columns ``bv*BV ..`` of value head ``h`` of
sequence ``n`` and walks its chunks in order (trip count read on the device: no host sync; a length-0
sequence writes ``ht = h0``).  384 threads, three roles, each a ``T.serial`` loop over the chunks (with the
``psplit`` option, on by default, 512: a scores warpgroup takes the row factors and P from the output one):

* warpgroup 0 (threads 0-127), the **state chain**, the only serial dependency::

      Sb    = bf16(S)                           -> shared, released to warpgroup 1
      v_new = u - w Sb                          rows past the sequence end forced to 0
      S     = exp(G_last) S + k^T (nk exp(G_last - G) v_new)

  two wgmma per chunk (64 x BV x K, then K x BV x 64);
* warpgroup 1 (threads 128-255), the **output**, one chunk behind at most::

      o     = nq exp(G) (q Sb)                  first, so Sb is released early
      P     = (q k^T) nq_r nk_j exp(G_r - G_j)  for j <= r   (needs no state)
      o     = scale * (o + P v_new)

  three wgmma per chunk, and the row factors ``nq``, ``nk`` of the fused L2 norm (1 without it);
* warpgroup 2 (threads 256-383), the **producer**: one warp issues the TMA loads of q, k (rows
  ``bos .. bos + 64`` of the packed tensors, query/key head ``h // ratio``), w, u, G (chunk-major
  tiles of stage 1) into a ring of R slots (R = 3 at BV = 32, else 2: what shared memory holds); the
  other three warps idle.  The output warpgroup hands its slot back as soon as P is built (before it
  waits for v_new), so a slot is refilled while the state chain is still on that chunk and the TMA
  latency stays off the chain.

Synchronisation (mbarriers; the phase of use ``j`` of a barrier has parity ``j % 2``; a wait for the
parity before phase 0 returns at once, which is how the first use of every "free" barrier passes):
``ready[s]`` (producer -> both consumers, 32 arrivals + TMA bytes), ``free[s]`` (both consumers ->
producer, 256 arrivals), ``state_ready`` / ``state_free`` (Sb, warpgroup 0 <-> 1), ``vnew_ready`` /
``vnew_free`` (v_new, 0 <-> 1), ``norm_ready`` (the L2 row factors, 1 -> 0).  Sb and v_new have two
buffers each (BV <= 64): with one, the state warpgroup's next chunk waited for the output warpgroup to
finish this chunk's ``P v_new``, the next ``q k^T`` and ``q Sb`` -- the output work landed on the serial
chain (measured: ~3 us per chunk at BV = 32).  With two, it waits only for the chunk before, long done.
At BV = 128 shared memory holds one buffer.

Shared memory (bf16, K = V = 128): ring slots of q, k, w (16 KB each), u (2 BV B/row), G (256 B);
Sb (K x BV) and v_new (64 x BV), twice at BV <= 64; the decayed v_new (64 x BV), P (8 KB).
BV = 32: ~194 KB (3 slots); BV = 64: ~177 KB; BV = 128: ~201 KB; one CTA per SM.  Registers: S is ``K * BV / 128`` fp32 per thread of warpgroup 0; ``setmaxnreg``
gives the consumers more and the producer 40 when BV = 128.

Decay numerics are those of the serial kernel: only ``G_last - G_r``, ``G_r - G_j`` (<= 0 after the
causal mask) and ``G_r`` are exponentiated, so g = -1e4 underflows to 0 and never overflows.
"""

CHUNK = 64
L2_EPS = 1e-6
# named barriers (bar.sync id, 128) of async_store: after the issuing thread's wait, before a role rewrites a tile
# its TMA store read.  TileLang's own partial barriers take the low ids (3-6 here); the hardware has 16
ASTORE_BARRIER_CHAIN = 13
ASTORE_BARRIER_OUTPUT = 14


# (event, role): what has just happened when the role's first thread stamps it
TRACE_EVENTS = (
    ("chain: slot ready", "state"), ("chain: Sb buffer free", "state"), ("chain: v_new = u - w S done", "state"),
    ("chain: v_new published", "state"), ("chain: S update done", "state"),
    ("out: slot ready", "output"), ("out: Sb ready", "output"), ("out: q Sb done", "output"),
    ("out: P ready", "output"), ("out: v_new ready", "output"), ("out: P v_new done", "output"),
    ("out: o stored", "output"),
    ("scores: slot ready", "scores"), ("scores: q k^T done", "scores"), ("scores: P published", "scores"),
    ("producer: slot free", "producer"),
)
TRACE_CHUNKS = 64


def ws_layout(BV: int) -> tuple:
    """(ring slots, Sb / v_new buffers) that fit shared memory at this V-block (see the docstring)."""
    return {32: (3, 2), 64: (2, 2), 128: (2, 1)}[BV]


def build_fwd_ws(dtype: str, K: int, V: int, BV: int, l2norm: bool, has_h0: bool, store_ht: bool,
                 save_states: bool, ring: int = 0, nbuf: int = 0, fast_exp: bool = False, psplit: bool = False,
                 tchain: bool = False, trace: bool = False, fused: bool = False, ostage: bool = False,
                 pscores: bool = False, hw_ex2: bool = False, halo: bool = False, async_store: bool = False,
                 x_beta: bool = False):
    """Options (both on by default in ``ops.fwd_ws_options``, measured on the H200): ``fast_exp`` takes every decay factor as
    ``exp2(x * log2 e)`` (the hardware ex2, ~2 ulp) instead of the accurate ``expf``; ``psplit`` adds a
    fourth warpgroup (512 threads) that builds the row factors and the masked, decayed scores P into two
    P buffers, so the output warpgroup only runs ``q Sb``, ``P v_new`` and the stores.

    ``tchain`` (register-only state chain, BV = 64): warpgroup 0 keeps the transposed state ``S^T [BV, K]``
    as its wgmma accumulator and runs both products with the A operand in registers::

        v_new^T = bf16(S^T) w^T                   (rs-wgmma, B = the w tile as stored)
        S^T     = exp(G_last) S^T + (v_new^T exp(G_last - G) nk) k     (rs-wgmma, async)

    The accumulator layout of an M x N product is the register layout of an M x K operand, so
    ``bf16(S^T)`` and the decayed ``v_new^T`` feed the next wgmma without going through shared memory,
    and no proxy fence sits on the chain.  Sb and v_new still go to shared memory for the output
    warpgroup, written while the second wgmma runs.  M = BV must be 64 (one warpgroup's wgmma).

    ``trace`` (diagnostics, ``benchmarks/trace_ws.py``): the first thread of every role of CTA (0, 0, 0)
    writes ``clock64()`` into ``trace[event, chunk]`` at the points listed in ``TRACE_EVENTS``, for the first
    ``TRACE_CHUNKS`` chunks; the per-chunk gaps show which role waits on which.  Off, ``trace`` is a
    placeholder parameter the kernel never touches.

    ``fused`` (the inference forward: stage 1 is ``build_intra(tb_only=True)``, which writes only the 64 x 64
    ``Tb = X diag(beta)`` per chunk instead of w and u): the parameter ``w`` holds ``Tb [NC, Hv, 64, 64]``
    and ``u`` holds ``v [NT, Hv, V]`` itself (packed rows, like q and k), and the state chain forms v_new
    from them, since ``u - w S = Tb (v - diag(exp(G) nk) k S)``::

        Y     = v - exp(G) nk (k Sb)                 rows past the sequence end forced to 0
        v_new = Tb bf16(Y)                           a third, 64 x BV x 64 wgmma on the chain

    The intra pass then reads k only and writes 8 KB per chunk and head instead of 32-64 KB, and the
    recurrence reads the same bytes as before (v for u, an 8 KB Tb for the 16 KB w); ``save_states``
    works as before, but the backward needs w, so training forwards keep the unfused pair.

    ``ostage`` (experimental, off until measured): the output warpgroup stages a full chunk's o in shared
    memory (64 x BV, 16-bit) and one thread writes it with a TMA store, instead of 64 * BV / 128 scattered
    predicated stores per thread (run s6/4's trace at BV = 128: ~2200 cycles from ``P v_new`` to ``o
    stored``, on the cycle the state chain waits for).  A chunk that ends past its sequence keeps the
    predicated stores (a TMA store would write the next sequence's rows).

    ``pscores`` (experimental, off until measured; needs ``psplit`` off): the masked, decayed scores
    ``P = (q k^T) nq_r nk_j exp(G_r - G_j)`` (``j <= r``) come precomputed from stage 1
    (``build_intra(tb_only=True, scores=True)``), ``[NC, Hv, 64, 64]`` 16-bit, in the last parameter, and
    travel in the ring with the other tiles; the output warpgroup computes no ``q k^T`` and builds no P (the
    run s6/4 trace: at BV = 32 the scores work set the chunk period, and every V-block CTA of a head redid
    it).  The cutlass forward does the same (its prep writes ``Aqk``).  The output warpgroup then holds its
    ring slot until ``P v_new`` is done.

    ``halo`` (in-kernel context parallelism, see :mod:`flashqla.backends.tilelang.segments`): the grid's last
    axis runs over *segments* (chunk-aligned pieces of the sequences; ``cu_seqlens`` / ``chunk_offsets`` are
    the segments' boundaries) and two trailing parameters say where each walk starts: ``seg_table[n] =
    (sequence, the sequence's first chunk, is-last, 0)`` and ``walk_from[n, h]``, the global chunk the state
    chain starts from (between the sequence's first chunk and the segment's).  The chain walks the chunks
    before its segment (the *halo*) from a zero state, or from ``h0`` when the halo reaches the sequence
    start, and publishes nothing for them; the other roles only hand the halo's ring slots back (the row
    factors of the L2 norm are still built: the chain needs nk).  ``h0`` / ``ht`` keep one entry per
    sequence; only a sequence's last segment writes ``ht``.

    ``async_store`` (session 24, off until measured): the TMA stores of a chunk's o (``ostage``) and of the saved
    state and v_new (``save_states``, where the chain stores them) are issued without waiting for them to read
    shared memory; the issuing role waits (``cp.async.bulk.wait_group.read 0``) just before it next writes that
    tile, a chunk later, and once after its loop.  ``T.copy`` waits right after the store, which puts the store's
    shared-memory read on the role's cycle: the output warpgroup's, whose ``q Sb`` of the next chunk releases Sb to
    the chain, and the chain's own.  The v_new saves of the fused walk over segments (stored by the output
    warpgroup, whose ``vnew_free`` arrival must follow the read) keep the waiting copy.

    ``x_beta`` (with ``fused`` and ``save_states``, no ``pscores``; ``FLASHQLA_TILELANG_TRAIN_XBETA=1``, session 37,
    off until measured): the fused training walk takes X itself in ``w`` and beta chunk-major ``[NC, Hv, 64]`` fp32
    in ``scores_in`` (``build_intra(x_beta=True)``), and folds beta into Y's row factors::

        Y     = diag(beta) (v - exp(G) nk (k Sb))    rows past the sequence end 0
        v_new = X bf16(Y)

    the same product as ``Tb bf16(Y)`` with beta rounded into the 16-bit Y instead of into Tb.  Stage 1 then
    writes X only (the whole-V backward reads it), 8 KB less per chunk and head, and the walk reads 256 bytes more
    (beta's tile, on the slot's ``ready`` barrier)."""
    import tilelang.language as T

    from ._common import EX2_APPROX_SRC, ex2_approx, make_l2_row_factors_ring, make_start_state, symbolic_sizes

    C = CHUNK
    acc = "float32"
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    TR0, TR1 = (len(TRACE_EVENTS), TRACE_CHUNKS) if trace else T.dynamic("TR0, TR1")
    H0N, H0H = (NS, Hv) if has_h0 else T.dynamic("H0N, H0H")
    HTN, HTH = (NS, Hv) if store_ht else T.dynamic("HTN, HTH")
    SVN, SVH = (NC, Hv) if save_states else T.dynamic("SVN, SVH")
    assert V % BV == 0
    assert not tchain or BV == 64, "tchain: the transposed state is one warpgroup's wgmma accumulator, M = BV = 64"
    assert not (tchain and fused), "tchain runs the unfused chain only"
    assert not (pscores and psplit), "pscores: the scores come from stage 1, there is no scores warpgroup"
    assert not (halo and tchain), "halo: the unfused or fused chain only"
    if halo:
        # h0 / ht stay per sequence while the grid runs over segments
        H0N, HTN = T.dynamic("H0N"), T.dynamic("HTN")
    SGN, WFN, WFH = (NS, NS, Hv) if halo else T.dynamic("SGN, WFN, WFH")
    PSN, PSH = (NC, Hv) if pscores else T.dynamic("PSN, PSH")
    assert not x_beta or (fused and save_states and not pscores), "x_beta: the fused training walk"
    # scores_in: the stage-1 scores (pscores), beta chunk-major (x_beta), else a placeholder
    SC_SHAPE, SC_DT = ((NC, Hv, C), acc) if x_beta else ((PSN, PSH, C, C), dtype)
    # fused: w holds Tb (64 x 64 per chunk), u holds the packed v rows (see ``fused``)
    W_SHAPE = (NC, Hv, C, C) if fused else (NC, Hv, C, K)
    U_SHAPE = (NT, Hv, V) if fused else (NC, Hv, C, V)
    WK = C if fused else K
    big = BV > 64
    # The fused training walk over segments stores its v_new saves from the output warpgroup, not the chain: with the
    # store (and its wait) under the chain's halo branch, ptxas ran out of registers there, spilled 512 bytes and
    # serialised every wgmma (40 waits for 40 HGMMA; session 20, nvcc 13 for sm_90a), which is why that walk took
    # 0.75 against 0.52 ms at 16/32 1x32768 on the H200 (session 19 run 3).  Elsewhere the chain stores them, as
    # measured.
    vn_save_by_output = save_states and fused and halo
    R0, nb0 = ws_layout(BV)
    R = ring or R0          # ring slots of q, k, w, u, G
    nb = nbuf or nb0        # buffers of Sb and v_new

    # n_s[s, r] = 1 / sqrt(|x_s[s, r, :]|^2 + eps), x of ring slot s
    l2_row_factors = make_l2_row_factors_ring(C, K, acc, L2_EPS)
    start_state = make_start_state(has_h0, halo)
    LOG2E = 1.4426950408889634

    def ex(x):
        # (T.exp2 is exp2f: MUFU.EX2 inside a subnormal-range test; hw_ex2, FLASHQLA_TILELANG_EX2=approx, session
        # 16, not yet run on a GPU, takes the instruction alone)
        if fast_exp and hw_ex2:
            return ex2_approx(x * LOG2E)
        return T.exp2(x * LOG2E) if fast_exp else T.exp(x)

    threads = 512 if psplit else 384
    prod0 = threads - 128          # first thread of the producer warpgroup
    consumers = threads - 128      # arrivals that free a ring slot
    npb = 2 if psplit else 1       # P buffers (pscores: one per ring slot, R)

    @T.macro
    def stamp(trace_out, event, i, tx, tx0, bv, h, n):
        # one thread of one CTA; everything else skips it
        if trace:
            if T.And(T.And(tx == tx0, bv + h + n == 0), i < TRACE_CHUNKS):
                trace_out[event, i] = T.call_extern("int64", "clock64")

    @T.macro
    def store_tile(src, dst):
        # a TMA store of a shared tile; under async_store without its wait (the role calls wait_for_store before it
        # next writes ``src``)
        if async_store:
            T.tma_copy(src, dst)
        else:
            T.copy(src, dst)

    @T.macro
    def wait_for_store(barrier_id):
        # the issuing thread's last store has read its shared tile; the role's named barrier holds the warpgroup's
        # other threads until then (TileLang's own partial barrier was once placed before the wait)
        T.tma_store_wait(0)
        T.sync_threads(barrier_id, 128)

    @T.macro
    def build_scores(P_f, P_s, pb, s, nq_s, nk_s, G_s, gr_f, gc_f):
        # P = (q k^T) nq_r nk_j exp(G_r - G_j) for j <= r, else 0, into P buffer pb (16-bit).  The row and
        # column gates go to registers first (gr_f, gc_f: a thread's own rows / columns of P_f), and the
        # row factors are applied to P_f in place, so the loop that stores P_s reads no shared memory
        # (no warpgroup barrier per unrolled iteration)
        for r in T.Parallel(C):
            gr_f[r] = G_s[s, r]
        for j in T.Parallel(C):
            gc_f[j] = G_s[s, j]
        if l2norm:
            for r, j in T.Parallel(C, C):
                P_f[r, j] = P_f[r, j] * nq_s[s, r] * nk_s[s, j]
        for r, j in T.Parallel(C, C):
            P_s[pb, r, j] = T.if_then_else(j <= r, P_f[r, j] * ex(gr_f[r] - gc_f[j]), 0.0)
        T.fence_proxy_async()

    @T.prim_func
    def gdn_fwd_recurrent_ws(
        q: T.Tensor((NT, Hqk, K), dtype),
        k: T.Tensor((NT, Hqk, K), dtype),
        w: T.Tensor(W_SHAPE, dtype),
        u: T.Tensor(U_SHAPE, dtype),
        G: T.Tensor((NC, Hv, C), acc),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_offsets: T.Tensor((NS + 1,), "int32"),
        h0: T.Tensor((H0N, H0H, K, V), acc),
        o: T.Tensor((NT, Hv, V), dtype),
        ht: T.Tensor((HTN, HTH, K, V), acc),
        h_out: T.Tensor((SVN, SVH, K, V), dtype),
        vn_out: T.Tensor((SVN, SVH, C, V), dtype),
        scale: T.float32,
        ratio: T.int32,
        trace_out: T.Tensor((TR0, TR1), "int64"),
        scores_in: T.Tensor(SC_SHAPE, SC_DT),
        seg_table: T.Tensor((SGN, 4), "int32"),
        walk_from: T.Tensor((WFN, WFH), "int32"),
    ):
        with T.Kernel(V // BV, Hv, NS, threads=threads) as (bv, h, n):
            if hw_ex2 and fast_exp:
                T.import_source(EX2_APPROX_SRC)
            q_s = T.alloc_shared((R, C, K), dtype)
            k_s = T.alloc_shared((R, C, K), dtype)
            w_s = T.alloc_shared((R, C, WK), dtype)
            u_s = T.alloc_shared((R, C, BV), dtype)
            G_s = T.alloc_shared((R, C), acc)
            S_s = T.alloc_shared((nb, K, BV), dtype)
            vn_s = T.alloc_shared((nb, C, BV), dtype)
            vd_s = T.alloc_shared((C, BV), dtype)
            P_s = T.alloc_shared((R if pscores else npb, C, C), dtype)
            if ostage:
                o_s = T.alloc_shared((C, BV), dtype)
            nq_s = T.alloc_shared((R, C), acc)
            nk_s = T.alloc_shared((R, C), acc)
            if x_beta:
                bt_s = T.alloc_shared((R, C), acc)     # beta of ring slot s
                rowb_f = T.alloc_fragment((C,), acc)

            if tchain:
                St_f = T.alloc_fragment((BV, K), acc)
                Stb_f = T.alloc_fragment((BV, K), dtype)
                vnt_f = T.alloc_fragment((BV, C), acc)
                vdt_f = T.alloc_fragment((BV, C), dtype)
            S_f = T.alloc_fragment((K, BV), acc)
            # per-row decay factors in registers (the flash-attention row-scale pattern): each thread holds
            # its two accumulator rows' values, so a chunk takes 2 ex2 per thread and factor instead of one
            # per element, and the loops that apply them read no shared memory (no barrier inside them)
            rowf_f = T.alloc_fragment((C,), acc)
            orow_f = T.alloc_fragment((C,), acc)
            glast = T.alloc_local((1,), acc)
            vn_f = T.alloc_fragment((C, BV), acc)
            P_f = T.alloc_fragment((C, C), acc)
            gr_f = T.alloc_fragment((C,), acc)
            gc_f = T.alloc_fragment((C,), acc)
            o_f = T.alloc_fragment((C, BV), acc)
            sq_f = T.alloc_fragment((C, K), acc)
            ss_f = T.alloc_fragment((C,), acc)

            ready = T.alloc_barrier(arrive_count=[32] * R)
            free = T.alloc_barrier(arrive_count=[consumers] * R)
            state_ready = T.alloc_barrier(arrive_count=[128] * nb)
            state_free = T.alloc_barrier(arrive_count=[128] * nb)
            vnew_ready = T.alloc_barrier(arrive_count=[128] * nb)
            vnew_free = T.alloc_barrier(arrive_count=[128] * nb)
            norm_ready = T.alloc_barrier(arrive_count=[128] * R)
            p_ready = T.alloc_barrier(arrive_count=[128] * npb)
            p_free = T.alloc_barrier(arrive_count=[128] * npb)

            tx = T.get_thread_binding()
            hq = h // ratio
            bos0 = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            c0 = chunk_offsets[n]
            nchunks = chunk_offsets[n + 1] - c0
            v0 = bv * BV
            if halo:
                seq = seg_table[n, 0]
                wf = walk_from[n, h]
                nhalo = c0 - wf
                from_src = wf == seg_table[n, 1]       # (the walk starts at h0)
                is_last = seg_table[n, 2] != 0
            else:
                seq = n
                nhalo = 0
            nwalk = nchunks + nhalo if halo else nchunks

            if tx < 128:
                if tchain:
                    # ---- state chain, transposed, operands in registers (see ``tchain``) ----
                    T.set_max_nreg(232 if psplit else 240, 1)
                    if has_h0:
                        for jj, a in T.Parallel(BV, K):
                            St_f[jj, a] = h0[n, h, a, v0 + jj]
                    else:
                        T.clear(St_f)
                    for i in T.serial(nchunks):
                        s = i % R
                        b = i % 2 if nb == 2 else 0
                        bos = bos0 + i * C
                        T.barrier_wait(ready[s], (i // R) % 2)
                        T.copy(St_f, Stb_f)
                        T.gemm(Stb_f, w_s[s, :, :], vnt_f, transpose_B=True, clear_accum=True)
                        for jj, r in T.Parallel(BV, C):
                            vnt_f[jj, r] = T.if_then_else(bos + r < eos, T.cast(u_s[s, r, jj], acc) - vnt_f[jj, r], 0.0)
                        if l2norm:
                            T.barrier_wait(norm_ready[s], (i // R) % 2)
                            for jj, r in T.Parallel(BV, C):
                                vdt_f[jj, r] = vnt_f[jj, r] * nk_s[s, r] * ex(G_s[s, C - 1] - G_s[s, r])
                        else:
                            for jj, r in T.Parallel(BV, C):
                                vdt_f[jj, r] = vnt_f[jj, r] * ex(G_s[s, C - 1] - G_s[s, r])
                        for jj, a in T.Parallel(BV, K):
                            St_f[jj, a] = St_f[jj, a] * ex(G_s[s, C - 1])
                        T.wgmma_gemm(vdt_f, k_s[s, :, :], St_f)
                        # while the update runs: Sb and v_new (this chunk's) for the output warpgroup
                        T.barrier_wait(state_free[b], (i // nb + 1) % 2)
                        for a, jj in T.Parallel(K, BV):
                            S_s[b, a, jj] = Stb_f[jj, a]
                        T.fence_proxy_async()
                        T.barrier_arrive(state_ready[b])
                        if save_states:
                            T.copy(S_s[b, :, :], h_out[c0 + i, h, :, v0:v0 + BV])
                        T.barrier_wait(vnew_free[b], (i // nb + 1) % 2)
                        for r, jj in T.Parallel(C, BV):
                            vn_s[b, r, jj] = vnt_f[jj, r]
                        T.fence_proxy_async()
                        T.barrier_arrive(vnew_ready[b])
                        if save_states:
                            T.copy(vn_s[b, :, :], vn_out[c0 + i, h, :, v0:v0 + BV])
                        T.wait_wgmma(0)
                        T.barrier_arrive(free[s])
                    if store_ht:
                        for jj, a in T.Parallel(BV, K):
                            ht[n, h, a, v0 + jj] = St_f[jj, a]
                else:
                    # ---- state chain ----
                    if psplit:
                        T.set_max_nreg(232 if big else 168, 1)
                    elif big:
                        T.set_max_nreg(240, 1)
                    start_state(h0, S_f, seq, h, v0, from_src if halo else True)
                    for i in T.serial(nwalk):
                        s = i % R
                        # halo: jc < 0 for the halo's chunks, whose rows lie before the segment's; (i + nhalo) has
                        # the parity of jc and is never negative
                        jc = i - nhalo if halo else i
                        b = ((i + nhalo) % 2 if halo else i % 2) if nb == 2 else 0
                        real = i >= nhalo if halo else True
                        bos = bos0 + jc * C
                        T.barrier_wait(ready[s], (i // R) % 2)
                        stamp(trace_out, 0, i, tx, 0, bv, h, n)
                        if real:
                            T.barrier_wait(state_free[b], (jc // nb + 1) % 2)
                        stamp(trace_out, 1, i, tx, 0, bv, h, n)
                        if async_store and save_states:
                            wait_for_store(ASTORE_BARRIER_CHAIN)        # (the last chunk's state save)
                        # (in the halo nobody else reads S_s: the output warpgroup starts at the first own chunk)
                        T.copy(S_f, S_s[b, :, :])
                        T.fence_proxy_async()
                        if real:
                            T.barrier_arrive(state_ready[b])
                            if save_states:
                                store_tile(S_s[b, :, :], h_out[c0 + jc, h, :, v0:v0 + BV])
                        if fused:
                            # Y = v - exp(G) nk (k Sb) -> vd_s (free: the last chunk's update has read it), then
                            # v_new = Tb Y.  Y is formed in place, then stored by a loop of its own: a loop
                            # that reads shared tiles and stores to one gets a warpgroup barrier per unrolled
                            # iteration at BV = 128 (and T.copy's stmatrix path spills there)
                            T.gemm(k_s[s, :, :], S_s[b, :, :], vn_f, clear_accum=True)
                            if l2norm:
                                T.barrier_wait(norm_ready[s], (i // R) % 2)
                                for r in T.Parallel(C):
                                    rowf_f[r] = ex(G_s[s, r]) * nk_s[s, r]
                            else:
                                for r in T.Parallel(C):
                                    rowf_f[r] = ex(G_s[s, r])
                            if x_beta:
                                # Y = beta (v - exp(G) nk (k Sb)): beta folded into both row factors
                                for r in T.Parallel(C):
                                    rowb_f[r] = bt_s[s, r]
                                for r in T.Parallel(C):
                                    rowf_f[r] = rowf_f[r] * rowb_f[r]
                                for r, j in T.Parallel(C, BV):
                                    vn_f[r, j] = T.if_then_else(
                                        bos + r < eos, T.cast(u_s[s, r, j], acc) * rowb_f[r] - rowf_f[r] * vn_f[r, j],
                                        0.0)
                            else:
                                for r, j in T.Parallel(C, BV):
                                    vn_f[r, j] = T.if_then_else(
                                        bos + r < eos, T.cast(u_s[s, r, j], acc) - rowf_f[r] * vn_f[r, j], 0.0)
                            for r, j in T.Parallel(C, BV):
                                vd_s[r, j] = vn_f[r, j]
                            T.fence_proxy_async()
                            T.gemm(w_s[s, :, :], vd_s, vn_f, clear_accum=True)
                        else:
                            T.gemm(w_s[s, :, :], S_s[b, :, :], vn_f, clear_accum=True)
                            for r, j in T.Parallel(C, BV):
                                vn_f[r, j] = T.if_then_else(bos + r < eos, T.cast(u_s[s, r, j], acc) - vn_f[r, j], 0.0)
                        stamp(trace_out, 2, i, tx, 0, bv, h, n)
                        if real:
                            if async_store and save_states and not vn_save_by_output:
                                wait_for_store(ASTORE_BARRIER_CHAIN)    # (the last chunk's v_new save)
                            T.barrier_wait(vnew_free[b], (jc // nb + 1) % 2)
                            T.copy(vn_f, vn_s[b, :, :])
                            T.fence_proxy_async()
                            T.barrier_arrive(vnew_ready[b])
                            stamp(trace_out, 3, i, tx, 0, bv, h, n)
                            if save_states and not vn_save_by_output:
                                store_tile(vn_s[b, :, :], vn_out[c0 + jc, h, :, v0:v0 + BV])
                        if l2norm:
                            if not fused:       # (the fused chain waited for the row factors already)
                                T.barrier_wait(norm_ready[s], (i // R) % 2)
                            for r in T.Parallel(C):
                                rowf_f[r] = nk_s[s, r] * ex(G_s[s, C - 1] - G_s[s, r])
                        else:
                            for r in T.Parallel(C):
                                rowf_f[r] = ex(G_s[s, C - 1] - G_s[s, r])
                        for r, j in T.Parallel(C, BV):
                            vd_s[r, j] = vn_f[r, j] * rowf_f[r]
                        T.fence_proxy_async()
                        glast[0] = ex(G_s[s, C - 1])
                        for a, b in T.Parallel(K, BV):
                            S_f[a, b] = S_f[a, b] * glast[0]
                        T.gemm(k_s[s, :, :], vd_s, S_f, transpose_A=True)
                        stamp(trace_out, 4, i, tx, 0, bv, h, n)
                        T.barrier_arrive(free[s])
                    if async_store and save_states:
                        T.tma_store_wait(0)
                    if store_ht:
                        if halo:
                            if is_last:
                                T.copy(S_f, ht[seq, h, :, v0:v0 + BV])
                        else:
                            T.copy(S_f, ht[n, h, :, v0:v0 + BV])
            elif tx < 256:
                # ---- output ----
                if big and not psplit:
                    T.set_max_nreg(208, 1)
                for i in T.serial(nwalk):
                    s = i % R
                    jc = i - nhalo if halo else i
                    b = ((i + nhalo) % 2 if halo else i % 2) if nb == 2 else 0
                    # (pscores: P came in ring slot s)
                    pb = s if pscores else (((i + nhalo) % 2 if halo else i % 2) if psplit else 0)
                    real = i >= nhalo if halo else True
                    bos = bos0 + jc * C
                    T.barrier_wait(ready[s], (i // R) % 2)
                    stamp(trace_out, 5, i, tx, 128, bv, h, n)
                    if l2norm:
                        if psplit:
                            if real:
                                T.barrier_wait(norm_ready[s], (i // R) % 2)
                        else:
                            # (also in the halo: the state chain needs nk)
                            l2_row_factors(q_s, nq_s, s, sq_f, ss_f)
                            l2_row_factors(k_s, nk_s, s, sq_f, ss_f)
                            T.barrier_arrive(norm_ready[s])
                    if not real:
                        T.barrier_arrive(free[s])
                    else:
                        # q Sb first: releasing Sb early keeps the state warpgroup off this one's work
                        T.barrier_wait(state_ready[b], (jc // nb) % 2)
                        stamp(trace_out, 6, i, tx, 128, bv, h, n)
                        T.gemm(q_s[s, :, :], S_s[b, :, :], o_f, clear_accum=True)
                        stamp(trace_out, 7, i, tx, 128, bv, h, n)
                        T.barrier_arrive(state_free[b])
                        if l2norm:
                            for r in T.Parallel(C):
                                orow_f[r] = nq_s[s, r] * ex(G_s[s, r])
                        else:
                            for r in T.Parallel(C):
                                orow_f[r] = ex(G_s[s, r])
                        for r, j in T.Parallel(C, BV):
                            o_f[r, j] = o_f[r, j] * orow_f[r]
                        if not pscores:
                            if not psplit:
                                T.gemm(q_s[s, :, :], k_s[s, :, :], P_f, transpose_B=True, clear_accum=True)
                                build_scores(P_f, P_s, 0, s, nq_s, nk_s, G_s, gr_f, gc_f)
                            # done with the ring slot (q, k, G, row factors): hand it back before waiting for
                            # v_new, so the producer can refill it while the state chain is still on this chunk
                            T.barrier_arrive(free[s])
                        if psplit:
                            T.barrier_wait(p_ready[pb], (jc // 2) % 2)
                        stamp(trace_out, 8, i, tx, 128, bv, h, n)
                        T.barrier_wait(vnew_ready[b], (jc // nb) % 2)
                        stamp(trace_out, 9, i, tx, 128, bv, h, n)
                        T.gemm(P_s[pb, :, :], vn_s[b, :, :], o_f)
                        stamp(trace_out, 10, i, tx, 128, bv, h, n)
                        if vn_save_by_output:
                            # (the electing thread waits for the store's shared reads before its arrival below, and
                            # the chain's wait on vnew_free needs every arrival, so v_new is not overwritten early)
                            T.copy(vn_s[b, :, :], vn_out[c0 + jc, h, :, v0:v0 + BV])
                        T.barrier_arrive(vnew_free[b])
                        if psplit:
                            T.barrier_arrive(p_free[pb])
                        if pscores:
                            T.barrier_arrive(free[s])
                        if ostage:
                            if bos + C <= eos:
                                if async_store:
                                    wait_for_store(ASTORE_BARRIER_OUTPUT)   # (the last chunk's o store)
                                for r, j in T.Parallel(C, BV):
                                    o_s[r, j] = o_f[r, j] * scale
                                T.fence_proxy_async()
                                store_tile(o_s, o[bos:bos + C, h, v0:v0 + BV])
                            else:
                                for r, j in T.Parallel(C, BV):
                                    if bos + r < eos:
                                        o[bos + r, h, v0 + j] = o_f[r, j] * scale
                        else:
                            for r, j in T.Parallel(C, BV):
                                if bos + r < eos:
                                    o[bos + r, h, v0 + j] = o_f[r, j] * scale
                        stamp(trace_out, 11, i, tx, 128, bv, h, n)
                if async_store and ostage:
                    T.tma_store_wait(0)
            elif psplit and tx < 384:
                # ---- scores (psplit): row factors and P, up to two chunks ahead of the output ----
                for i in T.serial(nwalk):
                    s = i % R
                    jc = i - nhalo if halo else i
                    pb = (i + nhalo) % 2 if halo else i % 2
                    real = i >= nhalo if halo else True
                    T.barrier_wait(ready[s], (i // R) % 2)
                    stamp(trace_out, 12, i, tx, 256, bv, h, n)
                    if l2norm:
                        # (also in the halo: the state chain needs nk)
                        l2_row_factors(q_s, nq_s, s, sq_f, ss_f)
                        l2_row_factors(k_s, nk_s, s, sq_f, ss_f)
                        T.barrier_arrive(norm_ready[s])
                    if real:
                        T.gemm(q_s[s, :, :], k_s[s, :, :], P_f, transpose_B=True, clear_accum=True)
                        stamp(trace_out, 13, i, tx, 256, bv, h, n)
                        T.barrier_wait(p_free[pb], (jc // 2 + 1) % 2)
                        build_scores(P_f, P_s, pb, s, nq_s, nk_s, G_s, gr_f, gc_f)
                        T.barrier_arrive(p_ready[pb])
                        stamp(trace_out, 14, i, tx, 256, bv, h, n)
                    T.barrier_arrive(free[s])
            else:
                # ---- producer: one warp issues every TMA load of a slot ----
                if big or psplit or tchain:
                    T.set_max_nreg(24 if psplit else 40, 0)
                if tx < prod0 + 32:
                    for i in T.serial(nwalk):
                        s = i % R
                        jc = i - nhalo if halo else i
                        bos = bos0 + jc * C
                        T.barrier_wait(free[s], (i // R + 1) % 2)
                        stamp(trace_out, 15, i, tx, prod0, bv, h, n)
                        T.tma_copy(q[bos:bos + C, hq, :], q_s[s, :, :], barrier=ready[s])
                        T.tma_copy(k[bos:bos + C, hq, :], k_s[s, :, :], barrier=ready[s])
                        T.tma_copy(w[c0 + jc, h, :, :], w_s[s, :, :], barrier=ready[s])
                        if fused:
                            T.tma_copy(u[bos:bos + C, h, v0:v0 + BV], u_s[s, :, :], barrier=ready[s])
                        else:
                            T.tma_copy(u[c0 + jc, h, :, v0:v0 + BV], u_s[s, :, :], barrier=ready[s])
                        T.tma_copy(G[c0 + jc, h, :], G_s[s, :], barrier=ready[s])
                        if pscores:
                            T.tma_copy(scores_in[c0 + jc, h, :, :], P_s[s, :, :], barrier=ready[s])
                        if x_beta:
                            T.tma_copy(scores_in[c0 + jc, h, :], bt_s[s, :], barrier=ready[s])
                        T.barrier_arrive(ready[s])

    return gdn_fwd_recurrent_ws
