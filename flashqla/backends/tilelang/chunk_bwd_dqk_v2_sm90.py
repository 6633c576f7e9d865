"""Backward stage 2 (Hopper): per-chunk gradients that need the chunk states.

Grid: ``(total_chunks, Hv)``, 256 threads (two warpgroups).  CTA ``(c, h)`` takes chunk ``c`` of value head
``h`` (query/key head ``h // ratio``) and contracts over V, with ``S = h[c]`` the forward chunk state and
``dS = dh[c]`` its gradient (stage 1)::

    dOS  = dO S^T          [64, K]        dPm = dO v_new^T    [64, 64]
    vdS  = v_new dS^T      [64, K]        dw  = -dv_new S^T   [64, K]

plus ``<S, dS>``.  dO rows past the sequence end (the next sequence's rows) are masked at every use.  Then,
with ``M`` the causal mask (j <= r, r < eos), ``E = exp(G_r - G_j)`` on M only, and the L2-norm row factors
nq, nk (1 without the option)::

    dQK  = scale * dPm * E * M                     (gradient w.r.t. q^ k^T)
    dq^  = scale exp(G) * dOS + (dQK diag(nk)) k   -> dq (L2-norm Jacobian applied; per value head)
    dk^p = diag(exp(G_last - G)) vdS + (diag(nq) dQK)^T q          (partial: stage 3 adds the WY part)
    dG_r = scale exp(G_r) nq_r q_r.dOS_r + rowsum(Z)_r - colsum(Z)_r - D_r dD_r
           (+ exp(G_last) <S, dS> + sum_r D_r dD_r on the last row),
    Z = dQK * (q k^T) nq nk,  D = exp(G_last - G),  dD_r = nk_r k_r . vdS_r.

Outputs: dq [NT, Hv, K] in the input dtype (rows < eos; per value head, summed over each GVA group in
fp32 by ``backends/gva.py``: FlashQLA's rounding point, session 10, half the bytes of the fp32 form it
replaced; with ``gva_pair``, GVA ratio 2, [NT, Hqk, K] summed in the kernel by pair reductions into the zeroed
output, as ``chunk_bwd_whole_sm90`` does), and chunk-major for stage 3: dk^p [NC, Hv, 64, K] fp32,
dw [NC, Hv, 64, K] (input dtype), dG [NC, Hv, 64] fp32.

Why this form.  Its first version (retired in session 9) was slow (H200, 16/32 heads, 32k tokens:
1.80 ms for 512 x 32 CTAs; each moves ~220 KB, a memory floor of ~0.8 ms at this contract's fp32
dq / dk^p outputs):

* its loads are serialised: the q tile is loaded and waited for, then the k tile, and only then does
  the T.Pipelined producer start the V-block stream -- three load latencies in a row per CTA;
* one thread (thread 191) finishes the last row's gate gradient with a serial loop of 128 shared loads
  plus 64 ``exp`` + shared loads (a dependent chain of ~200 shared-memory round trips) while the other
  255 threads wait at the final barrier;
* one CTA per SM (145 KB of shared memory, 168 registers x 384 threads), so nothing hides either.

What this form does instead:

* every tile (q, k, dO, S, dS, v_new, dv_new: 144 KB) is requested with TMA at the start, on two
  mbarriers (q/k and the V-side tiles), by one elected thread; no producer warpgroup (256 threads);
* the four V-contractions run once each on whole 128-wide tiles (wgmma K-loop of 8 instead of two
  pipelined 4-step halves);
* ``<S, dS>`` is accumulated over two 64-column halves into one [K, 64] fragment (the first version: per
  V-block); the K-sum and ``sum_t D_t dD_t`` of the last row's gate term are warp shuffles (``warp_reduce_sum``
  over 4 resp. 2 values per lane) instead of the serial loop.
"""

CHUNK = 64
L2_EPS = 1e-6


