"""Triton decode / verify kernel for the gated delta rule on a state pool (small T, state in registers).

Grid: ``(B * cdiv(V, BV), Hv)``: one program per (batch row, value block) x value head.  The batch row
and value block share grid axis 0 (limit 2^31 - 1, where axes 1/2 stop at 65535), value blocks of one
row adjacent, so the programs reading one row's q/k run next to each other and share its L2 lines.

Roles: each program
  1. reads its pool row ``idx = state_indices[b]`` (``b`` without indices); ``idx < 0`` is a padded slot
     (and, for memory safety only, so is ``idx >= P``): the program writes zeros to its output rows and
     never touches the pool;
  2. loads the state tile of row ``idx``, head ``h`` into registers as fp32, in the pool's own orientation:
     ``S[BK, BV]`` from the ``[K, V]`` layout, ``S^T[BV, BK]`` from ``[V, K]`` (``STATE_VK``, the layout
     serving engines use), so the contiguous dim is the fast one (vector loads; in VK the reductions over
     K stay inside a warp);
  3. walks the T tokens: ``S *= exp(g_t)``; ``delta = beta_t (v_t - S^T k_t)``; ``S += k_t delta^T``;
     ``o_t = S^T (scale q_t)`` -- the token recurrence of :mod:`flashqla.reference`, all in fp32, with the
     optional q/k L2 norm fused (each program sees all of K, so it can normalise on its own);
  4. stores the tile back in the pool's dtype (fp32 / bf16 / fp16), in place, once after the last token.

Memory budget: the state tile is ``BK * BV`` fp32 values (``BK = next_pow2(K)``), kept at <= 4096 values
(32 per thread at 4 warps): BV = 32 for K <= 128, 16 for K = 256.  Per token a program reads K values of
q and k, BV of v, two scalars, and writes BV outputs; the state is read and written once per call, which
is the whole cost of decode (the kernel is bandwidth-bound on the pool).

Layouts: q, k ``[B, T, Hqk, K]``, v ``[B, T, Hv, V]``, g, beta ``[B, T, Hv]`` with arbitrary strides on the
outer dims (only the last dim of q/k/v must be contiguous), so views of a fused projection need no
copy; o ``[B, T, Hv, V]`` contiguous; pool ``[P, Hv, K, V]`` or ``[P, Hv, V, K]`` with arbitrary strides
on its two outer dims and contiguous inner two.  Pool offsets and the per-token offsets ``t * stride``
are computed in int64 (big pools, and long calls, exceed 2^31 elements).

Compile key (constexpr): K, V, BK, BV, NV = cdiv(V, BV), GROUP (Hv // Hqk), STATE_VK, USE_L2NORM, HAS_INDICES, plus the pointer
dtypes; never B, T or P.  Host syncs: none, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

L2NORM_EPS = 1e-6


# T, P and the batch strides (which scale with T) change per call: keep them out of Triton's integer
# specialisation (== 1, % 16) so a new T or batch size never recompiles.
@triton.jit(do_not_specialize=["T", "P", "sq_b", "sk_b", "sv_b", "sg_b", "sbt_b", "so_b"])
def gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, idx_ptr,
    T, P, scale,
    sq_b, sq_t, sq_h,
    sk_b, sk_t, sk_h,
    sv_b, sv_t, sv_h,
    sg_b, sg_t, sg_h,
    sbt_b, sbt_t, sbt_h,
    so_b, so_t, so_h,
    ss_p, ss_h,
    K: tl.constexpr, V: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    STATE_VK: tl.constexpr, USE_L2NORM: tl.constexpr, HAS_INDICES: tl.constexpr,
):
    i_bv = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = i_bv // NV
    i_v = i_bv % NV
    i_hk = i_h // GROUP

    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V

    if HAS_INDICES:
        idx = tl.load(idx_ptr + i_b).to(tl.int64)
    else:
        idx = i_b.to(tl.int64)
    valid = (idx >= 0) & (idx < P)

    o_base = o_ptr + i_b.to(tl.int64) * so_b + i_h * so_h
    if valid:
        q_base = q_ptr + i_b.to(tl.int64) * sq_b + i_hk * sq_h
        k_base = k_ptr + i_b.to(tl.int64) * sk_b + i_hk * sk_h
        v_base = v_ptr + i_b.to(tl.int64) * sv_b + i_h * sv_h
        g_base = g_ptr + i_b.to(tl.int64) * sg_b + i_h * sg_h
        b_base = beta_ptr + i_b.to(tl.int64) * sbt_b + i_h * sbt_h

        s_base = state_ptr + idx * ss_p + i_h.to(tl.int64) * ss_h
        # The tile keeps the pool's memory orientation, so its contiguous dim is the fast one in
        # registers: VK -> S^T tile [BV, BK] (K contiguous; the K reductions stay inside a warp),
        # KV -> S tile [BK, BV] (V contiguous).
        if STATE_VK:
            s_ptrs = s_base + offs_v[:, None] * K + offs_k[None, :]
            s_mask = mask_v[:, None] & mask_k[None, :]
        else:
            s_ptrs = s_base + offs_k[:, None] * V + offs_v[None, :]
            s_mask = mask_k[:, None] & mask_v[None, :]
        S = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)

        # A while loop rather than range(T): same code on the GPU, and the Triton interpreter (with
        # numpy 2) cannot iterate range() over a runtime scalar.  The token counter is 64-bit:
        # t * stride passes 2^31 elements for long calls (T = 1M tokens x 32 heads x 128 values).
        t = tl.full([], 0, tl.int64)
        while t < T:
            b_q = tl.load(q_base + t * sq_t + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            b_k = tl.load(k_base + t * sk_t + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            b_v = tl.load(v_base + t * sv_t + offs_v, mask=mask_v, other=0.0).to(tl.float32)
            b_g = tl.load(g_base + t * sg_t).to(tl.float32)
            b_beta = tl.load(b_base + t * sbt_t).to(tl.float32)
            if USE_L2NORM:
                # Padded K lanes hold 0, so the sums cover exactly the K real values.
                b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
                b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
            b_q = b_q * scale
            S = S * tl.exp(b_g)
            if STATE_VK:
                pred = tl.sum(S * b_k[None, :], axis=1)                # S^T k      [BV]
                delta = (b_v - pred) * b_beta
                S = S + delta[:, None] * b_k[None, :]                  # rank-1 update
                b_o = tl.sum(S * b_q[None, :], axis=1)                 # S^T q      [BV]
            else:
                pred = tl.sum(S * b_k[:, None], axis=0)
                delta = (b_v - pred) * b_beta
                S = S + b_k[:, None] * delta[None, :]
                b_o = tl.sum(S * b_q[:, None], axis=0)
            tl.store(o_base + t * so_t + offs_v, b_o.to(o_ptr.dtype.element_ty), mask=mask_v)
            t += 1

        tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=s_mask)
    else:
        # Padded slot: zeros out, pool untouched (o is allocated uninitialised by the host).
        zero = tl.zeros([BV], dtype=tl.float32)
        t = tl.full([], 0, tl.int64)
        while t < T:
            tl.store(o_base + t * so_t + offs_v, zero.to(o_ptr.dtype.element_ty), mask=mask_v)
            t += 1
