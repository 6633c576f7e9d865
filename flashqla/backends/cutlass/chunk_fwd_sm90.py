"""Forward recurrence over chunks (SM90, CuTe DSL): state, v_new and the output, serial in the chunks.

Works in the transposed frame, ``H = S^T`` ([V, K] per value head), so that the state is the *M*
operand of every product and can stay in registers as the A operand of ``wgmma``::

    vn^T  = u^T + H (-w)^T                       [Vb, 64]  A = H (regs)   B = -w   (smem, K-major)
    o^T   = (H q^T) diag(scale*Gamma)            [Vb, 64]  A = H (regs)   B = q    (smem, K-major)
          + vn^T Aqk^T                                     A = vn (regs)  B = Aqk  (smem, K-major)
    H     = Gamma_C H + (vn diag(d))^T k         [Vb, K]   A = vn*d (regs) B = k   (smem, MN-major)

with ``d_s = exp(G_C - G_s)``; ``-w``, ``u^T``, ``Aqk`` (scale and decay folded in, causal) and the
chunk-local cumulative gate ``G`` come from the prep kernel (:mod:`.chunk_prep_sm90`), stored
chunk-major and zero-padded, so every TMA tile of them is whole.  q and k are TMA-loaded straight from
the inputs; rows past the end of a sequence (the next sequence's tokens) are harmless for q (they only
reach output rows that are never stored) and are zeroed in shared memory for k, so that a NaN in one
sequence can never reach another.

Grid: ``(num_seqs * V / Vb, Hv)`` with ``Vb = 64 * num_wg``, the V blocks of a sequence adjacent.  Block:
``num_wg`` consumer warpgroups (threads ``0 .. 128*num_wg-1``; warpgroup ``i`` owns value rows ``64i .. 64i+63``
of the state) plus one producer warp (TMA).  A ``stages``-deep ``PipelineTmaAsync`` (full/empty mbarriers) feeds the
per-chunk tiles.

Registers (consumer thread, num_wg=1): H 64 fp32 + H bf16 32 + vn 32 + o 32 + two vn operands 16 + 16.
Shared memory per stage: q, k, -w 16 KiB each (64x128 bf16, 128B swizzle), u^T Vb*64*2 B, Aqk 8 KiB,
G 256 B; plus an output staging tile 64 x (Vb+8) bf16.  num_wg=1, 2 stages: ~138 KiB.

Global layouts: q, k [T_total, Hqk, K]; o [T_total, Hv, V] (bf16); workspaces (chunk c = global
chunk index, h = value head): -w [c, h, 64, K], u^T [c, h, V, 64], Aqk [c, h, 64, 64] (bf16),
G [c, h, 64] (fp32); states h0/ht [N, Hv, K, V] fp32; cu_seqlens, chunk_offsets int32 [N+1].

``halo`` (in-kernel context parallelism, as the tilelang forward's: ``backends/tilelang/segments.py``): the grid's
first axis runs over chunk-aligned *segments* (``cu_seqlens`` / ``chunk_offsets`` are the segments' boundaries) and
each (segment, head) walk starts at global chunk ``walk[n, h]``, before its segment, from a zero state (from h0
when that is its sequence's first chunk).  The halo's chunks (``c < 0`` below, whole chunks of the same sequence)
run the whole step and store nothing.  ``seg[n] = (sequence, its first chunk, is-last, 0)``: h0 / ht stay per
sequence and only a sequence's last segment writes ht.  Off, the two pointers are placeholders.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from ._sm90 import (NUM_THREADS_PER_WG, acc_as_a_operand, convert_into, fence_operand, fwd_global_tensors,
                    load_walk_start, store_walk_end, tma_load, token_tile, wg_gemm)

BT = 64  # chunk size


class ChunkFwdSm90:
    def __init__(self, K: int = 128, V: int = 128, num_wg: int = 1, stages: int = 2, save: bool = False,
                 halo: bool = False):
        assert K == 128 and V % (64 * num_wg) == 0
        self.K, self.V = K, V
        self.num_wg = num_wg
        self.vblk = 64 * num_wg
        self.nvb = V // self.vblk
        self.stages = stages
        self.n_consumer = NUM_THREADS_PER_WG * num_wg
        self.producer_warp = 4 * num_wg
        # With two consumer warpgroups a lone producer warp would make 9 warps, i.e. 3 on one SM
        # sub-partition and a 168-register cap for everyone (the kernel spills).  Use a whole producer
        # warpgroup instead and move registers to the consumers with setmaxregister.
        self.threads = self.n_consumer + (32 if num_wg == 1 else NUM_THREADS_PER_WG)
        self.regs_producer, self.regs_consumer = 40, 232
        self.o_pitch = self.vblk + 8  # padded row pitch of the output staging tile (bank spread)
        # training forward: also store the bf16 state at each chunk start (S = H^T, [K, V] layout) and
        # the bf16 v_new ([64, V]) for the backward kernels, through one more staging tile
        self.save = save
        self.halo = halo

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, w_ptr: cute.Pointer,
                 u_ptr: cute.Pointer, a_ptr: cute.Pointer, g_ptr: cute.Pointer,
                 h0_ptr: cute.Pointer, ht_ptr: cute.Pointer, o_ptr: cute.Pointer,
                 s_ptr: cute.Pointer, vn_ptr: cute.Pointer,
                 cu_ptr: cute.Pointer, co_ptr: cute.Pointer, seg_ptr: cute.Pointer, walk_ptr: cute.Pointer,
                 total_tokens: cutlass.Int32, total_chunks: cutlass.Int32, num_seqs: cutlass.Int32,
                 hqk: cutlass.Int32, hv: cutlass.Int32, scale: cutlass.Float32,
                 use_h0: cutlass.Int32, store_ht: cutlass.Int32, stream: cuda.CUstream):
        K, V, st = self.K, self.V, self.stages
        bf16 = cutlass.BFloat16
        t = fwd_global_tensors(q_ptr, k_ptr, a_ptr, g_ptr, h0_ptr, ht_ptr, o_ptr, s_ptr, vn_ptr, cu_ptr, co_ptr,
                               seg_ptr, walk_ptr, total_tokens, total_chunks, num_seqs, hqk, hv, K, V, self.vblk, BT)
        mQ, mK, mA, mG = t["mQ"], t["mK"], t["mA"], t["mG"]
        mH0, mHt, mO, mS, mVn = t["mH0"], t["mHt"], t["mO"], t["mS"], t["mVn"]
        mCu, mCo, mSeg, mWalk = t["mCu"], t["mCo"], t["mSeg"], t["mWalk"]
        rows = total_chunks * hv
        mW = cute.make_tensor(w_ptr, cute.make_layout((rows * BT, K), stride=(K, 1)))
        mU = cute.make_tensor(u_ptr, cute.make_layout((rows * V, BT), stride=(BT, 1)))

        atom128 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16)
        l_qk = cute.tile_to_shape(atom128, (BT, K, st), order=(0, 1, 2))
        l_u = cute.tile_to_shape(atom128, (self.vblk, BT, st), order=(0, 1, 2))
        l_a = cute.tile_to_shape(atom128, (BT, BT, st), order=(0, 1, 2))
        l_g = cute.make_layout((BT, st))

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, mQ, cute.slice_(l_qk, (None, None, 0)), (BT, K))
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mK, cute.slice_(l_qk, (None, None, 0)), (BT, K))
        tma_w, tW = cpasync.make_tiled_tma_atom(g2s, mW, cute.slice_(l_qk, (None, None, 0)), (BT, K))
        tma_u, tU = cpasync.make_tiled_tma_atom(g2s, mU, cute.slice_(l_u, (None, None, 0)), (self.vblk, BT))
        tma_a, tA = cpasync.make_tiled_tma_atom(g2s, mA, cute.slice_(l_a, (None, None, 0)), (BT, BT))
        tma_g, tG = cpasync.make_tiled_tma_atom(g2s, mG, cute.slice_(l_g, (None, 0)), (BT,))

        self.tx_bytes = (3 * BT * K + self.vblk * BT + BT * BT) * 2 + BT * 4

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, st * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_qk)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_qk)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_qk)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_u)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_a)], 1024]
            sG: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BT * st], 128]
            sO: cute.struct.Align[cute.struct.MemRange[bf16, BT * self.o_pitch], 128]
            sSave: cute.struct.Align[cute.struct.MemRange[bf16, (K + BT) * self.o_pitch if self.save else 8], 128]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

        group = hv // hqk
        self.kernel(tma_q, tQ, tma_k, tK, tma_w, tW, tma_u, tU, tma_a, tA, tma_g, tG,
                    mH0, mHt, mO, mS, mVn, mCu, mCo, mSeg, mWalk, hv, group, scale, use_h0, store_ht,
                    l_qk, l_u, l_a, l_g).launch(
            grid=(num_seqs * self.nvb, hv, 1), block=(self.threads, 1, 1), stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, tQ: cute.Tensor, tma_k: cute.CopyAtom, tK: cute.Tensor,
               tma_w: cute.CopyAtom, tW: cute.Tensor, tma_u: cute.CopyAtom, tU: cute.Tensor,
               tma_a: cute.CopyAtom, tA: cute.Tensor, tma_g: cute.CopyAtom, tG: cute.Tensor,
               mH0: cute.Tensor, mHt: cute.Tensor, mO: cute.Tensor, mS: cute.Tensor, mVn: cute.Tensor,
               mCu: cute.Tensor, mCo: cute.Tensor, mSeg: cute.Tensor, mWalk: cute.Tensor,
               hv: cutlass.Int32, group: cutlass.Int32, scale: cutlass.Float32,
               use_h0: cutlass.Int32, store_ht: cutlass.Int32, l_qk: cute.ComposedLayout, l_u: cute.ComposedLayout, l_a: cute.ComposedLayout,
               l_g: cute.Layout):
        K, V = self.K, self.V
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
        # Un-swizzled alias of the same buffer.  The 128B swizzle only permutes 16-byte chunks inside one
        # 128-byte line, and a token row fills whole lines, so zeroing a full row through this alias
        # zeroes exactly that row of the swizzled tile.
        sK_raw = cute.make_tensor(storage.sK.data_ptr(), l_qk.outer)
        # the same k tile seen as (K, token): the MN-major B operand of the state update
        sK_mn = storage.sK.get_tensor(cute.select(l_qk, mode=[1, 0, 2]).outer, swizzle=l_qk.inner)
        sW = storage.sW.get_tensor(l_qk.outer, swizzle=l_qk.inner)
        sU = storage.sU.get_tensor(l_u.outer, swizzle=l_u.inner)
        sA = storage.sA.get_tensor(l_a.outer, swizzle=l_a.inner)
        sG = storage.sG.get_tensor(l_g)
        # output staging: row-major [token][v] with a padded pitch, seen as (v, token) for the C partition
        sO = storage.sO.get_tensor(cute.make_layout((BT, self.vblk), stride=(self.o_pitch, 1)))
        sO_t = storage.sO.get_tensor(cute.make_layout((self.vblk, BT), stride=(1, self.o_pitch)))
        # save staging: rows 0..K-1 hold S = H^T ([k][v]), rows K..K+63 hold v_new ([token][v])
        sSave = storage.sSave.get_tensor(cute.make_layout((K + BT, self.vblk), stride=(self.o_pitch, 1)))
        sSaveS_c = storage.sSave.get_tensor(cute.make_layout((self.vblk, K), stride=(1, self.o_pitch)))
        sSaveV_c = cute.make_tensor(storage.sSave.data_ptr() + K * self.o_pitch,
                                    cute.make_layout((self.vblk, BT), stride=(1, self.o_pitch)))

        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_wg),
            tx_count=self.tx_bytes)

        bos = mCu[seq]
        eos = mCu[seq + 1]
        c0 = mCo[seq]
        nchunks = mCo[seq + 1] - c0
        # the walk's chunks c = first .. nchunks - 1 of this segment (c < 0: the halo's, before it); the states
        # h0 / ht of sequence sid
        first = 0
        sid = seq
        if cutlass.const_expr(self.halo):
            first = mWalk[seq, head] - c0
            sid = mSeg[seq, 0]
        qk_head = head // group
        v0 = vb * self.vblk

        if warp_idx >= self.producer_warp:
            if cutlass.const_expr(self.num_wg > 1):
                cute.arch.warpgroup_reg_dealloc(self.regs_producer)
        if warp_idx == self.producer_warp:
            # ---------------------------------------------------------------- producer warp: TMA
            for atom in (tma_q, tma_k, tma_w, tma_u, tma_a, tma_g):
                cpasync.prefetch_descriptor(atom)
            pstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for c in cutlass.range(first, nchunks, unroll=1):
                tok = bos + c * BT
                row = (c0 + c) * hv + head
                pipe.producer_acquire(pstate)
                bar = pipe.producer_get_barrier(pstate)
                s = pstate.index
                gq = token_tile(tQ, qk_head, tok, 0, BT, K)
                gk = token_tile(tK, qk_head, tok, 0, BT, K)
                gw = cute.local_tile(tW, (BT, K), (row, 0))
                gu = cute.local_tile(tU, (self.vblk, BT), (row * self.nvb + vb, 0))
                ga = cute.local_tile(tA, (BT, BT), (row, 0))
                gg = cute.local_tile(tG, (BT,), (row,))
                for atom, s_t, g_t in ((tma_q, sQ, gq), (tma_k, sK, gk), (tma_w, sW, gw),
                                       (tma_u, sU, gu), (tma_a, sA, ga)):
                    tma_load(atom, s_t[None, None, s], g_t, bar)
                tma_load(tma_g, sG[None, s], gg, bar, rank=1)
                pipe.producer_commit(pstate)
                pstate.advance()
        elif warp_idx < self.producer_warp:
            # ---------------------------------------------------------------- consumer warpgroups
            if cutlass.const_expr(self.num_wg > 1):
                cute.arch.warpgroup_reg_alloc(self.regs_consumer)
            mma64 = sm90_utils.make_trivial_tiled_mma(
                bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, f32,
                (self.num_wg, 1, 1), (64, BT), warpgroup.OperandSource.RMEM)
            mmah = sm90_utils.make_trivial_tiled_mma(
                bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, f32,
                (self.num_wg, 1, 1), (64, K), warpgroup.OperandSource.RMEM)
            thr64 = mma64.get_slice(tidx)
            thrh = mmah.get_slice(tidx)
            tWs = thr64.make_fragment_B(thr64.partition_B(sW))
            tQs = thr64.make_fragment_B(thr64.partition_B(sQ))
            tAs = thr64.make_fragment_B(thr64.partition_B(sA))
            tKs = thrh.make_fragment_B(thrh.partition_B(sK_mn))

            acc_h = thrh.make_fragment_C(thrh.partition_shape_C((self.vblk, K)))
            cH = thrh.partition_C(cute.make_identity_tensor((self.vblk, K)))
            acc_h.fill(0.0)
            load_walk_start(acc_h, cH, mH0, mWalk, mSeg, seq, sid, head, v0, use_h0, self.halo)
            h_op = acc_as_a_operand(acc_h, mma64, bf16)

            acc_vn = thr64.make_fragment_C(thr64.partition_shape_C((self.vblk, BT)))
            acc_o = thr64.make_fragment_C(thr64.partition_shape_C((self.vblk, BT)))
            cVN = thr64.partition_C(cute.make_identity_tensor((self.vblk, BT)))
            tOs = thr64.partition_C(sO_t)
            # u^T tile (v, token), token-contiguous and swizzled: ldmatrix straight into the C layout
            ldsm = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), bf16)
            u_copy = cute.make_tiled_copy_C(ldsm, mma64)
            u_thr = u_copy.get_slice(tidx)
            tUs = u_thr.partition_S(sU)
            u_reg = cute.make_rmem_tensor(acc_vn.shape, bf16)
            u_reg_cv = u_thr.retile(u_reg)

            # 128-bit copies of the staged output rows to global memory
            vec = 8
            cols = self.vblk // vec
            copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), bf16, num_bits_per_copy=128)
            tiled_copy = cute.make_tiled_copy_tv(
                copy_atom, cute.make_layout((self.n_consumer // cols, cols), stride=(cols, 1)),
                cute.make_layout((1, vec)))
            thr_copy = tiled_copy.get_slice(tidx)
            tOsrc = thr_copy.partition_S(sO)
            cO = thr_copy.partition_S(cute.make_identity_tensor((BT, self.vblk)))
            if cutlass.const_expr(self.save):
                tSaveS = thrh.partition_C(sSaveS_c)
                tSaveV = thr64.partition_C(sSaveV_c)
                tSaveSrc = thr_copy.partition_S(sSave)

            cstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            for c in cutlass.range(first, nchunks, unroll=1):
                tok = bos + c * BT
                valid = cutlass.min(eos - tok, BT)
                # stores only for the segment's own chunks (a halo chunk's rows belong to the segment before)
                own = True
                if cutlass.const_expr(self.halo):
                    own = c >= 0
                pipe.consumer_wait(cstate)
                s = cstate.index
                if valid < BT:
                    # rows past the sequence end belong to the next sequence: zero them in k
                    for idx in cutlass.range((BT - valid) * K // self.n_consumer + 1, unroll=1):
                        e = idx * self.n_consumer + tidx
                        r = valid + e // K
                        if r < BT:
                            sK_raw[r, e % K, s] = bf16(0.0)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=1, number_of_threads=self.n_consumer)

                cute.copy(u_copy, tUs[None, None, None, s], u_reg_cv)
                acc_vn.store(u_reg.load().to(f32))
                fence_operand(acc_vn)
                fence_operand(h_op)
                warpgroup.fence()
                wg_gemm(mma64, acc_vn, h_op, tWs[None, None, None, s], False)
                wg_gemm(mma64, acc_o, h_op, tQs[None, None, None, s], True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                fence_operand(acc_vn)
                fence_operand(acc_o)

                if cutlass.const_expr(self.save):
                    if own:
                        # the bf16 state this chunk multiplied with, and the bf16 v_new it will use
                        row = (c0 + c) * hv + head
                        for i in cutlass.range_constexpr(cute.size(acc_h)):
                            tSaveS[i] = bf16(acc_h[i])
                        for i in cutlass.range_constexpr(cute.size(acc_vn)):
                            tSaveV[i] = bf16(acc_vn[i])
                        cute.arch.barrier(barrier_id=1, number_of_threads=self.n_consumer)
                        gS = cute.local_tile(mS, (K, self.vblk), (row, vb))
                        gVn = cute.local_tile(mVn, (BT, self.vblk), (row, vb))
                        tSd = thr_copy.partition_D(gS)
                        tVd = thr_copy.partition_D(gVn)
                        nS = cute.size(tSd, mode=[1])
                        for m in cutlass.range_constexpr(nS):
                            cute.copy(copy_atom, tSaveSrc[None, m, None], tSd[None, m, None])
                        for m in cutlass.range_constexpr(cute.size(tVd, mode=[1])):
                            cute.copy(copy_atom, tSaveSrc[None, nS + m, None], tVd[None, m, None])

                g_last = sG[BT - 1, s]
                for i in cutlass.range_constexpr(cute.size(acc_o)):
                    gn = sG[cVN[i][1], s]
                    acc_o[i] = acc_o[i] * (scale * cute.math.exp(gn, fastmath=True))
                vn_op = acc_as_a_operand(acc_vn, mma64, bf16)
                for i in cutlass.range_constexpr(cute.size(acc_vn)):
                    gn = sG[cVN[i][1], s]
                    acc_vn[i] = acc_vn[i] * cute.math.exp(g_last - gn, fastmath=True)
                vnd_op = acc_as_a_operand(acc_vn, mmah, bf16)
                decay = cute.math.exp(g_last, fastmath=True)
                for i in cutlass.range_constexpr(cute.size(acc_h)):
                    acc_h[i] = acc_h[i] * decay
                fence_operand(vn_op)
                fence_operand(vnd_op)
                fence_operand(acc_o)
                fence_operand(acc_h)
                warpgroup.fence()
                wg_gemm(mma64, acc_o, vn_op, tAs[None, None, None, s], False)
                wg_gemm(mmah, acc_h, vnd_op, tKs[None, None, None, s], False)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                fence_operand(acc_o)
                fence_operand(acc_h)
                pipe.consumer_release(cstate)
                cstate.advance()
                convert_into(h_op, acc_h)

                # output: registers -> staging tile -> rows < valid of o
                if own:
                    for i in cutlass.range_constexpr(cute.size(acc_o)):
                        tOs[i] = bf16(acc_o[i])
                    cute.arch.barrier(barrier_id=1, number_of_threads=self.n_consumer)
                    gO = cute.domain_offset((tok, 0), mO[None, head, vb, None])
                    tOdst = thr_copy.partition_D(cute.zipped_divide(gO, (BT, self.vblk))[((None, None), (0, 0))])
                    for m in cutlass.range_constexpr(cute.size(tOsrc, mode=[1])):
                        if cO[0, m, 0][0] < valid:
                            cute.copy(copy_atom, tOsrc[None, m, None], tOdst[None, m, None])
                    cute.arch.barrier(barrier_id=1, number_of_threads=self.n_consumer)

            store_walk_end(acc_h, cH, mHt, mSeg, seq, sid, head, v0, store_ht, self.halo)
