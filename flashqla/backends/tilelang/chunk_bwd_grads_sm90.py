"""Backward stages 2 + 3 in one kernel (Hopper): the per-chunk gradients, dqk's work then wy's.

Grid: ``(total_chunks, Hv)``, 256 threads (two warpgroups), no loop, one CTA per SM.  CTA ``(c, h)`` takes
chunk ``c`` of value head ``h`` and runs, in this order:

1. dqk phase (``chunk_bwd_dqk_v2_sm90``, same code and order): ``dO S^T``, ``dO v_new^T``,
   ``v_new dS^T``, ``-dv_new S^T`` and ``<S, dS>``; dq (stored, per value head), ``dk^p`` and the chunk's
   gate term ``dG`` before the cumsum.
2. wy phase (``chunk_bwd_wy_v2_sm90``, same code and order): ``dX``, ``dA``, dv, dk, dbeta, dg.

Same inputs and outputs as the pair (``BACKWARD_PLAN.md`` item E), less the three intermediates.  The split pair
sends them through HBM: dk^p fp32 [NC, Hv, 64, K] (32 KB per CTA, written once and read once), dw 16-bit
(16 KB) and dG fp32; at 16/32 heads x 32k tokens that is ~1.6 GB of the backward's ~11 GB.  Here they stay
on the chip, in the exact form the wy kernel read them, so every output is bitwise the pair's:

* ``dk^p`` stays in the accumulator fragment of ``v_new dS^T`` (32 fp32 registers per thread) until the dk
  epilogue adds it.  Its layout is that of the ``Xb^T dw`` accumulator it is added to (both are 64 x 128
  wgmma accumulators), so the add is the wy kernel's elementwise fp32 add, element for element;
* ``dw`` stays in its 16-bit shared tile (the value the pair stored and reloaded) and feeds ``dw Bw^T``
  and ``Xb^T dw``;
* ``dG`` stays in its fp32 shared vector; wy's terms are added to it, then the reverse cumsum.

Two L2-norm row factors of k exist, as in the pair: dqk's from a sum of squares, wy's from the diagonal of
the ``k k^T`` wgmma.  The two sums run in different orders and may differ in the last bit, so each phase
keeps its own (``nk_s``, ``nkw_s``) and no output moves.

Shared memory (K = V = 128, 16-bit inputs, sm_90a lowering with TileLang 0.1.15): every input tile of
both phases is requested by TMA at the start (q, k, dO, S, dS, v_new, dv_new on two barriers as in dqk;
v and Xb on a third, waited for only when the wy phase starts, so the dqk phase never waits on them).
Side by side the two phases' tiles would need ~274 KB.  TileLang's shared-memory merge plans reuse by
liveness, statement by statement, and both phases run in one straight line with no role branches, so it
sees every lifetime: wy's scratch tiles land in dqk tiles dead by then (in the bf16 and fp16 builds: Bw /
dX / T1 and wy's row vectors over q; W, Bu, dG and dqk's row vectors over S; Ws next to them).  The pass
also places the cross-warp reduction workspaces, and TileLang's thread-sync pass puts a __syncthreads
between a tile's last reader and the first writer of what overlays it (checked in the generated CUDA,
e.g. the ``dk`` L2-norm reduction's workspace over Ws after ``Ws k``).  Result: 168 KB dynamic + 2 KB
static (174592 B of the 232448 B budget), against 144 + 2 KB for the dqk kernel alone and 105 + 2 KB for
wy.  Registers: 255 per thread (the cap at 256 threads, one CTA per SM), LOCAL:0; the dqk kernel alone
takes 207, the wy kernel 96 (2 CTAs per SM).  A second CTA per SM is out of reach either way (it would
need <= 113 KB and <= 128 registers), so nothing is lost by keeping dk^p in registers instead of a 32 KB
fp32 shared tile, which would also add a round trip through shared memory to the dk epilogue.

The two phases repeat the bodies of the dqk and wy kernels line for line, on purpose and for now: sharing
them (TileLang macros) would rewrite the TIR of the default pair, whose compile keys the carried cache and
every measurement so far rely on.  The GPU A/B (``bash benchmarks/next_device_run.sh bwdpipe``) decides
which form stays; the other goes, and the duplication with it.
"""

CHUNK = 64
L2_EPS = 1e-6
WPAD = 65


