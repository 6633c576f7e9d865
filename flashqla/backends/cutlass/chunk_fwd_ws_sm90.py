"""Forward recurrence over chunks (SM90, CuTe DSL), warp-specialised: the state chain and the output in two
consumer warpgroups, each fed by its own TMA producer warp.

Same arguments and results as :mod:`.chunk_fwd_sm90` (``ChunkFwdSm90`` with ``num_wg = 1``: V block 64), same
transposed frame ``H = S^T`` ([Vb, K] per value head).  What changes is who waits for whom.  In
``ChunkFwdSm90`` one warpgroup does the whole chunk step, so the output's two products and its store sit on the
serial path between one state and the next.  Here the serial path keeps only the state's own dependencies::

    warpgroup 0, the state chain (threads 0-127):
        Sb    = bf16(H)                          -> shared buffer b (stmatrix), for warpgroup 1
        vn^T  = u^T + H (-w)^T                   wgmma, A = H (registers), B = -w (shared, K-major)
        vn    -> shared buffer b (bf16, stmatrix), published to warpgroup 1 with Sb
        H     = Gamma_C H + (vn diag(d))^T k     wgmma, A = vn*d (registers), B = k (shared, MN-major)

    warpgroup 1, the output (threads 128-255), up to two chunks behind:
        o^T   = (Sb q^T) diag(scale Gamma)       wgmma, A = Sb (shared, K-major), B = q (shared, K-major)
              + vn^T Aqk^T                       wgmma, A = vn (shared, K-major), B = Aqk (shared, K-major)
        o     -> staging tile -> rows < valid of o (128-bit stores)
        training (``save``): Sb and vn -> the chunk-major workspaces S [K, V] and v_new [64, V] (transposed on
        the way: 8 consecutive v per 128-bit store)

    warpgroup 2 (threads 256-383): warp 8 loads the chain's tiles (k, -w, u^T, G), warp 9 the output's
    (q, Aqk, G), each into its own two-slot ring; warps 10-11 idle.

Why two rings: with one, a slot holds q and Aqk until the output warpgroup is done with them, so the refill of
the chain's next tiles waited for the output (the TMA latency landed on the chain).  With its own ring the chain
gets its chunk c + 2 as soon as it leaves chunk c.  The handoff (Sb, vn) has two buffers, so the chain runs up to
two chunks ahead of the output and waits only for a chunk long done.  In a walk over segments (``halo``) the halo's
chunks run on the chain alone: they publish nothing and the output warpgroup walks the segment's own chunks.

Synchronisation: ``PipelineTmaAsync`` for each ring (full: TMA bytes; empty: one arrival per consumer warp),
``PipelineAsync`` for the handoff (128 arrivals each way).  The chain fences its shared stores for the async proxy
before it publishes (warpgroup 1 reads them with wgmma); warpgroup 1 releases a buffer only after its last wgmma
on it has completed (``wait_group 0``).

``fused`` (inference only): the prep stores ``Tb = T diag(beta)`` (64 x 64 per chunk and head) instead of ``-w`` and
``u^T``, and the chain forms v_new from v itself::

        Y^T   = H k^T                            wgmma, A = H (registers), B = k (shared, K-major)
        X^T   = v^T - Y^T diag(Gamma)            v^T by a transposing ldmatrix; bf16, the A operand of
        vn^T  = X^T Tb^T                         wgmma, B = Tb (shared, K-major)

(``vn = T beta v - T beta Gamma k S = u - w S``.)  One more (64 x 64 x 64) wgmma on the chain, and per (chunk, head)
8 KiB of Tb through HBM instead of the 32 KiB of -w and u^T (which each V block read again).  Rows of k and v past
the sequence end are zeroed in shared memory, so v_new's columns there are exactly 0.  The chain's ring holds k,
v (64 x Vb), Tb and G (~32 KiB a slot).  The kernel's arguments stay those of the split form: ``w_ptr`` brings Tb
and ``u_ptr`` the input v ([T, Hv, V]).

Registers: ``setmaxnreg`` 232 for the chain (H 64 fp32 + its bf16 copy 32 + vn 32 + the u tile and the decayed
vn 16 each), 216 for the output, 40 for the producers (128 x (232 + 216 + 40) < 65536).
Shared memory (bf16 unless noted): chain ring 2 x (k 16 KiB + -w 16 KiB + u^T 8 KiB + G 256 B fp32), output ring
2 x (q 16 KiB + Aqk 8 KiB + G 256 B), handoff 2 x (Sb 16 KiB + vn 8 KiB), output staging 64 x 72: ~187 KiB, one
CTA per SM.  Grid ``(num_seqs * V / 64, Hv)`` (the V blocks of a sequence adjacent), 384 threads.
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
                    load_walk_start, store_walk_end, sw128_index, tma_load, token_tile, wg_gemm)

BT = 64  # chunk size

# named barriers (0 is the CTA-wide one)
CHAIN_BAR, OUT_BAR = 1, 2


class ChunkFwdWsSm90:
    def __init__(self, K: int = 128, V: int = 128, save: bool = False, halo: bool = False, fused: bool = False):
        assert K == 128 and V % 64 == 0 and not (save and fused)
        self.K, self.V = K, V
        self.vblk = 64
        self.nvb = V // self.vblk
        self.stages = 2          # each ring
        self.nbuf = 2            # handoff buffers (Sb, vn)
        self.threads = 3 * NUM_THREADS_PER_WG
        self.regs_chain, self.regs_out, self.regs_producer = 232, 216, 40
        self.chain_load_warp, self.out_load_warp = 8, 9
        self.o_pitch = self.vblk + 8  # padded row pitch of the output staging tile (bank spread)
        self.save = save
        self.halo = halo
        self.fused = fused

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
        K, V, st, nb, vblk = self.K, self.V, self.stages, self.nbuf, self.vblk
        bf16 = cutlass.BFloat16
        t = fwd_global_tensors(q_ptr, k_ptr, a_ptr, g_ptr, h0_ptr, ht_ptr, o_ptr, s_ptr, vn_ptr, cu_ptr, co_ptr,
                               seg_ptr, walk_ptr, total_tokens, total_chunks, num_seqs, hqk, hv, K, V, vblk, BT)
        mQ, mK, mA, mG = t["mQ"], t["mK"], t["mA"], t["mG"]
        mH0, mHt, mO, mS, mVn = t["mH0"], t["mHt"], t["mO"], t["mS"], t["mVn"]
        mCu, mCo, mSeg, mWalk = t["mCu"], t["mCo"], t["mSeg"], t["mWalk"]
        rows = total_chunks * hv
        if cutlass.const_expr(self.fused):
            mW = cute.make_tensor(w_ptr, cute.make_layout((rows * BT, BT), stride=(BT, 1)))      # Tb
            mU = cute.make_tensor(u_ptr, cute.make_layout((total_tokens, V, hv), stride=(hv * V, 1, V)))  # v
        else:
            mW = cute.make_tensor(w_ptr, cute.make_layout((rows * BT, K), stride=(K, 1)))
            mU = cute.make_tensor(u_ptr, cute.make_layout((rows * V, BT), stride=(BT, 1)))

        atom128 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16)
        l_qk = cute.tile_to_shape(atom128, (BT, K, st), order=(0, 1, 2))
        l_u = cute.tile_to_shape(atom128, (vblk, BT, st), order=(0, 1, 2))
        l_a = cute.tile_to_shape(atom128, (BT, BT, st), order=(0, 1, 2))
        l_g = cute.make_layout((BT, st))
        # handoff buffers, K-major so that the chain's stmatrix writes whole 16-byte rows: Sb (v, k), vn (v, token)
        l_sb = cute.tile_to_shape(atom128, (vblk, K, nb), order=(0, 1, 2))
        l_vn = cute.tile_to_shape(atom128, (vblk, BT, nb), order=(0, 1, 2))

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, mQ, cute.slice_(l_qk, (None, None, 0)), (BT, K))
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mK, cute.slice_(l_qk, (None, None, 0)), (BT, K))
        if cutlass.const_expr(self.fused):
            # Tb tiles like Aqk's; v tiles (64 tokens, Vb) of the input, token-major
            l_w = l_a
            l_u = cute.tile_to_shape(atom128, (BT, vblk, st), order=(0, 1, 2))
            tma_w, tW = cpasync.make_tiled_tma_atom(g2s, mW, cute.slice_(l_a, (None, None, 0)), (BT, BT))
            tma_u, tU = cpasync.make_tiled_tma_atom(g2s, mU, cute.slice_(l_u, (None, None, 0)), (BT, vblk))
        else:
            l_w = l_qk
            tma_w, tW = cpasync.make_tiled_tma_atom(g2s, mW, cute.slice_(l_qk, (None, None, 0)), (BT, K))
            tma_u, tU = cpasync.make_tiled_tma_atom(g2s, mU, cute.slice_(l_u, (None, None, 0)), (vblk, BT))
        tma_a, tA = cpasync.make_tiled_tma_atom(g2s, mA, cute.slice_(l_a, (None, None, 0)), (BT, BT))
        tma_g, tG = cpasync.make_tiled_tma_atom(g2s, mG, cute.slice_(l_g, (None, 0)), (BT,))

        self.tx_chain = (BT * K + cute.cosize(l_w) // st + vblk * BT) * 2 + BT * 4
        self.tx_out = (BT * K + BT * BT) * 2 + BT * 4

        @cute.struct
        class SharedStorage:
            mbar_chain: cute.struct.MemRange[cutlass.Int64, st * 2]
            mbar_out: cute.struct.MemRange[cutlass.Int64, st * 2]
            mbar_hand: cute.struct.MemRange[cutlass.Int64, nb * 2]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_qk)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_w)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_qk)], 1024]
            sSb: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_sb)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_u)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_a)], 1024]
            sVn: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_vn)], 1024]
            sGc: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BT * st], 128]
            sGo: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BT * st], 128]
            sO: cute.struct.Align[cute.struct.MemRange[bf16, BT * self.o_pitch], 128]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

        group = hv // hqk
        self.kernel(tma_q, tQ, tma_k, tK, tma_w, tW, tma_u, tU, tma_a, tA, tma_g, tG,
                    mH0, mHt, mO, mS, mVn, mCu, mCo, mSeg, mWalk, hv, group, scale, use_h0, store_ht,
                    l_qk, l_w, l_u, l_a, l_g, l_sb, l_vn).launch(
            grid=(num_seqs * self.nvb, hv, 1), block=(self.threads, 1, 1), stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, tQ: cute.Tensor, tma_k: cute.CopyAtom, tK: cute.Tensor,
               tma_w: cute.CopyAtom, tW: cute.Tensor, tma_u: cute.CopyAtom, tU: cute.Tensor,
               tma_a: cute.CopyAtom, tA: cute.Tensor, tma_g: cute.CopyAtom, tG: cute.Tensor,
               mH0: cute.Tensor, mHt: cute.Tensor, mO: cute.Tensor, mS: cute.Tensor, mVn: cute.Tensor,
               mCu: cute.Tensor, mCo: cute.Tensor, mSeg: cute.Tensor, mWalk: cute.Tensor,
               hv: cutlass.Int32, group: cutlass.Int32, scale: cutlass.Float32,
               use_h0: cutlass.Int32, store_ht: cutlass.Int32, l_qk: cute.ComposedLayout,
               l_w: cute.ComposedLayout, l_u: cute.ComposedLayout, l_a: cute.ComposedLayout, l_g: cute.Layout,
               l_sb: cute.ComposedLayout, l_vn: cute.ComposedLayout):
        K = self.K
        vblk = self.vblk
        nthr = NUM_THREADS_PER_WG
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        role = warp_idx // 4
        # the V blocks of a (sequence, head) are neighbours in launch order: they run together and read the
        # K-wide tiles (q, k, w, ...) through L2 once, where V-block-major order ran them a wave apart
        bx, head, _ = cute.arch.block_idx()
        seq = bx // self.nvb
        vb = bx % self.nvb

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(l_qk.outer, swizzle=l_qk.inner)
        sK = storage.sK.get_tensor(l_qk.outer, swizzle=l_qk.inner)
        # Un-swizzled alias: a token row fills whole 128-byte lines, so zeroing a row through it zeroes that row
        sK_raw = cute.make_tensor(storage.sK.data_ptr(), l_qk.outer)
        sK_mn = storage.sK.get_tensor(cute.select(l_qk, mode=[1, 0, 2]).outer, swizzle=l_qk.inner)
        sW = storage.sW.get_tensor(l_w.outer, swizzle=l_w.inner)      # -w, or Tb (fused)
        sU = storage.sU.get_tensor(l_u.outer, swizzle=l_u.inner)      # u^T (v, token), or v (token, v) (fused)
        sU_raw = cute.make_tensor(storage.sU.data_ptr(), l_u.outer)
        sU_mn = storage.sU.get_tensor(cute.select(l_u, mode=[1, 0, 2]).outer, swizzle=l_u.inner)
        sA = storage.sA.get_tensor(l_a.outer, swizzle=l_a.inner)
        sGc = storage.sGc.get_tensor(l_g)
        sGo = storage.sGo.get_tensor(l_g)
        sSb = storage.sSb.get_tensor(l_sb.outer, swizzle=l_sb.inner)
        sVn = storage.sVn.get_tensor(l_vn.outer, swizzle=l_vn.inner)
        # flat un-swizzled views of the handoff buffers, for the output's scalar (transposing) reads
        sSb_flat = cute.make_tensor(storage.sSb.data_ptr(), cute.make_layout((cute.cosize(l_sb.outer),)))
        sVn_flat = cute.make_tensor(storage.sVn.data_ptr(), cute.make_layout((cute.cosize(l_vn.outer),)))
        sO = storage.sO.get_tensor(cute.make_layout((BT, vblk), stride=(self.o_pitch, 1)))
        sO_t = storage.sO.get_tensor(cute.make_layout((vblk, BT), stride=(1, self.o_pitch)))

        ring_chain = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_chain.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=self.tx_chain, defer_sync=True)
        ring_out = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_out.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=self.tx_out, defer_sync=True)
        hand = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_hand.data_ptr(), num_stages=self.nbuf,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, nthr),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, nthr), defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        bos = mCu[seq]
        eos = mCu[seq + 1]
        c0 = mCo[seq]
        nchunks = mCo[seq + 1] - c0
        first = 0
        sid = seq
        if cutlass.const_expr(self.halo):
            first = mWalk[seq, head] - c0
            sid = mSeg[seq, 0]
        own_first = cutlass.max(first, 0)   # the output walks the segment's own chunks only
        qk_head = head // group
        v0 = vb * vblk

        if role == 2:
            cute.arch.warpgroup_reg_dealloc(self.regs_producer)
            if warp_idx == self.chain_load_warp:
                # ------------------------------------------------------------ the chain's tiles
                for atom in (tma_k, tma_w, tma_u, tma_g):
                    cpasync.prefetch_descriptor(atom)
                pstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for c in cutlass.range(first, nchunks, unroll=1):
                    tok = bos + c * BT
                    row = (c0 + c) * hv + head
                    ring_chain.producer_acquire(pstate)
                    bar = ring_chain.producer_get_barrier(pstate)
                    s = pstate.index
                    tma_load(tma_k, sK[None, None, s], token_tile(tK, qk_head, tok, 0, BT, K), bar)
                    if cutlass.const_expr(self.fused):
                        tma_load(tma_w, sW[None, None, s], cute.local_tile(tW, (BT, BT), (row, 0)), bar)
                        tma_load(tma_u, sU[None, None, s], token_tile(tU, head, tok, v0, BT, vblk), bar)
                    else:
                        tma_load(tma_w, sW[None, None, s], cute.local_tile(tW, (BT, K), (row, 0)), bar)
                        tma_load(tma_u, sU[None, None, s],
                                 cute.local_tile(tU, (vblk, BT), (row * self.nvb + vb, 0)), bar)
                    tma_load(tma_g, sGc[None, s], cute.local_tile(tG, (BT,), (row,)), bar, rank=1)
                    ring_chain.producer_commit(pstate)
                    pstate.advance()
            elif warp_idx == self.out_load_warp:
                # ------------------------------------------------------------ the output's tiles
                for atom in (tma_q, tma_a):
                    cpasync.prefetch_descriptor(atom)
                pstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for c in cutlass.range(own_first, nchunks, unroll=1):
                    tok = bos + c * BT
                    row = (c0 + c) * hv + head
                    ring_out.producer_acquire(pstate)
                    bar = ring_out.producer_get_barrier(pstate)
                    s = pstate.index
                    tma_load(tma_q, sQ[None, None, s], token_tile(tQ, qk_head, tok, 0, BT, K), bar)
                    tma_load(tma_a, sA[None, None, s], cute.local_tile(tA, (BT, BT), (row, 0)), bar)
                    tma_load(tma_g, sGo[None, s], cute.local_tile(tG, (BT,), (row,)), bar, rank=1)
                    ring_out.producer_commit(pstate)
                    pstate.advance()
        elif role == 0:
            # ---------------------------------------------------------------- the state chain
            cute.arch.warpgroup_reg_alloc(self.regs_chain)
            mma64 = sm90_utils.make_trivial_tiled_mma(
                bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, f32,
                (1, 1, 1), (64, BT), warpgroup.OperandSource.RMEM)
            mmah = sm90_utils.make_trivial_tiled_mma(
                bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, f32,
                (1, 1, 1), (64, K), warpgroup.OperandSource.RMEM)
            thr64 = mma64.get_slice(tidx)
            thrh = mmah.get_slice(tidx)
            tWs = thr64.make_fragment_B(thr64.partition_B(sW))
            tKs = thrh.make_fragment_B(thrh.partition_B(sK_mn))

            acc_h = thrh.make_fragment_C(thrh.partition_shape_C((vblk, K)))
            cH = thrh.partition_C(cute.make_identity_tensor((vblk, K)))
            acc_h.fill(0.0)
            load_walk_start(acc_h, cH, mH0, mWalk, mSeg, seq, sid, head, v0, use_h0, self.halo)
            h_op = acc_as_a_operand(acc_h, mma64, bf16)
            # the bf16 state in the accumulator's (v, k) order: what stmatrix stores as Sb
            h_bf = cute.make_tensor(h_op.iterator, acc_h.layout)

            acc_vn = thr64.make_fragment_C(thr64.partition_shape_C((vblk, BT)))
            cVN = thr64.partition_C(cute.make_identity_tensor((vblk, BT)))
            # u^T (v, token) is token-contiguous: ldmatrix straight into the C layout; the fused form's v tile
            # (token, v) is v-contiguous: the transposing ldmatrix over its (v, token) view
            ldsm = cute.make_copy_atom(
                cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=self.fused, num_matrices=4), bf16)
            u_copy = cute.make_tiled_copy_C(ldsm, mma64)
            u_thr = u_copy.get_slice(tidx)
            if cutlass.const_expr(self.fused):
                tUs = u_thr.partition_S(sU_mn)
                tKk = thr64.make_fragment_B(thr64.partition_B(sK))     # k as the K-major B of H k^T
                acc_y = thr64.make_fragment_C(thr64.partition_shape_C((vblk, BT)))
            else:
                tUs = u_thr.partition_S(sU)
            u_reg = cute.make_rmem_tensor(acc_vn.shape, bf16)
            u_reg_cv = u_thr.retile(u_reg)
            stsm = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), bf16)
            sb_copy = cute.make_tiled_copy_C(stsm, mmah)
            sb_thr = sb_copy.get_slice(tidx)
            tSbd = sb_thr.partition_D(sSb)
            h_bf_cv = sb_thr.retile(h_bf)
            vn_copy = cute.make_tiled_copy_C(stsm, mma64)
            vn_thr = vn_copy.get_slice(tidx)
            tVnd = vn_thr.partition_D(sVn)
            vn_bf = cute.make_rmem_tensor(acc_vn.shape, bf16)
            vn_bf_cv = vn_thr.retile(vn_bf)

            cstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            hstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.nbuf)
            for c in cutlass.range(first, nchunks, unroll=1):
                tok = bos + c * BT
                valid = cutlass.min(eos - tok, BT)
                ring_chain.consumer_wait(cstate)
                s = cstate.index
                if valid < BT:
                    # rows past the sequence end belong to the next sequence: zero them in k, and in v for the
                    # fused form (NaN stays home; v_new's columns there come out exactly 0)
                    for idx in cutlass.range((BT - valid) * K // nthr + 1, unroll=1):
                        e = idx * nthr + tidx
                        r = valid + e // K
                        if r < BT:
                            sK_raw[r, e % K, s] = bf16(0.0)
                    if cutlass.const_expr(self.fused):
                        for idx in cutlass.range((BT - valid) * vblk // nthr + 1, unroll=1):
                            e = idx * nthr + tidx
                            r = valid + e // vblk
                            if r < BT:
                                sU_raw[r, e % vblk, s] = bf16(0.0)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=CHAIN_BAR, number_of_threads=nthr)

                own = True
                if cutlass.const_expr(self.halo):
                    own = c >= 0
                if cutlass.const_expr(self.fused):
                    fence_operand(h_op)
                    warpgroup.fence()
                    wg_gemm(mma64, acc_y, h_op, tKk[None, None, None, s], True)
                    warpgroup.commit_group()
                    cute.copy(u_copy, tUs[None, None, None, s], u_reg_cv)     # v^T, while H k^T runs
                    if own:
                        # Sb for the output (a halo chunk publishes nothing)
                        hand.producer_acquire(hstate)
                        cute.copy(sb_copy, h_bf_cv, tSbd[None, None, None, hstate.index])
                    warpgroup.wait_group(0)
                    fence_operand(acc_y)
                    for i in cutlass.range_constexpr(cute.size(acc_y)):
                        gn = sGc[cVN[i][1], s]
                        acc_y[i] = u_reg[i].to(f32) - acc_y[i] * cute.math.exp(gn, fastmath=True)
                    x_op = acc_as_a_operand(acc_y, mma64, bf16)
                    fence_operand(x_op)
                    warpgroup.fence()
                    wg_gemm(mma64, acc_vn, x_op, tWs[None, None, None, s], True)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    fence_operand(acc_vn)
                else:
                    cute.copy(u_copy, tUs[None, None, None, s], u_reg_cv)
                    acc_vn.store(u_reg.load().to(f32))
                    fence_operand(acc_vn)
                    fence_operand(h_op)
                    warpgroup.fence()
                    wg_gemm(mma64, acc_vn, h_op, tWs[None, None, None, s], False)
                    warpgroup.commit_group()
                    if own:
                        # while the tensor cores work: Sb for the output (a halo chunk publishes nothing)
                        hand.producer_acquire(hstate)
                        cute.copy(sb_copy, h_bf_cv, tSbd[None, None, None, hstate.index])
                    warpgroup.wait_group(0)
                    fence_operand(acc_vn)
                if own:
                    vn_bf.store(acc_vn.load().to(bf16))
                    cute.copy(vn_copy, vn_bf_cv, tVnd[None, None, None, hstate.index])
                    cute.arch.fence_view_async_shared()
                    hand.producer_commit(hstate)
                    hstate.advance()

                g_last = sGc[BT - 1, s]
                for i in cutlass.range_constexpr(cute.size(acc_vn)):
                    gn = sGc[cVN[i][1], s]
                    acc_vn[i] = acc_vn[i] * cute.math.exp(g_last - gn, fastmath=True)
                vnd_op = acc_as_a_operand(acc_vn, mmah, bf16)
                decay = cute.math.exp(g_last, fastmath=True)
                for i in cutlass.range_constexpr(cute.size(acc_h)):
                    acc_h[i] = acc_h[i] * decay
                fence_operand(vnd_op)
                fence_operand(acc_h)
                warpgroup.fence()
                wg_gemm(mmah, acc_h, vnd_op, tKs[None, None, None, s], False)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                fence_operand(acc_h)
                ring_chain.consumer_release(cstate)
                cstate.advance()
                convert_into(h_op, acc_h)

            store_walk_end(acc_h, cH, mHt, mSeg, seq, sid, head, v0, store_ht, self.halo)
        else:
            # ---------------------------------------------------------------- the output
            cute.arch.warpgroup_reg_alloc(self.regs_out)
            otid = tidx - nthr
            mmao = sm90_utils.make_trivial_tiled_mma(
                bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, f32,
                (1, 1, 1), (64, BT), warpgroup.OperandSource.SMEM)
            thro = mmao.get_slice(otid)
            tSbA = thro.make_fragment_A(thro.partition_A(sSb))
            tVnA = thro.make_fragment_A(thro.partition_A(sVn))
            tQs = thro.make_fragment_B(thro.partition_B(sQ))
            tAs = thro.make_fragment_B(thro.partition_B(sA))
            acc_o = thro.make_fragment_C(thro.partition_shape_C((vblk, BT)))
            cO_vt = thro.partition_C(cute.make_identity_tensor((vblk, BT)))
            tOs = thro.partition_C(sO_t)

            vec = 8
            copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), bf16, num_bits_per_copy=128)
            tiled_copy = cute.make_tiled_copy_tv(
                copy_atom, cute.make_layout((nthr // (vblk // vec), vblk // vec), stride=(vblk // vec, 1)),
                cute.make_layout((1, vec)))
            thr_copy = tiled_copy.get_slice(otid)
            tOsrc = thr_copy.partition_S(sO)
            cO = thr_copy.partition_S(cute.make_identity_tensor((BT, vblk)))
            if cutlass.const_expr(self.save):
                # S = Sb^T rows [k][v0 ..] and v_new rows [token][v0 ..]: 8 consecutive v per store, read across
                # the K-major handoff buffers
                cS = thr_copy.partition_S(cute.make_identity_tensor((K, vblk)))
                cV = cO
                rS = cute.make_rmem_tensor(cS.shape, bf16)
                rV = cute.make_rmem_tensor(cV.shape, bf16)

            ostate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            hstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.nbuf)
            for c in cutlass.range(own_first, nchunks, unroll=1):
                tok = bos + c * BT
                valid = cutlass.min(eos - tok, BT)
                ring_out.consumer_wait(ostate)
                s = ostate.index
                hand.consumer_wait(hstate)
                b = hstate.index
                warpgroup.fence()
                wg_gemm(mmao, acc_o, tSbA[None, None, None, b], tQs[None, None, None, s], True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                fence_operand(acc_o)
                for i in cutlass.range_constexpr(cute.size(acc_o)):
                    gn = sGo[cO_vt[i][1], s]
                    acc_o[i] = acc_o[i] * (scale * cute.math.exp(gn, fastmath=True))
                fence_operand(acc_o)
                warpgroup.fence()
                wg_gemm(mmao, acc_o, tVnA[None, None, None, b], tAs[None, None, None, s], False)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                fence_operand(acc_o)
                ring_out.consumer_release(ostate)
                ostate.advance()

                if cutlass.const_expr(self.save):
                    row = (c0 + c) * hv + head
                    for i in cutlass.range_constexpr(cute.size(rS)):
                        kk, vv = cS[i]
                        rS[i] = sSb_flat[sw128_index(cute.crd2idx((vv, kk, b), l_sb.outer))]
                    for i in cutlass.range_constexpr(cute.size(rV)):
                        tt, vv = cV[i]
                        rV[i] = sVn_flat[sw128_index(cute.crd2idx((vv, tt, b), l_vn.outer))]
                    cute.copy(tiled_copy, rS, thr_copy.partition_D(cute.local_tile(mS, (K, vblk), (row, vb))))
                    cute.copy(tiled_copy, rV, thr_copy.partition_D(cute.local_tile(mVn, (BT, vblk), (row, vb))))
                hand.consumer_release(hstate)
                hstate.advance()

                # output: registers -> staging tile -> rows < valid of o
                for i in cutlass.range_constexpr(cute.size(acc_o)):
                    tOs[i] = bf16(acc_o[i])
                cute.arch.barrier(barrier_id=OUT_BAR, number_of_threads=nthr)
                gO = cute.domain_offset((tok, 0), mO[None, head, vb, None])
                tOdst = thr_copy.partition_D(cute.zipped_divide(gO, (BT, vblk))[((None, None), (0, 0))])
                for m in cutlass.range_constexpr(cute.size(tOsrc, mode=[1])):
                    if cO[0, m, 0][0] < valid:
                        cute.copy(copy_atom, tOsrc[None, m, None], tOdst[None, m, None])
                cute.arch.barrier(barrier_id=OUT_BAR, number_of_threads=nthr)
