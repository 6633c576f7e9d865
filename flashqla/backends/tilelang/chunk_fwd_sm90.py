"""Forward stage 2 (Hopper): the state recurrence with the chunk output fused in.

Grid: ``(V / BV, Hv, N)``; CTA ``(bv, h, n)`` owns columns ``bv*BV ..`` of the state of value head ``h``
of sequence ``n`` and walks that sequence's chunks in order (a ``T.Pipelined`` loop whose trip count,
``chunk_offsets[n+1] - chunk_offsets[n]``, is read on the device: no host sync, and a length-0
sequence runs no iteration and writes ``ht = h0``).  128 compute threads (one warpgroup: every wgmma is
M = 64) plus the producer warpgroup TileLang adds for warp specialisation: it streams q, k (rows
``bos .. bos+64`` of the packed tensors, query/key head ``h // ratio``), w, u and G (whole chunk-major
tiles written by stage 1) into a 2-stage ring of shared buffers with TMA, while the consumer computes.

Per chunk, with the state ``S`` ([K, BV], fp32 accumulators in registers) and ``Sb`` its 16-bit copy in
shared memory (the wgmma operand; also the saved chunk state when the backward needs it)::

    v_new = u - w Sb                               rows past the sequence end forced to 0
    P     = (q k^T) * nq_r nk_j exp(G_r - G_j)     for j <= r, else 0 (16-bit)
    o     = scale * (diag(nq exp(G)) (q Sb) + P v_new)            stored only for rows < eos
    S     = exp(G_last) S + k^T diag(nk exp(G_last - G)) v_new

``nq``, ``nk`` are the fused-L2-norm row factors (1 without the option): they multiply fp32 values
only, so normalised q/k are never rounded.  Only differences ``G_last - G_r``, ``G_r - G_j`` (<= 0)
and ``G_r`` itself are exponentiated, so strong decay (g = -1e4) underflows to 0 and never overflows.
Rows past the end of a sequence read the next sequence's q/k (finite) or TMA zero fill, and see
``w = u = 0`` and ``G = G_last`` from stage 1: their ``v_new`` is masked to 0, so they add nothing.

Shared memory (K = V = 128, BV = 64, 16-bit inputs): per stage q, k, w 16 KB each, u 8 KB, G 256 B,
two stages ~113 KB; Sb 16 KB, P, v_new, scaled v_new, o staging 8 KB each: ~161 KB, one CTA per SM.
Registers: S 64, v_new / P / o accumulators 32 each per thread.
"""

CHUNK = 64
L2_EPS = 1e-6


