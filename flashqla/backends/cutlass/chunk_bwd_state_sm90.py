"""Backward state recurrence (SM90, CuTe DSL): the state gradient, serial over chunks in reverse.

With ``dH = dS^T`` ([V, K], the transposed gradient of the state at the END of the current chunk), per
chunk walked backwards::

    dvn^T = dO^T P + (dH k^T) diag(d)          [Vb, 64]  A = dO^T (ldmatrix.trans)  B = P = Aqk (MN-major)
                                                         A = dH (regs)             B = k (K-major)
    dH   <- Gamma_C dH + (dO diag(scale*Gamma))^T q + dvn^T (-w)
                                               [Vb, K]   A = scaled dO^T (regs)    B = q  (MN-major)
                                                         A = dvn (regs)            B = -w (MN-major)

``d_s = exp(G_C - G_s)``.  Before the update, the kernel stores the bf16 ``dH`` it used (as ``dS'`` in
the [K, V] layout) and the bf16 ``dvn`` ([64, V]): the per-chunk gradient kernels read them.  After
the first chunk it writes ``dh0`` (fp32).

Grid ``(num_seqs * V / Vb, Hv)`` (the V blocks of a sequence adjacent), ``Vb = 64 * num_wg``; ``num_wg``
consumer warpgroups plus a producer warp (warpgroup when num_wg = 2) that TMA-loads q, k, -w (64 x 128), dO (64
x Vb), Aqk (64 x 64) and G into a two-stage mbarrier pipeline. Rows past the sequence end (another sequence's
tokens) are zeroed in shared memory for q, k and dO before use.

Layouts: q, k [T, Hqk, K]; do [T, Hv, V] (bf16); -w [c, h, 64, K], Aqk [c, h, 64, 64] (bf16),
G [c, h, 64] (fp32); dht / dh0 [N, Hv, K, V] fp32; outputs dS' [c, h, K, V] and dvn [c, h, 64, V] (bf16).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from ._sm90 import (NUM_THREADS_PER_WG, acc_as_a_operand, convert_into, fence_operand, tma_load, token_tile,
                    wg_gemm, wide)

BT = 64


class ChunkBwdStateSm90:
    def __init__(self, K: int = 128, V: int = 128, num_wg: int = 1, stages: int = 2):
        assert K == 128 and V % (64 * num_wg) == 0
        self.K, self.V = K, V
        self.num_wg = num_wg
        self.vblk = 64 * num_wg
        self.nvb = V // self.vblk
        self.stages = stages
        self.n_consumer = NUM_THREADS_PER_WG * num_wg
        self.producer_warp = 4 * num_wg
        self.threads = self.n_consumer + (32 if num_wg == 1 else NUM_THREADS_PER_WG)
        self.regs_producer, self.regs_consumer = 40, 232
        self.pitch = self.vblk + 8

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, do_ptr: cute.Pointer,
                 w_ptr: cute.Pointer, a_ptr: cute.Pointer, g_ptr: cute.Pointer,
                 dht_ptr: cute.Pointer, dh0_ptr: cute.Pointer, dh_ptr: cute.Pointer, dvn_ptr: cute.Pointer,
                 cu_ptr: cute.Pointer, co_ptr: cute.Pointer,
                 total_tokens: cutlass.Int32, total_chunks: cutlass.Int32, num_seqs: cutlass.Int32,
                 hqk: cutlass.Int32, hv: cutlass.Int32, scale: cutlass.Float32,
                 use_dht: cutlass.Int32, store_dh0: cutlass.Int32, stream: cuda.CUstream):
        K, V, st = self.K, self.V, self.stages
        bf16 = cutlass.BFloat16
        mQ = cute.make_tensor(q_ptr, cute.make_layout((total_tokens, K, hqk), stride=(hqk * K, 1, K)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((total_tokens, K, hqk), stride=(hqk * K, 1, K)))
        mDO = cute.make_tensor(do_ptr, cute.make_layout((total_tokens, V, hv), stride=(hv * V, 1, V)))
        rows = total_chunks * hv
        mW = cute.make_tensor(w_ptr, cute.make_layout((rows * BT, K), stride=(K, 1)))
        mA = cute.make_tensor(a_ptr, cute.make_layout((rows * BT, BT), stride=(BT, 1)))
        mG = cute.make_tensor(g_ptr, cute.make_layout((rows * BT,), stride=(1,)))
        # tensors accessed with plain loads / stores get 64-bit outer strides (offsets past 2^31 elements)
        state_strides = (wide(hv * K * V, K * V), K * V, V, 1)
        mDht = cute.make_tensor(dht_ptr, cute.make_layout((num_seqs, hv, K, V), stride=state_strides))
        mDh0 = cute.make_tensor(dh0_ptr, cute.make_layout((num_seqs, hv, K, V), stride=state_strides))
        mDh = cute.make_tensor(dh_ptr, cute.make_layout((rows * K, V), stride=(wide(V, V), 1)))
        mDvn = cute.make_tensor(dvn_ptr, cute.make_layout((rows * BT, V), stride=(wide(V, V), 1)))
        mCu = cute.make_tensor(cu_ptr, cute.make_layout((num_seqs + 1,)))
        mCo = cute.make_tensor(co_ptr, cute.make_layout((num_seqs + 1,)))

        atom128 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16)
        l_qk = cute.tile_to_shape(atom128, (BT, K, st), order=(0, 1, 2))
        l_do = cute.tile_to_shape(atom128, (BT, self.vblk, st), order=(0, 1, 2))
        l_a = cute.tile_to_shape(atom128, (BT, BT, st), order=(0, 1, 2))
        l_g = cute.make_layout((BT, st))

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, mQ, cute.slice_(l_qk, (None, None, 0)), (BT, K))
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mK, cute.slice_(l_qk, (None, None, 0)), (BT, K))
        tma_w, tW = cpasync.make_tiled_tma_atom(g2s, mW, cute.slice_(l_qk, (None, None, 0)), (BT, K))
        tma_do, tDO = cpasync.make_tiled_tma_atom(g2s, mDO, cute.slice_(l_do, (None, None, 0)), (BT, self.vblk))
        tma_a, tA = cpasync.make_tiled_tma_atom(g2s, mA, cute.slice_(l_a, (None, None, 0)), (BT, BT))
        tma_g, tG = cpasync.make_tiled_tma_atom(g2s, mG, cute.slice_(l_g, (None, 0)), (BT,))
        self.tx_bytes = (3 * BT * K + BT * self.vblk + BT * BT) * 2 + BT * 4

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, st * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_qk)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_qk)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_qk)], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_do)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_a)], 1024]
            sG: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BT * st], 128]
            sSave: cute.struct.Align[cute.struct.MemRange[bf16, (K + BT) * self.pitch], 128]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        group = hv // hqk
        self.kernel(tma_q, tQ, tma_k, tK, tma_w, tW, tma_do, tDO, tma_a, tA, tma_g, tG,
                    mDht, mDh0, mDh, mDvn, mCu, mCo, hv, group, scale, use_dht, store_dh0,
                    l_qk, l_do, l_a, l_g).launch(
            grid=(num_seqs * self.nvb, hv, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, tQ: cute.Tensor, tma_k: cute.CopyAtom, tK: cute.Tensor,
               tma_w: cute.CopyAtom, tW: cute.Tensor, tma_do: cute.CopyAtom, tDO: cute.Tensor,
               tma_a: cute.CopyAtom, tA: cute.Tensor, tma_g: cute.CopyAtom, tG: cute.Tensor,
               mDht: cute.Tensor, mDh0: cute.Tensor, mDh: cute.Tensor, mDvn: cute.Tensor,
               mCu: cute.Tensor, mCo: cute.Tensor, hv: cutlass.Int32, group: cutlass.Int32,
               scale: cutlass.Float32, use_dht: cutlass.Int32, store_dh0: cutlass.Int32,
               l_qk: cute.ComposedLayout, l_do: cute.ComposedLayout, l_a: cute.ComposedLayout,
               l_g: cute.Layout):
        K = self.K
        vblk = self.vblk
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # the V blocks of a (sequence, head) are neighbours in launch order: they run together and read the
        # K-wide tiles (q, k, w, ...) through L2 once, where V-block-major order ran them a wave apart
        bx, head, _ = cute.arch.block_idx()
        seq = bx // self.nvb
        vb = bx % self.nvb

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(l_qk.outer, swizzle=l_qk.inner)
        sK = storage.sK.get_tensor(l_qk.outer, swizzle=l_qk.inner)
        sW = storage.sW.get_tensor(l_qk.outer, swizzle=l_qk.inner)
        sDO = storage.sDO.get_tensor(l_do.outer, swizzle=l_do.inner)
        sA = storage.sA.get_tensor(l_a.outer, swizzle=l_a.inner)
        # (feature, token) views of the same tiles: MN-major B operands / transposed A loads
        sQ_mn = storage.sQ.get_tensor(cute.select(l_qk, mode=[1, 0, 2]).outer, swizzle=l_qk.inner)
        sW_mn = storage.sW.get_tensor(cute.select(l_qk, mode=[1, 0, 2]).outer, swizzle=l_qk.inner)
        sDO_mn = storage.sDO.get_tensor(cute.select(l_do, mode=[1, 0, 2]).outer, swizzle=l_do.inner)
        sA_mn = storage.sA.get_tensor(cute.select(l_a, mode=[1, 0, 2]).outer, swizzle=l_a.inner)
        # un-swizzled aliases for zeroing whole token rows (a row is whole 128-byte swizzle lines)
        sQ_raw = cute.make_tensor(storage.sQ.data_ptr(), l_qk.outer)
        sK_raw = cute.make_tensor(storage.sK.data_ptr(), l_qk.outer)
        sDO_raw = cute.make_tensor(storage.sDO.data_ptr(), l_do.outer)
        sG = storage.sG.get_tensor(l_g)
        sSave = storage.sSave.get_tensor(cute.make_layout((K + BT, vblk), stride=(self.pitch, 1)))
        sSaveS_c = storage.sSave.get_tensor(cute.make_layout((vblk, K), stride=(1, self.pitch)))
        sSaveV_c = cute.make_tensor(storage.sSave.data_ptr() + K * self.pitch,
                                    cute.make_layout((vblk, BT), stride=(1, self.pitch)))

        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_wg),
            tx_count=self.tx_bytes)

        bos = mCu[seq]
        eos = mCu[seq + 1]
        c0 = mCo[seq]
        nchunks = mCo[seq + 1] - c0
        qk_head = head // group
        v0 = vb * vblk

        if warp_idx >= self.producer_warp:
            if cutlass.const_expr(self.num_wg > 1):
                cute.arch.warpgroup_reg_dealloc(self.regs_producer)
        if warp_idx == self.producer_warp:
            for atom in (tma_q, tma_k, tma_w, tma_do, tma_a, tma_g):
                cpasync.prefetch_descriptor(atom)
            pstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for it in cutlass.range(nchunks, unroll=1):
                c = nchunks - 1 - it
                tok = bos + c * BT
                row = (c0 + c) * hv + head
                pipe.producer_acquire(pstate)
                bar = pipe.producer_get_barrier(pstate)
                s = pstate.index
                gq = token_tile(tQ, qk_head, tok, 0, BT, K)
                gk = token_tile(tK, qk_head, tok, 0, BT, K)
                gdo = token_tile(tDO, head, tok, v0, BT, vblk)
                gw = cute.local_tile(tW, (BT, K), (row, 0))
                ga = cute.local_tile(tA, (BT, BT), (row, 0))
                gg = cute.local_tile(tG, (BT,), (row,))
                for atom, s_t, g_t in ((tma_q, sQ, gq), (tma_k, sK, gk), (tma_w, sW, gw),
                                       (tma_do, sDO, gdo), (tma_a, sA, ga)):
                    tma_load(atom, s_t[None, None, s], g_t, bar)
                tma_load(tma_g, sG[None, s], gg, bar, rank=1)
                pipe.producer_commit(pstate)
                pstate.advance()
        elif warp_idx < self.producer_warp:
            if cutlass.const_expr(self.num_wg > 1):
                cute.arch.warpgroup_reg_alloc(self.regs_consumer)
            K_ = warpgroup.OperandMajorMode.K
            MN_ = warpgroup.OperandMajorMode.MN
            RM = warpgroup.OperandSource.RMEM
            mma_kb = sm90_utils.make_trivial_tiled_mma(bf16, bf16, K_, K_, f32, (self.num_wg, 1, 1), (64, BT), RM)
            mma_mb = sm90_utils.make_trivial_tiled_mma(bf16, bf16, K_, MN_, f32, (self.num_wg, 1, 1), (64, BT), RM)
            mma_h = sm90_utils.make_trivial_tiled_mma(bf16, bf16, K_, MN_, f32, (self.num_wg, 1, 1), (64, K), RM)
            thr_kb = mma_kb.get_slice(tidx)
            thr_mb = mma_mb.get_slice(tidx)
            thr_h = mma_h.get_slice(tidx)
            tKs = thr_kb.make_fragment_B(thr_kb.partition_B(sK))          # (N=token, K=feature)
            tAs = thr_mb.make_fragment_B(thr_mb.partition_B(sA_mn))       # (N=s, K=t)
            tQs = thr_h.make_fragment_B(thr_h.partition_B(sQ_mn))         # (N=feature, K=token)
            tWs = thr_h.make_fragment_B(thr_h.partition_B(sW_mn))

            # dO^T as a register A operand: transposed ldmatrix of the (v, token) view
            ldsm_t = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), bf16)
            do_copy = cute.make_tiled_copy_A(ldsm_t, mma_mb)
            do_thr = do_copy.get_slice(tidx)
            tDOs = do_thr.partition_S(sDO_mn)
            a_do = cute.make_rmem_tensor(thr_mb.partition_shape_A((vblk, BT)), bf16)
            a_do_cv = do_thr.retile(a_do)
            a_dos = cute.make_rmem_tensor(thr_mb.partition_shape_A((vblk, BT)), bf16)
            cAdo = thr_mb.partition_A(cute.make_identity_tensor((vblk, BT)))

            acc_h = thr_h.make_fragment_C(thr_h.partition_shape_C((vblk, K)))
            cH = thr_h.partition_C(cute.make_identity_tensor((vblk, K)))
            acc_h.fill(0.0)
            if use_dht != 0:
                for i in cutlass.range_constexpr(cute.size(acc_h)):
                    vv, kk = cH[i]
                    acc_h[i] = mDht[seq, head, kk, v0 + vv]
            # (the two wgmma fences, after dht's load and before dh0's store, order those register accesses for
            # ptxas: without them it inserted the fence itself on a divergent path and, at one consumer warpgroup,
            # serialised all 20 wgmma; C7520, session 24)
            warpgroup.fence()
            h_op = acc_as_a_operand(acc_h, mma_kb, bf16)

            acc1 = thr_mb.make_fragment_C(thr_mb.partition_shape_C((vblk, BT)))
            acc2 = thr_kb.make_fragment_C(thr_kb.partition_shape_C((vblk, BT)))
            cV = thr_kb.partition_C(cute.make_identity_tensor((vblk, BT)))
            tSaveS = thr_h.partition_C(sSaveS_c)
            tSaveV = thr_kb.partition_C(sSaveV_c)

            vec = 8
            cols = vblk // vec
            copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), bf16, num_bits_per_copy=128)
            tiled_copy = cute.make_tiled_copy_tv(
                copy_atom, cute.make_layout((self.n_consumer // cols, cols), stride=(cols, 1)),
                cute.make_layout((1, vec)))
            thr_copy = tiled_copy.get_slice(tidx)
            tSaveSrc = thr_copy.partition_S(sSave)

            cstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            for it in cutlass.range(nchunks, unroll=1):
                c = nchunks - 1 - it
                tok = bos + c * BT
                row = (c0 + c) * hv + head
                valid = cutlass.min(eos - tok, BT)
                pipe.consumer_wait(cstate)
                s = cstate.index
                if valid < BT:
                    for idx in cutlass.range((BT - valid) * K // self.n_consumer + 1, unroll=1):
                        e = idx * self.n_consumer + tidx
                        r = valid + e // K
                        if r < BT:
                            sQ_raw[r, e % K, s] = bf16(0.0)
                            sK_raw[r, e % K, s] = bf16(0.0)
                    for idx in cutlass.range((BT - valid) * vblk // self.n_consumer + 1, unroll=1):
                        e = idx * self.n_consumer + tidx
                        r = valid + e // vblk
                        if r < BT:
                            sDO_raw[r, e % vblk, s] = bf16(0.0)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=1, number_of_threads=self.n_consumer)

                cute.copy(do_copy, tDOs[None, None, None, s], a_do_cv)
                fence_operand(a_do)
                fence_operand(h_op)
                warpgroup.fence()
                wg_gemm(mma_mb, acc1, a_do, tAs[None, None, None, s], True)
                wg_gemm(mma_kb, acc2, h_op, tKs[None, None, None, s], True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                fence_operand(acc1)
                fence_operand(acc2)

                g_last = sG[BT - 1, s]
                for i in cutlass.range_constexpr(cute.size(acc2)):
                    gn = sG[cV[i][1], s]
                    acc2[i] = acc1[i] + acc2[i] * cute.math.exp(g_last - gn, fastmath=True)
                # store the bf16 dS' this chunk used and the bf16 dvn
                for i in cutlass.range_constexpr(cute.size(acc_h)):
                    tSaveS[i] = bf16(acc_h[i])
                for i in cutlass.range_constexpr(cute.size(acc2)):
                    tSaveV[i] = bf16(acc2[i])
                cute.arch.barrier(barrier_id=1, number_of_threads=self.n_consumer)
                tSd = thr_copy.partition_D(cute.local_tile(mDh, (K, vblk), (row, vb)))
                tVd = thr_copy.partition_D(cute.local_tile(mDvn, (BT, vblk), (row, vb)))
                nS = cute.size(tSd, mode=[1])
                for m in cutlass.range_constexpr(nS):
                    cute.copy(copy_atom, tSaveSrc[None, m, None], tSd[None, m, None])
                for m in cutlass.range_constexpr(cute.size(tVd, mode=[1])):
                    cute.copy(copy_atom, tSaveSrc[None, nS + m, None], tVd[None, m, None])

                dvn_op = acc_as_a_operand(acc2, mma_h, bf16)
                for i in cutlass.range_constexpr(cute.size(a_dos)):
                    tt = cAdo[i][1]
                    a_dos[i] = bf16(f32(a_do[i]) * (scale * cute.math.exp(sG[tt, s], fastmath=True)))
                decay = cute.math.exp(g_last, fastmath=True)
                for i in cutlass.range_constexpr(cute.size(acc_h)):
                    acc_h[i] = acc_h[i] * decay
                fence_operand(a_dos)
                fence_operand(dvn_op)
                fence_operand(acc_h)
                warpgroup.fence()
                wg_gemm(mma_h, acc_h, a_dos, tQs[None, None, None, s], False)
                wg_gemm(mma_h, acc_h, dvn_op, tWs[None, None, None, s], False)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                fence_operand(acc_h)
                pipe.consumer_release(cstate)
                cstate.advance()
                convert_into(h_op, acc_h)
                # the save staging is rewritten next chunk: everyone must be done reading it
                cute.arch.barrier(barrier_id=1, number_of_threads=self.n_consumer)

            warpgroup.fence()
            if store_dh0 != 0:
                for i in cutlass.range_constexpr(cute.size(acc_h)):
                    vv, kk = cH[i]
                    mDh0[seq, head, kk, v0 + vv] = acc_h[i]
