"""Decode / multi-token verify on a state pool (Hopper build; plain SIMT code, no tensor cores).

The op is :func:`flashqla.decode.gated_delta_rule_decode`; this file is its ``impl="tilelang"``.  Decode
moves a K x V fp32 state per (row, head) through HBM for a few dozen FLOPs per value, so the kernel is a
streaming kernel: its job is full-width coalesced loads of the pool and nothing on the critical path
that waits on shared memory.

Grid ``(B * V / BV, Hv)``, 128 threads (4 warps).  CTA ``(b * NV + vb, h)`` owns state columns
``vb*BV .. vb*BV + BV`` of value head ``h`` of pool row ``state_indices[b]`` (``b`` without indices).
Per token (all fp32): ``S *= exp(g)``; ``pred = S^T k``; ``S += k (beta (v - pred))^T``;
``o = S^T (scale q)``.  The two sums run over K, so the thread mapping puts K where the pool layout
lets loads stay coalesced:

* ``[P, Hv, V, K]`` (``state_vk``, what serving engines use): warp ``w`` owns ``VPW = BV / 4`` columns,
  lane ``l`` the ``KPL = K / 32`` consecutive key rows ``l*KPL ..``; a warp reads each column as one
  contiguous row (16-byte vector loads) and the sums over K are warp shuffles (``warp_reduce_sum``):
  no shared memory, no CTA barrier on the chain.  q and k come straight from global memory (L1 hits
  after the first warp); the outputs go through a BV-float shared buffer for one coalesced store.
* ``[P, Hv, K, V]``: V contiguous, so lanes go along V (``VPL`` values each: 2 at BV = 64) and the
  threads split K into ``KG`` groups of ``KPG`` rows (4 x 32 at BV = 64); a warp reads 256 contiguous
  bytes per key row.  The sums over K are per-group partials combined through shared memory (two CTA
  barriers per token); warps 0 and 1 stage k and scale * q (normalised: a warp sum) in shared memory.

A padded slot (``state_indices[b] < 0``, and, for memory safety, ``>= P``) writes zeros to its outputs
and never touches the pool.  The state is written back once, after the last token, in the pool dtype.

Compile key: dtypes of q/k/v, g, beta and the pool, K, V, BV, layout, L2 norm, indices or not; batch,
tokens, heads and pool rows are symbolic.  Shared memory <= 3 KB; state registers K * BV / 128 per thread.
"""


import functools

import torch

from ._compile import get_kernel

THREADS = 128
WARPS = THREADS // 32
L2_EPS = 1e-6

_TL = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


MIN_BV = 16   # the narrowest V block block_v() picks: V must be a multiple of it


def supported_head_dims(K: int, V: int, BV: int) -> bool:
    return K % 32 == 0 and 32 <= K <= 256 and V % BV == 0 and BV % WARPS == 0


def build_decode(io_dtype: str, g_dtype: str, beta_dtype: str, state_dtype: str, K: int, V: int, BV: int,
                 state_vk: bool, l2norm: bool, has_indices: bool):
    """The kernel for one key; the two pool layouts get different thread mappings (module docstring)."""
    build = _build_vk if state_vk else _build_kv
    return build(io_dtype, g_dtype, beta_dtype, state_dtype, K, V, BV, l2norm, has_indices)


STATE_VK, STATE_KV = True, False


def _signature(io_dtype, g_dtype, beta_dtype, state_dtype, K, V, state_vk, has_indices):
    """The kernel's tensor types (both layouts share them but the pool's): q/k ``[B, T, Hqk, K]``, v and o
    ``[B, T, Hv, V]``, g and beta ``[B, T, Hv]``, the pool, the indices; every outer size symbolic.  One
    object per parameter: TileLang binds a parameter's buffer to its annotation object, so two parameters
    sharing one would alias."""
    from types import SimpleNamespace

    import tilelang.language as T

    B, Tn, Hqk, Hv, P = T.dynamic("B"), T.dynamic("T"), T.dynamic("Hqk"), T.dynamic("Hv"), T.dynamic("P")
    NI = B if has_indices else T.dynamic("NI")
    return SimpleNamespace(
        q=T.Tensor((B, Tn, Hqk, K), io_dtype), k=T.Tensor((B, Tn, Hqk, K), io_dtype),
        v=T.Tensor((B, Tn, Hv, V), io_dtype), o=T.Tensor((B, Tn, Hv, V), io_dtype),
        g=T.Tensor((B, Tn, Hv), g_dtype), beta=T.Tensor((B, Tn, Hv), beta_dtype),
        state=T.Tensor((P, Hv, V, K) if state_vk else (P, Hv, K, V), state_dtype),
        indices=T.Tensor((NI,), "int32"), B=B, Tn=Tn, Hv=Hv, P=P)


