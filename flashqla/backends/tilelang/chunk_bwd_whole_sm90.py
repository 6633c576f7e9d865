"""The fused backward at whole V (Hopper), second design: one CTA per (value head, sequence) walks dS [K, V] and
forms every gradient of each chunk, with the work split by its MAC count over three math warpgroups
(``BACKWARD_PLAN.md``, "Status (session 14)"; CPU model: ``chunk_bwd_fused_ref.bwd_fused_ref(w_free=True)``,
whose order, rounding points and masks this kernel follows).

Why a second design: the first (``chunk_bwd_fused_sm90``, BV = 64, retired in session 15) ran each (chunk, head) in
two CTAs that both repeated the K-side products, and one warpgroup carried the whole dA chain: 33 K cycles per step
at 16/32 4x8192, slower than the split backward (session 14 run 3).  Here nothing is repeated, w is not read at all (the chain
updates dS with ``k^T dVg``, ``dVg = -diag(eG) dY``, from the dY that the value warpgroup forms anyway), and the
~12 M MAC of a step are split about 2 / 5.8 / 5.5 M over the chain, value and key warpgroups.

Grid ``(Hv, N)``, 512 threads, chunks walked in reverse.  Notation per chunk (as the CPU model): ``E[r, j] =
exp(G_r - G_j)`` for ``j <= r``, ``D_r = exp(G_last - G_r)``, ``eG = exp(G)``, ``M`` the causal mask with rows
``r < eos``; no L2 norm in this kernel (such calls take the split backward).

* warpgroup 0, **chain** (dS fp32 in registers, 128 per thread)::

      dSb = bf16(dS) -> value, key;  e^{G_last} <S, dSb> row sums -> key's dg warp
      dOs = bf16(scale eG dO) (rows < eos);  dS = e^{G_last} dS + q^T dOs;  dS += k^T dVg (from value)

* warpgroup 1, **value** (state-free part first, while the chain finishes the previous chunk)::

      P = q k^T -> Pm = bf16(scale P E M);  dPm = dO vn^T -> dQK = bf16(scale E M dPm) -> key;
      Z = dQK P: its row sums -> key's dg warp
      acc = diag(D) k dSb + Pm^T dO (rows >= eos 0) -> dvn (bf16, own tile);  Z' = X^T dvn;  dv = dY = b Z';
      m = dvn Y^T;  dVg = bf16(-eG dY) over dvn -> chain, key;  db = rowsum(Z' Y)
      dX = bf16(m diag(b));  T1 = X^T dX;  dA = -(T1 X^T), dA^T = -(X T1^T) (strict);  KK = k k^T;
      Ws = bf16(W + W^T), W = dA diag(b) E -> key;  db += rowsum(dA KK E);  dAA sums -> key's dg warp

* warpgroup 2, **key**::

      U = k S -> Y = bf16(v - eG U) over v's tile -> value;  Z's column sums as the row sums of the [j, r]
      frame (vn dO^T, k q^T)
      t = vn dSb^T (K halves): dk = diag(D) t, dD = rowsum(k t)  (frees dSb: the chain's next step waits on it)
      dq = scale eG (dO S^T) + dQK k (K halves, stored), ginter = scale eG rowsum(q dO S^T)
      dk += dQK^T q;  dk += dVg S^T, gv = rowsum(k dVg S^T);  dk += Ws k (stored)
      dG = [r < eos](rowZ - colZ + ginter - D dD + gv) + rowsum(dAA) - colsum(dAA), plus e^{G_last} <S, dS> + sum D dD
      on the last row: dg = its reverse cumsum (one warp), db

* warpgroup 3, the **producer**: one warp issues the TMA loads of vn, q, dO, S, v, X and k with G (the order in
  which the previous chunk's last readers release them), each as soon as they have arrived on its ``empty`` barrier.

Shared memory (bf16, K = V = 128): inputs q 16, k 16, v / Y 16, dO 16, S 32, vn 16, X 8 KB; hand-offs dSb 32,
dOs 16, Pm 8, dvn / dVg 16, dQK 8, dX / T1 8, Ws 8 KB; vectors ~3 KB: ~219 KB of the 227.  Registers (setmaxnreg):
chain 160, value 168, key 160, producer 24 (ptxas, bf16: 96 bytes of stack, no local memory).  The counts are set
by ptxas's wgmma pipelining, not by spills: where it cannot hold a role's wgmma accumulators it serialises every
wgmma of the kernel (each k-step waited on alone; its C7512 note, which TileLang's build hides).  Until session 16
the key role's dq phase ran with both dk accumulators live and did that at 160 (needed 192); dq now runs first.
Chain and key then need 160 each (below, serialised again), the value role, which sets the step, takes the rest:
its spills go from 34 to 5 load / store instructions, the key role keeps ~50 (per step, against ~30 K cycles).
Every tile is single-buffered; a hand-off is written only after its previous readers arrived on its ``free``
barrier, and each ``ready`` barrier is arrived by a writer that has waited for that, so no barrier runs two phases
ahead of a waiter (the vectors for the dg warp alternate over two slots and two barriers, as the chain can be one
chunk ahead of the key warpgroup).

Outputs: ``dq``, ``dk`` ``[NT, Hv, K]`` per value head in the inputs' dtype (the host sums each GVA group in
fp32; with ``gva_pair``, ``[NT, Hqk, K]`` already summed, below), ``dv`` ``[NT, Hv, V]``, ``dg``, ``db`` ``[NT, Hv]`` fp32, ``dh0`` ``[N, Hv, K, V]`` fp32.  Rows past a
sequence's end are never stored.

``halo`` (in-kernel context parallelism, as the split backward's ``chunk_bwd_state_ws`` and
:mod:`flashqla.backends.tilelang.segments`): the grid's last axis runs over chunk-aligned segments
(``cu_seqlens`` / ``chunk_offsets`` are the segments' boundaries), ``seg_table[n] = (sequence, its end chunk,
is-first, its end token)`` and ``walk_end[n, h]`` the global chunk (exclusive) the walk starts from, between the
segment's end and the sequence's.  The chunks between (the halo) run the whole step from ``dS = 0`` (from ``dht``
where the halo reaches the sequence end) and store nothing: every role runs them, so the barrier protocol is the
plain walk's over more chunks.  A whole step per halo chunk costs more than the chain alone would, but the halo is
~3 chunks at the benchmarks' gates against 100+ per segment.  Row masks use the sequence's end; only a sequence's
first segment writes ``dh0``.

``light_halo`` (with ``halo``; ``FLASHQLA_TILELANG_HALO_STEP=light``): a halo step runs only what the chain's dS
needs: ``dSb``, ``dOs``, ``q^T dOs``, ``k^T dVg`` (chain, without ``<S, dSb>``) and ``Pm``, ``k dSb``, ``Pm^T dO``,
``X^T dvn``, ``dVg`` (value: ~2.5 of its ~5.8 M MAC, the dependent part of the step); the key role only waits and
arrives.  The chain and the value role run the halo steps in a loop of their own ahead of the main loop (which
then starts at the segment's first chunk, its row bound the sequence end); the key role takes them in an if /
else of its one loop (a loop of its own made ptxas serialise every wgmma); the producer predicates its vn, S and v
loads, whose ``full`` phases then complete without one.  Every halo region has its main loop's barrier operations
in the same order (a CPU test compares them), so the protocol, and its model, are the plain walk's.  At 16/32 one
32k sequence the longest CTA walks 128 chunks and a 4-chunk halo.

``gva_pair`` (GVA ratio 2 only; ``BACKWARD_PLAN.md`` section 7): the key role adds its dq / dk rows, rounded to the
dtype, into the group's row of ``dq`` / ``dk`` ``[NT, Hqk, K]``, which the host zeroes, with bf16x2 / f16x2 reductions
(``red.global.add.noftz``, round to nearest) instead of storing them per value head for a separate sum kernel.  Each
element then gets exactly two adds onto +0: ``0 + a = a`` exactly, then ``rn(a + b) = rn(b + a)``, so the result does
not depend on which head's CTA comes first: deterministic without flags or waits, and no CTA ever waits on another.
(Three or more adds would round in arrival order, hence ratio 2 only.)  It equals the host's sum (fp32, one rounding)
except where that fp32 sum rounded first (exponents 17+ apart), by one unit in the last place at most.  What it
saves: the sum kernel's read of both heads' rows and its write (~0.19 ms of 2.92 at 16/32 one 32k sequence), for a
memset of the outputs.

``pair_zero`` (with ``gva_pair``; ``FLASHQLA_TILELANG_GVA_ZERO=kernel``): the kernel zeroes those rows itself, so
the host's memset of both outputs (0.083 ms at 16/32 one 32k sequence, H100) goes.  The producer warpgroup's idle
second warp, the **zero** role, takes a ticket per (sequence or segment, query/key head) with a 64-bit atomic: the
CTA that gets 0 zeroes the pair's rows of each of its walk steps ``ZERO_AHEAD`` steps ahead of its key role (16-byte
stores; halo steps store nothing and are skipped) and after each step's rows sets that chunk's flag (a warp
barrier, then a release fence and a relaxed store); the other CTA's zero warp waits for the flag of each step
(relaxed polls, then one acquire fence: acquire loads and fence.acq_rel also invalidate the SM's L1).  Either
arrives on ``zero_ready`` once per step, after waiting for the key role's release of the previous step's k (so it
is never a phase ahead) and before the zeroing ahead, and the key role waits on it before its first reduction of
the step.  The CTA with ticket 0
has started before the other one waits, and it waits on no other CTA, so a grid larger than the GPU cannot hang.
The sums are the same two adds onto +0 as with the memset.  The words (tickets, then one flag per (chunk,
query/key head), zero at launch) travel in the int64 ``trace_out`` parameter (so the build without it keeps its
signature and its cached kernels); ``trace`` and ``pair_zero`` are exclusive.

A third form, ``pair_store`` (session 31: no zeroing, the pair's first CTA storing its rows and the other adding
after a flag per chunk), was removed in session 33: on an H100 its gradients differed from the memset build's
(relative L2 0.25) and the kernel took 2.133 against 1.784 ms at 16/32 one 32k sequence.
A fourth, ``pair_cluster`` (session 37: the same zeroing ahead with each pair's two CTAs as a 2-CTA cluster, the
signal a release fence and an add onto a count in the other CTA's shared memory, so no global flag and no acquire),
was removed in session 38: on an H100 the kernel took 2.090 against the memset build's 1.768 ms at 16/32 one 32k
sequence (fwd+bwd CUDA graph 2.965 against 2.747 ms with the memset; session 38 run 1).  Zeroing in the kernel has
now cost ~0.3 ms in both signalling forms, ~4x the 0.083 ms memset it removes.
"""

