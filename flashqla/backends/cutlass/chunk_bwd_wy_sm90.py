"""Backward, WY and gate part of one chunk (SM90, CuTe DSL): dv, dbeta, the rest of dk, dg.

Per (chunk, value head), with T = (I + A)^-1 (bf16, saved by the prep kernel), du = dvn and dw from the
previous backward kernels::

    a1 = T^T du              dv_j = beta_j a1_j            dbeta_j  = v_j . a1_j
    a2 = T^T dw              dk_j = beta_j Gamma_j a2_j     dbeta_j += Gamma_j (k_j . a2_j),  dG_j += beta_j Gamma_j (k_j . a2_j)
    dT = (du v^T) diag(beta) + (dw k^T) diag(beta Gamma)
    dA = -T^T (dT T^T)       masked to l > m, l < valid     (dT T^T staged in shared memory by stmatrix)
    dbeta_l += sum_m dA (k_l . k_m) E,   dG_l += sum_m dA A,   dG_m -= sum_l dA A      (E = exp(G_l - G_m))
    F = dA beta_l E          dk += F k + F^T k              (F staged by stmatrix; F^T through the MN view)
    dk += the bwd_dqk part;  dg = reverse cumsum of dG (+ dG1 of bwd_dqk)

Grid ``(total_chunks, Hv)``, one warpgroup; one mbarrier guards the TMA loads of k, v (the inputs, 64 x
128; rows past the sequence end are zeroed), T (64 x 64), dw and du (64 x 128, workspaces).  ~106 KiB of
shared memory.  Outputs: dk [T, Hv, K] (fp32, read-modify-write of the bwd_dqk part), dv [T, Hv, V],
dbeta, dg [T, Hv] (fp32).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from ._sm90 import (acc_as_a_operand, chunk_coords, fence_operand, init_tx_barrier, ldsm_c_copy, quad_sum,
                    tma_load, token_tile, wg_gemm, wide, zero_rows_past_end)

BT = 64
R_PITCH = 65


class ChunkBwdWySm90:
    def __init__(self, K: int = 128, V: int = 128):
        assert K == 128 and V == 128
        self.K, self.V = K, V
        self.threads = 128

    @cute.jit
    def __call__(self, k_ptr: cute.Pointer, v_ptr: cute.Pointer, beta_ptr: cute.Pointer,
                 t_ptr: cute.Pointer, dw_ptr: cute.Pointer, du_ptr: cute.Pointer, g_ptr: cute.Pointer,
                 dg1_ptr: cute.Pointer, dk_ptr: cute.Pointer, dv_ptr: cute.Pointer, db_ptr: cute.Pointer,
                 dg_ptr: cute.Pointer, cu_ptr: cute.Pointer, ci_ptr: cute.Pointer,
                 total_tokens: cutlass.Int32, total_chunks: cutlass.Int32, num_seqs: cutlass.Int32,
                 hqk: cutlass.Int32, hv: cutlass.Int32, stream: cuda.CUstream):
        K, V = self.K, self.V
        bf16 = cutlass.BFloat16
        rows = total_chunks * hv
        mK = cute.make_tensor(k_ptr, cute.make_layout((total_tokens, K, hqk), stride=(hqk * K, 1, K)))
        mV = cute.make_tensor(v_ptr, cute.make_layout((total_tokens, V, hv), stride=(hv * V, 1, V)))
        mB = cute.make_tensor(beta_ptr, cute.make_layout((total_tokens, hv), stride=(hv, 1)))
        mT = cute.make_tensor(t_ptr, cute.make_layout((rows * BT, BT), stride=(BT, 1)))
        mDW = cute.make_tensor(dw_ptr, cute.make_layout((rows * BT, K), stride=(K, 1)))
        mDU = cute.make_tensor(du_ptr, cute.make_layout((rows * BT, V), stride=(V, 1)))
        mG = cute.make_tensor(g_ptr, cute.make_layout((rows * BT,), stride=(1,)))
        mDG1 = cute.make_tensor(dg1_ptr, cute.make_layout((rows * BT,), stride=(1,)))
        kstride = wide(hv * K, K)   # 64-bit: dk / dv offsets pass 2^31 elements at ~1M tokens x 32 heads
        mDK = cute.make_tensor(dk_ptr, cute.make_layout((total_tokens, hv, K), stride=(kstride, K, 1)))
        mDV = cute.make_tensor(dv_ptr, cute.make_layout((total_tokens, hv, V), stride=(kstride, V, 1)))
        mDB = cute.make_tensor(db_ptr, cute.make_layout((total_tokens, hv), stride=(hv, 1)))
        mDg = cute.make_tensor(dg_ptr, cute.make_layout((total_tokens, hv), stride=(hv, 1)))
        mCu = cute.make_tensor(cu_ptr, cute.make_layout((num_seqs + 1,)))
        mCi = cute.make_tensor(ci_ptr, cute.make_layout((total_chunks, 2), stride=(2, 1)))

        atom128 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, bf16)
        l_t = cute.tile_to_shape(atom128, (BT, K), order=(0, 1))
        l_a = cute.tile_to_shape(atom128, (BT, BT), order=(0, 1))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mK, l_t, (BT, K))
        tma_v, tV = cpasync.make_tiled_tma_atom(g2s, mV, l_t, (BT, V))
        tma_t, tT = cpasync.make_tiled_tma_atom(g2s, mT, l_a, (BT, BT))
        tma_dw, tDW = cpasync.make_tiled_tma_atom(g2s, mDW, l_t, (BT, K))
        tma_du, tDU = cpasync.make_tiled_tma_atom(g2s, mDU, l_t, (BT, V))
        self.tx_bytes = (4 * BT * K + BT * BT) * 2

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 1]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sDW: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sDU: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_t)], 1024]
            sT: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_a)], 1024]
            sZ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_a)], 1024]
            sF: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_a)], 1024]
            sR: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BT * R_PITCH], 128]
            sG: cute.struct.MemRange[cutlass.Float32, BT]
            sB: cute.struct.MemRange[cutlass.Float32, BT]
            sdG: cute.struct.MemRange[cutlass.Float32, BT]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        group = hv // hqk
        self.kernel(tma_k, tK, tma_v, tV, tma_t, tT, tma_dw, tDW, tma_du, tDU, mB, mG, mDG1, mDK, mDV,
                    mDB, mDg, mCu, mCi, hv, group, l_t, l_a).launch(
            grid=(total_chunks, hv, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, tma_k: cute.CopyAtom, tK: cute.Tensor, tma_v: cute.CopyAtom, tV: cute.Tensor,
               tma_t: cute.CopyAtom, tT: cute.Tensor, tma_dw: cute.CopyAtom, tDW: cute.Tensor,
               tma_du: cute.CopyAtom, tDU: cute.Tensor, mB: cute.Tensor, mG: cute.Tensor,
               mDG1: cute.Tensor, mDK: cute.Tensor, mDV: cute.Tensor, mDB: cute.Tensor, mDg: cute.Tensor,
               mCu: cute.Tensor, mCi: cute.Tensor, hv: cutlass.Int32, group: cutlass.Int32,
               l_t: cute.ComposedLayout, l_a: cute.ComposedLayout):
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
        sK = storage.sK.get_tensor(l_t.outer, swizzle=l_t.inner)
        sV = storage.sV.get_tensor(l_t.outer, swizzle=l_t.inner)
        sDW = storage.sDW.get_tensor(l_t.outer, swizzle=l_t.inner)
        sDU = storage.sDU.get_tensor(l_t.outer, swizzle=l_t.inner)
        sT = storage.sT.get_tensor(l_a.outer, swizzle=l_a.inner)
        sZ = storage.sZ.get_tensor(l_a.outer, swizzle=l_a.inner)
        sF = storage.sF.get_tensor(l_a.outer, swizzle=l_a.inner)
        mn_t = cute.select(l_t, mode=[1, 0])
        mn_a = cute.select(l_a, mode=[1, 0])
        sK_mn = storage.sK.get_tensor(mn_t.outer, swizzle=l_t.inner)
        sDW_mn = storage.sDW.get_tensor(mn_t.outer, swizzle=l_t.inner)
        sDU_mn = storage.sDU.get_tensor(mn_t.outer, swizzle=l_t.inner)
        sT_mn = storage.sT.get_tensor(mn_a.outer, swizzle=l_a.inner)
        sZ_mn = storage.sZ.get_tensor(mn_a.outer, swizzle=l_a.inner)
        sF_mn = storage.sF.get_tensor(mn_a.outer, swizzle=l_a.inner)
        sK_raw = cute.make_tensor(storage.sK.data_ptr(), l_t.outer)
        sV_raw = cute.make_tensor(storage.sV.data_ptr(), l_t.outer)
        sR = storage.sR.get_tensor(cute.make_layout((BT, BT), stride=(R_PITCH, 1)))
        sG = storage.sG.get_tensor(cute.make_layout((BT,)))
        sB = storage.sB.get_tensor(cute.make_layout((BT,)))
        sdG = storage.sdG.get_tensor(cute.make_layout((BT,)))

        tok, valid, qk_head, row = chunk_coords(mCi, mCu, chunk, head, hv, group, BT)

        init_tx_barrier(mbar, tidx)
        if warp_idx == 0:
            for atom in (tma_k, tma_v, tma_t, tma_dw, tma_du):
                cpasync.prefetch_descriptor(atom)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, self.tx_bytes)
            gk = token_tile(tK, qk_head, tok, 0, BT, K)
            gv = token_tile(tV, head, tok, 0, BT, V)
            gt = cute.local_tile(tT, (BT, BT), (row, 0))
            gdw = cute.local_tile(tDW, (BT, K), (row, 0))
            gdu = cute.local_tile(tDU, (BT, V), (row, 0))
            for atom, s_t, g_t in ((tma_k, sK, gk), (tma_v, sV, gv), (tma_t, sT, gt), (tma_dw, sDW, gdw),
                                   (tma_du, sDU, gdu)):
                tma_load(atom, s_t, g_t, mbar)
        if tidx < BT:
            bval = f32(0.0)
            if tidx < valid:
                bval = f32(mB[tok + tidx, head])
            sB[tidx] = bval
            sG[tidx] = mG[row * BT + tidx]
            sdG[tidx] = mDG1[row * BT + tidx]
        cute.arch.mbarrier_wait(mbar, 0)
        zero_rows_past_end(((sK_raw, K), (sV_raw, V)), valid, tidx, nthr, BT, K)
        cute.arch.sync_threads()

        KM = warpgroup.OperandMajorMode.K
        MN = warpgroup.OperandMajorMode.MN
        mma_mm128 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, MN, MN, f32, (1, 1, 1), (64, K))
        mma_kk64 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, KM, KM, f32, (1, 1, 1), (64, BT))
        mma_rk64 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, KM, KM, f32, (1, 1, 1), (64, BT),
                                                     warpgroup.OperandSource.RMEM)
        mma_mm64 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, MN, MN, f32, (1, 1, 1), (64, BT))
        mma_km128 = sm90_utils.make_trivial_tiled_mma(bf16, bf16, KM, MN, f32, (1, 1, 1), (64, K))
        t_mm128 = mma_mm128.get_slice(tidx)
        t_kk64 = mma_kk64.get_slice(tidx)
        t_rk64 = mma_rk64.get_slice(tidx)
        t_mm64 = mma_mm64.get_slice(tidx)
        t_km128 = mma_km128.get_slice(tidx)
        cC128 = t_mm128.partition_C(cute.make_identity_tensor((BT, K)))
        cC64 = t_kk64.partition_C(cute.make_identity_tensor((BT, BT)))
        r0 = cC64[0][0]
        r1 = cC64[2][0]
        owner = (tidx % 4) == 0
        cp128, th128 = ldsm_c_copy(mma_mm128, tidx, False)

        beta0 = sB[r0]
        beta1 = sB[r1]
        gam0 = cute.math.exp(sG[r0], fastmath=True)
        gam1 = cute.math.exp(sG[r1], fastmath=True)
        db0 = f32(0.0)
        db1 = f32(0.0)
        tA_T = t_mm128.make_fragment_A(t_mm128.partition_A(sT_mn))

        # ---------------------------------------------------------------- a1 = T^T du: dv, dbeta
        acc1 = t_mm128.make_fragment_C(t_mm128.partition_shape_C((BT, V)))
        warpgroup.fence()
        wg_gemm(mma_mm128, acc1, tA_T, t_mm128.make_fragment_B(t_mm128.partition_B(sDU_mn)), True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc1)
        rv = cute.make_rmem_tensor(acc1.shape, bf16)
        cute.copy(cp128, th128.partition_S(sV), th128.retile(rv))
        p0 = f32(0.0)
        p1 = f32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc1)):
            x = acc1[i] * f32(rv[i])
            if cutlass.const_expr((i // 2) % 2 == 0):
                p0 = p0 + x
            else:
                p1 = p1 + x
        db0 = db0 + quad_sum(p0)
        db1 = db1 + quad_sum(p1)
        for i in cutlass.range_constexpr(cute.size(acc1)):
            jj, vv = cC128[i]
            bj = beta1
            if cutlass.const_expr((i // 2) % 2 == 0):
                bj = beta0
            if jj < valid:
                mDV[tok + jj, head, vv] = acc1[i] * bj

        # ---------------------------------------------------------------- a2 = T^T dw, X = du v^T, Y = dw k^T, k k^T
        acc_dk = t_mm128.make_fragment_C(t_mm128.partition_shape_C((BT, K)))
        acc_x = t_kk64.make_fragment_C(t_kk64.partition_shape_C((BT, BT)))
        acc_y = t_kk64.make_fragment_C(t_kk64.partition_shape_C((BT, BT)))
        acc_kk = t_kk64.make_fragment_C(t_kk64.partition_shape_C((BT, BT)))
        tKa = t_kk64.make_fragment_A(t_kk64.partition_A(sK))
        tKb = t_kk64.make_fragment_B(t_kk64.partition_B(sK))
        warpgroup.fence()
        wg_gemm(mma_mm128, acc_dk, tA_T, t_mm128.make_fragment_B(t_mm128.partition_B(sDW_mn)), True)
        wg_gemm(mma_kk64, acc_x, t_kk64.make_fragment_A(t_kk64.partition_A(sDU)),
                t_kk64.make_fragment_B(t_kk64.partition_B(sV)), True)
        wg_gemm(mma_kk64, acc_y, t_kk64.make_fragment_A(t_kk64.partition_A(sDW)), tKb, True)
        wg_gemm(mma_kk64, acc_kk, tKa, tKb, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_dk)
        fence_operand(acc_x)
        fence_operand(acc_y)
        fence_operand(acc_kk)

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
        db0 = db0 + gam0 * p0
        db1 = db1 + gam1 * p1
        if owner:
            sdG[r0] = sdG[r0] + beta0 * gam0 * p0
            sdG[r1] = sdG[r1] + beta1 * gam1 * p1
        for i in cutlass.range_constexpr(cute.size(acc_dk)):
            if cutlass.const_expr((i // 2) % 2 == 0):
                acc_dk[i] = acc_dk[i] * (beta0 * gam0)
            else:
                acc_dk[i] = acc_dk[i] * (beta1 * gam1)

        # dT = X diag(beta) + Y diag(beta Gamma) (columns j)
        for i in cutlass.range_constexpr(cute.size(acc_x)):
            jj = cC64[i][1]
            bj = sB[jj]
            acc_x[i] = bj * (acc_x[i] + acc_y[i] * cute.math.exp(sG[jj], fastmath=True))
        a_dt = acc_as_a_operand(acc_x, mma_rk64, bf16)

        # ---------------------------------------------------------------- Z = dT T^T  (staged as bf16)
        acc_z = t_rk64.make_fragment_C(t_rk64.partition_shape_C((BT, BT)))
        fence_operand(a_dt)
        warpgroup.fence()
        wg_gemm(mma_rk64, acc_z, a_dt, t_rk64.make_fragment_B(t_rk64.partition_B(sT)), True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_z)
        stsm = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), bf16)
        st_copy = cute.make_tiled_copy_C(stsm, mma_kk64)
        st_thr = st_copy.get_slice(tidx)
        z_b = cute.make_rmem_tensor(acc_z.shape, bf16)
        z_b.store(acc_z.load().to(bf16))
        cute.copy(st_copy, st_thr.retile(z_b), st_thr.partition_D(sZ))
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

        # ---------------------------------------------------------------- dA = -T^T Z, masked; A, F
        acc_da = t_mm64.make_fragment_C(t_mm64.partition_shape_C((BT, BT)))
        warpgroup.fence()
        wg_gemm(mma_mm64, acc_da, t_mm64.make_fragment_A(t_mm64.partition_A(sT_mn)),
                t_mm64.make_fragment_B(t_mm64.partition_B(sZ_mn)), True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_da)
        pb0 = f32(0.0)
        pb1 = f32(0.0)
        pg0 = f32(0.0)
        pg1 = f32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc_da)):
            ll, mm = cC64[i]
            da = f32(0.0)
            e_lm = f32(0.0)
            if mm < ll:
                if ll < valid:
                    da = -acc_da[i]
                    e_lm = cute.math.exp(sG[ll] - sG[mm], fastmath=True)
            bl = beta1
            if cutlass.const_expr((i // 2) % 2 == 0):
                bl = beta0
            xb = da * acc_kk[i] * e_lm          # dA (k_l . k_m) E
            xg = xb * bl                         # dA A
            if cutlass.const_expr((i // 2) % 2 == 0):
                pb0 = pb0 + xb
                pg0 = pg0 + xg
            else:
                pb1 = pb1 + xb
                pg1 = pg1 + xg
            sR[ll, mm] = xg
            acc_da[i] = da * bl * e_lm          # F
        db0 = db0 + quad_sum(pb0)
        db1 = db1 + quad_sum(pb1)
        pg0 = quad_sum(pg0)
        pg1 = quad_sum(pg1)
        if owner:
            sdG[r0] = sdG[r0] + pg0
            sdG[r1] = sdG[r1] + pg1
        f_b = cute.make_rmem_tensor(acc_da.shape, bf16)
        f_b.store(acc_da.load().to(bf16))
        cute.copy(st_copy, st_thr.retile(f_b), st_thr.partition_D(sF))
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

        # ---------------------------------------------------------------- dk += F k + F^T k (+ bwd_dqk part)
        tKm = t_km128.make_fragment_B(t_km128.partition_B(sK_mn))
        warpgroup.fence()
        wg_gemm(mma_km128, acc_dk, t_km128.make_fragment_A(t_km128.partition_A(sF)), tKm, False)
        wg_gemm(mma_mm128, acc_dk, t_mm128.make_fragment_A(t_mm128.partition_A(sF_mn)),
                t_mm128.make_fragment_B(t_mm128.partition_B(sK_mn)), False)
        warpgroup.commit_group()
        # meanwhile: column sums of dA * A (dG_m -= ...) from the staged products
        if tidx < BT:
            colsum = f32(0.0)
            for ll in cutlass.range_constexpr(BT):
                colsum = colsum + sR[ll, tidx]
            sdG[tidx] = sdG[tidx] - colsum
        warpgroup.wait_group(0)
        fence_operand(acc_dk)
        for i in cutlass.range_constexpr(cute.size(acc_dk)):
            jj, kk = cC128[i]
            if jj < valid:
                mDK[tok + jj, head, kk] = acc_dk[i] + mDK[tok + jj, head, kk]
        if owner:
            if r0 < valid:
                mDB[tok + r0, head] = db0
            if r1 < valid:
                mDB[tok + r1, head] = db1
        cute.arch.sync_threads()
        # dg_t = sum_{t' >= t} dG_t'
        if tidx < BT:
            acc = f32(0.0)
            for j in cutlass.range_constexpr(BT):
                if j >= tidx:
                    acc = acc + sdG[j]
            if tidx < valid:
                mDg[tok + tidx, head] = acc