def _build_vk(io_dtype, g_dtype, beta_dtype, state_dtype, K, V, BV, l2norm, has_indices):
    import tilelang.language as T

    ty = _signature(io_dtype, g_dtype, beta_dtype, state_dtype, K, V, STATE_VK, has_indices)
    B, Tn, Hv, P = ty.B, ty.Tn, ty.Hv, ty.P
    KPL = K // 32
    VPW = BV // WARPS
    NV = V // BV
    acc = "float32"

    @T.prim_func
    def gdn_decode_vk(
        q: ty.q,
        k: ty.k,
        v: ty.v,
        g: ty.g,
        beta: ty.beta,
        o: ty.o,
        state: ty.state,
        indices: ty.indices,
        scale: T.float32,
        ratio: T.int32,
    ):
        with T.Kernel(B * NV, Hv, threads=THREADS) as (bv, h):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            b = bv // NV
            col0 = (bv % NV) * BV + warp * VPW      # first state column of this warp
            hk = h // ratio

            S_l = T.alloc_local((VPW, KPL), acc)
            k_l = T.alloc_local((KPL,), acc)
            q_l = T.alloc_local((KPL,), acc)
            o_s = T.alloc_shared((BV,), acc)
            row = T.alloc_var("int32")
            red = T.alloc_var(acc)
            pred = T.alloc_var(acc)
            delta = T.alloc_var(acc)
            dec = T.alloc_var(acc)
            bt = T.alloc_var(acc)

            if has_indices:
                row = indices[b]
            else:
                row = b
            if row >= 0 and row < P:
                for j in T.unroll(VPW):
                    for i in T.vectorized(KPL):
                        S_l[j, i] = T.cast(state[row, h, col0 + j, lane * KPL + i], acc)
                for t in T.serial(Tn):
                    for i in T.vectorized(KPL):
                        k_l[i] = T.cast(k[b, t, hk, lane * KPL + i], acc)
                    for i in T.vectorized(KPL):
                        q_l[i] = T.cast(q[b, t, hk, lane * KPL + i], acc)
                    if l2norm:
                        red = 0.0
                        for i in T.unroll(KPL):
                            red += k_l[i] * k_l[i]
                        red = T.rsqrt(T.warp_reduce_sum(red) + L2_EPS)
                        for i in T.unroll(KPL):
                            k_l[i] = k_l[i] * red
                        red = 0.0
                        for i in T.unroll(KPL):
                            red += q_l[i] * q_l[i]
                        red = T.rsqrt(T.warp_reduce_sum(red) + L2_EPS) * scale
                    else:
                        red = scale
                    for i in T.unroll(KPL):
                        q_l[i] = q_l[i] * red
                    dec = T.exp(T.cast(g[b, t, h], acc))
                    bt = T.cast(beta[b, t, h], acc)
                    for j in T.unroll(VPW):
                        pred = 0.0
                        for i in T.unroll(KPL):
                            S_l[j, i] = S_l[j, i] * dec
                            pred += S_l[j, i] * k_l[i]
                        delta = (T.cast(v[b, t, h, col0 + j], acc) - T.warp_reduce_sum(pred)) * bt
                        red = 0.0
                        for i in T.unroll(KPL):
                            S_l[j, i] = S_l[j, i] + k_l[i] * delta
                            red += S_l[j, i] * q_l[i]
                        red = T.warp_reduce_sum(red)
                        if lane == 0:
                            o_s[warp * VPW + j] = red
                    T.sync_threads()
                    if tx < BV:
                        o[b, t, h, (bv % NV) * BV + tx] = T.cast(o_s[tx], io_dtype)
                    T.sync_threads()
                for j in T.unroll(VPW):
                    for i in T.vectorized(KPL):
                        state[row, h, col0 + j, lane * KPL + i] = T.cast(S_l[j, i], state_dtype)
            else:
                for t in T.serial(Tn):
                    if tx < BV:
                        o[b, t, h, (bv % NV) * BV + tx] = T.cast(0.0, io_dtype)

    return gdn_decode_vk


