"""The fused backward (Hopper), first version: the state-gradient walk and every per-chunk gradient in one
warp-specialised kernel (``BACKWARD_PLAN.md`` item F, at BV = 64; its CPU model is
``chunk_bwd_fused_ref.bwd_fused_ref``, whose order, rounding points and masks this kernel follows).

Why: the split backward sends every intermediate through HBM (dh, dv_new, dk^p, dw, ...), and its per-chunk
kernels run a straight-line body per CTA with nothing to overlap their loads, waits and reductions
(session 11: merging dqk and wy into one such kernel saved 1.6 GB of traffic and no time).  Here the state
gradient dS never leaves the chip and three warpgroups work on different parts of the same chunk at once.

Grid ``(V / BV, Hv, N)``, BV = 64: CTA ``(vb, h, n)`` owns columns ``vb*BV ..`` of dS of value head ``h`` of
sequence ``n`` and walks that sequence's chunks from last to first.  Everything on the V side (dv_new, Y, dY,
dv, dh0) is local to the V block; everything on the K side (dq, dk, dg, dbeta) is linear in V-contracted
partials, so each CTA writes its partial and the host sums the ``V / BV`` partials (dq, dk together with the
GVA group sum, fp32; dg, dbeta in fp32, then dbeta's cast).  The K-side products (q k^T, k k^T, Ws k, ...)
are repeated by the two V blocks; one block per head would need ~300 KB of shared memory.

512 threads, four roles (per chunk, notation of the CPU model: ``E[r, j] = exp(G_r - G_j)`` for j <= r,
``D_r = exp(G_last - G_r)``, ``eG = exp(G)``, rows past the sequence's end masked as noted):

* warpgroup 0, the **chain** (dS ``[K, BV]`` fp32 in registers for the whole walk)::

      c1  dSb = bf16(dS)                                   -> grad
      c2  acc = k dSb;  dS = e^{G_last} dS + q^T dOs
      c3  acc = D acc + Pt dO  (rows past the end 0);  SdS = <S, dSb> (row sums, slot i % 2)  -> grad;
          ndvn = bf16(-acc)   -> grad
      c4  dS += w^T ndvn
  and after the walk dh0 = dS.
* warpgroup 1, **prep** (state-free, feeds the chain, then the grad warpgroup)::

      p2  KQ = k q^T;  Pt[j, r] = scale KQ[j, r] E[r, j]  (j <= r < eos)
      p3  dOs = diag(scale eG) dO  (rows < eos)            -> chain
      p4  dPm^T = vn dO^T;  dQK^T[j, r] = scale E[r, j] dPm^T[j, r]  (j <= r < eos), bf16;
          Z^T = dQK^T * KQ -> colsum(Z) (its row sums); rowsum(Z) from the [r, j] frame (q k^T, dO vn^T again:
          a column reduction of a wgmma fragment would be a cross-warp AllReduce, see below)
      p5  U = k S;  Y = bf16(v - diag(eG) U)               -> grad (with dQK^T, dGp)
      p6  dOS = dO S^T;  ginter = scale eG rowsum(q * dOS)  -> grad;  dq = scale eG dOS + dQK k  (stored)
* warpgroup 2, **grad**::

      g2  dk = dQK^T q
      g3  t = vn dSb^T;  dD = rowsum(k * t);  dk += diag(D) t
      g4  Z' = X^T ndvn;  dY = bf16(-diag(b) Z')  (= dv, stored);  db = -rowsum(Z' * Y)
      g5  dYS = dY S^T;  dk -= diag(eG) dYS;  dG -= eG rowsum(dYS * k)
      g6  dX = bf16(-(ndvn Y^T) diag(b));  T1 = bf16(X^T dX);  dA = -(T1 X^T), dA^T = -(X T1^T) (strict);
          Ws = bf16(W + W^T) with W = dA diag(b) E;  KK = k k^T;  db += rowsum(dA KK E);  dAA = dA b KK E
      g7  dk += Ws k (stored);  dG = [r < eos](dGp + ginter - D dD - eG rowsum(dYS k)) + rowsum(dAA)
          - colsum(dAA), row 63 += e^{G_last} SdS + sum(D dD);  dg = reverse cumsum(dG) (stored), db (stored)
* warpgroup 3, the **producer**: one warp issues the TMA loads; the other three idle.

dA^T comes from its own 64^3 product (X T1^T) instead of an fp32 transpose through shared memory (16.6 KB); g6 makes
two elementwise passes over its products (W^T with the dAA column sums, then W with the dA KK E row sums).

Buffers and barriers (``i`` counts the steps of the walk; a barrier's phase j has parity j % 2, and a wait for
the parity before phase 0 returns at once, which is how every first wait on a "free" barrier passes).  Input
tiles are single-buffered and refilled as soon as their last reader has arrived on their ``empty`` barrier,
except k and G (read by all three roles, last by grad's final product): a two-slot ring, so prep and the chain
can start the next chunk while grad finishes this one::

    tile / hand-off     written by   read by              free after (arrivals)
    k, G [slot i % 2]   producer     prep, chain, grad    all three (384)
    q                   producer     prep, chain, grad    all three (384)
    dO                  producer     prep, chain          both (256)
    w                   producer     chain                c4 (128)
    vn                  producer     prep, grad           p4, g3 (256)
    v                   producer     prep                 p5 (128)
    S                   producer     prep, chain, grad    p6, c3, g5 (384)
    X                   producer     grad                 g6 (128)
    Pt, dOs             prep         chain                c3 (128)
    dQK^T, Y, Z sums,   prep [i % 2] grad                 g7 (128)   (two buffers)
    ginter
    dSb                 chain        grad                 g3 (128)
    ndvn                chain        grad                 g6 (128)
    SdS row sums        chain [i % 2] grad                (dvn_ready / dvn_free: written between the chain's
                                                          dvn_free wait and its dvn_ready arrive)

Waits: a consumer of a single-buffered tile waits parity ``i % 2`` on its ready barrier, its writer waits
``(i + 1) % 2`` on its free barrier before writing; ring slot ``i % 2`` uses ``(i // 2) % 2`` and
``(i // 2 + 1) % 2``.  No barrier runs two phases ahead of a waiter: every writer waits for the previous
phase's readers first.

Shared memory (bf16, BV = 64): inputs 112 KB (q 16, k 2 x 16, w 16, S 16, v / dO / vn / X 8 each), the chain's
dSb 16 + ndvn 8, prep's Pt 8 + dOs 8 + two (dQK^T 8 + Y 8), grad's dY / Ws 8 + dX / T1 8, vectors ~3 KB:
~205 KB of the 227 KB.  Registers (setmaxnreg): chain 144, prep 120, grad 224, producer 24 (sum 512, the
file's 64K registers over 128-thread groups); ptxas reports 4 bytes of spill.  The decay factors use the
hardware ex2 (``exp2(x log2 e)``, ~2 ulp), as the forward's ``fastexp``; only differences of G are exponentiated.
No reduction crosses warps: TileLang's cross-warp AllReduce syncs on ``bar.sync 1``, which all roles would share.

Outputs: ``dq_p``, ``dk_p`` ``[NT, Hv * NB, K]`` in the inputs' dtype (slot ``h * NB + vb``, so one GVA sum over
``ratio * NB`` consecutive slots gives dq, dk), ``dv`` ``[NT, Hv, V]`` (final), ``dg_p``, ``db_p``
``[NB, NT, Hv]`` fp32, ``dh0`` ``[N, Hv, K, V]`` fp32.  Rows past a sequence's end are never stored.  No L2
norm in this version (the host takes the split backward then).
"""