def build_bwd_dqk_v2(dtype: str, K: int, V: int, l2norm: bool, threads: int = 256, gva_pair: bool = False):
    import tilelang.language as T

    from ._common import RED_PAIR_SRC, make_l2_row_factors, make_grad_rows, symbolic_sizes

    C = CHUNK
    acc = "float32"
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    assert K == 128 and V % 64 == 0
    HB = 64
    l2_row_factors = make_l2_row_factors(C, K, acc, L2_EPS)
    grad_rows = make_grad_rows(C, gva_pair)
    HG = Hqk if gva_pair else Hv      # the head axis of dq_out (gva_pair: summed over GVA pairs)

    @T.prim_func
    def gdn_bwd_dqk_v2(
        q: T.Tensor((NT, Hqk, K), dtype),
        k: T.Tensor((NT, Hqk, K), dtype),
        do: T.Tensor((NT, Hv, V), dtype),
        G: T.Tensor((NC, Hv, C), acc),
        h: T.Tensor((NC, Hv, K, V), dtype),
        vn: T.Tensor((NC, Hv, C, V), dtype),
        dh: T.Tensor((NC, Hv, K, V), dtype),
        dvn: T.Tensor((NC, Hv, C, V), dtype),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        dq_out: T.Tensor((NT, HG, K), dtype),
        dkp_out: T.Tensor((NC, Hv, C, K), acc),
        dw_out: T.Tensor((NC, Hv, C, K), dtype),
        dG_out: T.Tensor((NC, Hv, C), acc),
        scale: T.float32,
        ratio: T.int32,
    ):
        with T.Kernel(NC, Hv, threads=threads) as (c, hv):
            if gva_pair:
                T.import_source(RED_PAIR_SRC)
                pend = T.alloc_local((1,), acc)   # a pair's even column (make_red_rows)
            else:
                pend = None
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
            bar_qk = T.alloc_barrier(threads)
            bar_v = T.alloc_barrier(threads)

            seq = chunk_indices[c, 0]
            bos = cu_seqlens[seq] + chunk_indices[c, 1] * C
            eos = cu_seqlens[seq + 1]
            hq = hv // ratio

            # every tile in flight at once
            T.tma_copy(do[bos:bos + C, hv, :], do_s, barrier=bar_v)
            T.tma_copy(h[c, hv, :, :], S_s, barrier=bar_v)
            T.tma_copy(vn[c, hv, :, :], vn_s, barrier=bar_v)
            T.tma_copy(dvn[c, hv, :, :], dvn_s, barrier=bar_v)
            T.tma_copy(dh[c, hv, :, :], dS_s, barrier=bar_v)
            T.mbarrier_arrive(bar_v)
            T.tma_copy(q[bos:bos + C, hq, :], q_s, barrier=bar_qk)
            T.tma_copy(k[bos:bos + C, hq, :], k_s, barrier=bar_qk)
            T.mbarrier_arrive(bar_qk)
            for r in T.Parallel(C):
                G_s[r] = G[c, hv, r]
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

            # dw first (frees its fragment early; the TMA store overlaps the rest)
            for r, d in T.Parallel(C, K):
                dw_s[r, d] = -dw_f[r, d]
            T.copy(dw_s, dw_out[c, hv, :, :])

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
            # Computed unconditionally, then masked by a select, and stored by T.copy: shared loads inside
            # T.if_then_else are one branch per element, and stores to shared memory between shared loads keep
            # the loop in program order (they may alias) -- a latency chain per element either way (session 15,
            # chunk_bwd_whole_sm90).  exp(G_r - G_j) may overflow off the mask; the select drops it.
            for r, j in T.Parallel(C, C):
                dPm_f[r, j] = dPm_f[r, j] * scale * T.exp(G_s[r] - G_s[j])
            for r, j in T.Parallel(C, C):
                dPm_f[r, j] = T.if_then_else((j <= r) & (bos + r < eos), dPm_f[r, j], 0.0)
            if l2norm:
                for r, j in T.Parallel(C, C):
                    Z_f[r, j] = dPm_f[r, j] * QK_f[r, j] * nq_s[r] * nk_s[j]
                for r, j in T.Parallel(C, C):
                    QK_f[r, j] = dPm_f[r, j] * nk_s[j]
                T.copy(QK_f, dQKn_s)
                for r, j in T.Parallel(C, C):
                    QK_f[r, j] = dPm_f[r, j] * nq_s[r]
                T.copy(QK_f, dQKq_s)
            else:
                for r, j in T.Parallel(C, C):
                    Z_f[r, j] = dPm_f[r, j] * QK_f[r, j]
                T.copy(dPm_f, dQKn_s)
                T.copy(dPm_f, dQKq_s)
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
            grad_rows(dq_out, dOS_f, bos, eos, hv, 0, pend)

            # partial dk
            for r, d in T.Parallel(C, K):
                tmp_f[r, d] = T.cast(k_s[r, d], acc) * vdS_f[r, d]
            T.reduce_sum(tmp_f, red_f, dim=1)
            for r in T.Parallel(C):
                dD_s[r] = red_f[r] * nk_s[r]
            for r, d in T.Parallel(C, K):
                vdS_f[r, d] = vdS_f[r, d] * T.exp(G_s[C - 1] - G_s[r])
            T.gemm(dQKq_s, q_s, vdS_f, transpose_A=True)
            T.copy(vdS_f, dkp_out[c, hv, :, :])

            # gate gradient of this chunk (before the reverse cumsum)
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
            T.sync_threads()
            T.copy(dG_s, dG_out[c, hv, :])

    return gdn_bwd_dqk_v2