CHUNK = 64

# (event, role): what has just happened when the role's first thread of CTA (0, 0) stamps clock64() (``trace=True``,
# ``benchmarks/trace_bwd_fused.py --kernel whole``), for the first TRACE_CHUNKS steps of its walk
TRACE_EVENTS = (
    ("chain: k, G ready", "chain"), ("chain: dSb free", "chain"), ("chain: dSb published", "chain"), ("chain: q^T dOs done", "chain"),
    ("chain: dVg ready", "chain"), ("chain: step done", "chain"),
    ("value: q, k ready", "value"), ("value: Pm written", "value"), ("value: dO vn^T done", "value"),
    ("value: dQK published", "value"), ("value: Z rows done", "value"), ("value: dSb ready", "value"), ("value: k dSb done", "value"),
    ("value: Pm^T dO done", "value"), ("value: dvn written", "value"), ("value: X^T dvn done", "value"),
    ("value: dv stored", "value"), ("value: dvn Y^T done", "value"), ("value: dVg published", "value"),
    ("value: db done", "value"), ("value: KK, dX done", "value"), ("value: T1 written", "value"),
    ("value: W^T pass done", "value"), ("value: Ws published", "value"), ("value: step done", "value"),
    ("key: k, S ready", "key"), ("key: k S done", "key"), ("key: Y published", "key"), ("key: colZ done", "key"), ("key: dSb freed", "key"),
    ("key: dD done", "key"), ("key: dQK ready", "key"), ("key: dq stored", "key"), ("key: dQK^T q done", "key"),
    ("key: dVg ready", "key"), ("key: dVg S^T done", "key"), ("key: Ws ready", "key"), ("key: Ws k done", "key"),
    ("key: dk stored", "key"), ("key: dg stored", "key"),
    ("producer: S issued", "producer"), ("producer: X issued", "producer"), ("producer: k issued", "producer"),
)
TRACE_CHUNKS = 64

# pair_zero: how many walk steps ahead of its key role the zeroing CTA zeroes a pair's rows (the other CTA of the
# pair may run this far ahead before it waits; the rows stay in L2 for the reductions: 32 KB a step)
ZERO_AHEAD = 2

# setmaxnreg of (chain, value, key, producer): they sum to 512 (x 128 threads = the 64K-register file); see the
# docstring for why these (a role below its count here serialises every wgmma of the kernel)
NREGS = (160, 168, 160, 24)


