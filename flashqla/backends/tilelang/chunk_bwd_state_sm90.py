"""Backward stage 1 (Hopper): the reverse state-gradient recurrence.

Grid: ``(V / BV, Hv, N)``; CTA ``(bv, h, n)`` owns columns ``bv*BV ..`` of ``dS`` (the gradient of the
state) of value head ``h`` of sequence ``n`` and walks its chunks from last to first (``T.Pipelined``
over a device-side trip count, chunk ``c0 + nchunks - 1 - i`` at step ``i``).  128 compute threads
(one warpgroup) plus TileLang's TMA producer warpgroup streaming q, k, w, G and the dO tile.

``dS`` starts as ``dht`` (or 0).  Per chunk, with ``dS`` the gradient w.r.t. the state *after* the
chunk and ``dSb`` its 16-bit copy (stored: stage 2 needs it)::

    Pt    = scale * (k q^T) * nk_j nq_r exp(G_r - G_j)     (j <= r, r < eos; else 0) = scale * P^T
    dv_new= Pt dO + diag(nk exp(G_last - G)) (k dSb)       rows past the end forced to 0 (stored)
    dS    = exp(G_last) dS + q^T diag(scale nq exp(G)) dO - w^T dv_new

and after the first chunk ``dh0 = dS``.  dO rows past the sequence end (the next sequence's rows,
or TMA zero fill) only meet zeroed ``Pt`` columns and zeroed scaled-dO rows.  Only differences
``G_r - G_j``, ``G_last - G_r`` (<= 0) and ``G_r`` are exponentiated (finite for g = -1e4).

Shared memory (K = V = 128, BV = 64): per stage q, k, w 16 KB, dO 8 KB, G 256 B (two stages ~113 KB);
dSb 16 KB, Pt, dv_new, -dv_new, scaled dO 8 KB each: ~161 KB.  Registers: dS 64, two [64, BV]
accumulators 32 each, Pt 32.
"""

CHUNK = 64
L2_EPS = 1e-6


def build_bwd_state(dtype: str, K: int, V: int, BV: int, l2norm: bool, has_dht: bool, need_dh0: bool,
                    num_stages: int = 2, threads: int = 128):
    import tilelang.language as T

    from ._common import make_l2_row_factors, symbolic_sizes

    C = CHUNK
    acc = "float32"
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    DTN, DTH = (NS, Hv) if has_dht else T.dynamic("DTN, DTH")
    D0N, D0H = (NS, Hv) if need_dh0 else T.dynamic("D0N, D0H")
    assert V % BV == 0
    l2_row_factors = make_l2_row_factors(C, K, acc, L2_EPS)

    @T.prim_func
    def gdn_bwd_state(
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
        with T.Kernel(V // BV, Hv, NS, threads=threads) as (bv, h, n):
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            w_s = T.alloc_shared((C, K), dtype)
            do_s = T.alloc_shared((C, BV), dtype)
            G_s = T.alloc_shared((C,), acc)
            dS_f = T.alloc_fragment((K, BV), acc)
            dS_s = T.alloc_shared((K, BV), dtype)
            Pt_f = T.alloc_fragment((C, C), acc)
            Pt_s = T.alloc_shared((C, C), dtype)
            a1_f = T.alloc_fragment((C, BV), acc)
            a2_f = T.alloc_fragment((C, BV), acc)
            dvn_s = T.alloc_shared((C, BV), dtype)
            ndvn_s = T.alloc_shared((C, BV), dtype)
            dos_s = T.alloc_shared((C, BV), dtype)
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

            if has_dht:
                T.copy(dht[n, h, :, v0:v0 + BV], dS_f)
            else:
                T.clear(dS_f)

            for i in T.Pipelined(nchunks, num_stages=num_stages):
                ci = nchunks - 1 - i
                bos = bos0 + ci * C
                T.copy(q[bos:bos + C, hq, :], q_s)
                T.copy(k[bos:bos + C, hq, :], k_s)
                T.copy(w[c0 + ci, h, :, :], w_s)
                T.copy(do[bos:bos + C, h, v0:v0 + BV], do_s)
                T.copy(G[c0 + ci, h, :], G_s)

                T.copy(dS_f, dS_s)
                T.copy(dS_s, dh_out[c0 + ci, h, :, v0:v0 + BV])

                if l2norm:
                    l2_row_factors(q_s, nq_s, sq_f, ss_f)
                    l2_row_factors(k_s, nk_s, sq_f, ss_f)
                else:
                    for r in T.Parallel(C):
                        nq_s[r] = 1.0
                        nk_s[r] = 1.0

                T.gemm(k_s, q_s, Pt_f, transpose_B=True, clear_accum=True)
                # Pt[j, r]: key row j, query row r
                for j, r in T.Parallel(C, C):
                    Pt_s[j, r] = T.if_then_else(
                        (j <= r) & (bos + r < eos),
                        Pt_f[j, r] * scale * nk_s[j] * nq_s[r] * T.exp(G_s[r] - G_s[j]), 0.0)
                T.gemm(k_s, dS_s, a1_f, clear_accum=True)
                T.gemm(Pt_s, do_s, a2_f, clear_accum=True)
                for r, j in T.Parallel(C, BV):
                    a2_f[r, j] = T.if_then_else(
                        bos + r < eos, a2_f[r, j] + a1_f[r, j] * nk_s[r] * T.exp(G_s[C - 1] - G_s[r]), 0.0)
                T.copy(a2_f, dvn_s)
                T.copy(dvn_s, dvn_out[c0 + ci, h, :, v0:v0 + BV])
                for r, j in T.Parallel(C, BV):
                    ndvn_s[r, j] = -a2_f[r, j]
                for r, j in T.Parallel(C, BV):
                    dos_s[r, j] = T.if_then_else(
                        bos + r < eos, T.cast(do_s[r, j], acc) * (scale * nq_s[r] * T.exp(G_s[r])), 0.0)

                for a, b in T.Parallel(K, BV):
                    dS_f[a, b] = dS_f[a, b] * T.exp(G_s[C - 1])
                T.gemm(q_s, dos_s, dS_f, transpose_A=True)
                T.gemm(w_s, ndvn_s, dS_f, transpose_A=True)

            if need_dh0:
                T.copy(dS_f, dh0[n, h, :, v0:v0 + BV])

    return gdn_bwd_state
