"""Intra-chunk preparation (SM90, CuTe DSL): everything of a 64-token chunk that does not need the state.

Per (chunk, value head), with ``G`` the chunk-local cumulative gate, ``Gamma = exp(G)`` and rows past
the end of the sequence treated as zero (g = beta = 0, k = v = 0)::

    A    = beta_i (k_i . k_j) exp(G_i - G_j)   for j < i, else 0          (fp32, shared memory)
    T    = (I + A)^-1                                                     (fp32 blocked forward substitution)
    -w   = -(T diag(beta Gamma)) k             u = (T diag(beta)) v       (wgmma, A operand in registers)
    Aqk  = scale (q_t . k_s) exp(G_t - G_s)    for s <= t < valid, else 0

Outputs (chunk-major, zero-padded so that the recurrence kernel reads whole TMA tiles): ``-w``
[c, h, 64, K], ``u^T`` [c, h, V, 64], ``Aqk`` [c, h, 64, 64] (bf16) and ``G`` [c, h, 64] (fp32).  The
negation of w lets the recurrence accumulate ``vn^T = u^T + H (-w)^T`` straight onto ``u^T``.

Grid: ``(total_chunks, Hv)``; block: one warpgroup (128 threads).  Thread 0 issues the TMA loads of the
q, k (head ``h // (Hv/Hqk)``) and v tiles (64 x 128 bf16, 128B swizzle) on one mbarrier while threads
0..63 load g and beta and form the cumulative gate.  Rows past the sequence end (another sequence's
tokens, or TMA zero fill past the tensor end) are zeroed in shared memory before any product.

Inverse: the four 16x16 diagonal blocks are inverted by forward substitution, one column per thread;
then the off-diagonal blocks by block distance d = 1, 2, 3: ``P = A[i, j:i] T[j:i, j]`` and
``T[i, j] = -T[i, i] P`` (two barrier-separated phases each), where a thread owns one row and four columns of an
output block and reads 128-bit slices; only the six blocks above the diagonal are cleared first.  Why: the prep is
bound by shared memory (session 20's Nsight Compute on the former form, one scalar output entry per thread and
step: L1 pipe 78%, 1.6-way store conflicts, 384 us at 16/32 4x8192 for the tb form); the register tiles issue ~3x
fewer shared-memory instructions, with bitwise the same T (session 23, H100: 0.391 -> 0.384 ms there).

``tb`` (the fused inference forward, :mod:`.chunk_fwd_ws_sm90` with ``fused``): no ``-w`` / ``u`` and no v tile;
instead ``Tb = T diag(beta)`` (bf16 [c, h, 64, 64], row-major, into the ``t`` workspace), from which the recurrence
forms ``v_new`` itself -- 8 KiB per (chunk, head) written and read instead of -w and u^T's 32 KiB.

Shared memory (~84 KiB, two CTAs per SM; ``tb`` has no v tile: ~68 KiB, three per SM): q, k, v tiles 3 x 16 KiB;
A and T fp32 64 x 68 each plus the 3 x 16 x 16 fp32 P scratch, re-used at the end as the bf16 staging tiles of -w
(64 x 136) and u^T (128 x 72) for 128-bit global stores.  Aqk is staged (bf16, 64 x 72) over the q tile once
q k^T is formed, and leaves with 128-bit stores too.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from ._sm90 import (chunk_coords, fence_operand, init_tx_barrier, tma_load, token_tile, wg_gemm, wide,
                    zero_rows_past_end)

BT = 64
PITCH = 68          # fp32 row pitch of A and T
W_PITCH = 136       # bf16 row pitch of the -w staging tile
U_PITCH = 72        # bf16 row pitch of the u^T staging tile
AQK_PITCH = 72      # bf16 row pitch of the Aqk staging tile (over the q tile)


class ChunkPrepSm90:
    def __init__(self, K: int = 128, V: int = 128, beta_fp32: bool = False, save: bool = False, tb: bool = False):
        assert K == 128 and V == 128 and not (save and tb)
        self.K, self.V = K, V
        self.beta_fp32 = beta_fp32
        self.save = save   # training forward: also store T = (I + A)^-1 as bf16 [c, h, 64, 64]
        self.tb = tb       # fused inference forward: store T diag(beta) there instead of -w and u
        self.threads = 128
        self.scratch_f32 = 2 * BT * PITCH + 3 * 256
        assert self.scratch_f32 * 4 >= (BT * W_PITCH + V * U_PITCH) * 2

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer,
                 g_ptr: cute.Pointer, beta_ptr: cute.Pointer,
                 w_ptr: cute.Pointer, u_ptr: cute.Pointer, a_ptr: cute.Pointer, gc_ptr: cute.Pointer,
                 t_ptr: cute.Pointer, cu_ptr: cute.Pointer, ci_ptr: cute.Pointer,
                 total_tokens: cutlass.Int32, total_chunks: cutlass.Int32, num_seqs: cutlass.Int32,
                 hqk: cutlass.Int32, hv: cutlass.Int32, scale: cutlass.Float32, stream: cuda.CUstream):
        K, V = self.K, self.V
        bf16 = cutlass.BFloat16
        mQ = cute.make_tensor(q_ptr, cute.make_layout((total_tokens, K, hqk), stride=(hqk * K, 1, K)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((total_tokens, K, hqk), stride=(hqk * K, 1, K)))
        mV = cute.make_tensor(v_ptr, cute.make_layout((total_tokens, V, hv), stride=(hv * V, 1, V)))
        mg = cute.make_tensor(g_ptr, cute.make_layout((total_tokens, hv), stride=(hv, 1)))
        mb = cute.make_tensor(beta_ptr, cute.make_layout((total_tokens, hv), stride=(hv, 1)))
        rows = total_chunks * hv
        # plain stores whose offsets pass 2^31 elements at ~1M tokens x 32 heads: 64-bit row strides
        mW = cute.make_tensor(w_ptr, cute.make_layout((rows * BT, K), stride=(wide(K, K), 1)))
        mU = cute.make_tensor(u_ptr, cute.make_layout((rows * V, BT), stride=(wide(BT, BT), 1)))
        mA = cute.make_tensor(a_ptr, cute.make_layout((rows * BT, BT), stride=(wide(BT, BT), 1)))
        mGc = cute.make_tensor(gc_ptr, cute.make_layout((rows * BT,), stride=(1,)))
        mT = cute.make_tensor(t_ptr, cute.make_layout((rows * BT, BT), stride=(wide(BT, BT), 1)))
        mCu = cute.make_tensor(cu_ptr, cute.make_layout((num_seqs + 1,)))
        mCi = cute.make_tensor(ci_ptr, cute.make_layout((total_chunks, 2), stride=(2, 1)))

        atom128 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16)
        l_t = cute.tile_to_shape(atom128, (BT, K), order=(0, 1))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, mQ, l_t, (BT, K))
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mK, l_t, (BT, K))
        tma_v, tV = cpasync.make_tiled_tma_atom(g2s, mV, l_t, (BT, V))
        self.tx_bytes = (2 if self.tb else 3) * BT * K * 2

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 1]
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            scratch: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.scratch_f32], 128]
            sGraw: cute.struct.MemRange[cutlass.Float32, BT]
            sG: cute.struct.MemRange[cutlass.Float32, BT]
            sB: cute.struct.MemRange[cutlass.Float32, BT]

        # tb reads no v: without its 16 KiB tile the CTA fits three to an SM instead of two, and this kernel is
        # latency-bound (its phases wait on shared memory and barriers), so the third CTA hides that
        @cute.struct
        class SharedStorageTb:
            mbar: cute.struct.MemRange[cutlass.Int64, 1]
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            scratch: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.scratch_f32], 128]
            sGraw: cute.struct.MemRange[cutlass.Float32, BT]
            sG: cute.struct.MemRange[cutlass.Float32, BT]
            sB: cute.struct.MemRange[cutlass.Float32, BT]

        self.shared_storage = SharedStorageTb if self.tb else SharedStorage
        self.smem_bytes = self.shared_storage.size_in_bytes()
        group = hv // hqk
        self.kernel(tma_q, tQ, tma_k, tK, tma_v, tV, mg, mb, mW, mU, mA, mGc, mT, mCu, mCi,
                    hv, group, scale, l_t).launch(
            grid=(total_chunks, hv, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, tQ: cute.Tensor, tma_k: cute.CopyAtom, tK: cute.Tensor,
               tma_v: cute.CopyAtom, tV: cute.Tensor, mg: cute.Tensor, mb: cute.Tensor,
               mW: cute.Tensor, mU: cute.Tensor, mA: cute.Tensor, mGc: cute.Tensor, mT: cute.Tensor,
               mCu: cute.Tensor, mCi: cute.Tensor, hv: cutlass.Int32, group: cutlass.Int32,
               scale: cutlass.Float32, l_t: cute.ComposedLayout):
        K, V = self.K, self.V
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32
        nthr = self.threads
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        chunk, head, _ = cute.arch.block_idx()

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mbar = storage.mbar.data_ptr()
        sQ = storage.sQ.get_tensor(l_t.outer, swizzle=l_t.inner)
        sK = storage.sK.get_tensor(l_t.outer, swizzle=l_t.inner)
        sK_mn = storage.sK.get_tensor(cute.select(l_t, mode=[1, 0]).outer, swizzle=l_t.inner)
        # un-swizzled aliases: a whole token row is whole 128-byte lines, which the swizzle only permutes
        # internally, so zeroing full rows through them is exact
        sQ_raw = cute.make_tensor(storage.sQ.data_ptr(), l_t.outer)
        sK_raw = cute.make_tensor(storage.sK.data_ptr(), l_t.outer)
        if cutlass.const_expr(not self.tb):
            sV = storage.sV.get_tensor(l_t.outer, swizzle=l_t.inner)
            sV_mn = storage.sV.get_tensor(cute.select(l_t, mode=[1, 0]).outer, swizzle=l_t.inner)
            sV_raw = cute.make_tensor(storage.sV.data_ptr(), l_t.outer)
        # Aqk's bf16 staging tile over the q tile (dead once q k^T is formed), rows padded to 72 so that the
        # fragment writes of neighbouring rows fall in different banks and each row stays 16-byte aligned
        sAqk = cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr(), dtype=bf16),
                                cute.make_layout((BT, BT), stride=(AQK_PITCH, 1)))
        base = storage.scratch.data_ptr()
        sAf = cute.make_tensor(base, cute.make_layout((BT, BT), stride=(PITCH, 1)))
        sT = cute.make_tensor(base + BT * PITCH, cute.make_layout((BT, BT), stride=(PITCH, 1)))
        sP = cute.make_tensor(base + 2 * BT * PITCH, cute.make_layout((3, 16, 16), stride=(256, 16, 1)))
        # staging tiles for the outputs, over the same scratch (used only after A, T, P are dead)
        base_bf = cute.recast_ptr(base, dtype=bf16)
        sWst = cute.make_tensor(base_bf, cute.make_layout((BT, K), stride=(W_PITCH, 1)))
        sUst = cute.make_tensor(base_bf + BT * W_PITCH, cute.make_layout((V, BT), stride=(U_PITCH, 1)))
        sUst_c = cute.make_tensor(base_bf + BT * W_PITCH, cute.make_layout((BT, V), stride=(1, U_PITCH)))
        sGraw = storage.sGraw.get_tensor(cute.make_layout((BT,)))
        sG = storage.sG.get_tensor(cute.make_layout((BT,)))
        sB = storage.sB.get_tensor(cute.make_layout((BT,)))

        tok, valid, qk_head, row = chunk_coords(mCi, mCu, chunk, head, hv, group, BT)

        init_tx_barrier(mbar, tidx)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, self.tx_bytes)
            for atom, tt, s_t, hh in ((tma_q, tQ, sQ, qk_head), (tma_k, tK, sK, qk_head)):
                tma_load(atom, s_t, token_tile(tt, hh, tok, 0, BT, K), mbar)
            if cutlass.const_expr(not self.tb):
                tma_load(tma_v, sV, token_tile(tV, head, tok, 0, BT, K), mbar)

        # gates: rows past the sequence end count as g = beta = 0
        if tidx < BT:
            gval = f32(0.0)
            bval = f32(0.0)
            if tidx < valid:
                gval = f32(mg[tok + tidx, head])
                bval = f32(mb[tok + tidx, head])
            sGraw[tidx] = gval
            sB[tidx] = bval
        cute.arch.sync_threads()
        if tidx < BT:
            acc = f32(0.0)
            for j in cutlass.range_constexpr(BT):
                if j <= tidx:
                    acc = acc + sGraw[j]
            sG[tidx] = acc
            mGc[row * BT + tidx] = acc

        cute.arch.mbarrier_wait(mbar, 0)
        if cutlass.const_expr(self.tb):
            zero_rows_past_end(((sQ_raw, K), (sK_raw, K)), valid, tidx, nthr, BT, K)
        else:
            zero_rows_past_end(((sQ_raw, K), (sK_raw, K), (sV_raw, V)), valid, tidx, nthr, BT, K)
        cute.arch.sync_threads()   # also publishes sG / sB

        # ---------------------------------------------------------------- k k^T and q k^T
        mma_ss = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, f32, (1, 1, 1), (64, BT))
        thr_ss = mma_ss.get_slice(tidx)
        tKa = thr_ss.make_fragment_A(thr_ss.partition_A(sK))
        tQa = thr_ss.make_fragment_A(thr_ss.partition_A(sQ))
        tKb = thr_ss.make_fragment_B(thr_ss.partition_B(sK))
        acc_kk = thr_ss.make_fragment_C(thr_ss.partition_shape_C((BT, BT)))
        acc_qk = thr_ss.make_fragment_C(thr_ss.partition_shape_C((BT, BT)))
        cC = thr_ss.partition_C(cute.make_identity_tensor((BT, BT)))
        warpgroup.fence()
        wg_gemm(mma_ss, acc_kk, tKa, tKb, True)
        wg_gemm(mma_ss, acc_qk, tQa, tKb, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_kk)
        fence_operand(acc_qk)

        rAqk = cute.make_rmem_tensor(acc_qk.shape, bf16)
        for i in cutlass.range_constexpr(cute.size(acc_kk)):
            r, cc = cC[i]
            gr = sG[r]
            gc = sG[cc]
            decay = cute.math.exp(gr - gc, fastmath=True)
            val = f32(0.0)
            if cc < r:
                val = sB[r] * acc_kk[i] * decay
            sAf[r, cc] = val
            qv = f32(0.0)
            if cc <= r:
                if r < valid:
                    qv = scale * acc_qk[i] * decay
            rAqk[i] = bf16(qv)
        self._clear_upper_blocks(tidx, sT)
        cute.arch.sync_threads()
        # every warp's q k^T wgmma has finished reading q (the barrier above): q's tile becomes Aqk's staging,
        # published by the inverse's first barrier and stored with 128-bit writes at the end (two-byte global
        # stores straight from the fragments took 32 store instructions per thread)
        # (pairs of neighbouring columns as one 32-bit store: 16 instead of 32 per thread, conflict-free at pitch 72)
        cute.autovec_copy(rAqk, thr_ss.partition_C(sAqk))

        # ---------------------------------------------------------------- T = (I + A)^-1
        if tidx < BT:
            b = tidx // 16
            c = tidx % 16
            x = cute.make_rmem_tensor((16,), f32)
            for r in cutlass.range_constexpr(16):
                acc = f32(0.0)
                for j in cutlass.range_constexpr(r):
                    acc = acc + sAf[16 * b + r, 16 * b + j] * x[j]
                val = -acc
                if r == c:
                    val = f32(1.0)
                if r < c:
                    val = f32(0.0)
                x[r] = val
            for r in cutlass.range_constexpr(16):
                sT[16 * b + r, 16 * b + c] = x[r]
        cute.arch.sync_threads()
        self._off_diagonal_tiled(tidx, sAf, sT, sP)

        copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), bf16, num_bits_per_copy=128)
        cp_a = cute.make_tiled_copy_tv(copy_atom, cute.make_layout((nthr // 8, 8), stride=(8, 1)),
                                       cute.make_layout((1, 8)))
        thr_a = cp_a.get_slice(tidx)
        cute.copy(cp_a, thr_a.partition_S(sAqk), thr_a.partition_D(cute.local_tile(mA, (BT, BT), (row, 0))))
        if cutlass.const_expr(self.save or self.tb):
            # T (bf16, row-major [i][j]) for the backward, or T diag(beta) for the fused forward: 8 consecutive
            # entries per 128-bit store
            cp_t = cute.make_tiled_copy_tv(copy_atom, cute.make_layout((nthr // 8, 8), stride=(8, 1)),
                                           cute.make_layout((1, 8)))
            thr_t = cp_t.get_slice(tidx)
            gT = thr_t.partition_D(cute.local_tile(mT, (BT, BT), (row, 0)))
            cT = thr_t.partition_S(cute.make_identity_tensor((BT, BT)))
            rT = cute.make_rmem_tensor(gT.shape, bf16)
            for i in cutlass.range_constexpr(cute.size(rT)):
                r, cc = cT[i]
                if cutlass.const_expr(self.tb):
                    rT[i] = bf16(sT[r, cc] * sB[cc])
                else:
                    rT[i] = bf16(sT[r, cc])
            cute.copy(cp_t, rT, gT)
        if cutlass.const_expr(not self.tb):
            self._store_w_u(tidx, sT, sB, sG, sK_mn, sV_mn, sWst, sUst, sUst_c, mW, mU, row, copy_atom)

    @cute.jit
    def _clear_upper_blocks(self, tidx, sT: cute.Tensor):
        """Zero T's six 16 x 16 blocks above the diagonal (the only entries no phase writes: P1 writes the diagonal
        blocks whole, the off-diagonal phases every block below), 128-bit stores, three per thread."""
        zero4 = cute.make_rmem_tensor((4,), cutlass.Float32)
        zero4.fill(0.0)
        half = tidx // 64
        w = tidx % 64
        # task e * 128 + tidx -> block 2e + half of (0,1) (0,2) | (0,3) (1,2) | (1,3) (2,3)
        for e in cutlass.range_constexpr(3):
            if cutlass.const_expr(e == 0):
                bi, bj = 0, 1 + half
            elif cutlass.const_expr(e == 1):
                bi, bj = half, 3 - half
            else:
                bi, bj = 1 + half, 3
            cute.autovec_copy(zero4, cute.local_tile(sT[(16 * bi + w // 4, None)], (4,), (4 * bj + w % 4,)))

    @cute.jit
    def _off_diagonal_tiled(self, tidx, sAf: cute.Tensor, sT: cute.Tensor, sP: cute.Tensor):
        """The inverse's off-diagonal blocks by block distance d = 1, 2, 3 (pairs p = 0 .. 3 - d, block i = p + d
        below block j = p), the same products and summation order as the former scalar phases (one output entry
        per thread; bitwise the same T on the GPU, session 23):
        ``P_p = A[i, j:i] T[j:i, j]``, then ``T[i, j] = -T[i, i] P_p``.  A task is one row and four consecutive
        columns of a 16 x 16 output block (64 tasks per block; a warp's 32 tasks share the block), so each 128-bit
        row read of A or T[i, i] (8 rows per warp, distinct banks at the 68-word pitch) feeds four k-steps, and each
        128-bit read of T or P (4 addresses per warp, broadcast) feeds four columns: ~4x fewer shared-memory
        instructions than one column per thread, which ran the prep at 78% of the L1 pipe (session 20's ncu)."""
        f32 = cutlass.Float32
        nthr = self.threads
        for d in cutlass.range_constexpr(1, 4):
            ntasks = (4 - d) * 64
            for rd in cutlass.range_constexpr(-(-ntasks // nthr)):
                task = rd * nthr + tidx
                if task < ntasks:
                    p = task // 64
                    r = (task % 64) // 4
                    q = task % 4
                    acc = cute.make_rmem_tensor((4,), f32)
                    acc.fill(0.0)
                    for kk in cutlass.range_constexpr(0, 16 * d, 4):
                        a4 = cute.make_rmem_tensor((4,), f32)
                        cute.autovec_copy(cute.local_tile(sAf[(16 * (p + d) + r, None)], (4,), (4 * p + kk // 4,)), a4)
                        for u in cutlass.range_constexpr(4):
                            t4 = cute.make_rmem_tensor((4,), f32)
                            cute.autovec_copy(cute.local_tile(sT[(16 * p + kk + u, None)], (4,), (4 * p + q,)), t4)
                            for c in cutlass.range_constexpr(4):
                                acc[c] = acc[c] + a4[u] * t4[c]
                    cute.autovec_copy(acc, cute.local_tile(sP[(p, r, None)], (4,), (q,)))
            cute.arch.sync_threads()
            for rd in cutlass.range_constexpr(-(-ntasks // nthr)):
                task = rd * nthr + tidx
                if task < ntasks:
                    p = task // 64
                    r = (task % 64) // 4
                    q = task % 4
                    acc = cute.make_rmem_tensor((4,), f32)
                    acc.fill(0.0)
                    for y in cutlass.range_constexpr(0, 16, 4):
                        d4 = cute.make_rmem_tensor((4,), f32)
                        cute.autovec_copy(cute.local_tile(sT[(16 * (p + d) + r, None)], (4,), (4 * (p + d) + y // 4,)),
                                          d4)
                        for u in cutlass.range_constexpr(4):
                            p4 = cute.make_rmem_tensor((4,), f32)
                            cute.autovec_copy(cute.local_tile(sP[(p, y + u, None)], (4,), (q,)), p4)
                            for c in cutlass.range_constexpr(4):
                                acc[c] = acc[c] + d4[u] * p4[c]
                    for c in cutlass.range_constexpr(4):
                        acc[c] = -acc[c]
                    cute.autovec_copy(acc, cute.local_tile(sT[(16 * (p + d) + r, None)], (4,), (4 * p + q,)))
            cute.arch.sync_threads()

    @cute.jit
    def _store_w_u(self, tidx, sT: cute.Tensor, sB: cute.Tensor, sG: cute.Tensor, sK_mn: cute.Tensor,
                   sV_mn: cute.Tensor, sWst: cute.Tensor, sUst: cute.Tensor, sUst_c: cute.Tensor,
                   mW: cute.Tensor, mU: cute.Tensor, row, copy_atom: cute.CopyAtom):
        K, V = self.K, self.V
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32
        nthr = self.threads
        # ---------------------------------------------------------------- -w = -(T beta Gamma) k, u = (T beta) v
        mma_rs = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, f32, (1, 1, 1), (64, K),
            warpgroup.OperandSource.RMEM)
        thr_rs = mma_rs.get_slice(tidx)
        cA = thr_rs.partition_A(cute.make_identity_tensor((BT, BT)))
        a_tb = cute.make_rmem_tensor(cA.shape, bf16)
        a_tbg = cute.make_rmem_tensor(cA.shape, bf16)
        for i in cutlass.range_constexpr(cute.size(a_tb)):
            r, cc = cA[i]
            tb = sT[r, cc] * sB[cc]
            a_tb[i] = bf16(tb)
            a_tbg[i] = bf16(tb * cute.math.exp(sG[cc], fastmath=True))
        tKm = thr_rs.make_fragment_B(thr_rs.partition_B(sK_mn))
        tVm = thr_rs.make_fragment_B(thr_rs.partition_B(sV_mn))
        acc_w = thr_rs.make_fragment_C(thr_rs.partition_shape_C((BT, K)))
        acc_u = thr_rs.make_fragment_C(thr_rs.partition_shape_C((BT, V)))
        cute.arch.sync_threads()   # every thread is done with A, T, P: the scratch becomes staging
        fence_operand(a_tb)
        fence_operand(a_tbg)
        warpgroup.fence()
        wg_gemm(mma_rs, acc_w, a_tbg, tKm, True)
        wg_gemm(mma_rs, acc_u, a_tb, tVm, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_w)
        fence_operand(acc_u)

        tWst = thr_rs.partition_C(sWst)
        tUst = thr_rs.partition_C(sUst_c)
        for i in cutlass.range_constexpr(cute.size(acc_w)):
            tWst[i] = bf16(-acc_w[i])
            tUst[i] = bf16(acc_u[i])
        cute.arch.sync_threads()

        # 128-bit stores of the staged rows: -w rows (64 x 128) and u^T rows (128 x 64)
        cp_w = cute.make_tiled_copy_tv(copy_atom, cute.make_layout((nthr // 16, 16), stride=(16, 1)),
                                       cute.make_layout((1, 8)))
        thr_w = cp_w.get_slice(tidx)
        gW = cute.local_tile(mW, (BT, K), (row, 0))
        cute.copy(cp_w, thr_w.partition_S(sWst), thr_w.partition_D(gW))
        cp_u = cute.make_tiled_copy_tv(copy_atom, cute.make_layout((nthr // 8, 8), stride=(8, 1)),
                                       cute.make_layout((1, 8)))
        thr_u = cp_u.get_slice(tidx)
        gU = cute.local_tile(mU, (V, BT), (row, 0))
        cute.copy(cp_u, thr_u.partition_S(sUst), thr_u.partition_D(gU))
