"""Backward, output and state paths of one chunk (SM90, CuTe DSL): dq, part of dk, dw, part of dG.

Per (chunk, value head), with S the bf16 state at the chunk start ([K, V]), dS' the bf16 gradient of the
state at the chunk end, vn / dvn the bf16 v_new and its gradient, P = Aqk (scale, causal decay folded)::

    dq1  = dO S^T                 dP = dO vn^T,  dP^T = vn dO^T            (SS wgmma, K-major operands)
    dPm  = dP * scale exp(G_t - G_s) [s <= t < valid]
    dq   = scale Gamma_t dq1 + dPm k                                       (RS wgmma, k MN-major)
    dk   = d_s (vn dS'^T) + dPm^T q        (+ the WY part, kernel bwd_wy)
    dw   = -dvn S^T                        (bf16 workspace for bwd_wy)
    dG   = scale Gamma_t (q_t . dq1_t) + rowsum(dP * P) - colsum(dP * P) - d_s (k_s . (vn dS'^T)_s)
           + [t = 63] (sum_s d_s (k_s . (vn dS'^T)_s) + Gamma_C <S, dS'>)

(``d_s = exp(G_C - G_s)``; the row dots use ldmatrix copies of q, k, P into the accumulator layout and
quad shuffles; every accumulator row has one owner thread, which adds into the shared dG.)

Grid ``(total_chunks, Hv)``, one warpgroup.  One mbarrier guards the TMA loads of q, k, dO, vn, dvn
(64 x 128), S, dS' (128 x 128) and P (64 x 64), ~152 KiB of shared memory.  Rows past the sequence end
are zeroed for q, k and dO (the workspace tiles are zero-padded already).

Outputs: dq [T, Hv, K] (fp32, final per value head), dk [T, Hv, K] (fp32, partial, completed by
bwd_wy), dw [c, h, 64, K] (bf16), dG1 [c, h, 64] (fp32, the gate gradient before the reverse cumsum).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from ._sm90 import (acc_as_a_operand, chunk_coords, fence_operand, init_tx_barrier, ldsm_c_copy, quad_sum,
                    tma_load, token_tile, warp_sum, wg_gemm, wide, zero_rows_past_end)

BT = 64


class ChunkBwdDqkSm90:
    def __init__(self, K: int = 128, V: int = 128):
        assert K == 128 and V == 128
        self.K, self.V = K, V
        self.threads = 128

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, do_ptr: cute.Pointer,
                 s_ptr: cute.Pointer, dh_ptr: cute.Pointer, vn_ptr: cute.Pointer, dvn_ptr: cute.Pointer,
                 a_ptr: cute.Pointer, g_ptr: cute.Pointer,
                 dq_ptr: cute.Pointer, dk_ptr: cute.Pointer, dw_ptr: cute.Pointer, dg1_ptr: cute.Pointer,
                 cu_ptr: cute.Pointer, ci_ptr: cute.Pointer,
                 total_tokens: cutlass.Int32, total_chunks: cutlass.Int32, num_seqs: cutlass.Int32,
                 hqk: cutlass.Int32, hv: cutlass.Int32, scale: cutlass.Float32, stream: cuda.CUstream):
        K, V = self.K, self.V
        bf16 = cutlass.BFloat16
        rows = total_chunks * hv
        mQ = cute.make_tensor(q_ptr, cute.make_layout((total_tokens, K, hqk), stride=(hqk * K, 1, K)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((total_tokens, K, hqk), stride=(hqk * K, 1, K)))
        mDO = cute.make_tensor(do_ptr, cute.make_layout((total_tokens, V, hv), stride=(hv * V, 1, V)))
        mS = cute.make_tensor(s_ptr, cute.make_layout((rows * K, V), stride=(V, 1)))
        mDS = cute.make_tensor(dh_ptr, cute.make_layout((rows * K, V), stride=(V, 1)))
        mVN = cute.make_tensor(vn_ptr, cute.make_layout((rows * BT, V), stride=(V, 1)))
        mDVN = cute.make_tensor(dvn_ptr, cute.make_layout((rows * BT, V), stride=(V, 1)))
        mA = cute.make_tensor(a_ptr, cute.make_layout((rows * BT, BT), stride=(BT, 1)))
        mG = cute.make_tensor(g_ptr, cute.make_layout((rows * BT,), stride=(1,)))
        kstride = wide(hv * K, K)   # 64-bit: dq / dk offsets pass 2^31 elements at ~1M tokens x 32 heads
        mDQ = cute.make_tensor(dq_ptr, cute.make_layout((total_tokens, hv, K), stride=(kstride, K, 1)))
        mDK = cute.make_tensor(dk_ptr, cute.make_layout((total_tokens, hv, K), stride=(kstride, K, 1)))
        mDW = cute.make_tensor(dw_ptr, cute.make_layout((rows * BT, K), stride=(wide(K, K), 1)))
        mDG1 = cute.make_tensor(dg1_ptr, cute.make_layout((rows * BT,), stride=(1,)))
        mCu = cute.make_tensor(cu_ptr, cute.make_layout((num_seqs + 1,)))
        mCi = cute.make_tensor(ci_ptr, cute.make_layout((total_chunks, 2), stride=(2, 1)))

        atom128 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16)
        l_t = cute.tile_to_shape(atom128, (BT, K), order=(0, 1))      # 64 x 128 token tiles
        l_s = cute.tile_to_shape(atom128, (K, V), order=(0, 1))       # 128 x 128 state tiles
        l_a = cute.tile_to_shape(atom128, (BT, BT), order=(0, 1))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, mQ, l_t, (BT, K))
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mK, l_t, (BT, K))
        tma_do, tDO = cpasync.make_tiled_tma_atom(g2s, mDO, l_t, (BT, V))
        tma_s, tS = cpasync.make_tiled_tma_atom(g2s, mS, l_s, (K, V))
        tma_ds, tDS = cpasync.make_tiled_tma_atom(g2s, mDS, l_s, (K, V))
        tma_vn, tVN = cpasync.make_tiled_tma_atom(g2s, mVN, l_t, (BT, V))
        tma_dvn, tDVN = cpasync.make_tiled_tma_atom(g2s, mDVN, l_t, (BT, V))
        tma_a, tA = cpasync.make_tiled_tma_atom(g2s, mA, l_a, (BT, BT))
        self.tx_bytes = (5 * BT * K + 2 * K * V + BT * BT) * 2

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 1]
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sVN: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sDVN: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_s)], 1024]
            sDS: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_s)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_a)], 1024]
            sG: cute.struct.MemRange[cutlass.Float32, BT]
            sdG: cute.struct.MemRange[cutlass.Float32, BT]
            sRed: cute.struct.MemRange[cutlass.Float32, 8]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        group = hv // hqk
        self.kernel(tma_q, tQ, tma_k, tK, tma_do, tDO, tma_s, tS, tma_ds, tDS, tma_vn, tVN, tma_dvn, tDVN,
                    tma_a, tA, mG, mDQ, mDK, mDW, mDG1, mCu, mCi, hv, group, scale, l_t, l_s, l_a).launch(
            grid=(total_chunks, hv, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, tQ: cute.Tensor, tma_k: cute.CopyAtom, tK: cute.Tensor,
               tma_do: cute.CopyAtom, tDO: cute.Tensor, tma_s: cute.CopyAtom, tS: cute.Tensor,
               tma_ds: cute.CopyAtom, tDS: cute.Tensor, tma_vn: cute.CopyAtom, tVN: cute.Tensor,
               tma_dvn: cute.CopyAtom, tDVN: cute.Tensor, tma_a: cute.CopyAtom, tA: cute.Tensor,
               mG: cute.Tensor, mDQ: cute.Tensor, mDK: cute.Tensor, mDW: cute.Tensor, mDG1: cute.Tensor,
               mCu: cute.Tensor, mCi: cute.Tensor, hv: cutlass.Int32, group: cutlass.Int32,
               scale: cutlass.Float32, l_t: cute.ComposedLayout, l_s: cute.ComposedLayout,
               l_a: cute.ComposedLayout):
        K, V = self.K, self.V
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32
        nthr = self.threads
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        chunk, head, _ = cute.arch.block_idx()

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mbar = storage.mbar.data_ptr()
        sQ = storage.sQ.get_tensor(l_t.outer, swizzle=l_t.inner)
        sK = storage.sK.get_tensor(l_t.outer, swizzle=l_t.inner)
        sDO = storage.sDO.get_tensor(l_t.outer, swizzle=l_t.inner)
        sVN = storage.sVN.get_tensor(l_t.outer, swizzle=l_t.inner)
        sDVN = storage.sDVN.get_tensor(l_t.outer, swizzle=l_t.inner)
        sS = storage.sS.get_tensor(l_s.outer, swizzle=l_s.inner)
        sDS = storage.sDS.get_tensor(l_s.outer, swizzle=l_s.inner)
        sA = storage.sA.get_tensor(l_a.outer, swizzle=l_a.inner)
        sQ_mn = storage.sQ.get_tensor(cute.select(l_t, mode=[1, 0]).outer, swizzle=l_t.inner)
        sK_mn = storage.sK.get_tensor(cute.select(l_t, mode=[1, 0]).outer, swizzle=l_t.inner)
        sA_mn = storage.sA.get_tensor(cute.select(l_a, mode=[1, 0]).outer, swizzle=l_a.inner)
        sQ_raw = cute.make_tensor(storage.sQ.data_ptr(), l_t.outer)
        sK_raw = cute.make_tensor(storage.sK.data_ptr(), l_t.outer)
        sDO_raw = cute.make_tensor(storage.sDO.data_ptr(), l_t.outer)
        # flat aliases of the two state tiles: the same swizzle permutes both identically, so the
        # element-wise product summed over the raw buffers is the Frobenius product <S, dS'>
        sS_flat = cute.make_tensor(storage.sS.data_ptr(), cute.make_layout((K * V,)))
        sDS_flat = cute.make_tensor(storage.sDS.data_ptr(), cute.make_layout((K * V,)))
        sG = storage.sG.get_tensor(cute.make_layout((BT,)))
        sdG = storage.sdG.get_tensor(cute.make_layout((BT,)))
        sRed = storage.sRed.get_tensor(cute.make_layout((8,)))

        tok, valid, qk_head, row = chunk_coords(mCi, mCu, chunk, head, hv, group, BT)

        init_tx_barrier(mbar, tidx)
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_do, tma_s, tma_ds, tma_vn, tma_dvn, tma_a):
                cpasync.prefetch_descriptor(atom)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, self.tx_bytes)
            gq = token_tile(tQ, qk_head, tok, 0, BT, K)
            gk = token_tile(tK, qk_head, tok, 0, BT, K)
            gdo = token_tile(tDO, head, tok, 0, BT, V)
            gs = cute.local_tile(tS, (K, V), (row, 0))
            gds = cute.local_tile(tDS, (K, V), (row, 0))
            gvn = cute.local_tile(tVN, (BT, V), (row, 0))
            gdvn = cute.local_tile(tDVN, (BT, V), (row, 0))
            ga = cute.local_tile(tA, (BT, BT), (row, 0))
            for atom, s_t, g_t in ((tma_q, sQ, gq), (tma_k, sK, gk), (tma_do, sDO, gdo), (tma_s, sS, gs),
                                   (tma_ds, sDS, gds), (tma_vn, sVN, gvn), (tma_dvn, sDVN, gdvn),
                                   (tma_a, sA, ga)):
                tma_load(atom, s_t, g_t, mbar)
        if tidx < BT:
            sG[tidx] = mG[row * BT + tidx]
            sdG[tidx] = f32(0.0)
        cute.arch.mbarrier_wait(mbar, 0)
        zero_rows_past_end(((sQ_raw, K), (sK_raw, K), (sDO_raw, K)), valid, tidx, nthr, BT, K)
        cute.arch.sync_threads()

        KM = warpgroup.OperandMajorMode.K
        MN = warpgroup.OperandMajorMode.MN
        mma_n128 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, KM, KM, f32, (1, 1, 1), (64, K))
        mma_n64 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, KM, KM, f32, (1, 1, 1), (64, BT))
        mma_rs = sm90_utils.make_trivial_tiled_mma(bf16, bf16, KM, MN, f32, (1, 1, 1), (64, K),
                                                   warpgroup.OperandSource.RMEM)
        t128 = mma_n128.get_slice(tidx)
        t64 = mma_n64.get_slice(tidx)
        trs = mma_rs.get_slice(tidx)

        g_last = sG[BT - 1]
        cC128 = t128.partition_C(cute.make_identity_tensor((BT, K)))
        cC64 = t64.partition_C(cute.make_identity_tensor((BT, BT)))
        r0 = cC64[0][0]      # the two accumulator rows this thread owns (v1 = 0, 1)
        r1 = cC64[2][0]
        owner = (tidx % 4) == 0

        # ---------------------------------------------------------------- dq1, dP, dP^T
        acc_dq = t128.make_fragment_C(t128.partition_shape_C((BT, K)))
        acc_dp = t64.make_fragment_C(t64.partition_shape_C((BT, BT)))
        acc_dpt = t64.make_fragment_C(t64.partition_shape_C((BT, BT)))
        warpgroup.fence()
        wg_gemm(mma_n128, acc_dq, t128.make_fragment_A(t128.partition_A(sDO)),
                t128.make_fragment_B(t128.partition_B(sS)), True)
        wg_gemm(mma_n64, acc_dp, t64.make_fragment_A(t64.partition_A(sDO)),
                t64.make_fragment_B(t64.partition_B(sVN)), True)
        wg_gemm(mma_n64, acc_dpt, t64.make_fragment_A(t64.partition_A(sVN)),
                t64.make_fragment_B(t64.partition_B(sDO)), True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_dq)
        fence_operand(acc_dp)
        fence_operand(acc_dpt)

        # q, P and P^T in the accumulator layouts
        cp128, th128 = ldsm_c_copy(mma_n128, tidx, False)
        cp64, th64 = ldsm_c_copy(mma_n64, tidx, False)
        cp64t, th64t = ldsm_c_copy(mma_n64, tidx, True)
        rq = cute.make_rmem_tensor(acc_dq.shape, bf16)
        cute.copy(cp128, th128.partition_S(sQ), th128.retile(rq))
        rp = cute.make_rmem_tensor(acc_dp.shape, bf16)
        cute.copy(cp64, th64.partition_S(sA), th64.retile(rp))
        rpt = cute.make_rmem_tensor(acc_dpt.shape, bf16)
        cute.copy(cp64t, th64t.partition_S(sA_mn), th64t.retile(rpt))

        # dG_t += scale Gamma_t (q_t . dq1_t);  then dq = scale Gamma_t dq1
        p0 = f32(0.0)
        p1 = f32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc_dq)):
            x = acc_dq[i] * f32(rq[i])
            if cutlass.const_expr((i // 2) % 2 == 0):
                p0 = p0 + x
            else:
                p1 = p1 + x
        p0 = quad_sum(p0)
        p1 = quad_sum(p1)
        gam0 = scale * cute.math.exp(sG[r0], fastmath=True)
        gam1 = scale * cute.math.exp(sG[r1], fastmath=True)
        if owner:
            sdG[r0] = sdG[r0] + gam0 * p0
            sdG[r1] = sdG[r1] + gam1 * p1
        for i in cutlass.range_constexpr(cute.size(acc_dq)):
            if cutlass.const_expr((i // 2) % 2 == 0):
                acc_dq[i] = acc_dq[i] * gam0
            else:
                acc_dq[i] = acc_dq[i] * gam1

        # the decayed causal mask of P: rows t (dP) or columns t (dP^T)
        p0 = f32(0.0)
        p1 = f32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc_dp)):
            tt, ss = cC64[i]
            x = acc_dp[i] * f32(rp[i])
            if cutlass.const_expr((i // 2) % 2 == 0):
                p0 = p0 + x
            else:
                p1 = p1 + x
            m = f32(0.0)
            if ss <= tt:
                if tt < valid:
                    m = scale * cute.math.exp(sG[tt] - sG[ss], fastmath=True)
            acc_dp[i] = acc_dp[i] * m
        p0 = quad_sum(p0)
        p1 = quad_sum(p1)
        if owner:
            sdG[r0] = sdG[r0] + p0
            sdG[r1] = sdG[r1] + p1
        p0 = f32(0.0)
        p1 = f32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc_dpt)):
            ss, tt = cC64[i]
            x = acc_dpt[i] * f32(rpt[i])
            if cutlass.const_expr((i // 2) % 2 == 0):
                p0 = p0 + x
            else:
                p1 = p1 + x
            m = f32(0.0)
            if ss <= tt:
                if tt < valid:
                    m = scale * cute.math.exp(sG[tt] - sG[ss], fastmath=True)
            acc_dpt[i] = acc_dpt[i] * m
        p0 = quad_sum(p0)
        p1 = quad_sum(p1)
        if owner:
            sdG[r0] = sdG[r0] - p0
            sdG[r1] = sdG[r1] - p1
        a_dpm = acc_as_a_operand(acc_dp, mma_rs, bf16)
        a_dpmt = acc_as_a_operand(acc_dpt, mma_rs, bf16)

        # ---------------------------------------------------------------- dq += dPm k ; dk1 = vn dS'^T
        acc_dk = t128.make_fragment_C(t128.partition_shape_C((BT, K)))
        fence_operand(a_dpm)
        fence_operand(acc_dq)
        warpgroup.fence()
        wg_gemm(mma_rs, acc_dq, a_dpm, trs.make_fragment_B(trs.partition_B(sK_mn)), False)
        wg_gemm(mma_n128, acc_dk, t128.make_fragment_A(t128.partition_A(sVN)),
                t128.make_fragment_B(t128.partition_B(sDS)), True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_dq)
        fence_operand(acc_dk)
        for i in cutlass.range_constexpr(cute.size(acc_dq)):
            tt, kk = cC128[i]
            if tt < valid:
                mDQ[tok + tt, head, kk] = acc_dq[i]

        # d(d_s) = k_s . (vn dS'^T)_s ; dk = d_s (vn dS'^T)
        rk = cute.make_rmem_tensor(acc_dk.shape, bf16)
        cute.copy(cp128, th128.partition_S(sK), th128.retile(rk))
        p0 = f32(0.0)
        p1 = f32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc_dk)):
            x = acc_dk[i] * f32(rk[i])
            if cutlass.const_expr((i // 2) % 2 == 0):
                p0 = p0 + x
            else:
                p1 = p1 + x
        p0 = quad_sum(p0)
        p1 = quad_sum(p1)
        d0 = cute.math.exp(g_last - sG[r0], fastmath=True)
        d1 = cute.math.exp(g_last - sG[r1], fastmath=True)
        part_c = f32(0.0)
        if owner:
            sdG[r0] = sdG[r0] - d0 * p0
            sdG[r1] = sdG[r1] - d1 * p1
            part_c = d0 * p0 + d1 * p1
        for i in cutlass.range_constexpr(cute.size(acc_dk)):
            if cutlass.const_expr((i // 2) % 2 == 0):
                acc_dk[i] = acc_dk[i] * d0
            else:
                acc_dk[i] = acc_dk[i] * d1
        # Gamma_C <S, dS'>, each thread a strided share of the raw buffers
        fro = f32(0.0)
        for j in cutlass.range(K * V // nthr, unroll=8):
            e = j * nthr + tidx
            fro = fro + f32(sS_flat[e]) * f32(sDS_flat[e])
        part_c = part_c + cute.math.exp(g_last, fastmath=True) * fro

        # ---------------------------------------------------------------- dk += dPm^T q ; dw = -dvn S^T
        acc_dw = t128.make_fragment_C(t128.partition_shape_C((BT, K)))
        fence_operand(a_dpmt)
        fence_operand(acc_dk)
        warpgroup.fence()
        wg_gemm(mma_rs, acc_dk, a_dpmt, trs.make_fragment_B(trs.partition_B(sQ_mn)), False)
        wg_gemm(mma_n128, acc_dw, t128.make_fragment_A(t128.partition_A(sDVN)),
                t128.make_fragment_B(t128.partition_B(sS)), True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_dk)
        fence_operand(acc_dw)
        for i in cutlass.range_constexpr(cute.size(acc_dk)):
            tt, kk = cC128[i]
            if tt < valid:
                mDK[tok + tt, head, kk] = acc_dk[i]
        for i in cutlass.range_constexpr(cute.size(acc_dw)):
            tt, kk = cC128[i]
            mDW[row * BT + tt, kk] = bf16(-acc_dw[i])

        # ---------------------------------------------------------------- dG1 = sdG (+ the t = 63 term)
        part_c = warp_sum(part_c)
        if lane == 0:
            sRed[warp_idx] = part_c
        cute.arch.sync_threads()
        if tidx < BT:
            val = sdG[tidx]
            if tidx == BT - 1:
                val = val + sRed[0] + sRed[1] + sRed[2] + sRed[3]
            mDG1[row * BT + tidx] = val
