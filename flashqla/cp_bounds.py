"""The decay bound behind CP windows (:mod:`flashqla.cp`): per token and value head an upper bound of
``log ||exp(g_t) (I - beta_t k_t k_t^T)||_2``, and per window candidate (the end chunks of a segment) the
first chunk count at which the bound summed over those chunks, the largest over the heads, is under a
threshold.

Grid (Triton, CUDA): ``(candidates,)``, one program per window candidate walking its chunks in order; per
chunk it gathers the 64 tokens through ``idx`` (-1: padding, bound 0), reads g and beta ``[C, Hv]`` and,
without the fused L2 norm, ``||k||^2`` of each query/key head ``[C, K]``, adds the chunk's ``[Hv]`` sums to a
running sum and notes the first chunk count under the threshold.  One launch replaces the bound kernel and
six torch ops of the same computation: a windowed CP call's host time is mostly per-launch overhead.  On the
CPU: the torch ops.
"""

from __future__ import annotations

import functools

import torch

CHUNK = 64


def token_log_bound(k, g, beta, use_qk_l2norm: bool) -> torch.Tensor:
    """[T, Hv] fp32 for packed ``k [1, T, Hqk, K]``, ``g`` and ``beta [1, T, Hv]``: per token and value head an
    upper bound of ``log ||exp(g) (I - beta k k^T)||_2``.

    The eigenvalues of ``I - beta k k^T`` are 1 and ``1 - beta ||k||^2``, so the norm is
    ``max(1, |1 - beta ||k||^2|)``; a 2% slack on ``beta ||k||^2`` covers the kernels' rounding of k (bf16, or
    its L2 norm, ~2^-8)."""
    g0, b0 = g[0].float(), beta[0].float()
    Hv, Hqk = g0.shape[1], k.shape[2]
    if use_qk_l2norm:
        kap = torch.ones((), dtype=torch.float32, device=g0.device)
    else:
        kap = k[0].float().square().sum(-1)
        if Hv != Hqk:
            kap = kap.repeat_interleave(Hv // Hqk, dim=1)
    f = (1.0 - b0 * kap).abs() + 0.02 * (b0 * kap).abs()
    return g0 + torch.log(torch.clamp(f, min=1.0))


def chunk_bound_sums_ref(k, g, beta, idx: torch.Tensor, n: int, use_qk_l2norm: bool) -> torch.Tensor:
    """``[E, n, Hv]``: per window candidate (``idx`` ``[E * n * 64]`` token indices, -1 padding) and chunk,
    the summed token bounds.  Torch ops (the CPU path and the kernel's oracle)."""
    valid = idx >= 0
    at = idx.clamp(min=0)
    ell = token_log_bound(k[:, at], g[:, at], beta[:, at], use_qk_l2norm)
    ell = torch.where(valid[:, None], ell, torch.zeros((), dtype=ell.dtype, device=ell.device))
    return ell.reshape(-1, n, CHUNK, ell.shape[-1]).sum(2)


@functools.lru_cache(maxsize=None)
def _kernel():
    # defined on first use: importing triton (and the interpreter switch) waits for a call that needs it
    import triton
    import triton.language as tl

    @triton.jit
    def window_count_kernel(k_ptr, g_ptr, b_ptr, idx_ptr, out_ptr, threshold, stride_kt, stride_kh,
                            stride_gt, stride_bt, n: tl.constexpr, Hqk: tl.constexpr, RATIO: tl.constexpr,
                            Hv: tl.constexpr, K: tl.constexpr, HV_P: tl.constexpr, L2: tl.constexpr,
                            C: tl.constexpr):
        # one program per window candidate: its chunks in order, the running per-head sum, the first chunk
        # count at which the largest head is under the threshold (a NaN head never is, nor after it)
        e = tl.program_id(0)
        rows = tl.arange(0, C)
        hv = tl.arange(0, HV_P)
        hmask = hv < Hv
        cum = tl.zeros((HV_P,), tl.float32)
        found = tl.sum(tl.zeros((HV_P,), tl.int32), axis=0)      # a 0-d int32 (the loop carries a tensor)
        for j in range(0, n):
            tok = tl.load(idx_ptr + (e * n + j) * C + rows)
            valid = tok >= 0
            tok = tl.where(valid, tok, 0)
            m2 = valid[:, None] & hmask[None, :]
            g = tl.load(g_ptr + tok[:, None] * stride_gt + hv[None, :], mask=m2, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + tok[:, None] * stride_bt + hv[None, :], mask=m2, other=0.0).to(tl.float32)
            if L2:
                kap = tl.full((C, HV_P), 1.0, tl.float32)
            else:
                kap = tl.zeros((C, HV_P), tl.float32)
                cols = tl.arange(0, K)
                for hq in range(Hqk):
                    kt = tl.load(k_ptr + tok[:, None] * stride_kt + hq * stride_kh + cols[None, :],
                                 mask=valid[:, None], other=0.0).to(tl.float32)
                    sq = tl.sum(kt * kt, axis=1)
                    kap = tl.where((hv // RATIO == hq)[None, :], sq[:, None], kap)
            bk = b * kap
            f = tl.abs(1.0 - bk) + 0.02 * tl.abs(bk)
            ell = g + tl.log(tl.maximum(f, 1.0))
            cum += tl.sum(tl.where(m2, ell, 0.0), axis=0)
            nan = tl.sum(tl.where((cum != cum) & hmask, 1, 0), axis=0)
            top = tl.max(tl.where(hmask, cum, float("-inf")), axis=0)
            hit = (top <= threshold) & (nan == 0) & (found == 0)
            found = tl.where(hit, j + 1, found)
        tl.store(out_ptr + e, found.to(tl.int64))

    return window_count_kernel


def window_counts_ref(k, g, beta, idx: torch.Tensor, n: int, use_qk_l2norm: bool, threshold: float) -> torch.Tensor:
    """``[E]`` int64: per window candidate the fewest chunks ``j`` whose summed bound (the largest over the
    value heads) is at most ``threshold``, 0 when none of the ``n`` is.  A NaN bound compares false: no
    window.  Torch ops (the CPU path and the kernel's oracle)."""
    cum = chunk_bound_sums_ref(k, g, beta, idx, n, use_qk_l2norm).cumsum(1).amax(-1)
    below = (cum <= threshold).to(torch.int32)
    zero = torch.zeros((), dtype=torch.int64, device=cum.device)
    return torch.where(below.amax(1) > 0, below.argmax(1) + 1, zero)


def window_counts(k, g, beta, idx: torch.Tensor, n: int, use_qk_l2norm: bool, threshold: float,
                  force_kernel: bool = False) -> torch.Tensor:
    """:func:`window_counts_ref` in one Triton launch on CUDA (``force_kernel``: also elsewhere, for the
    interpreter tests)."""
    K = k.shape[-1]
    if not (k.is_cuda or force_kernel) or K & (K - 1):      # (tl.arange needs a power-of-two K)
        return window_counts_ref(k, g, beta, idx, n, use_qk_l2norm, threshold)
    import triton
    k0, g0, b0 = k[0], g[0], beta[0]
    if k0.stride(-1) != 1:
        k0 = k0.contiguous()
    if g0.stride(-1) != 1:
        g0 = g0.contiguous()
    if b0.stride(-1) != 1:
        b0 = b0.contiguous()
    Hqk, Hv = k0.shape[1], g0.shape[1]
    E = idx.numel() // (n * CHUNK)
    out = torch.empty(E, dtype=torch.int64, device=g.device)
    if E == 0:
        return out
    hv_p = triton.next_power_of_2(Hv)
    # (n, at most MAX_WINDOW_CHUNKS, is a compile-time constant: a few variants, and the interpreter's loops
    # need a Python bound; the [64, Hv] fp32 tiles g, beta, ||k||^2 and the bound: more warps past 32 heads
    # keep them in registers)
    _kernel()[(E,)](k0, g0, b0, idx, out, float(threshold), k0.stride(0), k0.stride(1), g0.stride(0),
                    b0.stride(0), n=int(n), Hqk=Hqk, RATIO=Hv // Hqk, Hv=Hv, K=K, HV_P=hv_p,
                    L2=bool(use_qk_l2norm), C=CHUNK, num_warps=4 if hv_p <= 32 else 8)
    return out
