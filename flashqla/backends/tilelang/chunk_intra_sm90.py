"""Forward stage 1 (Hopper): everything that is local to one 64-token chunk.

Grid: ``(total_chunks, Hv)``, 128 threads (one warpgroup), no loop.  CTA ``(c, h)`` takes chunk ``c``
(``chunk_indices[c] = (sequence n, chunk i of n)``, rows ``bos = cu[n] + 64 i`` .. ``min(bos + 64,
cu[n+1])``) of value head ``h``; its query/key head is ``h // ratio`` (GVA, indexed in the kernel).

Per CTA, with rows past the sequence end treated as ``g = beta = 0`` (they then drop out exactly):

1. TMA loads of the k tile ``[64, K]`` and the v tile ``[64, V]``; g and beta (any float dtype) go to
   shared memory as fp32 through predicated loads.
2. ``G = cumsum(g)`` (fp32, in shared memory).
3. ``KK = k k^T`` (wgmma, fp32 accumulators).  With the fused L2 norm the row factors
   ``n_r = rsqrt(|k_r|^2 + 1e-6)`` come from KK's diagonal, and are applied to fp32 products only, so
   the normalised k is never rounded to 16 bits.
4. ``A[r, j] = beta_r n_r n_j KK[r, j] exp(G_r - G_j)`` for ``j < r`` (only differences of G are
   exponentiated: finite for any decay, also ``g = -1e4``), stored transposed in shared memory.
5. ``X = (I + A)^-1`` by forward substitution in fp32 registers: thread ``j < 64`` owns column ``j``
   and runs the right-looking update ``x_r -= A[r, m] x_m`` (independent FMAs for every r > m; the
   A column is a broadcast read).
6. ``w = (X diag(beta exp(G) n)) k`` and ``u = (X diag(beta)) v``: the column scalings are folded into
   two 16-bit copies of X, so k and v enter the wgmma unmodified (one rounding fewer than scaling k
   and v).

Outputs, chunk-major so that stage 2 reads whole tiles with TMA and the padded tail rows of a last
chunk are well defined (zero in w and u, ``G = G_last`` in G): ``w [NC, Hv, 64, K]``, ``u [NC, Hv, 64,
V]`` in the input dtype, ``G [NC, Hv, 64]`` fp32 and, when the backward needs it, ``X [NC, Hv, 64,
64]`` fp32.

Shared memory (bf16/fp16, K = V = 128): k 16 KB, v 16 KB, A^T 16 KB (fp32), two X copies 8 KB each,
w/u staging 16 KB each, small vectors; TileLang reuses dead buffers, ~100 KB, two CTAs per SM.
"""


CHUNK = 64
L2_EPS = 1e-6


def build_intra(dtype: str, beta_dtype: str, K: int, V: int, l2norm: bool, save_x: bool,
                threads: int = 128):
    import tilelang.language as T

    from ._common import symbolic_sizes

    C = CHUNK
    acc = "float32"
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    # The X output is only written when the backward needs it; otherwise a tiny placeholder is
    # passed, with its own symbolic sizes.
    XN = NC if save_x else T.dynamic("XN")
    XH = Hv if save_x else T.dynamic("XH")

    @T.prim_func
    def gdn_fwd_intra(
        k: T.Tensor((NT, Hqk, K), dtype),
        v: T.Tensor((NT, Hv, V), dtype),
        g: T.Tensor((NT, Hv), acc),
        beta: T.Tensor((NT, Hv), beta_dtype),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        w_out: T.Tensor((NC, Hv, C, K), dtype),
        u_out: T.Tensor((NC, Hv, C, V), dtype),
        G_out: T.Tensor((NC, Hv, C), acc),
        X_out: T.Tensor((XN, XH, C, C), acc),
        ratio: T.int32,
    ):
        with T.Kernel(NC, Hv, threads=threads) as (c, h):
            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, V), dtype)
            g_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            n_s = T.alloc_shared((C,), acc)
            At_s = T.alloc_shared((C, C), acc)
            Xw_s = T.alloc_shared((C, C), dtype)
            Xu_s = T.alloc_shared((C, C), dtype)
            w_s = T.alloc_shared((C, K), dtype)
            u_s = T.alloc_shared((C, V), dtype)
            kk_f = T.alloc_fragment((C, C), acc)
            w_f = T.alloc_fragment((C, K), acc)
            u_f = T.alloc_fragment((C, V), acc)
            bar = T.alloc_barrier(threads)

            seq = chunk_indices[c, 0]
            bos = cu_seqlens[seq] + chunk_indices[c, 1] * C
            eos = cu_seqlens[seq + 1]
            hq = h // ratio

            # Both TMA loads in flight at once (one mbarrier, every thread arrives once), overlapped
            # with the small gate / beta loads and the cumsum.
            T.tma_copy(k[bos:bos + C, hq, :], k_s, barrier=bar)
            T.tma_copy(v[bos:bos + C, h, :], v_s, barrier=bar)
            T.mbarrier_arrive(bar)
            for r in T.Parallel(C):
                g_s[r] = T.if_then_else(bos + r < eos, g[bos + r, h], 0.0)
                b_s[r] = T.if_then_else(bos + r < eos, T.cast(beta[bos + r, h], acc), 0.0)
            T.cumsum(g_s, dim=0)
            T.mbarrier_wait_parity(bar, 0)

            T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
            if l2norm:
                for r, j in T.Parallel(C, C):
                    if r == j:
                        n_s[r] = T.rsqrt(kk_f[r, j] + L2_EPS)
                for r, j in T.Parallel(C, C):
                    At_s[j, r] = T.if_then_else(
                        r > j, kk_f[r, j] * b_s[r] * n_s[r] * n_s[j] * T.exp(g_s[r] - g_s[j]), 0.0)
            else:
                for r in T.Parallel(C):
                    n_s[r] = 1.0
                for r, j in T.Parallel(C, C):
                    At_s[j, r] = T.if_then_else(r > j, kk_f[r, j] * b_s[r] * T.exp(g_s[r] - g_s[j]), 0.0)

            tx = T.get_thread_binding()
            if tx < C:
                x = T.alloc_local((C,), acc)
                for m in T.unroll(C):
                    x[m] = T.if_then_else(m == tx, 1.0, 0.0)
                for m in T.unroll(C):
                    for r in T.unroll(m + 1, C):
                        x[r] = x[r] - At_s[m, r] * x[m]
                cw = b_s[tx] * T.exp(g_s[tx]) * n_s[tx]
                cb = b_s[tx]
                for r in T.unroll(C):
                    Xw_s[r, tx] = T.cast(x[r] * cw, dtype)
                    Xu_s[r, tx] = T.cast(x[r] * cb, dtype)
                if save_x:
                    for r in T.unroll(C):
                        X_out[c, h, r, tx] = x[r]

            T.gemm(Xw_s, k_s, w_f, clear_accum=True)
            T.gemm(Xu_s, v_s, u_f, clear_accum=True)
            T.copy(w_f, w_s)
            T.copy(u_f, u_s)
            T.copy(w_s, w_out[c, h, :, :])
            T.copy(u_s, u_out[c, h, :, :])
            T.copy(g_s, G_out[c, h, :])

    return gdn_fwd_intra
