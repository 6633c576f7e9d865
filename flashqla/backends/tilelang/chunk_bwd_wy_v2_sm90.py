"""Backward stage 3 (Hopper): back through the WY representation, the gate cumsum and the L2 norm.

Grid: ``(total_chunks, Hv)``, 256 threads (two warpgroups), no loop.  CTA ``(c, h)`` takes chunk ``c``
of value head ``h``; inputs are the forward's ``X = (I + A)^-1`` (``Xb``: X rounded to the inputs' 16-bit
dtype, as stage 1 of the forward saves it), stage 2's ``dw``, ``dk^p``, ``dG`` and stage 1's ``dv_new``
(= du).  With ``Bw = diag(beta exp(G) nk) k`` and ``Bu = diag(beta) v`` (so ``w = X Bw``, ``u = X Bu``)::

    dX   = dw Bw^T + du Bu^T
    dA   = -(Xb^T dX) Xb^T                 strictly lower part
    A    = beta_r nk_r nk_j (k k^T) exp(G_r - G_j)   (j < r)
    W    = dA beta_r exp(G_r - G_j)
    dBw  = Xb^T dw,  dBu = Xb^T du
    dv   = diag(beta) dBu
    dk^  = dk^p + diag(beta exp(G)) dBw + ((W + W^T) diag(nk)) k   -> dk (L2-norm Jacobian)
    dbeta_r = exp(G_r) nk_r dBw_r . k_r + dBu_r . v_r + sum_j dA_rj nk_r nk_j (k k^T)_rj exp(G_r - G_j)
    dG_r += beta_r exp(G_r) nk_r dBw_r . k_r + rowsum(dA * A)_r - colsum(dA * A)_r
    dg   = reverse cumsum of dG within the chunk

Rows past the sequence end have beta = 0, so every WY term vanishes there; outputs are written for
rows < eos only.  ``nk`` comes from the diagonal of ``k k^T`` (fp32 accumulators).  Outputs per value
head: dg [NT, Hv] in fp32; dv [NT, Hv, V] in the inputs' dtype and dbeta [NT, Hv] in beta's: nothing is
added to those two afterwards, so they are rounded here once, as the cast on the host did (session 10: the
fp32 dv and its cast pass cost 0.2 ms and 2 units of [T, Hv, V] fp32 memory at the backward's peak, 16/32
heads x 32k tokens); dk [NT, Hv, K] in the inputs' dtype too, per value head, summed over each GVA group in
fp32 on the host (``backends/gva.py``; the same rounding point as dq's, as in FlashQLA), or with ``gva_pair``
(GVA ratio 2) [NT, Hqk, K], summed in the kernel by pair reductions into the zeroed output (``chunk_bwd_whole_sm90``).

Why this form.  Its first version (retired in session 9) was slow (H200, 16/32 heads, 32k tokens:
1.51 ms for a grid of 512 x 32 CTAs that each move ~176 KB, a ~0.7 ms memory floor): 132 registers x
256 threads round to 34816 registers per CTA, so only ONE CTA fits an SM (65536 registers) although its
105 KB of shared memory would allow two; with one CTA per SM every load latency (TMA tiles, X, dk^p) and
every ``__syncthreads`` of the ~12 cross-warpgroup row reductions is exposed, nothing overlaps it.

What this form does instead (same wgmma products, same rounding points):

* ``__launch_bounds__(256, 2)`` (``T.annotate_min_blocks_per_sm(2)``) and an order of work that fits
  128 registers without spilling: ``dBu = Xb^T du`` is finished (dv stored, ``dBu . v`` reduced, the
  product formed in place: no separate scratch fragment) before ``dBw = Xb^T dw`` starts, and the
  ``dBw . k`` / L2-norm row products reuse the dead ``dBu`` fragment as scratch.  Two CTAs per SM: one
  CTA's loads and barriers overlap the other's arithmetic.
* ``rowsum(dA * A * beta)_r = beta_r rowsum(dA * A)_r``: one cross-warpgroup row reduction fewer.
* ``W`` (fp32) lives in shared memory with a row stride of 65 words: ``W + W^T`` reads W by columns,
  which at stride 64 put all 32 lanes of a warp in one bank (32-way conflict); at 65 lane ``l`` hits
  bank ``(l + c) % 32``.
"""

CHUNK = 64
WPAD = 65