def build_fwd(dtype: str, K: int, V: int, BV: int, l2norm: bool, has_h0: bool, store_ht: bool,
              save_states: bool, num_stages: int = 2, threads: int = 128):
    import tilelang.language as T

    from ._common import make_l2_row_factors, symbolic_sizes

    C = CHUNK
    acc = "float32"
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    # Tensors a variant does not use are tiny placeholders with their own symbolic sizes.
    H0N, H0H = (NS, Hv) if has_h0 else T.dynamic("H0N, H0H")
    HTN, HTH = (NS, Hv) if store_ht else T.dynamic("HTN, HTH")
    SVN, SVH = (NC, Hv) if save_states else T.dynamic("SVN, SVH")
    assert V % BV == 0
    l2_row_factors = make_l2_row_factors(C, K, acc, L2_EPS)

    @T.prim_func
    def gdn_fwd_recurrent(
        q: T.Tensor((NT, Hqk, K), dtype),
        k: T.Tensor((NT, Hqk, K), dtype),
        w: T.Tensor((NC, Hv, C, K), dtype),
        u: T.Tensor((NC, Hv, C, V), dtype),
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
    ):
        with T.Kernel(V // BV, Hv, NS, threads=threads) as (bv, h, n):
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            w_s = T.alloc_shared((C, K), dtype)
            u_s = T.alloc_shared((C, BV), dtype)
            G_s = T.alloc_shared((C,), acc)
            S_f = T.alloc_fragment((K, BV), acc)
            S_s = T.alloc_shared((K, BV), dtype)
            vn_f = T.alloc_fragment((C, BV), acc)
            vn_s = T.alloc_shared((C, BV), dtype)
            vd_s = T.alloc_shared((C, BV), dtype)
            P_f = T.alloc_fragment((C, C), acc)
            P_s = T.alloc_shared((C, C), dtype)
            o_f = T.alloc_fragment((C, BV), acc)
            o_s = T.alloc_shared((C, BV), dtype)
            nq_s = T.alloc_shared((C,), acc)
            nk_s = T.alloc_shared((C,), acc)
            sq_f = T.alloc_fragment((C, K), acc)
            ss_f = T.alloc_fragment((C,), acc)

            hq = h // ratio
            bos0 = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            c0 = chunk_offsets[n]
            nchunks = chunk_offsets[n + 1] - c0
            v0 = bv * BV

            if has_h0:
                T.copy(h0[n, h, :, v0:v0 + BV], S_f)
            else:
                T.clear(S_f)

            for i in T.Pipelined(nchunks, num_stages=num_stages):
                bos = bos0 + i * C
                T.copy(q[bos:bos + C, hq, :], q_s)
                T.copy(k[bos:bos + C, hq, :], k_s)
                T.copy(w[c0 + i, h, :, :], w_s)
                T.copy(u[c0 + i, h, :, v0:v0 + BV], u_s)
                T.copy(G[c0 + i, h, :], G_s)

                T.copy(S_f, S_s)
                if save_states:
                    T.copy(S_s, h_out[c0 + i, h, :, v0:v0 + BV])
                T.gemm(w_s, S_s, vn_f, clear_accum=True)

                if l2norm:
                    l2_row_factors(q_s, nq_s, sq_f, ss_f)
                    l2_row_factors(k_s, nk_s, sq_f, ss_f)

                for r, j in T.Parallel(C, BV):
                    vn_f[r, j] = T.if_then_else(bos + r < eos, T.cast(u_s[r, j], acc) - vn_f[r, j], 0.0)
                T.copy(vn_f, vn_s)
                if save_states:
                    T.copy(vn_s, vn_out[c0 + i, h, :, v0:v0 + BV])
                if l2norm:
                    for r, j in T.Parallel(C, BV):
                        vd_s[r, j] = vn_f[r, j] * nk_s[r] * T.exp(G_s[C - 1] - G_s[r])
                else:
                    for r, j in T.Parallel(C, BV):
                        vd_s[r, j] = vn_f[r, j] * T.exp(G_s[C - 1] - G_s[r])

                T.gemm(q_s, k_s, P_f, transpose_B=True, clear_accum=True)
                if l2norm:
                    for r, j in T.Parallel(C, C):
                        P_s[r, j] = T.if_then_else(
                            j <= r, P_f[r, j] * nq_s[r] * nk_s[j] * T.exp(G_s[r] - G_s[j]), 0.0)
                else:
                    for r, j in T.Parallel(C, C):
                        P_s[r, j] = T.if_then_else(j <= r, P_f[r, j] * T.exp(G_s[r] - G_s[j]), 0.0)

                T.gemm(q_s, S_s, o_f, clear_accum=True)
                if l2norm:
                    for r, j in T.Parallel(C, BV):
                        o_f[r, j] = o_f[r, j] * nq_s[r] * T.exp(G_s[r])
                else:
                    for r, j in T.Parallel(C, BV):
                        o_f[r, j] = o_f[r, j] * T.exp(G_s[r])
                T.gemm(P_s, vn_s, o_f)
                for r, j in T.Parallel(C, BV):
                    o_s[r, j] = o_f[r, j] * scale
                for r, j in T.Parallel(C, BV):
                    if bos + r < eos:
                        o[bos + r, h, v0 + j] = o_s[r, j]

                for a, b in T.Parallel(K, BV):
                    S_f[a, b] = S_f[a, b] * T.exp(G_s[C - 1])
                T.gemm(k_s, vd_s, S_f, transpose_A=True)

            if store_ht:
                T.copy(S_f, ht[n, h, :, v0:v0 + BV])

    return gdn_fwd_recurrent