def kv_mapping(K: int, BV: int) -> tuple:
    """(VPL, NVS, KG, KPG) of the [K, V] kernel: values per lane along V, V slots, K groups, K rows per group."""
    VPL = max(1, BV // 32)
    NVS = BV // VPL
    KG = THREADS // NVS
    return VPL, NVS, KG, K // KG


def _build_kv(io_dtype, g_dtype, beta_dtype, state_dtype, K, V, BV, l2norm, has_indices):
    import tilelang.language as T

    ty = _signature(io_dtype, g_dtype, beta_dtype, state_dtype, K, V, STATE_KV, has_indices)
    B, Tn, Hv, P = ty.B, ty.Tn, ty.Hv, ty.P
    KPL = K // 32
    VPL, NVS, KG, KPG = kv_mapping(K, BV)
    assert K % KG == 0 and BV % NVS == 0
    NV = V // BV
    acc = "float32"

    @T.prim_func
    def gdn_decode_kv(
        q: ty.q,
        k: ty.k,
        v: ty.v,
        g: ty.g,
        beta: ty.beta,
        o: ty.o,
        state: ty.state,
        indices: ty.indices,
        scale: T.float32,
        ratio: T.int32,
    ):
        with T.Kernel(B * NV, Hv, threads=THREADS) as (bv, h):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            vs = tx % NVS
            kg = tx // NVS
            b = bv // NV
            v0 = (bv % NV) * BV + vs * VPL        # first state column of this thread
            k0 = kg * KPG                         # first state row of this thread
            hk = h // ratio

            S_l = T.alloc_local((KPG, VPL), acc)
            x_l = T.alloc_local((KPL,), acc)
            pv = T.alloc_local((VPL,), acc)
            ov = T.alloc_local((VPL,), acc)
            x_s = T.alloc_shared((2, K), acc)          # this token's k and scale * q, normalised
            red_s = T.alloc_shared((2, KG, BV), acc)   # per K group partial sums: S^T k, then S^T q
            row = T.alloc_var("int32")
            red = T.alloc_var(acc)
            dec = T.alloc_var(acc)
            bt = T.alloc_var(acc)

            if has_indices:
                row = indices[b]
            else:
                row = b
            if row >= 0 and row < P:
                for i in T.unroll(KPG):
                    for j in T.vectorized(VPL):
                        S_l[i, j] = T.cast(state[row, h, k0 + i, v0 + j], acc)
                for t in T.serial(Tn):
                    # warp 0 stages k, warp 1 stages q (lanes over K; the norm is a warp sum)
                    if warp == 0:
                        red = 0.0
                        for i in T.vectorized(KPL):
                            x_l[i] = T.cast(k[b, t, hk, lane * KPL + i], acc)
                        for i in T.unroll(KPL):
                            red += x_l[i] * x_l[i]
                        if l2norm:
                            red = T.rsqrt(T.warp_reduce_sum(red) + L2_EPS)
                        else:
                            red = 1.0
                        for i in T.unroll(KPL):
                            x_s[0, lane * KPL + i] = x_l[i] * red
                    if warp == 1:
                        red = 0.0
                        for i in T.vectorized(KPL):
                            x_l[i] = T.cast(q[b, t, hk, lane * KPL + i], acc)
                        for i in T.unroll(KPL):
                            red += x_l[i] * x_l[i]
                        if l2norm:
                            red = T.rsqrt(T.warp_reduce_sum(red) + L2_EPS) * scale
                        else:
                            red = scale
                        for i in T.unroll(KPL):
                            x_s[1, lane * KPL + i] = x_l[i] * red
                    T.sync_threads()
                    dec = T.exp(T.cast(g[b, t, h], acc))
                    bt = T.cast(beta[b, t, h], acc)
                    for j in T.unroll(VPL):
                        pv[j] = 0.0
                    for i in T.unroll(KPG):
                        for j in T.unroll(VPL):
                            S_l[i, j] = S_l[i, j] * dec
                            pv[j] += S_l[i, j] * x_s[0, k0 + i]
                    for j in T.unroll(VPL):
                        red_s[0, kg, vs * VPL + j] = pv[j]
                    T.sync_threads()
                    for j in T.unroll(VPL):
                        red = 0.0
                        for gi in T.unroll(KG):
                            red += red_s[0, gi, vs * VPL + j]
                        pv[j] = (T.cast(v[b, t, h, v0 + j], acc) - red) * bt
                        ov[j] = 0.0
                    for i in T.unroll(KPG):
                        for j in T.unroll(VPL):
                            S_l[i, j] = S_l[i, j] + x_s[0, k0 + i] * pv[j]
                            ov[j] += S_l[i, j] * x_s[1, k0 + i]
                    for j in T.unroll(VPL):
                        red_s[1, kg, vs * VPL + j] = ov[j]
                    T.sync_threads()
                    if kg == 0:
                        for j in T.unroll(VPL):
                            red = 0.0
                            for gi in T.unroll(KG):
                                red += red_s[1, gi, vs * VPL + j]
                            o[b, t, h, v0 + j] = T.cast(red, io_dtype)
                for i in T.unroll(KPG):
                    for j in T.vectorized(VPL):
                        state[row, h, k0 + i, v0 + j] = T.cast(S_l[i, j], state_dtype)
            else:
                for t in T.serial(Tn):
                    if kg == 0:
                        for j in T.unroll(VPL):
                            o[b, t, h, v0 + j] = T.cast(0.0, io_dtype)

    return gdn_decode_kv


def block_v(K: int, V: int, rows: int) -> int:
    """The V block: 64 columns per CTA (64 fp32 state values per thread at K = 128) when there are enough
    (batch row, head) pairs to fill the GPU, else 16 (four times the CTAs for small batches)."""
    bv = 64 if rows > 512 else MIN_BV
    while bv > WARPS and V % bv:
        bv //= 2
    if K > 128:
        bv = min(bv, 32)
    return bv


@functools.lru_cache(maxsize=None)
def _dummy_indices(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def decode_kernel(io_dtype, g_dtype, beta_dtype, state_dtype, K, V, BV, state_vk, l2norm, has_indices):
    return get_kernel("decode_sm90", build_decode,
                      (_TL[io_dtype], _TL[g_dtype], _TL[beta_dtype], _TL[state_dtype], int(K), int(V), int(BV),
                       bool(state_vk), bool(l2norm), bool(has_indices)))


def run(q, k, v, g, beta, state, state_indices, scale: float, use_qk_l2norm: bool, state_vk: bool):
    """Launch on contiguous q/k/v/g/beta (copies otherwise); ``state`` is updated in place (its inner two
    dims are contiguous, its outer strides must be those of a contiguous pool: checked by the caller)."""
    B, T_, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    o = torch.empty(B, T_, Hv, V, dtype=v.dtype, device=v.device)
    if B == 0 or T_ == 0:
        return o
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    BV = block_v(K, V, B * Hv)
    has_idx = state_indices is not None
    kern = decode_kernel(q.dtype, g.dtype, beta.dtype, state.dtype, K, V, BV, state_vk, use_qk_l2norm, has_idx)
    kern(q, k, v, g, beta, o, state, state_indices if has_idx else _dummy_indices(q.device),
         float(scale), Hv // Hqk)
    return o


def decode_ref(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, state_vk):
    """The torch path of :mod:`flashqla.decode` (what this kernel must match)."""
    from ...decode import _torch_decode
    return _torch_decode(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, state_vk)