def build_bwd_wy_v2(dtype: str, beta_dtype: str, K: int, V: int, l2norm: bool, threads: int = 256,
                    gva_pair: bool = False):
    import tilelang.language as T

    from ._common import RED_PAIR_SRC, make_grad_rows, symbolic_sizes

    C = CHUNK
    acc = "float32"
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    L2_EPS = 1e-6
    grad_rows = make_grad_rows(C, gva_pair)
    HG = Hqk if gva_pair else Hv      # the head axis of dk_out (gva_pair: summed over GVA pairs)
    assert K == V, "the dBu fragment doubles as the [C, K] scratch"

    @T.prim_func
    def gdn_bwd_wy_v2(
        k: T.Tensor((NT, Hqk, K), dtype),
        v: T.Tensor((NT, Hv, V), dtype),
        beta: T.Tensor((NT, Hv), beta_dtype),
        G: T.Tensor((NC, Hv, C), acc),
        X: T.Tensor((NC, Hv, C, C), dtype),
        dw: T.Tensor((NC, Hv, C, K), dtype),
        du: T.Tensor((NC, Hv, C, V), dtype),
        dkp: T.Tensor((NC, Hv, C, K), acc),
        dGp: T.Tensor((NC, Hv, C), acc),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        dk_out: T.Tensor((NT, HG, K), dtype),
        dv_out: T.Tensor((NT, Hv, V), dtype),
        dg_out: T.Tensor((NT, Hv), acc),
        db_out: T.Tensor((NT, Hv), beta_dtype),
        ratio: T.int32,
    ):
        with T.Kernel(NC, Hv, threads=threads) as (c, hv):
            if gva_pair:
                T.import_source(RED_PAIR_SRC)
                pend = T.alloc_local((1,), acc)   # a pair's even column (make_red_rows)
            else:
                pend = None
            T.annotate_min_blocks_per_sm(2)
            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, V), dtype)
            dw_s = T.alloc_shared((C, K), dtype)
            du_s = T.alloc_shared((C, V), dtype)
            Xb_s = T.alloc_shared((C, C), dtype)
            Bw_s = T.alloc_shared((C, K), dtype)
            Bu_s = T.alloc_shared((C, V), dtype)
            dX_s = T.alloc_shared((C, C), dtype)
            T1_s = T.alloc_shared((C, C), dtype)
            W_s = T.alloc_shared((C, WPAD), acc)
            Ws_s = T.alloc_shared((C, C), dtype)
            G_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            nk_s = T.alloc_shared((C,), acc)
            bk_s = T.alloc_shared((C,), acc)
            bv_s = T.alloc_shared((C,), acc)
            bA_s = T.alloc_shared((C,), acc)
            cA_s = T.alloc_shared((C,), acc)
            kd_s = T.alloc_shared((C,), acc)
            dG_s = T.alloc_shared((C,), acc)

            KK_f = T.alloc_fragment((C, C), acc)
            dX_f = T.alloc_fragment((C, C), acc)
            T1_f = T.alloc_fragment((C, C), acc)
            dA_f = T.alloc_fragment((C, C), acc)
            dBw_f = T.alloc_fragment((C, K), acc)
            dBu_f = T.alloc_fragment((C, V), acc)
            red_f = T.alloc_fragment((C,), acc)
            cred_f = T.alloc_fragment((C,), acc)   # column sums: a different layout than row sums
            bar = T.alloc_barrier(threads)

            seq = chunk_indices[c, 0]
            bos = cu_seqlens[seq] + chunk_indices[c, 1] * C
            eos = cu_seqlens[seq + 1]
            hq = hv // ratio

            T.tma_copy(k[bos:bos + C, hq, :], k_s, barrier=bar)
            T.tma_copy(v[bos:bos + C, hv, :], v_s, barrier=bar)
            T.tma_copy(dw[c, hv, :, :], dw_s, barrier=bar)
            T.tma_copy(du[c, hv, :, :], du_s, barrier=bar)
            T.mbarrier_arrive(bar)
            for r, j in T.Parallel(C, C):
                Xb_s[r, j] = X[c, hv, r, j]
            for r in T.Parallel(C):
                G_s[r] = G[c, hv, r]
                b_s[r] = T.if_then_else(bos + r < eos, T.cast(beta[bos + r, hv], acc), 0.0)
                dG_s[r] = dGp[c, hv, r]
            T.mbarrier_wait_parity(bar, 0)

            T.gemm(k_s, k_s, KK_f, transpose_B=True, clear_accum=True)
            if l2norm:
                for r, j in T.Parallel(C, C):
                    if r == j:
                        nk_s[r] = T.rsqrt(KK_f[r, j] + L2_EPS)
            else:
                for r in T.Parallel(C):
                    nk_s[r] = 1.0
            # Elementwise passes compute in registers (dBw_f / dBu_f are free until their products), mask by a
            # select in a loop of their own and store by T.copy: shared loads inside T.if_then_else are one
            # branch per element, and stores to shared memory between shared loads keep a loop in program order
            # (they may alias) -- a latency chain per element either way (session 15, chunk_bwd_whole_sm90)
            for r, d in T.Parallel(C, K):
                dBw_f[r, d] = T.cast(k_s[r, d], acc) * (b_s[r] * T.exp(G_s[r]) * nk_s[r])
            T.copy(dBw_f, Bw_s)
            for r, d in T.Parallel(C, V):
                dBu_f[r, d] = T.cast(v_s[r, d], acc) * b_s[r]
            T.copy(dBu_f, Bu_s)

            # dX, then dA = -(X^T dX) X^T on the strictly lower part
            T.gemm(dw_s, Bw_s, dX_f, transpose_B=True, clear_accum=True)
            T.gemm(du_s, Bu_s, dX_f, transpose_B=True)
            T.copy(dX_f, dX_s)
            T.gemm(Xb_s, dX_s, T1_f, transpose_A=True, clear_accum=True)
            T.copy(T1_f, T1_s)
            T.gemm(T1_s, Xb_s, dA_f, transpose_B=True, clear_accum=True)
            # dA = -(fragment) on the strictly lower part; W = dA beta_r E; KK_f becomes dA * KKn (= dA * A / beta_r)
            # (E = exp(G_r - G_j) once, in T1_f: may overflow above the diagonal, where the select drops it)
            for r, j in T.Parallel(C, C):
                T1_f[r, j] = T.exp(G_s[r] - G_s[j])
            for r, j in T.Parallel(C, C):
                dX_f[r, j] = -dA_f[r, j] * b_s[r] * T1_f[r, j]
                KK_f[r, j] = -dA_f[r, j] * KK_f[r, j] * nk_s[r] * nk_s[j] * T1_f[r, j]
            for r, j in T.Parallel(C, C):
                dX_f[r, j] = T.if_then_else(r > j, dX_f[r, j], 0.0)
                KK_f[r, j] = T.if_then_else(r > j, KK_f[r, j], 0.0)
            for r, j in T.Parallel(C, C):
                W_s[r, j] = dX_f[r, j]
            T.reduce_sum(KK_f, red_f, dim=1)
            for r in T.Parallel(C):
                bA_s[r] = red_f[r]
            for r, j in T.Parallel(C, C):
                KK_f[r, j] = KK_f[r, j] * b_s[r]
            T.reduce_sum(KK_f, cred_f, dim=0)
            for r in T.Parallel(C):
                cA_s[r] = cred_f[r]
            for r, j in T.Parallel(C, C):
                T1_f[r, j] = (W_s[r, j] + W_s[j, r]) * nk_s[j]
            T.copy(T1_f, Ws_s)

            # dBu first (dv, dBu . v), then dBw in a fragment of its own; dBu's is the scratch after
            T.gemm(Xb_s, du_s, dBu_f, transpose_A=True, clear_accum=True)
            # (a whole chunk stores without a test per element, which would be a branch per store)
            if bos + C <= eos:
                for r, d in T.Parallel(C, V):
                    dv_out[bos + r, hv, d] = T.cast(dBu_f[r, d] * b_s[r], dtype)
            else:
                for r, d in T.Parallel(C, V):
                    if bos + r < eos:
                        dv_out[bos + r, hv, d] = T.cast(dBu_f[r, d] * b_s[r], dtype)
            for r, d in T.Parallel(C, V):
                dBu_f[r, d] = dBu_f[r, d] * T.cast(v_s[r, d], acc)
            T.reduce_sum(dBu_f, red_f, dim=1)
            for r in T.Parallel(C):
                bv_s[r] = red_f[r]

            T.gemm(Xb_s, dw_s, dBw_f, transpose_A=True, clear_accum=True)
            for r, d in T.Parallel(C, K):
                dBu_f[r, d] = dBw_f[r, d] * T.cast(k_s[r, d], acc)
            T.reduce_sum(dBu_f, red_f, dim=1)
            for r in T.Parallel(C):
                bk_s[r] = red_f[r] * T.exp(G_s[r]) * nk_s[r]

            # dk
            for r, d in T.Parallel(C, K):
                dBw_f[r, d] = dBw_f[r, d] * (b_s[r] * T.exp(G_s[r])) + dkp[c, hv, r, d]
            T.gemm(Ws_s, k_s, dBw_f)
            if l2norm:
                for r, d in T.Parallel(C, K):
                    dBu_f[r, d] = dBw_f[r, d] * T.cast(k_s[r, d], acc)
                T.reduce_sum(dBu_f, red_f, dim=1)
                for r in T.Parallel(C):
                    kd_s[r] = red_f[r] * nk_s[r] * nk_s[r]
                for r, d in T.Parallel(C, K):
                    dBw_f[r, d] = nk_s[r] * (dBw_f[r, d] - kd_s[r] * T.cast(k_s[r, d], acc))
            grad_rows(dk_out, dBw_f, bos, eos, hv, 0, pend)

            # dbeta, dg
            for r in T.Parallel(C):
                dG_s[r] = dG_s[r] + b_s[r] * bk_s[r] + b_s[r] * bA_s[r] - cA_s[r]
                if bos + r < eos:
                    db_out[bos + r, hv] = T.cast(bk_s[r] + bv_s[r] + bA_s[r], beta_dtype)
            T.cumsum(dG_s, dim=0, reverse=True)
            for r in T.Parallel(C):
                if bos + r < eos:
                    dg_out[bos + r, hv] = dG_s[r]

    return gdn_bwd_wy_v2