def build_bwd_whole(dtype: str, beta_dtype: str, K: int, V: int, has_dht: bool, need_dh0: bool,
                    trace: bool = False, nregs=None, hw_ex2: bool = False, halo: bool = False,
                    gva_pair: bool = False, pair_zero: bool = False, light_halo: bool = False):
    """``trace`` (diagnostics): clock64 stamps of ``TRACE_EVENTS`` into the ``trace_out`` parameter (a placeholder
    the kernel never touches otherwise); ``nregs``: setmaxnreg per role (default ``NREGS``); ``hw_ex2``: the
    exponentials as one ``ex2.approx.ftz`` each instead of ``exp2f`` (``_common.EX2_APPROX_SRC``: ~400 fewer
    instructions in the value role, ~160 in the key role); ``halo``: the walk over segments (the docstring;
    ``seg_table`` / ``walk_end`` are placeholders otherwise); ``gva_pair``: dq / dk summed over GVA pairs in the
    kernel (the docstring; the launch must have Hv = 2 Hqk and zeroed ``dq`` / ``dk``); ``pair_zero`` (with
    ``gva_pair``, without ``trace``): the kernel zeroes those rows itself, ``trace_out`` then carries the pair's
    words, zeroed (the docstring's last section); ``light_halo`` (with ``halo``, without ``trace``): halo steps run
    only what the chain needs (the docstring's ``light_halo``)."""
    import tilelang.language as T

    from ._common import EX2_APPROX_SRC, PAIR_ZERO_SRC, RED_PAIR_SRC, ex2_approx, make_grad_rows, symbolic_sizes

    assert not pair_zero or (gva_pair and not trace), "pair_zero needs gva_pair and no trace"
    assert not light_halo or (halo and not trace), "light_halo needs halo and no trace"
    light = light_halo

    C = CHUNK
    KH = K // 2        # K halves of the key warpgroup's [C, K] products
    grad_rows = make_grad_rows(C, gva_pair)   # dq / dk: per value head, or into the GVA pair's row
    SQ = 8             # column block of <S, dSb> (the chain's)
    DB = 16            # column block of the chain's dOs pass
    acc = "float32"
    assert K == 128 and V == 128
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    HG = Hqk if gva_pair else Hv      # dq / dk's head axis
    DTN, DTH = (NS, Hv) if has_dht else T.dynamic("DTN, DTH")
    D0N, D0H = (NS, Hv) if need_dh0 else T.dynamic("D0N, D0H")
    if halo:
        # dht / dh0 stay per sequence while the grid runs over segments
        DTN, D0N = T.dynamic("DTN"), T.dynamic("D0N")
    SGN, WEN, WEH = (NS, NS, Hv) if halo else T.dynamic("SGN, WEN, WEH")
    TR0, TR1 = (len(TRACE_EVENTS), TRACE_CHUNKS) if trace else T.dynamic("TR0, TR1")
    EV = {name: e for e, (name, _) in enumerate(TRACE_EVENTS)}
    LOG2E = 1.4426950408889634
    R_CHAIN, R_VALUE, R_KEY, R_PROD = nregs or NREGS
    assert R_CHAIN + R_VALUE + R_KEY + R_PROD <= 512

    def fexp(x):
        # MUFU.EX2 (~2 ulp); only differences of G are exponentiated.  T.exp2 is exp2f, which adds a
        # subnormal-range test and two multiplies to each (hw_ex2 drops them)
        if hw_ex2:
            return ex2_approx(x * LOG2E)
        return T.exp2(x * LOG2E)

    def store_end(i, nhalo, bos, eos):
        # the row bound of step i's stores: the sequence's end, or (a halo chunk) the chunk's start: nothing.  A
        # bound, not an ``if`` around the stores: that ``if`` around the key role's dk stores made ptxas serialise
        # every wgmma of the kernel (its accumulators live across the branch; session 18, lowering for sm_90a)
        return T.if_then_else(i >= nhalo, eos, bos) if halo and not light else eos

    def zero_step(words, dq_out, dk_out, j, nchunks, nhalo, bos0, eos, c0, hq, nseg, hqk):
        # pair_zero, the ticket-0 CTA: walk step j's dq / dk rows of the pair zeroed, then its flag set (the
        # arithmetic in the helper: in TileLang's int64 forms the producer warpgroup's 24 registers spilled).  A
        # plain function, not a T.macro: a macro's parameter names rename the kernel's symbolic sizes
        return T.call_extern("handle", "flq_pair_zero_step", words.data, dq_out.data, dk_out.data, j, nchunks,
                             nhalo, bos0, eos, c0, hq, nseg, hqk)

    @T.macro
    def chain_dos(do_s, G_s, dos_f, dOs_s, scale, bos, eos):
        # dOs = bf16(scale eG dO), rows past the sequence end 0, by column blocks (the chain's, in its halo and
        # main steps alike)
        for jb in T.unroll(V // DB):
            for r, j in T.Parallel(C, DB):
                dos_f[r, j] = T.cast(do_s[r, jb * DB + j], acc) * (scale * fexp(G_s[r]))
            for r, j in T.Parallel(C, DB):
                dos_f[r, j] = T.if_then_else(bos + r < eos, dos_f[r, j], 0.0)
            T.copy(dos_f, dOs_s[:, jb * DB:(jb + 1) * DB])

    @T.macro
    def value_pm(P_f, G_s, M_f, Pm_s, scale, bos, eos):
        # Pm = bf16(scale P E M) [r, j] from P = q k^T (the value role's, in its halo and main steps alike)
        for r, j in T.Parallel(C, C):
            M_f[r, j] = P_f[r, j] * scale * fexp(G_s[r] - G_s[j])
        for r, j in T.Parallel(C, C):
            M_f[r, j] = T.if_then_else((j <= r) & (bos + r < eos), M_f[r, j], 0.0)
        T.copy(M_f, Pm_s)

    @T.macro
    def value_dvg(A_f, bf_f, G_s, rowf_f, dvn_s):
        # dVg = bf16(-eG bf16(dY)) over dvn, dY = b Z' (eG once per row, not per element)
        for r in T.Parallel(C):
            rowf_f[r] = -fexp(G_s[r])
        for r, j in T.Parallel(C, V):
            dvn_s[r, j] = rowf_f[r] * T.cast(T.cast(bf_f[r] * A_f[r, j], dtype), acc)

    @T.macro
    def stamp(trace_out, name, i, tx, tx0, hv, n):
        if trace:
            if T.And(T.And(tx == tx0, hv + n == 0), i < TRACE_CHUNKS):
                trace_out[EV[name], i] = T.call_extern("int64", "clock64")

    @T.prim_func
    def gdn_bwd_whole(
        q: T.Tensor((NT, Hqk, K), dtype),
        k: T.Tensor((NT, Hqk, K), dtype),
        v: T.Tensor((NT, Hv, V), dtype),
        beta: T.Tensor((NT, Hv), beta_dtype),
        do: T.Tensor((NT, Hv, V), dtype),
        G: T.Tensor((NC, Hv, C), acc),
        X: T.Tensor((NC, Hv, C, C), dtype),
        h: T.Tensor((NC, Hv, K, V), dtype),
        vn: T.Tensor((NC, Hv, C, V), dtype),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_offsets: T.Tensor((NS + 1,), "int32"),
        dht: T.Tensor((DTN, DTH, K, V), acc),
        dq_out: T.Tensor((NT, HG, K), dtype),
        dk_out: T.Tensor((NT, HG, K), dtype),
        dv_out: T.Tensor((NT, Hv, V), dtype),
        dg_out: T.Tensor((NT, Hv), acc),
        db_out: T.Tensor((NT, Hv), acc),
        dh0: T.Tensor((D0N, D0H, K, V), acc),
        trace_out: T.Tensor((TR0, TR1), "int64"),
        scale: T.float32,
        ratio: T.int32,
        seg_table: T.Tensor((SGN, 4), "int32"),
        walk_end: T.Tensor((WEN, WEH), "int32"),
    ):
        with T.Kernel(Hv, NS, threads=512) as (hv, n):
            # (one import per kernel: a second one is an annotation clash)
            if hw_ex2 or gva_pair:
                T.import_source((EX2_APPROX_SRC if hw_ex2 else "") + (RED_PAIR_SRC if gva_pair else "")
                                + (PAIR_ZERO_SRC if pair_zero else ""))
            # ---- input tiles (TMA), single-buffered
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            G_s = T.alloc_shared((C,), acc)
            v_s = T.alloc_shared((C, V), dtype)       # v, then Y (key writes it in place)
            do_s = T.alloc_shared((C, V), dtype)
            S_s = T.alloc_shared((K, V), dtype)
            vn_s = T.alloc_shared((C, V), dtype)
            X_s = T.alloc_shared((C, C), dtype)
            # ---- hand-offs and private tiles
            dSb_s = T.alloc_shared((K, V), dtype)     # chain -> value, key
            dOs_s = T.alloc_shared((C, V), dtype)     # chain's own
            Pm_s = T.alloc_shared((C, C), dtype)      # value's own
            dvn_s = T.alloc_shared((C, V), dtype)     # value's dvn, then dVg -> chain, key
            dQK_s = T.alloc_shared((C, C), dtype)     # value -> key
            dX_s = T.alloc_shared((C, C), dtype)      # value's own: dX, then T1
            Ws_s = T.alloc_shared((C, C), dtype)      # value -> key
            b_s = T.alloc_shared((C,), acc)           # value's own
            vz_s = T.alloc_shared((2, C), acc)        # value -> key's dg warp: rowZ
            cz_s = T.alloc_shared((C,), acc)          # key's own: colZ
            va_s = T.alloc_shared((2, C), acc)        # value -> key's dg warp: rowsum(dAA) - colsum(dAA)
            vb_s = T.alloc_shared((2, C), acc)        # value -> key's dg warp: dbeta
            sdr_s = T.alloc_shared((2, K), acc)       # chain -> key's dg warp: e^{G_last} <S, dSb> row sums
            kg_s = T.alloc_shared((C,), acc)          # key's own: its dG terms
            dD_s = T.alloc_shared((C,), acc)          # key's own

            # chain fragments
            dS_f = T.alloc_fragment((K, V), acc)
            sd_f = T.alloc_fragment((K, SQ), acc)
            sdr_f = T.alloc_fragment((K,), acc)
            sda_f = T.alloc_fragment((K,), acc)
            dos_f = T.alloc_fragment((C, DB), acc)
            glast = T.alloc_local((1,), acc)
            # value fragments
            P_f = T.alloc_fragment((C, C), acc)
            M_f = T.alloc_fragment((C, C), acc)
            KK_f = T.alloc_fragment((C, C), acc)
            A_f = T.alloc_fragment((C, V), acc)
            rowf_f = T.alloc_fragment((C,), acc)
            vr_f = T.alloc_fragment((C,), acc)
            vc_f = T.alloc_fragment((C,), acc)
            vk_f = T.alloc_fragment((C,), acc)
            bf_f = T.alloc_fragment((C,), acc)
            bn_f = T.alloc_fragment((C,), acc)
            # key fragments
            U_f = T.alloc_fragment((C, V), acc)
            dk0_f = T.alloc_fragment((C, KH), acc)
            dk1_f = T.alloc_fragment((C, KH), acc)
            t_f = T.alloc_fragment((C, KH), acc)
            tq_f = T.alloc_fragment((C, KH), acc)
            kr_f = T.alloc_fragment((C,), acc)
            if gva_pair:
                pend = T.alloc_local((1,), acc)   # a pair's even column (make_red_rows)
            else:
                pend = None

            # inputs: 0 q, 1 k + G, 2 v, 3 dO, 4 S, 5 vn, 6 X; their readers arrive on empty_in
            full_in = T.alloc_barrier(arrive_count=[32] * 7)
            empty_in = T.alloc_barrier(arrive_count=[384, 384, 128, 384, 256, 256, 128])
            dsb_ready = T.alloc_barrier(arrive_count=128)
            dsb_free = T.alloc_barrier(arrive_count=256)
            y_ready = T.alloc_barrier(arrive_count=128)
            dqk_ready = T.alloc_barrier(arrive_count=128)
            dqk_free = T.alloc_barrier(arrive_count=128)
            dvg_ready = T.alloc_barrier(arrive_count=128)
            dvg_free = T.alloc_barrier(arrive_count=256)
            ws_ready = T.alloc_barrier(arrive_count=128)
            ws_free = T.alloc_barrier(arrive_count=128)
            vec_ready = T.alloc_barrier(arrive_count=[256, 256])
            if pair_zero:
                zero_ready = T.alloc_barrier(arrive_count=32)     # zero -> key: this step's pair rows are ready

            tx = T.get_thread_binding()
            # (gva_pair: ratio 2 by contract, a shift instead of a signed division in every reduction's address)
            hq = hv // 2 if gva_pair else hv // ratio
            bos0 = cu_seqlens[n]
            if not halo:
                eos = cu_seqlens[n + 1]
            c0 = chunk_offsets[n]
            if halo:
                # the walk: the halo's chunks past the segment's end (ci >= the segment's chunk count), then its own
                seq = seg_table[n, 0]
                eos = seg_table[n, 3]
                nhalo = walk_end[n, hv] - chunk_offsets[n + 1]
                from_dht = walk_end[n, hv] == seg_table[n, 1]
                is_first = seg_table[n, 2] != 0
                nchunks = walk_end[n, hv] - c0
            else:
                nhalo = 0
                nchunks = chunk_offsets[n + 1] - c0

            if tx < 128:
                # ---------------- chain ----------------
                T.set_max_nreg(R_CHAIN, 1)
                if has_dht:
                    if halo:
                        # a halo that reaches the sequence end walks from dht (no approximation at all)
                        # (a select, not an if / else around the copy: that branch made ptxas serialise every wgmma)
                        T.copy(dht[seq, hv, :, :], dS_f)
                        for a, b in T.Parallel(K, V):
                            dS_f[a, b] = T.if_then_else(from_dht, dS_f[a, b], 0.0)
                    else:
                        T.copy(dht[n, hv, :, :], dS_f)
                else:
                    T.clear(dS_f)
                if light:
                    # ~~ light halo ~~ (the main loop's barrier operations in its order: a test compares them)
                    for i in T.serial(nhalo):
                        s = i % 2
                        ci = nchunks - 1 - i
                        bos = bos0 + ci * C
                        T.barrier_wait(full_in[1], i % 2)          # k, G
                        T.barrier_wait(dsb_free, (i + 1) % 2)
                        T.copy(dS_f, dSb_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(dsb_ready)
                        # (S is not loaded in a halo step: <S, dSb> only feeds dg, which a halo chunk does not store)
                        T.barrier_wait(full_in[4], i % 2)          # S
                        T.barrier_arrive(empty_in[4])
                        T.barrier_arrive(vec_ready[s])
                        T.barrier_wait(full_in[3], i % 2)          # dO
                        chain_dos(do_s, G_s, dos_f, dOs_s, scale, bos, eos)
                        T.fence_proxy_async()
                        T.barrier_arrive(empty_in[3])
                        glast[0] = fexp(G_s[C - 1])
                        for a, b in T.Parallel(K, V):
                            dS_f[a, b] = dS_f[a, b] * glast[0]
                        T.barrier_wait(full_in[0], i % 2)          # q
                        T.gemm(q_s, dOs_s, dS_f, transpose_A=True)
                        T.barrier_arrive(empty_in[0])
                        T.barrier_wait(dvg_ready, i % 2)
                        T.gemm(k_s, dvn_s, dS_f, transpose_A=True)
                        T.barrier_arrive(dvg_free)
                        T.barrier_arrive(empty_in[1])
                    # ~~ light halo end ~~
                for i in (T.serial(nhalo, nchunks) if light else T.serial(nchunks)):
                    s = i % 2
                    ci = nchunks - 1 - i
                    bos = bos0 + ci * C
                    T.barrier_wait(full_in[1], i % 2)          # k, G
                    stamp(trace_out, "chain: k, G ready", i, tx, 0, hv, n)
                    T.barrier_wait(dsb_free, (i + 1) % 2)
                    stamp(trace_out, "chain: dSb free", i, tx, 0, hv, n)
                    T.copy(dS_f, dSb_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(dsb_ready)
                    stamp(trace_out, "chain: dSb published", i, tx, 0, hv, n)
                    # <S, dSb> by column blocks, its row sums for the dg warp (slot s: the key warpgroup reads
                    # slot s of chunk i before it frees dSb of chunk i + 1, which this role waits for before
                    # writing slot s again at chunk i + 2)
                    T.barrier_wait(full_in[4], i % 2)          # S
                    # (summed in registers, stored once: see the value role on stores between shared loads.  These two
                    # passes as serial loops, ~170 fewer SASS instructions against the instruction cache's pressure,
                    # made the kernel 2.5% slower: session 16 run 10)
                    for qb in T.unroll(V // SQ):
                        for a, b in T.Parallel(K, SQ):
                            sd_f[a, b] = T.cast(S_s[a, qb * SQ + b], acc) * T.cast(dSb_s[a, qb * SQ + b], acc)
                        T.reduce_sum(sd_f, sdr_f, dim=1)
                        if qb == 0:
                            for a in T.Parallel(K):
                                sda_f[a] = sdr_f[a]
                        else:
                            for a in T.Parallel(K):
                                sda_f[a] = sda_f[a] + sdr_f[a]
                    # scaled by e^{G_last} here: the dg warp runs after the key role released G
                    for a in T.Parallel(K):
                        sdr_s[s, a] = sda_f[a] * fexp(G_s[C - 1])
                    T.barrier_arrive(empty_in[4])
                    T.barrier_arrive(vec_ready[s])
                    # dS = e^{G_last} dS + q^T dOs
                    T.barrier_wait(full_in[3], i % 2)          # dO
                    chain_dos(do_s, G_s, dos_f, dOs_s, scale, bos, eos)
                    T.fence_proxy_async()
                    T.barrier_arrive(empty_in[3])
                    glast[0] = fexp(G_s[C - 1])
                    for a, b in T.Parallel(K, V):
                        dS_f[a, b] = dS_f[a, b] * glast[0]
                    T.barrier_wait(full_in[0], i % 2)          # q
                    T.gemm(q_s, dOs_s, dS_f, transpose_A=True)
                    T.barrier_arrive(empty_in[0])
                    stamp(trace_out, "chain: q^T dOs done", i, tx, 0, hv, n)
                    # dS += k^T dVg
                    T.barrier_wait(dvg_ready, i % 2)
                    stamp(trace_out, "chain: dVg ready", i, tx, 0, hv, n)
                    T.gemm(k_s, dvn_s, dS_f, transpose_A=True)
                    T.barrier_arrive(dvg_free)
                    T.barrier_arrive(empty_in[1])
                    stamp(trace_out, "chain: step done", i, tx, 0, hv, n)
                if need_dh0:
                    if halo:
                        if is_first:
                            T.copy(dS_f, dh0[seq, hv, :, :])
                    else:
                        T.copy(dS_f, dh0[n, hv, :, :])
            elif tx < 256:
                # ---------------- value ----------------
                T.set_max_nreg(R_VALUE, 1)
                # beta of the next chunk is loaded into registers at the start of a step and written to b_s at the
                # start of the next, so the HBM latency overlaps a whole step (read at the start of its own step,
                # or at the end of the one before, it cost ~1.5 K resp. ~3.5 K cycles: session 15 runs 4-5)
                if nchunks > 0:
                    for r in T.Parallel(C):
                        bn_f[r] = T.if_then_else(
                            bos0 + (nchunks - 1) * C + r < eos, T.cast(beta[bos0 + (nchunks - 1) * C + r, hv], acc), 0.0)
                if light:
                    # ~~ light halo ~~ (only what the chain's dS needs: dVg = -eG b X^T dvn, dvn = D k dSb + Pm^T dO;
                    # the dQK, Ws and vector hand-offs are published empty, as no halo chunk stores a gradient)
                    for i in T.serial(nhalo):
                        s = i % 2
                        ci = nchunks - 1 - i
                        bos = bos0 + ci * C
                        for r in T.Parallel(C):
                            b_s[r] = bn_f[r]
                        if i + 1 < nchunks:
                            for r in T.Parallel(C):
                                bn_f[r] = T.cast(beta[bos - C + r, hv], acc)
                        T.barrier_wait(full_in[1], i % 2)          # k, G
                        T.barrier_wait(full_in[0], i % 2)          # q
                        T.gemm(q_s, k_s, P_f, transpose_B=True, clear_accum=True)
                        value_pm(P_f, G_s, M_f, Pm_s, scale, bos, eos)
                        T.fence_proxy_async()
                        T.barrier_arrive(empty_in[0])
                        T.barrier_wait(full_in[3], i % 2)          # dO
                        T.barrier_wait(full_in[5], i % 2)          # vn
                        T.barrier_arrive(empty_in[5])
                        T.barrier_wait(dqk_free, (i + 1) % 2)
                        T.barrier_arrive(dqk_ready)
                        T.barrier_wait(dsb_ready, i % 2)
                        T.gemm(k_s, dSb_s, A_f, clear_accum=True)
                        T.barrier_arrive(dsb_free)
                        for r in T.Parallel(C):
                            rowf_f[r] = fexp(G_s[C - 1] - G_s[r])
                        for r, j in T.Parallel(C, V):
                            A_f[r, j] = A_f[r, j] * rowf_f[r]
                        T.gemm(Pm_s, do_s, A_f, transpose_A=True)
                        T.barrier_arrive(empty_in[3])
                        T.barrier_wait(dvg_free, (i + 1) % 2)
                        for r, j in T.Parallel(C, V):
                            A_f[r, j] = T.if_then_else(bos + r < eos, A_f[r, j], 0.0)
                        T.copy(A_f, dvn_s)
                        T.fence_proxy_async()
                        T.barrier_wait(full_in[6], i % 2)          # X
                        T.gemm(X_s, dvn_s, A_f, transpose_A=True, clear_accum=True)
                        for r in T.Parallel(C):
                            bf_f[r] = b_s[r]
                        T.barrier_wait(y_ready, i % 2)
                        value_dvg(A_f, bf_f, G_s, rowf_f, dvn_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(dvg_ready)
                        T.barrier_arrive(empty_in[2])
                        T.barrier_wait(ws_free, (i + 1) % 2)
                        T.barrier_arrive(empty_in[6])
                        T.barrier_arrive(ws_ready)
                        T.barrier_arrive(empty_in[1])
                        T.barrier_arrive(vec_ready[s])
                    # ~~ light halo end ~~
                for i in (T.serial(nhalo, nchunks) if light else T.serial(nchunks)):
                    s = i % 2
                    ci = nchunks - 1 - i
                    bos = bos0 + ci * C
                    for r in T.Parallel(C):
                        b_s[r] = bn_f[r]
                    if i + 1 < nchunks:
                        # (the chunk before this one: whole, as only a sequence's last chunk can be short)
                        for r in T.Parallel(C):
                            bn_f[r] = T.cast(beta[bos - C + r, hv], acc)
                    T.barrier_wait(full_in[1], i % 2)          # k, G
                    T.barrier_wait(full_in[0], i % 2)          # q
                    stamp(trace_out, "value: q, k ready", i, tx, 128, hv, n)
                    # P = q k^T, Pm = bf16(scale P E M) [r, j]
                    T.gemm(q_s, k_s, P_f, transpose_B=True, clear_accum=True)
                    # Every elementwise pass computes in registers, masks in a second loop and then stores its
                    # tile in one T.copy.  A masked value whose shared loads sit inside T.if_then_else is one
                    # branch per element, and a pass that stores to shared memory between its loads of G / b is
                    # kept in program order (the stores may alias the loads): either way one load -> ex2 ->
                    # store latency chain per element, ~4 K cycles for a [64, 64] pass (session 15's SASS and
                    # trace).  Unmasked, exp(G_r - G_j) may overflow above the diagonal or past the end; the
                    # mask's select drops those values.
                    value_pm(P_f, G_s, M_f, Pm_s, scale, bos, eos)
                    T.fence_proxy_async()
                    T.barrier_arrive(empty_in[0])
                    stamp(trace_out, "value: Pm written", i, tx, 128, hv, n)
                    # dQK = scale E M (dO vn^T) -> key; Z = dQK P: its row sums here, its column sums as the row
                    # sums of the [j, r] frame below (a column reduction of a wgmma fragment would be a cross-warp
                    # AllReduce on bar.sync 1, which every warpgroup would share)
                    T.barrier_wait(full_in[3], i % 2)          # dO
                    T.barrier_wait(full_in[5], i % 2)          # vn
                    T.gemm(do_s, vn_s, M_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(empty_in[5])
                    stamp(trace_out, "value: dO vn^T done", i, tx, 128, hv, n)
                    for r, j in T.Parallel(C, C):
                        M_f[r, j] = M_f[r, j] * scale * fexp(G_s[r] - G_s[j])
                    for r, j in T.Parallel(C, C):
                        M_f[r, j] = T.if_then_else((j <= r) & (bos + r < eos), M_f[r, j], 0.0)
                    T.barrier_wait(dqk_free, (i + 1) % 2)
                    T.copy(M_f, dQK_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(dqk_ready)
                    stamp(trace_out, "value: dQK published", i, tx, 128, hv, n)
                    for r, j in T.Parallel(C, C):
                        M_f[r, j] = M_f[r, j] * P_f[r, j]
                    T.reduce_sum(M_f, vr_f, dim=1)
                    for r in T.Parallel(C):
                        vz_s[s, r] = vr_f[r]
                    stamp(trace_out, "value: Z rows done", i, tx, 128, hv, n)
                    # acc = diag(D) k dSb + Pm^T dO  (dv_new's gradient), rows past the end 0
                    T.barrier_wait(dsb_ready, i % 2)
                    stamp(trace_out, "value: dSb ready", i, tx, 128, hv, n)
                    T.gemm(k_s, dSb_s, A_f, clear_accum=True)
                    T.barrier_arrive(dsb_free)
                    stamp(trace_out, "value: k dSb done", i, tx, 128, hv, n)
                    for r in T.Parallel(C):
                        rowf_f[r] = fexp(G_s[C - 1] - G_s[r])
                    for r, j in T.Parallel(C, V):
                        A_f[r, j] = A_f[r, j] * rowf_f[r]
                    T.gemm(Pm_s, do_s, A_f, transpose_A=True)
                    T.barrier_arrive(empty_in[3])
                    stamp(trace_out, "value: Pm^T dO done", i, tx, 128, hv, n)
                    T.barrier_wait(dvg_free, (i + 1) % 2)
                    for r, j in T.Parallel(C, V):
                        A_f[r, j] = T.if_then_else(bos + r < eos, A_f[r, j], 0.0)
                    T.copy(A_f, dvn_s)
                    T.fence_proxy_async()
                    stamp(trace_out, "value: dvn written", i, tx, 128, hv, n)
                    # Z' = X^T dvn; dv = dY = b Z'
                    T.barrier_wait(full_in[6], i % 2)          # X
                    T.gemm(X_s, dvn_s, A_f, transpose_A=True, clear_accum=True)
                    stamp(trace_out, "value: X^T dvn done", i, tx, 128, hv, n)
                    for r in T.Parallel(C):
                        bf_f[r] = b_s[r]
                    # (a whole chunk stores without a test per element, which would be a branch per store; storing dv
                    # after dVg is published spilled: session 15 run 5.  Staging dv in Pm_s / dX_s for TMA stores,
                    # alone, within the dVg pass, or with dq / dk staged too, was 5-7% slower in session 16 runs 3-5:
                    # per-element shared stores and the named barriers around each stage cost more than these
                    # scattered 4-byte stores, and releasing staging tiles late coupled the roles)
                    if bos + C <= store_end(i, nhalo, bos, eos):
                        for r, j in T.Parallel(C, V):
                            dv_out[bos + r, hv, j] = T.cast(bf_f[r] * A_f[r, j], dtype)
                    else:
                        for r, j in T.Parallel(C, V):
                            if bos + r < store_end(i, nhalo, bos, eos):
                                dv_out[bos + r, hv, j] = T.cast(bf_f[r] * A_f[r, j], dtype)
                    stamp(trace_out, "value: dv stored", i, tx, 128, hv, n)
                    # m = dvn Y^T, before dVg overwrites dvn
                    T.barrier_wait(y_ready, i % 2)
                    T.gemm(dvn_s, v_s, M_f, transpose_B=True, clear_accum=True)
                    stamp(trace_out, "value: dvn Y^T done", i, tx, 128, hv, n)
                    # dVg = bf16(-eG bf16(dY)) over dvn -> chain, key (eG once per row, not per element)
                    value_dvg(A_f, bf_f, G_s, rowf_f, dvn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(dvg_ready)
                    stamp(trace_out, "value: dVg published", i, tx, 128, hv, n)
                    # db = rowsum(Z' Y)
                    for r, j in T.Parallel(C, V):
                        A_f[r, j] = A_f[r, j] * T.cast(v_s[r, j], acc)
                    T.reduce_sum(A_f, vk_f, dim=1)
                    T.barrier_arrive(empty_in[2])
                    for r in T.Parallel(C):
                        vb_s[s, r] = vk_f[r]
                    stamp(trace_out, "value: db done", i, tx, 128, hv, n)
                    # dX = bf16(m diag(b)); T1 = X^T dX; dA^T = -(X T1^T), dA = -(T1 X^T) (strict)
                    T.gemm(k_s, k_s, KK_f, transpose_B=True, clear_accum=True)
                    for r, j in T.Parallel(C, C):
                        M_f[r, j] = M_f[r, j] * b_s[j]
                    T.copy(M_f, dX_s)
                    T.fence_proxy_async()
                    stamp(trace_out, "value: KK, dX done", i, tx, 128, hv, n)
                    T.gemm(X_s, dX_s, M_f, transpose_A=True, clear_accum=True)
                    T.copy(M_f, dX_s)
                    T.fence_proxy_async()
                    stamp(trace_out, "value: T1 written", i, tx, 128, hv, n)
                    T.barrier_wait(ws_free, (i + 1) % 2)
                    # W^T[r, j] = dA[j, r] b_j E[j, r] (j > r) into Ws, and in the same pass the column sums of
                    # dAA[r, j] = dA[r, j] b_r KK[r, j] E[r, j] as row sums over the dA^T frame
                    T.gemm(X_s, dX_s, M_f, transpose_B=True, clear_accum=True)
                    for r, j in T.Parallel(C, C):
                        P_f[r, j] = -M_f[r, j] * b_s[j] * fexp(G_s[j] - G_s[r])
                    for r, j in T.Parallel(C, C):
                        P_f[r, j] = T.if_then_else(j > r, P_f[r, j], 0.0)
                    for r, j in T.Parallel(C, C):
                        M_f[r, j] = P_f[r, j] * KK_f[r, j]
                    T.reduce_sum(M_f, vc_f, dim=1)
                    stamp(trace_out, "value: W^T pass done", i, tx, 128, hv, n)
                    # then W from dA, added to the same elements, and dA KK E's row sums (db and dAA's rows)
                    T.gemm(dX_s, X_s, M_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(empty_in[6])
                    for r, j in T.Parallel(C, C):
                        M_f[r, j] = -M_f[r, j] * fexp(G_s[r] - G_s[j])
                    for r, j in T.Parallel(C, C):
                        M_f[r, j] = T.if_then_else(r > j, M_f[r, j], 0.0)
                    for r, j in T.Parallel(C, C):
                        P_f[r, j] = P_f[r, j] + M_f[r, j] * bf_f[r]
                    T.copy(P_f, Ws_s)
                    for r, j in T.Parallel(C, C):
                        KK_f[r, j] = M_f[r, j] * KK_f[r, j]
                    T.fence_proxy_async()
                    T.barrier_arrive(ws_ready)
                    stamp(trace_out, "value: Ws published", i, tx, 128, hv, n)
                    T.reduce_sum(KK_f, vk_f, dim=1)
                    T.barrier_arrive(empty_in[1])
                    for r in T.Parallel(C):
                        vb_s[s, r] = vb_s[s, r] + vk_f[r]
                    for r in T.Parallel(C):
                        va_s[s, r] = b_s[r] * vk_f[r] - vc_f[r]
                    T.barrier_arrive(vec_ready[s])
                    stamp(trace_out, "value: step done", i, tx, 128, hv, n)
            elif tx < 384:
                # ---------------- key ----------------
                T.set_max_nreg(R_KEY, 1)
                for i in T.serial(nchunks):
                    s = i % 2
                    ci = nchunks - 1 - i
                    bos = bos0 + ci * C
                    # (light_halo: a halo step is this role's barriers only, in the main branch's order, so the other
                    # roles' phases stay those of the main loop.  An if / else in the one loop, not a loop of its own
                    # ahead of it: that loop, barriers only, made ptxas serialise every wgmma of the kernel (C7512).
                    # Without light_halo the condition is a Python False and the else branch is the whole loop body)
                    if (i < nhalo) if light else False:
                        # ~~ light halo ~~
                        T.barrier_wait(full_in[1], i % 2)          # k, G
                        T.barrier_wait(full_in[4], i % 2)          # S
                        T.barrier_wait(full_in[2], i % 2)          # v
                        T.barrier_arrive(y_ready)
                        T.barrier_wait(full_in[5], i % 2)          # vn
                        T.barrier_wait(full_in[3], i % 2)          # dO
                        T.barrier_wait(full_in[0], i % 2)          # q
                        T.barrier_wait(dqk_ready, i % 2)
                        if pair_zero:
                            T.barrier_wait(zero_ready, i % 2)
                        T.barrier_arrive(empty_in[3])
                        T.barrier_wait(dsb_ready, i % 2)
                        T.barrier_arrive(dsb_free)
                        T.barrier_arrive(empty_in[5])
                        T.barrier_arrive(dqk_free)
                        T.barrier_arrive(empty_in[0])
                        T.barrier_wait(dvg_ready, i % 2)
                        T.barrier_arrive(dvg_free)
                        T.barrier_arrive(empty_in[4])
                        T.barrier_wait(ws_ready, i % 2)
                        T.barrier_arrive(ws_free)
                        T.barrier_arrive(empty_in[1])
                        T.barrier_wait(vec_ready[s], (i // 2) % 2)
                        # ~~ light halo end ~~
                    else:
                        # Y = v - diag(eG) k S over v's tile -> value
                        T.barrier_wait(full_in[1], i % 2)          # k, G
                        T.barrier_wait(full_in[4], i % 2)          # S
                        stamp(trace_out, "key: k, S ready", i, tx, 256, hv, n)
                        T.gemm(k_s, S_s, U_f, clear_accum=True)
                        stamp(trace_out, "key: k S done", i, tx, 256, hv, n)
                        # (eG once per row, not per element)
                        for r in T.Parallel(C):
                            kr_f[r] = fexp(G_s[r])
                        T.barrier_wait(full_in[2], i % 2)          # v
                        for r, j in T.Parallel(C, V):
                            U_f[r, j] = T.cast(v_s[r, j], acc) - kr_f[r] * U_f[r, j]
                        T.copy(U_f, v_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(y_ready)
                        stamp(trace_out, "key: Y published", i, tx, 256, hv, n)
                        # Z's column sums as the row sums of the [j, r] frame (vn dO^T, k q^T; a column reduction of a
                        # wgmma fragment would be a cross-warp AllReduce on bar.sync 1, shared by every warpgroup).
                        # Here, not in the value role, which sets the step (session 15 run 5), and before dk's
                        # accumulators are live (after them this role spilled).  t / tq are [C, C] at K / 2 = C.
                        T.barrier_wait(full_in[5], i % 2)          # vn
                        T.barrier_wait(full_in[3], i % 2)          # dO
                        T.barrier_wait(full_in[0], i % 2)          # q
                        T.gemm(vn_s, do_s, t_f, transpose_B=True, clear_accum=True)
                        T.gemm(k_s, q_s, tq_f, transpose_B=True, clear_accum=True)
                        for j, r in T.Parallel(C, C):
                            t_f[j, r] = t_f[j, r] * scale * fexp(G_s[r] - G_s[j])
                        for j, r in T.Parallel(C, C):
                            t_f[j, r] = T.if_then_else((j <= r) & (bos + r < eos), t_f[j, r], 0.0) * tq_f[j, r]
                        T.reduce_sum(t_f, kr_f, dim=1)
                        for r in T.Parallel(C):
                            cz_s[r] = kr_f[r]
                        stamp(trace_out, "key: colZ done", i, tx, 256, hv, n)
                        # dq = scale eG (dO S^T) + dQK k by K halves; ginter = scale eG rowsum(q (dO S^T))
                        T.barrier_wait(dqk_ready, i % 2)
                        if pair_zero:
                            T.barrier_wait(zero_ready, i % 2)
                        stamp(trace_out, "key: dQK ready", i, tx, 256, hv, n)
                        for hb in T.unroll(2):
                            T.gemm(do_s, S_s[hb * KH:(hb + 1) * KH, :], t_f, transpose_B=True, clear_accum=True)
                            for r, d in T.Parallel(C, KH):
                                tq_f[r, d] = t_f[r, d] * T.cast(q_s[r, hb * KH + d], acc)
                            T.reduce_sum(tq_f, kr_f, dim=1)
                            if hb == 0:
                                for r in T.Parallel(C):
                                    kg_s[r] = kr_f[r]
                            else:
                                for r in T.Parallel(C):
                                    kg_s[r] = (kg_s[r] + kr_f[r]) * scale * fexp(G_s[r])
                            for r, d in T.Parallel(C, KH):
                                t_f[r, d] = t_f[r, d] * (scale * fexp(G_s[r]))
                            T.gemm(dQK_s, k_s[:, hb * KH:(hb + 1) * KH], t_f)
                            grad_rows(dq_out, t_f, bos, store_end(i, nhalo, bos, eos), hv, hb * KH, pend)
                        T.barrier_arrive(empty_in[3])
                        stamp(trace_out, "key: dq stored", i, tx, 256, hv, n)
                        # t = vn dSb^T by K halves: dk = diag(D) t, dD = rowsum(k t)
                        T.barrier_wait(dsb_ready, i % 2)
                        T.gemm(vn_s, dSb_s[0:KH, :], dk0_f, transpose_B=True, clear_accum=True)
                        T.gemm(vn_s, dSb_s[KH:K, :], dk1_f, transpose_B=True, clear_accum=True)
                        T.barrier_arrive(dsb_free)
                        T.barrier_arrive(empty_in[5])
                        stamp(trace_out, "key: dSb freed", i, tx, 256, hv, n)
                        for r, d in T.Parallel(C, KH):
                            t_f[r, d] = dk0_f[r, d] * T.cast(k_s[r, d], acc)
                        T.reduce_sum(t_f, kr_f, dim=1)
                        for r in T.Parallel(C):
                            dD_s[r] = kr_f[r]
                        for r, d in T.Parallel(C, KH):
                            t_f[r, d] = dk1_f[r, d] * T.cast(k_s[r, KH + d], acc)
                        T.reduce_sum(t_f, kr_f, dim=1)
                        for r in T.Parallel(C):
                            dD_s[r] = dD_s[r] + kr_f[r]
                        # D once per row; dD_s keeps D dD, the only form the dg warp reads
                        for r in T.Parallel(C):
                            kr_f[r] = fexp(G_s[C - 1] - G_s[r])
                        for r in T.Parallel(C):
                            dD_s[r] = dD_s[r] * kr_f[r]
                        for r, d in T.Parallel(C, KH):
                            dk0_f[r, d] = dk0_f[r, d] * kr_f[r]
                        for r, d in T.Parallel(C, KH):
                            dk1_f[r, d] = dk1_f[r, d] * kr_f[r]
                        stamp(trace_out, "key: dD done", i, tx, 256, hv, n)
                        # dk += dQK^T q
                        T.gemm(dQK_s, q_s[:, 0:KH], dk0_f, transpose_A=True)
                        T.gemm(dQK_s, q_s[:, KH:K], dk1_f, transpose_A=True)
                        T.barrier_arrive(dqk_free)
                        T.barrier_arrive(empty_in[0])
                        stamp(trace_out, "key: dQK^T q done", i, tx, 256, hv, n)
                        # dk += dVg S^T by K halves; gv = rowsum(k (dVg S^T))
                        T.barrier_wait(dvg_ready, i % 2)
                        stamp(trace_out, "key: dVg ready", i, tx, 256, hv, n)
                        for hb in T.unroll(2):
                            T.gemm(dvn_s, S_s[hb * KH:(hb + 1) * KH, :], t_f, transpose_B=True, clear_accum=True)
                            if hb == 0:
                                for r, d in T.Parallel(C, KH):
                                    dk0_f[r, d] = dk0_f[r, d] + t_f[r, d]
                            else:
                                for r, d in T.Parallel(C, KH):
                                    dk1_f[r, d] = dk1_f[r, d] + t_f[r, d]
                            for r, d in T.Parallel(C, KH):
                                t_f[r, d] = t_f[r, d] * T.cast(k_s[r, hb * KH + d], acc)
                            T.reduce_sum(t_f, kr_f, dim=1)
                            for r in T.Parallel(C):
                                kg_s[r] = kg_s[r] + kr_f[r]
                        T.barrier_arrive(dvg_free)
                        T.barrier_arrive(empty_in[4])
                        stamp(trace_out, "key: dVg S^T done", i, tx, 256, hv, n)
                        # dk += Ws k, stored
                        T.barrier_wait(ws_ready, i % 2)
                        stamp(trace_out, "key: Ws ready", i, tx, 256, hv, n)
                        T.gemm(Ws_s, k_s[:, 0:KH], dk0_f)
                        T.gemm(Ws_s, k_s[:, KH:K], dk1_f)
                        T.barrier_arrive(ws_free)
                        # k's (and G's) last read in this role: the next chunk's k may load while dk is stored and
                        # the dg warp runs (session 15: the step period was the key role's dg end + the k load)
                        T.barrier_arrive(empty_in[1])
                        stamp(trace_out, "key: Ws k done", i, tx, 256, hv, n)
                        grad_rows(dk_out, dk0_f, bos, store_end(i, nhalo, bos, eos), hv, 0, pend)
                        grad_rows(dk_out, dk1_f, bos, store_end(i, nhalo, bos, eos), hv, KH, pend)
                        stamp(trace_out, "key: dk stored", i, tx, 256, hv, n)
                        # dg: the reverse cumsum of dG over the chunk; the last row's extra term e^{G_last} <S, dSb> +
                        # sum D dD reaches every row of the cumsum, so it is added to each.  One warp: lane l holds
                        # rows 2l, 2l + 1
                        T.barrier_wait(vec_ready[s], (i // 2) % 2)
                        for r in T.Parallel(C):
                            kg_s[r] = T.if_then_else(bos + r < eos, vz_s[s, r] - cz_s[r] + kg_s[r] - dD_s[r], 0.0) \
                                + va_s[s, r]
                        if tx < 288:
                            lane = tx - 256
                            part = T.alloc_var(acc)
                            part = (sdr_s[s, lane] + sdr_s[s, lane + 32] + sdr_s[s, lane + 64] + sdr_s[s, lane + 96]) \
                                + dD_s[lane] + dD_s[lane + 32]
                            last = T.alloc_var(acc)
                            last = T.warp_reduce_sum(part)
                            lo = T.alloc_var(acc)
                            lo = kg_s[2 * lane]
                            suf = T.alloc_var(acc)
                            suf = lo + kg_s[2 * lane + 1]
                            for sh in T.unroll(5):
                                y = T.alloc_var(acc)
                                y = T.shfl_down(suf, 1 << sh)
                                if lane + (1 << sh) < 32:
                                    suf = suf + y
                            if bos + 2 * lane < store_end(i, nhalo, bos, eos):
                                dg_out[bos + 2 * lane, hv] = suf + last
                                db_out[bos + 2 * lane, hv] = vb_s[s, 2 * lane]
                            if bos + 2 * lane + 1 < store_end(i, nhalo, bos, eos):
                                dg_out[bos + 2 * lane + 1, hv] = suf - lo + last
                                db_out[bos + 2 * lane + 1, hv] = vb_s[s, 2 * lane + 1]
                        stamp(trace_out, "key: dg stored", i, tx, 256, hv, n)
            else:
                # ---------------- producer: one warp issues every TMA load ----------------
                T.set_max_nreg(R_PROD, 0)
                if tx < 416:
                    for i in T.serial(nchunks):
                        ci = nchunks - 1 - i
                        bos = bos0 + ci * C
                        c = c0 + ci
                        # in the order the previous chunk's last readers release the tiles (vn, q, dO, S, v, X,
                        # then k with G at the end of the step): every tile but k is in flight or loaded when k
                        # is released, so a step waits on one load, not on a burst of seven (session 15's trace).
                        # Written out, not looped: the protocol-model test reads every barrier operation here.
                        # light_halo: vn, S and v are not read in a halo step, so their phases complete unloaded (a
                        # Python True without it: the loads as they were)
                        T.barrier_wait(empty_in[5], (i + 1) % 2)
                        if (i >= nhalo) if light else True:
                            T.tma_copy(vn[c, hv, :, :], vn_s, barrier=full_in[5])
                        T.barrier_arrive(full_in[5])
                        T.barrier_wait(empty_in[0], (i + 1) % 2)
                        T.tma_copy(q[bos:bos + C, hq, :], q_s, barrier=full_in[0])
                        T.barrier_arrive(full_in[0])
                        T.barrier_wait(empty_in[3], (i + 1) % 2)
                        T.tma_copy(do[bos:bos + C, hv, :], do_s, barrier=full_in[3])
                        T.barrier_arrive(full_in[3])
                        T.barrier_wait(empty_in[4], (i + 1) % 2)
                        if (i >= nhalo) if light else True:
                            T.tma_copy(h[c, hv, :, :], S_s, barrier=full_in[4])
                        T.barrier_arrive(full_in[4])
                        stamp(trace_out, "producer: S issued", i, tx, 384, hv, n)
                        T.barrier_wait(empty_in[2], (i + 1) % 2)
                        if (i >= nhalo) if light else True:
                            T.tma_copy(v[bos:bos + C, hv, :], v_s, barrier=full_in[2])
                        T.barrier_arrive(full_in[2])
                        T.barrier_wait(empty_in[6], (i + 1) % 2)
                        T.tma_copy(X[c, hv, :, :], X_s, barrier=full_in[6])
                        T.barrier_arrive(full_in[6])
                        stamp(trace_out, "producer: X issued", i, tx, 384, hv, n)
                        T.barrier_wait(empty_in[1], (i + 1) % 2)
                        T.tma_copy(k[bos:bos + C, hq, :], k_s, barrier=full_in[1])
                        T.tma_copy(G[c, hv, :], G_s, barrier=full_in[1])
                        T.barrier_arrive(full_in[1])
                        stamp(trace_out, "producer: k issued", i, tx, 384, hv, n)
                if pair_zero:
                    if T.And(tx >= 416, tx < 448):
                        # ---------------- zero: the pair's dq / dk rows, zeroed ahead (pair_zero)
                        # (the walk's bounds read again here, not taken from above: live across the TMA warp's
                        # loop, they made this warpgroup's 24 registers spill)
                        zb0 = cu_seqlens[n]
                        zc0 = chunk_offsets[n]
                        if halo:
                            zeos = seg_table[n, 3]
                            zhalo = walk_end[n, hv] - chunk_offsets[n + 1]
                            znc = walk_end[n, hv] - zc0
                        else:
                            zeos = cu_seqlens[n + 1]
                            zhalo = 0
                            znc = chunk_offsets[n + 1] - zc0
                        zhq = hv // 2
                        ticket = T.alloc_var("int32")
                        ticket = T.call_extern("int32", "flq_pair_ticket", trace_out.data,
                                               T.cast(n * Hqk + zhq, "int64"))
                        if ticket == 0:
                            for j in T.serial(ZERO_AHEAD):
                                zero_step(trace_out, dq_out, dk_out, j, znc, zhalo, zb0, zeos, zc0, zhq, NS, Hqk)
                        for i in T.serial(znc):
                            # (not over one phase ahead of the key role: its previous step has released k)
                            T.barrier_wait(empty_in[1], (i + 1) % 2)
                            if ticket != 0:
                                if i >= zhalo:
                                    T.call_extern("handle", "flq_pair_wait", trace_out.data,
                                                  T.cast(NS * Hqk + (zc0 + znc - 1 - i) * Hqk + zhq, "int64"))
                            # this step's rows first, the zeroing ahead after: before it, the key role waited for
                            # the zeroing and its fence each step (+0.28 ms at 16/32 1x32768, session 30 run 2)
                            T.barrier_arrive(zero_ready)
                            if ticket == 0:
                                zero_step(trace_out, dq_out, dk_out, i + ZERO_AHEAD, znc, zhalo, zb0, zeos, zc0, zhq,
                                          NS, Hqk)
    return gdn_bwd_whole
