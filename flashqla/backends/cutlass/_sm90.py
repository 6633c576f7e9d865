"""Small SM90 building blocks shared by the CuTe DSL kernels of this backend.

Only imported from inside the kernel modules, i.e. after ``cutlass`` imported fine.

* :func:`fence_operand` -- an empty inline-asm "register fence" on every value of a fragment, so the
  compiler cannot move reads or writes of accumulator / operand registers across ``wgmma`` issue and
  ``wgmma.wait_group`` (the registers of an in-flight ``wgmma`` belong to the tensor core).
* :func:`acc_as_a_operand` -- re-type an fp32 accumulator fragment ``[M, N]`` as the bf16 register
  A-operand ``[M, K=N]`` of a following warpgroup MMA.  For 16-bit types the C fragment of
  ``m64nNk16`` and the A fragment of ``m64nXk16`` hold the same (row, column) pairs in the same order,
  so this is a value-wise conversion plus a layout re-interpretation (no data movement).
* :func:`wg_gemm` -- one warpgroup GEMM over all K blocks of the operand fragments.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T

NUM_THREADS_PER_WG = 128


@cute.jit
def _fence_f32(x: cutlass.Float32) -> cutlass.Float32:
    return cutlass.Float32(
        llvm.inline_asm(T.f32(), [x.ir_value()], "", "=f,0", has_side_effects=True,
                        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def _fence_u32(x: cutlass.Uint32) -> cutlass.Uint32:
    return cutlass.Uint32(
        llvm.inline_asm(T.i32(), [x.ir_value()], "", "=r,0", has_side_effects=True,
                        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def fence_operand(frag: cute.Tensor):
    if cutlass.const_expr(frag.element_type is cutlass.Float32):
        for i in cutlass.range_constexpr(cute.size(frag)):
            frag[i] = _fence_f32(frag[i])
    else:
        as_u32 = cute.recast_tensor(frag, cutlass.Uint32)
        for i in cutlass.range_constexpr(cute.size(as_u32)):
            as_u32[i] = _fence_u32(as_u32[i])


def _c_layout_as_a_layout(c_layout, a_value_layout):
    """((vals), MMA_M, MMA_N) accumulator layout -> ((a vals), MMA_M, (MMA_N, k blocks per C column block))."""
    return cute.make_layout(
        (a_value_layout, c_layout.shape[1],
         (c_layout.shape[2], cute.size(c_layout, mode=[0]) // cute.size(a_value_layout))),
        stride=(c_layout.stride[0], c_layout.stride[1],
                (c_layout.stride[2], cute.size(a_value_layout, mode=[2]) * c_layout.stride[0][2])),
    )


@cute.jit
def acc_as_a_operand(acc: cute.Tensor, tiled_mma_next: cute.TiledMma, dtype) -> cute.Tensor:
    op = cute.make_rmem_tensor_like(
        _c_layout_as_a_layout(acc.layout, tiled_mma_next.tv_layout_A.shape[1]), dtype)
    op_as_acc = cute.make_tensor(op.iterator, acc.layout)
    op_as_acc.store(acc.load().to(dtype))
    return op


@cute.jit
def convert_into(dst: cute.Tensor, acc: cute.Tensor):
    """dst (an A-operand fragment made by acc_as_a_operand for the same acc layout) <- acc, converted."""
    view = cute.make_tensor(dst.iterator, acc.layout)
    view.store(acc.load().to(dst.element_type))


@cute.jit
def wg_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a_frag: cute.Tensor, b_frag: cute.Tensor,
            zero_init: cutlass.Constexpr[bool]):
    """acc (+)= A @ B^T over every K block of the fragments (issue only: no fence/commit/wait)."""
    for kb in cutlass.range_constexpr(cute.size(a_frag, mode=[2])):
        tiled_mma.set(warpgroup.Field.ACCUMULATE, not (zero_init and kb == 0))
        cute.gemm(tiled_mma, acc, a_frag[None, None, kb], b_frag[None, None, kb], acc)


def ldsm_c_copy(tiled_mma: cute.TiledMma, tidx, transpose: bool):
    """ldmatrix copy from a bf16 shared tile ``(M, N)`` into the accumulator (C) layout of ``tiled_mma``.

    ``transpose=False`` for tiles contiguous along N, ``True`` for tiles contiguous along M (use the
    selected ``(M, N)`` view of such a tile).  Returns (tiled copy, thread copy)."""
    atom = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4),
                               cutlass.BFloat16)
    cp = cute.make_tiled_copy_C(atom, tiled_mma)
    return cp, cp.get_slice(tidx)


@cute.jit
def quad_sum(x: cutlass.Float32) -> cutlass.Float32:
    """Sum over the 4 lanes of a quad: the threads sharing accumulator rows in a wgmma C fragment."""
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x


@cute.jit
def warp_sum(x: cutlass.Float32) -> cutlass.Float32:
    for off in cutlass.range_constexpr(5):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << off)
    return x


def wide(stride, divby: int):
    """A row stride for a global tensor whose element offsets can pass 2^31: the stride as a dynamic
    ``Int64`` known to be a multiple of ``divby``.

    CuTe computes ``coordinate * stride`` in the stride's integer type, so with a static or ``Int32``
    stride an offset past 2^31 elements wraps (``o`` at 1M tokens x 32 heads x 128 is 2^32 elements,
    the chunk-major state workspaces 2^33).  With this stride the product is 64-bit (a ``mul.lo.s64``
    per address; the other address terms stay 32-bit) and the divisibility keeps the 128-bit vector
    accesses provable.  For the tensors the kernels read or write with plain loads / stores; TMA
    tensors need none (TMA coordinates are per dimension, the descriptor's strides 64-bit).
    """
    return cute.assume(cutlass.Int64(stride), divby=divby)


# ------------------------------------------------------------------ trace-time helpers of the kernels
# Plain Python: they run while a kernel is traced and emit exactly the ops their callers used to
# write out inline, in the same order.

def sw128_index(idx):
    """Element index, in a 1024-byte aligned 16-bit tile with the 128-byte swizzle (``K_SW128`` atoms), of
    un-swizzled element ``idx``: the 16-byte chunk bits (4-6 of the byte offset) XOR the row bits (7-9).  For
    the scalar reads of such a tile, which the DSL does not lower through a swizzled tensor."""
    return idx ^ ((idx >> 3) & 0x38)


def fwd_global_tensors(q_ptr, k_ptr, a_ptr, g_ptr, h0_ptr, ht_ptr, o_ptr, s_ptr, vn_ptr, cu_ptr, co_ptr, seg_ptr,
                       walk_ptr, total_tokens, total_chunks, num_seqs, hqk, hv, K: int, V: int, vblk: int,
                       BT: int) -> dict:
    """The global tensors both forward recurrences (``chunk_fwd_sm90``, ``chunk_fwd_ws_sm90``) read and write, by
    name: q, k ``(token, K, qk head)`` (TMA), Aqk and G (chunk-major rows), the states h0 / ht, o
    ``(token, head, V block, v)``, the cu_seqlens / chunk offsets / segment / walk tables and the training saves S and
    v_new (64-bit row strides where offsets pass 2^31 elements)."""
    rows = total_chunks * hv
    state_strides = (wide(hv * K * V, K * V), K * V, V, 1)
    return dict(
        mQ=cute.make_tensor(q_ptr, cute.make_layout((total_tokens, K, hqk), stride=(hqk * K, 1, K))),
        mK=cute.make_tensor(k_ptr, cute.make_layout((total_tokens, K, hqk), stride=(hqk * K, 1, K))),
        mA=cute.make_tensor(a_ptr, cute.make_layout((rows * BT, BT), stride=(BT, 1))),
        mG=cute.make_tensor(g_ptr, cute.make_layout((rows * BT,), stride=(1,))),
        mH0=cute.make_tensor(h0_ptr, cute.make_layout((num_seqs, hv, K, V), stride=state_strides)),
        mHt=cute.make_tensor(ht_ptr, cute.make_layout((num_seqs, hv, K, V), stride=state_strides)),
        # (token, head, v block, v): the static strides of the last two modes let the compiler prove the
        # 16-byte alignment of each output row segment (vectorised stores)
        mO=cute.make_tensor(o_ptr, cute.make_layout((total_tokens, hv, V // vblk, vblk),
                                                    stride=(wide(hv * V, V), V, vblk, 1))),
        mCu=cute.make_tensor(cu_ptr, cute.make_layout((num_seqs + 1,))),
        mCo=cute.make_tensor(co_ptr, cute.make_layout((num_seqs + 1,))),
        # (halo: num_seqs counts segments; the per-sequence states are indexed by seg[n, 0] < num_seqs)
        mSeg=cute.make_tensor(seg_ptr, cute.make_layout((num_seqs, 4), stride=(4, 1))),
        mWalk=cute.make_tensor(walk_ptr, cute.make_layout((num_seqs, hv), stride=(hv, 1))),
        mS=cute.make_tensor(s_ptr, cute.make_layout((rows * K, V), stride=(wide(V, V), 1))),
        mVn=cute.make_tensor(vn_ptr, cute.make_layout((rows * BT, V), stride=(wide(V, V), 1))),
    )


@cute.jit
def load_walk_start(acc_h: cute.Tensor, cH: cute.Tensor, mH0: cute.Tensor, mWalk: cute.Tensor, mSeg: cute.Tensor,
                    seq, sid, head, v0, use_h0, halo: cutlass.Constexpr):
    """A forward walk's start state in the transposed accumulator ``acc_h`` (v, k) (zeroed by the caller): h0 of
    sequence ``sid``, when given and -- over segments -- when the walk starts at its sequence's first chunk."""
    if use_h0 != 0:
        if cutlass.const_expr(halo):
            # h0 only for a walk from its sequence's first chunk (no halo before it)
            if mWalk[seq, head] == mSeg[seq, 1]:
                for i in cutlass.range_constexpr(cute.size(acc_h)):
                    vv, kk = cH[i]
                    acc_h[i] = mH0[sid, head, kk, v0 + vv]
        else:
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                vv, kk = cH[i]
                acc_h[i] = mH0[seq, head, kk, v0 + vv]


@cute.jit
def store_walk_end(acc_h: cute.Tensor, cH: cute.Tensor, mHt: cute.Tensor, mSeg: cute.Tensor, seq, sid, head, v0,
                   store_ht, halo: cutlass.Constexpr):
    """The final state ht from the transposed accumulator; over segments only a sequence's last segment has it."""
    if store_ht != 0:
        if cutlass.const_expr(halo):
            # only a sequence's last segment ends at its end
            if mSeg[seq, 2] != 0:
                for i in cutlass.range_constexpr(cute.size(acc_h)):
                    vv, kk = cH[i]
                    mHt[sid, head, kk, v0 + vv] = acc_h[i]
        else:
            for i in cutlass.range_constexpr(cute.size(acc_h)):
                vv, kk = cH[i]
                mHt[seq, head, kk, v0 + vv] = acc_h[i]


def chunk_coords(mCi: cute.Tensor, mCu: cute.Tensor, chunk, head, hv, group, BT: int):
    """Where chunk ``chunk`` of the chunk-major grid lies: ``(tok, valid, qk_head, row)`` -- its first
    token, how many of its ``BT`` rows lie inside the sequence, the query/key head of value head
    ``head`` (GQA group ``group``) and its row ``chunk * hv + head`` in the chunk-major workspaces."""
    seq = mCi[chunk, 0]
    cidx = mCi[chunk, 1]
    bos = mCu[seq]
    eos = mCu[seq + 1]
    tok = bos + cidx * BT
    valid = cutlass.min(eos - tok, BT)
    qk_head = head // group
    row = chunk * hv + head
    return tok, valid, qk_head, row


def token_tile(t: cute.Tensor, head, tok, col0, rows: int, cols: int) -> cute.Tensor:
    """The ``(rows, cols)`` tile at token ``tok``, column ``col0`` of head ``head`` of a token-major
    TMA tensor ``(tokens, features, heads)``."""
    return cute.zipped_divide(cute.domain_offset((tok, col0), t[None, None, head]),
                              (rows, cols))[((None, None), (0, 0))]


def tma_load(atom: cute.CopyAtom, smem_tile: cute.Tensor, gmem_tile: cute.Tensor, bar, rank: int = 2):
    """Issue the TMA copy of ``gmem_tile`` into ``smem_tile`` (both of ``rank`` modes), completing on
    the mbarrier ``bar``."""
    ts, tg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem_tile, 0, rank),
                                   cute.group_modes(gmem_tile, 0, rank))
    cute.copy(atom, tg, ts, tma_bar_ptr=bar)


@cute.jit
def init_tx_barrier(mbar, tidx):
    """Thread 0 initialises the single-arrival transaction mbarrier ``mbar``; then the CTA syncs."""
    if tidx == 0:
        cute.arch.mbarrier_init(mbar, 1)
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()


@cute.jit
def zero_rows_past_end(raw_tiles: cutlass.Constexpr, valid, tidx, nthr: cutlass.Constexpr,
                       BT: cutlass.Constexpr, K: cutlass.Constexpr):
    """Zero rows ``valid ..`` of the ``BT``-row token tiles of a chunk (TMA read the next sequence's rows
    there).  ``raw_tiles``: ``(tile, width)`` pairs of un-swizzled shared tiles; the CTA's ``nthr``
    threads stride over ``(BT - valid) * K`` elements.  Fences the writes for the async proxy."""
    if valid < BT:
        for idx in cutlass.range((BT - valid) * K // nthr + 1, unroll=1):
            e = idx * nthr + tidx
            r = valid + e // K
            if r < BT:
                for tile, width in raw_tiles:
                    tile[r, e % width] = tile.element_type(0.0)
        cute.arch.fence_view_async_shared()