def build_bwd_grads(dtype: str, beta_dtype: str, K: int, V: int, l2norm: bool, threads: int = 256):
    import tilelang.language as T

    from ._common import make_l2_row_factors, symbolic_sizes

    C = CHUNK
    acc = "float32"
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    assert K == 128 and V == K, "wy's dBu fragment doubles as the [C, K] scratch"
    HB = 64
    l2_row_factors = make_l2_row_factors(C, K, acc, L2_EPS)

    @T.prim_func
    def gdn_bwd_grads(
        q: T.Tensor((NT, Hqk, K), dtype),
        k: T.Tensor((NT, Hqk, K), dtype),
        v: T.Tensor((NT, Hv, V), dtype),
        beta: T.Tensor((NT, Hv), beta_dtype),
        do: T.Tensor((NT, Hv, V), dtype),
        G: T.Tensor((NC, Hv, C), acc),
        X: T.Tensor((NC, Hv, C, C), dtype),
        h: T.Tensor((NC, Hv, K, V), dtype),
        vn: T.Tensor((NC, Hv, C, V), dtype),
        dh: T.Tensor((NC, Hv, K, V), dtype),
        dvn: T.Tensor((NC, Hv, C, V), dtype),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        dq_out: T.Tensor((NT, Hv, K), dtype),
        dk_out: T.Tensor((NT, Hv, K), dtype),
        dv_out: T.Tensor((NT, Hv, V), dtype),
        dg_out: T.Tensor((NT, Hv), acc),
        db_out: T.Tensor((NT, Hv), beta_dtype),
        scale: T.float32,
        ratio: T.int32,
    ):
        with T.Kernel(NC, Hv, threads=threads) as (c, hv):
            # ---- dqk phase tiles
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            G_s = T.alloc_shared((C,), acc)
            do_s = T.alloc_shared((C, V), dtype)
            S_s = T.alloc_shared((K, V), dtype)
            dS_s = T.alloc_shared((K, V), dtype)
            vn_s = T.alloc_shared((C, V), dtype)
            dvn_s = T.alloc_shared((C, V), dtype)

            dOS_f = T.alloc_fragment((C, K), acc)
            dPm_f = T.alloc_fragment((C, C), acc)
            vdS_f = T.alloc_fragment((C, K), acc)
            dw_f = T.alloc_fragment((C, K), acc)
            sd_f = T.alloc_fragment((K, HB), acc)

            QK_f = T.alloc_fragment((C, C), acc)
            Z_f = T.alloc_fragment((C, C), acc)
            dQKn_s = T.alloc_shared((C, C), dtype)
            dQKq_s = T.alloc_shared((C, C), dtype)
            tmp_f = T.alloc_fragment((C, K), acc)
            red_f = T.alloc_fragment((C,), acc)
            cred_f = T.alloc_fragment((C,), acc)
            sdr_f = T.alloc_fragment((K,), acc)
            sdr_s = T.alloc_shared((K,), acc)
            nq_s = T.alloc_shared((C,), acc)
            nk_s = T.alloc_shared((C,), acc)
            rowZ_s = T.alloc_shared((C,), acc)
            colZ_s = T.alloc_shared((C,), acc)
            ginter_s = T.alloc_shared((C,), acc)
            dD_s = T.alloc_shared((C,), acc)
            qdq_s = T.alloc_shared((C,), acc)
            dG_s = T.alloc_shared((C,), acc)
            dw_s = T.alloc_shared((C, K), dtype)

            # ---- wy phase (its scratch tiles reuse dead dqk tiles through TileLang's liveness merge)
            v_s = T.alloc_shared((C, V), dtype)
            Bw_s = T.alloc_shared((C, K), dtype)
            Bu_s = T.alloc_shared((C, V), dtype)
            dX_s = T.alloc_shared((C, C), dtype)
            T1_s = T.alloc_shared((C, C), dtype)
            du_s = dvn_s    # du of the wy kernel is the dv_new tile already loaded
            Xb_s = T.alloc_shared((C, C), dtype)
            W_s = T.alloc_shared((C, WPAD), acc)
            Ws_s = T.alloc_shared((C, C), dtype)
            b_s = T.alloc_shared((C,), acc)
            nkw_s = T.alloc_shared((C,), acc)
            bk_s = T.alloc_shared((C,), acc)
            bv_s = T.alloc_shared((C,), acc)
            bA_s = T.alloc_shared((C,), acc)
            cA_s = T.alloc_shared((C,), acc)
            kd_s = T.alloc_shared((C,), acc)

            KK_f = T.alloc_fragment((C, C), acc)
            dX_f = T.alloc_fragment((C, C), acc)
            T1_f = T.alloc_fragment((C, C), acc)
            dA_f = T.alloc_fragment((C, C), acc)
            dBw_f = T.alloc_fragment((C, K), acc)
            dBu_f = T.alloc_fragment((C, V), acc)
            wred_f = T.alloc_fragment((C,), acc)
            wcred_f = T.alloc_fragment((C,), acc)

            bar_qk = T.alloc_barrier(threads)
            bar_v = T.alloc_barrier(threads)
            bar_w = T.alloc_barrier(threads)

            seq = chunk_indices[c, 0]
            bos = cu_seqlens[seq] + chunk_indices[c, 1] * C
            eos = cu_seqlens[seq + 1]
            hq = hv // ratio

            # all loads up front; v and Xb on their own barrier, so the dqk phase never waits for them
            T.tma_copy(do[bos:bos + C, hv, :], do_s, barrier=bar_v)
            T.tma_copy(h[c, hv, :, :], S_s, barrier=bar_v)
            T.tma_copy(vn[c, hv, :, :], vn_s, barrier=bar_v)
            T.tma_copy(dvn[c, hv, :, :], dvn_s, barrier=bar_v)
            T.tma_copy(dh[c, hv, :, :], dS_s, barrier=bar_v)
            T.mbarrier_arrive(bar_v)
            T.tma_copy(q[bos:bos + C, hq, :], q_s, barrier=bar_qk)
            T.tma_copy(k[bos:bos + C, hq, :], k_s, barrier=bar_qk)
            T.mbarrier_arrive(bar_qk)
            T.tma_copy(v[bos:bos + C, hv, :], v_s, barrier=bar_w)
            T.tma_copy(X[c, hv, :, :], Xb_s, barrier=bar_w)
            T.mbarrier_arrive(bar_w)
            for r in T.Parallel(C):
                G_s[r] = G[c, hv, r]
                b_s[r] = T.if_then_else(bos + r < eos, T.cast(beta[bos + r, hv], acc), 0.0)
            T.mbarrier_wait_parity(bar_v, 0)

            T.gemm(do_s, S_s, dOS_f, transpose_B=True, clear_accum=True)
            T.gemm(do_s, vn_s, dPm_f, transpose_B=True, clear_accum=True)
            T.gemm(vn_s, dS_s, vdS_f, transpose_B=True, clear_accum=True)
            T.gemm(dvn_s, S_s, dw_f, transpose_B=True, clear_accum=True)
            for a, b in T.Parallel(K, HB):
                sd_f[a, b] = T.cast(S_s[a, b], acc) * T.cast(dS_s[a, b], acc)
            for hb in T.unroll(1, V // HB):
                for a, b in T.Parallel(K, HB):
                    sd_f[a, b] = sd_f[a, b] + T.cast(S_s[a, hb * HB + b], acc) * T.cast(dS_s[a, hb * HB + b], acc)

            for r, d in T.Parallel(C, K):
                dw_s[r, d] = -dw_f[r, d]

            T.mbarrier_wait_parity(bar_qk, 0)
            if l2norm:
                l2_row_factors(q_s, nq_s, tmp_f, red_f)
                l2_row_factors(k_s, nk_s, tmp_f, red_f)
            else:
                for r in T.Parallel(C):
                    nq_s[r] = 1.0
                    nk_s[r] = 1.0

            # intra-chunk attention gradient
            T.gemm(q_s, k_s, QK_f, transpose_B=True, clear_accum=True)
            for r, j in T.Parallel(C, C):
                dPm_f[r, j] = T.if_then_else(
                    (j <= r) & (bos + r < eos), dPm_f[r, j] * scale * T.exp(G_s[r] - G_s[j]), 0.0)
            for r, j in T.Parallel(C, C):
                Z_f[r, j] = dPm_f[r, j] * QK_f[r, j] * nq_s[r] * nk_s[j]
                dQKn_s[r, j] = dPm_f[r, j] * nk_s[j]
                dQKq_s[r, j] = dPm_f[r, j] * nq_s[r]
            T.reduce_sum(Z_f, red_f, dim=1)
            for r in T.Parallel(C):
                rowZ_s[r] = red_f[r]
            T.reduce_sum(Z_f, cred_f, dim=0)
            for r in T.Parallel(C):
                colZ_s[r] = cred_f[r]

            # dq
            for r, d in T.Parallel(C, K):
                tmp_f[r, d] = T.cast(q_s[r, d], acc) * dOS_f[r, d]
            T.reduce_sum(tmp_f, red_f, dim=1)
            for r in T.Parallel(C):
                ginter_s[r] = red_f[r] * scale * nq_s[r] * T.exp(G_s[r])
            for r, d in T.Parallel(C, K):
                dOS_f[r, d] = dOS_f[r, d] * (scale * T.exp(G_s[r]))
            T.gemm(dQKn_s, k_s, dOS_f)
            if l2norm:
                for r, d in T.Parallel(C, K):
                    tmp_f[r, d] = T.cast(q_s[r, d], acc) * dOS_f[r, d]
                T.reduce_sum(tmp_f, red_f, dim=1)
                for r in T.Parallel(C):
                    qdq_s[r] = red_f[r] * nq_s[r] * nq_s[r]
                for r, d in T.Parallel(C, K):
                    dOS_f[r, d] = nq_s[r] * (dOS_f[r, d] - qdq_s[r] * T.cast(q_s[r, d], acc))
            for r, d in T.Parallel(C, K):
                if bos + r < eos:
                    dq_out[bos + r, hv, d] = T.cast(dOS_f[r, d], dtype)

            # partial dk: stays in vdS_f for the wy phase's dk epilogue
            for r, d in T.Parallel(C, K):
                tmp_f[r, d] = T.cast(k_s[r, d], acc) * vdS_f[r, d]
            T.reduce_sum(tmp_f, red_f, dim=1)
            for r in T.Parallel(C):
                dD_s[r] = red_f[r] * nk_s[r]
            for r, d in T.Parallel(C, K):
                vdS_f[r, d] = vdS_f[r, d] * T.exp(G_s[C - 1] - G_s[r])
            T.gemm(dQKq_s, q_s, vdS_f, transpose_A=True)

            # gate gradient of this chunk (before wy's terms and the reverse cumsum)
            T.reduce_sum(sd_f, sdr_f, dim=1)
            for a in T.Parallel(K):
                sdr_s[a] = sdr_f[a]
            for r in T.Parallel(C):
                dG_s[r] = T.if_then_else(
                    bos + r < eos,
                    ginter_s[r] + rowZ_s[r] - colZ_s[r] - T.exp(G_s[C - 1] - G_s[r]) * dD_s[r], 0.0)
            T.sync_threads()
            tx = T.get_thread_binding()
            if tx < 32:
                part = T.alloc_var(acc)
                part = (sdr_s[tx] + sdr_s[tx + 32] + sdr_s[tx + 64] + sdr_s[tx + 96]) * T.exp(G_s[C - 1]) \
                    + T.exp(G_s[C - 1] - G_s[tx]) * dD_s[tx] + T.exp(G_s[C - 1] - G_s[tx + 32]) * dD_s[tx + 32]
                tot = T.alloc_var(acc)
                tot = T.warp_reduce_sum(part)
                if tx == 0:
                    dG_s[C - 1] = dG_s[C - 1] + tot
            # wy's scratch tiles overlay dqk tiles read just above (liveness merge): all threads first
            T.sync_threads()

            # ---- wy phase
            T.mbarrier_wait_parity(bar_w, 0)
            T.gemm(k_s, k_s, KK_f, transpose_B=True, clear_accum=True)
            if l2norm:
                for r, j in T.Parallel(C, C):
                    if r == j:
                        nkw_s[r] = T.rsqrt(KK_f[r, j] + L2_EPS)
            else:
                for r in T.Parallel(C):
                    nkw_s[r] = 1.0
            for r, d in T.Parallel(C, K):
                Bw_s[r, d] = T.cast(k_s[r, d], acc) * (b_s[r] * T.exp(G_s[r]) * nkw_s[r])
            for r, d in T.Parallel(C, V):
                Bu_s[r, d] = T.cast(v_s[r, d], acc) * b_s[r]

            # dX, then dA = -(X^T dX) X^T on the strictly lower part
            T.gemm(dw_s, Bw_s, dX_f, transpose_B=True, clear_accum=True)
            T.gemm(du_s, Bu_s, dX_f, transpose_B=True)
            T.copy(dX_f, dX_s)
            T.gemm(Xb_s, dX_s, T1_f, transpose_A=True, clear_accum=True)
            T.copy(T1_f, T1_s)
            T.gemm(T1_s, Xb_s, dA_f, transpose_B=True, clear_accum=True)
            for r, j in T.Parallel(C, C):
                W_s[r, j] = T.if_then_else(r > j, -dA_f[r, j] * b_s[r] * T.exp(G_s[r] - G_s[j]), 0.0)
                KK_f[r, j] = T.if_then_else(
                    r > j, -dA_f[r, j] * KK_f[r, j] * nkw_s[r] * nkw_s[j] * T.exp(G_s[r] - G_s[j]), 0.0)
            T.reduce_sum(KK_f, wred_f, dim=1)
            for r in T.Parallel(C):
                bA_s[r] = wred_f[r]
            for r, j in T.Parallel(C, C):
                KK_f[r, j] = KK_f[r, j] * b_s[r]
            T.reduce_sum(KK_f, wcred_f, dim=0)
            for r in T.Parallel(C):
                cA_s[r] = wcred_f[r]
            for r, j in T.Parallel(C, C):
                Ws_s[r, j] = (W_s[r, j] + W_s[j, r]) * nkw_s[j]

            # dBu first (dv, dBu . v), then dBw; dBu's fragment is the scratch after
            T.gemm(Xb_s, du_s, dBu_f, transpose_A=True, clear_accum=True)
            for r, d in T.Parallel(C, V):
                if bos + r < eos:
                    dv_out[bos + r, hv, d] = T.cast(dBu_f[r, d] * b_s[r], dtype)
            for r, d in T.Parallel(C, V):
                dBu_f[r, d] = dBu_f[r, d] * T.cast(v_s[r, d], acc)
            T.reduce_sum(dBu_f, wred_f, dim=1)
            for r in T.Parallel(C):
                bv_s[r] = wred_f[r]

            T.gemm(Xb_s, dw_s, dBw_f, transpose_A=True, clear_accum=True)
            for r, d in T.Parallel(C, K):
                dBu_f[r, d] = dBw_f[r, d] * T.cast(k_s[r, d], acc)
            T.reduce_sum(dBu_f, wred_f, dim=1)
            for r in T.Parallel(C):
                bk_s[r] = wred_f[r] * T.exp(G_s[r]) * nkw_s[r]

            # dk (dk^p from the dqk phase's fragment)
            for r, d in T.Parallel(C, K):
                dBw_f[r, d] = dBw_f[r, d] * (b_s[r] * T.exp(G_s[r])) + vdS_f[r, d]
            T.gemm(Ws_s, k_s, dBw_f)
            if l2norm:
                for r, d in T.Parallel(C, K):
                    dBu_f[r, d] = dBw_f[r, d] * T.cast(k_s[r, d], acc)
                T.reduce_sum(dBu_f, wred_f, dim=1)
                for r in T.Parallel(C):
                    kd_s[r] = wred_f[r] * nkw_s[r] * nkw_s[r]
                for r, d in T.Parallel(C, K):
                    dBw_f[r, d] = nkw_s[r] * (dBw_f[r, d] - kd_s[r] * T.cast(k_s[r, d], acc))
            for r, d in T.Parallel(C, K):
                if bos + r < eos:
                    dk_out[bos + r, hv, d] = T.cast(dBw_f[r, d], dtype)

            # dbeta, dg
            for r in T.Parallel(C):
                dG_s[r] = dG_s[r] + b_s[r] * bk_s[r] + b_s[r] * bA_s[r] - cA_s[r]
                if bos + r < eos:
                    db_out[bos + r, hv] = T.cast(bk_s[r] + bv_s[r] + bA_s[r], beta_dtype)
            T.cumsum(dG_s, dim=0, reverse=True)
            for r in T.Parallel(C):
                if bos + r < eos:
                    dg_out[bos + r, hv] = dG_s[r]

    return gdn_bwd_grads