CHUNK = 64
BV_FUSED = 64

# (event, role): what has just happened when the role's first thread of CTA (0, 0, 0) stamps clock64()
# (``trace=True``, ``benchmarks/trace_bwd_fused.py``), for the first TRACE_CHUNKS steps of its walk
TRACE_EVENTS = (
    ("chain: k, G ready", "chain"), ("chain: dSb published", "chain"), ("chain: q^T dOs done", "chain"),
    ("chain: ndvn published", "chain"), ("chain: step done", "chain"),
    ("prep: q ready", "prep"), ("prep: Pt, dOs published", "prep"), ("prep: dQK^T, Z sums done", "prep"),
    ("prep: Y done", "prep"), ("prep: published to grad", "prep"), ("prep: dq stored", "prep"),
    ("grad: prep's tiles ready", "grad"), ("grad: t, dD done", "grad"), ("grad: dv, db done", "grad"),
    ("grad: dY S^T done", "grad"), ("grad: dA terms done", "grad"), ("grad: dk stored", "grad"),
    ("grad: dg, db stored", "grad"),
    ("producer: q issued", "producer"), ("producer: S issued", "producer"), ("producer: X issued", "producer"),
)
TRACE_CHUNKS = 64


def build_bwd_fused(dtype: str, beta_dtype: str, K: int, V: int, has_dht: bool, need_dh0: bool,
                    trace: bool = False):
    """``trace`` (diagnostics): clock64 stamps of ``TRACE_EVENTS`` into the ``trace_out`` parameter (a
    placeholder the kernel never touches otherwise)."""
    import tilelang.language as T

    from ._common import symbolic_sizes

    C = CHUNK
    BV = BV_FUSED
    NB = V // BV
    KH = K // 2        # dk's halves
    SQ = 8             # column block of <S, dSb> (the chain's)
    acc = "float32"
    assert K == 128 and V % BV == 0
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    DTN, DTH = (NS, Hv) if has_dht else T.dynamic("DTN, DTH")
    D0N, D0H = (NS, Hv) if need_dh0 else T.dynamic("D0N, D0H")
    HVB = T.dynamic("HVB")       # Hv * NB
    TR0, TR1 = (len(TRACE_EVENTS), TRACE_CHUNKS) if trace else T.dynamic("TR0, TR1")
    EV = {name: e for e, (name, _) in enumerate(TRACE_EVENTS)}

    LOG2E = 1.4426950408889634

    def fexp(x):
        # the hardware ex2 (~2 ulp): accurate expf is ~10 instructions, and the grad warpgroup's elementwise
        # phases (four [64, 64] decay masks per chunk) are instruction-bound (session 11 trace)
        return T.exp2(x * LOG2E)

    @T.macro
    def k_side_pass(A_s, B_s, s, fac_s, out_s, k_s, dk0_f, dk1_f, t_f, gr_f):
        # grad's two products against the state side (g3: vn dSb^T, g5: dY S^T), by K halves: dk += diag(fac) t,
        # out = rowsum(k * t), unscaled (the per-row factor fac is read from shared memory, not recomputed
        # per element)
        for hb in T.unroll(2):
            T.gemm(A_s, B_s[hb * KH:(hb + 1) * KH, :], t_f, transpose_B=True, clear_accum=True)
            if hb == 0:
                for r, d in T.Parallel(C, KH):
                    dk0_f[r, d] = dk0_f[r, d] + fac_s[r] * t_f[r, d]
            else:
                for r, d in T.Parallel(C, KH):
                    dk1_f[r, d] = dk1_f[r, d] + fac_s[r] * t_f[r, d]
            for r, d in T.Parallel(C, KH):
                t_f[r, d] = t_f[r, d] * T.cast(k_s[s, r, hb * KH + d], acc)
            T.reduce_sum(t_f, gr_f, dim=1)
            if hb == 0:
                for r in T.Parallel(C):
                    out_s[r] = gr_f[r]
            else:
                for r in T.Parallel(C):
                    out_s[r] = out_s[r] + gr_f[r]

    @T.macro
    def stamp(trace_out, name, i, tx, tx0, vb, hv, n):
        if trace:
            if T.And(T.And(tx == tx0, vb + hv + n == 0), i < TRACE_CHUNKS):
                trace_out[EV[name], i] = T.call_extern("int64", "clock64")

    @T.prim_func
    def gdn_bwd_fused(
        q: T.Tensor((NT, Hqk, K), dtype),
        k: T.Tensor((NT, Hqk, K), dtype),
        v: T.Tensor((NT, Hv, V), dtype),
        beta: T.Tensor((NT, Hv), beta_dtype),
        do: T.Tensor((NT, Hv, V), dtype),
        G: T.Tensor((NC, Hv, C), acc),
        X: T.Tensor((NC, Hv, C, C), dtype),
        h: T.Tensor((NC, Hv, K, V), dtype),
        vn: T.Tensor((NC, Hv, C, V), dtype),
        w: T.Tensor((NC, Hv, C, K), dtype),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_offsets: T.Tensor((NS + 1,), "int32"),
        dht: T.Tensor((DTN, DTH, K, V), acc),
        dq_p: T.Tensor((NT, HVB, K), dtype),
        dk_p: T.Tensor((NT, HVB, K), dtype),
        dv_out: T.Tensor((NT, Hv, V), dtype),
        dg_p: T.Tensor((NB, NT, Hv), acc),
        db_p: T.Tensor((NB, NT, Hv), acc),
        dh0: T.Tensor((D0N, D0H, K, V), acc),
        trace_out: T.Tensor((TR0, TR1), "int64"),
        scale: T.float32,
        ratio: T.int32,
    ):
        with T.Kernel(NB, Hv, NS, threads=512) as (vb, hv, n):
            # ---- input tiles (TMA)
            k_s = T.alloc_shared((2, C, K), dtype)
            G_s = T.alloc_shared((2, C), acc)
            q_s = T.alloc_shared((C, K), dtype)
            do_s = T.alloc_shared((C, BV), dtype)
            w_s = T.alloc_shared((C, K), dtype)
            vn_s = T.alloc_shared((C, BV), dtype)
            v_s = T.alloc_shared((C, BV), dtype)
            S_s = T.alloc_shared((K, BV), dtype)
            X_s = T.alloc_shared((C, C), dtype)
            # ---- hand-offs
            dSb_s = T.alloc_shared((K, BV), dtype)
            ndvn_s = T.alloc_shared((C, BV), dtype)
            Pt_s = T.alloc_shared((C, C), dtype)
            dOs_s = T.alloc_shared((C, BV), dtype)
            dQKt_s = T.alloc_shared((2, C, C), dtype)
            Y_s = T.alloc_shared((2, C, BV), dtype)
            dGp_s = T.alloc_shared((2, C), acc)
            dGc_s = T.alloc_shared((2, C), acc)
            gi_s = T.alloc_shared((2, C), acc)
            # ---- grad's own
            dY_s = T.alloc_shared((C, BV), dtype)     # dY, then Ws (BV = C)
            dX_s = T.alloc_shared((C, C), dtype)      # dX, then T1
            b_s = T.alloc_shared((C,), acc)
            dD_s = T.alloc_shared((C,), acc)
            dG_s = T.alloc_shared((C,), acc)
            fac_s = T.alloc_shared((C,), acc)
            db_s = T.alloc_shared((C,), acc)
            sdr_s = T.alloc_shared((2, K), acc)      # <S, dSb> row sums, chain -> grad's dg warp

            # chain fragments
            dS_f = T.alloc_fragment((K, BV), acc)
            a1_f = T.alloc_fragment((C, BV), acc)
            rowf_f = T.alloc_fragment((C,), acc)
            glast = T.alloc_local((1,), acc)
            sd_f = T.alloc_fragment((K, SQ), acc)
            sdr_f = T.alloc_fragment((K,), acc)
            # prep fragments
            KQ_f = T.alloc_fragment((C, C), acc)
            dPt_f = T.alloc_fragment((C, C), acc)
            U_f = T.alloc_fragment((C, BV), acc)
            dOS0_f = T.alloc_fragment((C, KH), acc)
            dOS1_f = T.alloc_fragment((C, KH), acc)
            pr_f = T.alloc_fragment((C,), acc)
            pc_f = T.alloc_fragment((C,), acc)
            pq_f = T.alloc_fragment((C,), acc)
            ptmp_f = T.alloc_fragment((C, KH), acc)
            # grad fragments
            dk0_f = T.alloc_fragment((C, KH), acc)
            dk1_f = T.alloc_fragment((C, KH), acc)
            t_f = T.alloc_fragment((C, KH), acc)
            Zp_f = T.alloc_fragment((C, BV), acc)
            m_f = T.alloc_fragment((C, C), acc)
            KK_f = T.alloc_fragment((C, C), acc)
            gr_f = T.alloc_fragment((C,), acc)
            gc_f = T.alloc_fragment((C,), acc)
            gv_f = T.alloc_fragment((C,), acc)
            gk_f = T.alloc_fragment((C,), acc)

            full_kg = T.alloc_barrier(arrive_count=[32, 32])
            empty_kg = T.alloc_barrier(arrive_count=[384, 384])
            # single-buffered inputs: q, dO, w, vn, v, S, X
            full_in = T.alloc_barrier(arrive_count=[32] * 7)
            empty_in = T.alloc_barrier(arrive_count=[384, 256, 128, 256, 128, 384, 128])
            pc_ready = T.alloc_barrier(arrive_count=128)
            pc_free = T.alloc_barrier(arrive_count=128)
            pg_ready = T.alloc_barrier(arrive_count=[128, 128])
            pg_free = T.alloc_barrier(arrive_count=[128, 128])
            dsb_ready = T.alloc_barrier(arrive_count=128)
            dsb_free = T.alloc_barrier(arrive_count=128)
            dvn_ready = T.alloc_barrier(arrive_count=128)
            dvn_free = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            hq = hv // ratio
            bos0 = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            c0 = chunk_offsets[n]
            nchunks = chunk_offsets[n + 1] - c0
            v0 = vb * BV
            slot_o = hv * NB + vb

            if tx < 128:
                # ---------------- chain ----------------
                T.set_max_nreg(144, 1)
                if has_dht:
                    T.copy(dht[n, hv, :, v0:v0 + BV], dS_f)
                else:
                    T.clear(dS_f)
                for i in T.serial(nchunks):
                    s = i % 2
                    ci = nchunks - 1 - i
                    bos = bos0 + ci * C
                    T.barrier_wait(full_kg[s], (i // 2) % 2)
                    stamp(trace_out, "chain: k, G ready", i, tx, 0, vb, hv, n)
                    # c1
                    T.barrier_wait(dsb_free, (i + 1) % 2)
                    T.copy(dS_f, dSb_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(dsb_ready)
                    stamp(trace_out, "chain: dSb published", i, tx, 0, vb, hv, n)
                    # c2
                    T.gemm(k_s[s, :, :], dSb_s, a1_f, clear_accum=True)
                    glast[0] = fexp(G_s[s, C - 1])
                    for a, b in T.Parallel(K, BV):
                        dS_f[a, b] = dS_f[a, b] * glast[0]
                    T.barrier_wait(full_in[0], i % 2)          # q
                    T.barrier_wait(pc_ready, i % 2)
                    T.gemm(q_s, dOs_s, dS_f, transpose_A=True)
                    stamp(trace_out, "chain: q^T dOs done", i, tx, 0, vb, hv, n)
                    T.barrier_arrive(empty_in[0])
                    # c3
                    for r in T.Parallel(C):
                        rowf_f[r] = fexp(G_s[s, C - 1] - G_s[s, r])
                    for r, j in T.Parallel(C, BV):
                        a1_f[r, j] = a1_f[r, j] * rowf_f[r]
                    T.barrier_wait(full_in[1], i % 2)          # dO
                    T.gemm(Pt_s, do_s, a1_f)
                    T.barrier_arrive(pc_free)
                    T.barrier_arrive(empty_in[1])
                    T.barrier_wait(dvn_free, (i + 1) % 2)
                    # <S, dSb> by column blocks, its row sums into sdr_s[s] for grad's dg warp (moved off grad,
                    # the bottleneck, in session 12).  Here, after the dvn_free wait: grad reads slot s in its
                    # chunk i (after waiting dvn_ready, arrived below), and this slot's next write, two steps on,
                    # follows the dvn_free wait of step i + 2, which grad arrives at g6 of chunk i + 1: after
                    # its read of chunk i
                    T.barrier_wait(full_in[5], i % 2)          # S
                    for qb in T.unroll(BV // SQ):
                        for a, b in T.Parallel(K, SQ):
                            sd_f[a, b] = T.cast(S_s[a, qb * SQ + b], acc) * T.cast(dSb_s[a, qb * SQ + b], acc)
                        T.reduce_sum(sd_f, sdr_f, dim=1)
                        if qb == 0:
                            for a in T.Parallel(K):
                                sdr_s[s, a] = sdr_f[a]
                        else:
                            for a in T.Parallel(K):
                                sdr_s[s, a] = sdr_s[s, a] + sdr_f[a]
                    T.barrier_arrive(empty_in[5])
                    for r, j in T.Parallel(C, BV):
                        ndvn_s[r, j] = T.if_then_else(bos + r < eos, -a1_f[r, j], 0.0)
                    T.fence_proxy_async()
                    T.barrier_arrive(dvn_ready)
                    stamp(trace_out, "chain: ndvn published", i, tx, 0, vb, hv, n)
                    # c4
                    T.barrier_wait(full_in[2], i % 2)          # w
                    T.gemm(w_s, ndvn_s, dS_f, transpose_A=True)
                    T.barrier_arrive(empty_in[2])
                    T.barrier_arrive(empty_kg[s])
                    stamp(trace_out, "chain: step done", i, tx, 0, vb, hv, n)
                if need_dh0:
                    T.copy(dS_f, dh0[n, hv, :, v0:v0 + BV])
            elif tx < 256:
                # ---------------- prep ----------------
                # (below the 128 of the launch: a dec; setmaxnreg.inc to fewer registers is an illegal
                # instruction, which is how the first H200 run of this kernel failed)
                T.set_max_nreg(120, 0)
                for i in T.serial(nchunks):
                    s = i % 2
                    ci = nchunks - 1 - i
                    bos = bos0 + ci * C
                    T.barrier_wait(full_kg[s], (i // 2) % 2)
                    T.barrier_wait(full_in[0], i % 2)          # q
                    stamp(trace_out, "prep: q ready", i, tx, 128, vb, hv, n)
                    # p2: KQ[j, r] = k_j . q_r
                    T.gemm(k_s[s, :, :], q_s, KQ_f, transpose_B=True, clear_accum=True)
                    T.barrier_wait(pc_free, (i + 1) % 2)
                    for j, r in T.Parallel(C, C):
                        Pt_s[j, r] = T.if_then_else(
                            (j <= r) & (bos + r < eos), KQ_f[j, r] * scale * fexp(G_s[s, r] - G_s[s, j]), 0.0)
                    # p3
                    T.barrier_wait(full_in[1], i % 2)          # dO
                    for r, j in T.Parallel(C, BV):
                        dOs_s[r, j] = T.if_then_else(
                            bos + r < eos, T.cast(do_s[r, j], acc) * (scale * fexp(G_s[s, r])), 0.0)
                    T.fence_proxy_async()
                    T.barrier_arrive(pc_ready)
                    stamp(trace_out, "prep: Pt, dOs published", i, tx, 128, vb, hv, n)
                    # p4: dQK^T[j, r] from vn dO^T (partial over this V block)
                    # p4: dQK^T (its row sums are Z's column sums), then Z in the [r, j] frame for its row sums
                    # (q k^T and dO vn^T: two more small wgmma; a column reduction of a wgmma fragment would be
                    # a cross-warp AllReduce on bar.sync id 1, which the grad warpgroup could hit at the same time)
                    T.barrier_wait(full_in[3], i % 2)          # vn
                    T.gemm(vn_s, do_s, dPt_f, transpose_B=True, clear_accum=True)
                    T.barrier_wait(pg_free[s], (i // 2 + 1) % 2)
                    for j, r in T.Parallel(C, C):
                        dPt_f[j, r] = T.if_then_else(
                            (j <= r) & (bos + r < eos), dPt_f[j, r] * scale * fexp(G_s[s, r] - G_s[s, j]), 0.0)
                    T.copy(dPt_f, dQKt_s[s, :, :])
                    for j, r in T.Parallel(C, C):
                        dPt_f[j, r] = dPt_f[j, r] * KQ_f[j, r]
                    T.reduce_sum(dPt_f, pc_f, dim=1)
                    for r in T.Parallel(C):
                        dGc_s[s, r] = pc_f[r]
                    stamp(trace_out, "prep: dQK^T, Z sums done", i, tx, 128, vb, hv, n)
                    T.gemm(do_s, vn_s, dPt_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(empty_in[3])
                    T.gemm(q_s, k_s[s, :, :], KQ_f, transpose_B=True, clear_accum=True)
                    for r, j in T.Parallel(C, C):
                        dPt_f[r, j] = T.if_then_else(
                            (j <= r) & (bos + r < eos), dPt_f[r, j] * scale * fexp(G_s[s, r] - G_s[s, j]), 0.0) \
                            * KQ_f[r, j]
                    T.reduce_sum(dPt_f, pr_f, dim=1)
                    for r in T.Parallel(C):
                        dGp_s[s, r] = pr_f[r]
                    # p5: Y = v - diag(eG) k S
                    T.barrier_wait(full_in[5], i % 2)          # S
                    T.gemm(k_s[s, :, :], S_s, U_f, clear_accum=True)
                    T.barrier_wait(full_in[4], i % 2)          # v
                    for r, j in T.Parallel(C, BV):
                        Y_s[s, r, j] = T.cast(v_s[r, j], acc) - fexp(G_s[s, r]) * U_f[r, j]
                    T.barrier_arrive(empty_in[4])
                    stamp(trace_out, "prep: Y done", i, tx, 128, vb, hv, n)
                    # p6: dOS = dO S^T by K halves, the inter-chunk gate term, dq
                    T.gemm(do_s, S_s[0:KH, :], dOS0_f, transpose_B=True, clear_accum=True)
                    T.gemm(do_s, S_s[KH:K, :], dOS1_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(empty_in[5])
                    T.barrier_arrive(empty_in[1])
                    for r, d in T.Parallel(C, KH):
                        ptmp_f[r, d] = T.cast(q_s[r, d], acc) * dOS0_f[r, d]
                    T.reduce_sum(ptmp_f, pq_f, dim=1)
                    for r in T.Parallel(C):
                        gi_s[s, r] = pq_f[r]
                    for r, d in T.Parallel(C, KH):
                        ptmp_f[r, d] = T.cast(q_s[r, KH + d], acc) * dOS1_f[r, d]
                    T.reduce_sum(ptmp_f, pq_f, dim=1)
                    for r in T.Parallel(C):
                        gi_s[s, r] = (gi_s[s, r] + pq_f[r]) * scale * fexp(G_s[s, r])
                    T.fence_proxy_async()
                    T.barrier_arrive(pg_ready[s])
                    stamp(trace_out, "prep: published to grad", i, tx, 128, vb, hv, n)
                    for r, d in T.Parallel(C, KH):
                        dOS0_f[r, d] = dOS0_f[r, d] * (scale * fexp(G_s[s, r]))
                    for r, d in T.Parallel(C, KH):
                        dOS1_f[r, d] = dOS1_f[r, d] * (scale * fexp(G_s[s, r]))
                    T.gemm(dQKt_s[s, :, :], k_s[s, :, 0:KH], dOS0_f, transpose_A=True)
                    T.gemm(dQKt_s[s, :, :], k_s[s, :, KH:K], dOS1_f, transpose_A=True)
                    T.barrier_arrive(empty_in[0])
                    T.barrier_arrive(empty_kg[s])
                    for r, d in T.Parallel(C, KH):
                        if bos + r < eos:
                            dq_p[bos + r, slot_o, d] = T.cast(dOS0_f[r, d], dtype)
                    for r, d in T.Parallel(C, KH):
                        if bos + r < eos:
                            dq_p[bos + r, slot_o, KH + d] = T.cast(dOS1_f[r, d], dtype)
                    stamp(trace_out, "prep: dq stored", i, tx, 128, vb, hv, n)
            elif tx < 384:
                # ---------------- grad ----------------
                # dk is held as two [C, 64] halves (K = 128): every product into it and every temporary of
                # the same shape then takes 32 registers per thread, not 64
                T.set_max_nreg(224, 1)
                for i in T.serial(nchunks):
                    s = i % 2
                    ci = nchunks - 1 - i
                    bos = bos0 + ci * C
                    for r in T.Parallel(C):
                        b_s[r] = T.if_then_else(bos + r < eos, T.cast(beta[bos + r, hv], acc), 0.0)
                    T.barrier_wait(full_kg[s], (i // 2) % 2)
                    T.barrier_wait(full_in[0], i % 2)          # q
                    T.barrier_wait(pg_ready[s], (i // 2) % 2)
                    stamp(trace_out, "grad: prep's tiles ready", i, tx, 256, vb, hv, n)
                    # g2
                    T.gemm(dQKt_s[s, :, :], q_s[:, 0:KH], dk0_f, clear_accum=True)
                    T.gemm(dQKt_s[s, :, :], q_s[:, KH:K], dk1_f, clear_accum=True)
                    T.barrier_arrive(empty_in[0])
                    # g3: t = vn dSb^T by K halves; dk += D t; dD = rowsum(k t)
                    T.barrier_wait(dsb_ready, i % 2)
                    T.barrier_wait(full_in[3], i % 2)          # vn
                    for r in T.Parallel(C):
                        fac_s[r] = fexp(G_s[s, C - 1] - G_s[s, r])
                    k_side_pass(vn_s, dSb_s, s, fac_s, dD_s, k_s, dk0_f, dk1_f, t_f, gr_f)
                    T.barrier_arrive(empty_in[3])
                    T.barrier_arrive(dsb_free)
                    stamp(trace_out, "grad: t, dD done", i, tx, 256, vb, hv, n)
                    # g4: Z' = X^T ndvn, dY = dv, db = -rowsum(Z' Y)
                    T.barrier_wait(dvn_ready, i % 2)
                    T.barrier_wait(full_in[6], i % 2)          # X
                    T.gemm(X_s, ndvn_s, Zp_f, transpose_A=True, clear_accum=True)
                    for r, j in T.Parallel(C, BV):
                        dY_s[r, j] = -b_s[r] * Zp_f[r, j]
                    for r, j in T.Parallel(C, BV):
                        if bos + r < eos:
                            dv_out[bos + r, hv, v0 + j] = T.cast(-b_s[r] * Zp_f[r, j], dtype)
                    for r, j in T.Parallel(C, BV):
                        Zp_f[r, j] = Zp_f[r, j] * T.cast(Y_s[s, r, j], acc)
                    T.reduce_sum(Zp_f, gv_f, dim=1)
                    for r in T.Parallel(C):
                        db_s[r] = -gv_f[r]
                    stamp(trace_out, "grad: dv, db done", i, tx, 256, vb, hv, n)
                    T.fence_proxy_async()
                    # g5: dY S^T by K halves; dk -= diag(eG) (.), dG's term -eG rowsum((.) k)
                    T.barrier_wait(full_in[5], i % 2)          # S
                    for r in T.Parallel(C):
                        fac_s[r] = -fexp(G_s[s, r])
                    k_side_pass(dY_s, S_s, s, fac_s, dG_s, k_s, dk0_f, dk1_f, t_f, gr_f)
                    T.barrier_arrive(empty_in[5])
                    stamp(trace_out, "grad: dY S^T done", i, tx, 256, vb, hv, n)
                    for r in T.Parallel(C):
                        dG_s[r] = T.if_then_else(
                            bos + r < eos,
                            dGp_s[s, r] - dGc_s[s, r] + gi_s[s, r] - fexp(G_s[s, C - 1] - G_s[s, r]) * dD_s[r]
                            - fexp(G_s[s, r]) * dG_s[r], 0.0)
                    # g6: dX = -(ndvn Y^T) diag(b); T1 = X^T dX (over dX's tile); dA = -(T1 X^T), dA^T = -(X T1^T)
                    # k k^T issued without a wait: it runs under the dTb product (whose wait covers both)
                    T.wgmma_gemm(k_s[s, :, :], k_s[s, :, :], KK_f, transpose_B=True, clear_accum=True)
                    T.gemm(ndvn_s, Y_s[s, :, :], m_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(dvn_free)
                    for r, j in T.Parallel(C, C):
                        dX_s[r, j] = -m_f[r, j] * b_s[j]
                    T.fence_proxy_async()
                    T.gemm(X_s, dX_s, m_f, transpose_A=True, clear_accum=True)
                    T.copy(m_f, dX_s)
                    T.fence_proxy_async()
                    # Ws = W + W^T into dY's tile (last read by the dY S^T wgmma), W^T from dA^T first; in the same
                    # pass, the column sums of dAA[r, j] = dA[r, j] b_r KK[r, j] E[r, j] (r > j) as row sums over
                    # dA^T (dA[r, j] = -m[j, r]; KK is symmetric, so its element is W^T's times KK): no cross-warp
                    # reduction, one exp per element
                    T.gemm(X_s, dX_s, m_f, transpose_B=True, clear_accum=True)
                    for r, j in T.Parallel(C, C):
                        wt = T.if_then_else(j > r, -m_f[r, j] * b_s[j] * fexp(G_s[s, j] - G_s[s, r]), 0.0)
                        dY_s[r, j] = wt
                        m_f[r, j] = wt * KK_f[r, j]
                    T.reduce_sum(m_f, gc_f, dim=1)
                    # then W from dA, added to the same elements (the same accumulator layout, so each thread
                    # rereads what it wrote), and dA KK E for the rows in the same pass
                    T.gemm(dX_s, X_s, m_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(empty_in[6])
                    for r, j in T.Parallel(C, C):
                        wr = T.if_then_else(r > j, -m_f[r, j] * fexp(G_s[s, r] - G_s[s, j]), 0.0)
                        dY_s[r, j] = T.cast(dY_s[r, j], acc) + wr * b_s[r]
                        KK_f[r, j] = wr * KK_f[r, j]
                    T.fence_proxy_async()
                    T.reduce_sum(KK_f, gk_f, dim=1)
                    for r in T.Parallel(C):
                        db_s[r] = db_s[r] + gk_f[r]
                    for r in T.Parallel(C):
                        dG_s[r] = dG_s[r] + b_s[r] * gk_f[r]
                    for r in T.Parallel(C):
                        dG_s[r] = dG_s[r] - gc_f[r]
                    stamp(trace_out, "grad: dA terms done", i, tx, 256, vb, hv, n)
                    # g7
                    T.gemm(dY_s, k_s[s, :, 0:KH], dk0_f)
                    T.gemm(dY_s, k_s[s, :, KH:K], dk1_f)
                    for r, d in T.Parallel(C, KH):
                        if bos + r < eos:
                            dk_p[bos + r, slot_o, d] = T.cast(dk0_f[r, d], dtype)
                    for r, d in T.Parallel(C, KH):
                        if bos + r < eos:
                            dk_p[bos + r, slot_o, KH + d] = T.cast(dk1_f[r, d], dtype)
                    T.barrier_arrive(pg_free[s])
                    stamp(trace_out, "grad: dk stored", i, tx, 256, vb, hv, n)
                    # dg: the reverse cumsum of dG over the chunk (rows past the end hold only the terms the
                    # CPU model keeps there); the last row's extra term e^{G_last} <S, dS> + sum D dD reaches
                    # every row of the cumsum, so it is added to each.  One warp: lane l holds rows 2l, 2l+1.
                    if tx < 288:
                        lane = tx - 256
                        part = T.alloc_var(acc)
                        part = (sdr_s[s, lane] + sdr_s[s, lane + 32] + sdr_s[s, lane + 64] + sdr_s[s, lane + 96]) \
                            * fexp(G_s[s, C - 1]) \
                            + fexp(G_s[s, C - 1] - G_s[s, lane]) * dD_s[lane] \
                            + fexp(G_s[s, C - 1] - G_s[s, lane + 32]) * dD_s[lane + 32]
                        last = T.alloc_var(acc)
                        last = T.warp_reduce_sum(part)
                        lo = T.alloc_var(acc)
                        lo = dG_s[2 * lane]
                        suf = T.alloc_var(acc)
                        suf = lo + dG_s[2 * lane + 1]
                        for sh in T.unroll(5):
                            y = T.alloc_var(acc)
                            y = T.shfl_down(suf, 1 << sh)
                            if lane + (1 << sh) < 32:
                                suf = suf + y
                        if bos + 2 * lane < eos:
                            dg_p[vb, bos + 2 * lane, hv] = suf + last
                        if bos + 2 * lane + 1 < eos:
                            dg_p[vb, bos + 2 * lane + 1, hv] = suf - lo + last
                    T.barrier_arrive(empty_kg[s])
                    for r in T.Parallel(C):
                        if bos + r < eos:
                            db_p[vb, bos + r, hv] = db_s[r]
                    stamp(trace_out, "grad: dg, db stored", i, tx, 256, vb, hv, n)
            else:
                # ---------------- producer: one warp issues every TMA load ----------------
                T.set_max_nreg(24, 0)
                if tx < 416:
                    for i in T.serial(nchunks):
                        s = i % 2
                        ci = nchunks - 1 - i
                        bos = bos0 + ci * C
                        c = c0 + ci
                        # in the order their previous chunk's last readers free them
                        T.barrier_wait(empty_kg[s], (i // 2 + 1) % 2)
                        T.tma_copy(k[bos:bos + C, hq, :], k_s[s, :, :], barrier=full_kg[s])
                        T.tma_copy(G[c, hv, :], G_s[s, :], barrier=full_kg[s])
                        T.barrier_arrive(full_kg[s])
                        T.barrier_wait(empty_in[0], (i + 1) % 2)
                        T.tma_copy(q[bos:bos + C, hq, :], q_s, barrier=full_in[0])
                        T.barrier_arrive(full_in[0])
                        stamp(trace_out, "producer: q issued", i, tx, 384, vb, hv, n)
                        T.barrier_wait(empty_in[1], (i + 1) % 2)
                        T.tma_copy(do[bos:bos + C, hv, v0:v0 + BV], do_s, barrier=full_in[1])
                        T.barrier_arrive(full_in[1])
                        T.barrier_wait(empty_in[3], (i + 1) % 2)
                        T.tma_copy(vn[c, hv, :, v0:v0 + BV], vn_s, barrier=full_in[3])
                        T.barrier_arrive(full_in[3])
                        T.barrier_wait(empty_in[2], (i + 1) % 2)
                        T.tma_copy(w[c, hv, :, :], w_s, barrier=full_in[2])
                        T.barrier_arrive(full_in[2])
                        T.barrier_wait(empty_in[4], (i + 1) % 2)
                        T.tma_copy(v[bos:bos + C, hv, v0:v0 + BV], v_s, barrier=full_in[4])
                        T.barrier_arrive(full_in[4])
                        T.barrier_wait(empty_in[5], (i + 1) % 2)
                        T.tma_copy(h[c, hv, :, v0:v0 + BV], S_s, barrier=full_in[5])
                        T.barrier_arrive(full_in[5])
                        stamp(trace_out, "producer: S issued", i, tx, 384, vb, hv, n)
                        T.barrier_wait(empty_in[6], (i + 1) % 2)
                        T.tma_copy(X[c, hv, :, :], X_s, barrier=full_in[6])
                        T.barrier_arrive(full_in[6])
                        stamp(trace_out, "producer: X issued", i, tx, 384, vb, hv, n)
    return gdn_bwd_fused
