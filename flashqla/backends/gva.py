"""The GVA group sum of per-value-head gradients, shared by the GPU backends' backwards.

With Hv = ratio * Hqk value heads, value head ``h`` reads query/key head ``h // ratio``.  The kernels write
dq and dk once per value head (no atomics; in the output dtype, or fp32 where the triton backward's L2-norm
Jacobian follows), and the host sums each group: ``x [NT, Hv, D]`` seen as ``[NT * Hqk, ratio, D]``
(contiguous), summed over the middle axis in fp32 and rounded once to the output dtype.

By default (``FLASHQLA_GVA_SUM=triton``), on a CUDA device (or under ``TRITON_INTERPRET=1``), one Triton
kernel does it, the sum and the cast in a single pass: each program reads ``ratio`` contiguous
``[BLOCK_M, D]`` tiles and writes one; elsewhere (CPU tensors, no Triton, a non-power-of-two D) the PyTorch
form runs, and ``FLASHQLA_GVA_SUM=torch`` forces it.  On the H200 (session 11,
``bash benchmarks/next_device_run.sh gvasum``, ``benchmarks/results/h200_2026-12-03_s11run1_gva_sum.json``)
the kernel is bitwise equal to both PyTorch forms on every case (ratio 2, 3, 4; bf16, fp16) and takes
0.169 ms against 0.307 (``torch.add``) and 0.382 (sum + cast) at NT 32768, Hv 32, ratio 2, fp32 slots
(3.98 TB/s).  Why a kernel: with fp32 slots, the
tilelang backward at 16/32 heads x 32k tokens (H200, session 10) spent 0.29 + 0.09 ms per gradient in
``x.view(...).sum(2)`` and the cast (a strided reduction at ~1.9 TB/s, then a pass of its own), and still
0.31 ms in one ``torch.add(a, b, out=bf16)`` over the strided views, which runs torch's generic,
unvectorised elementwise loop (run 4 profile); the 537 MB read and 134 MB write of that case take ~0.16 ms
at the H200's 4.2 TB/s.  (Since then the tilelang slots are 16-bit: half the bytes to read.)  Both forms are
deterministic (fixed order, no atomics).
"""

from __future__ import annotations

import contextlib
import os

import torch

from .._env import env_choice

_BLOCK_ELEMS = 4096          # elements of one [BLOCK_M, D] tile per load


def gva_sum_impl() -> str:
    """``FLASHQLA_GVA_SUM``: ``triton`` (default; PyTorch where Triton cannot run) or ``torch``."""
    return env_choice("FLASHQLA_GVA_SUM", ("torch", "triton"), "triton")


def _triton_ok(x: torch.Tensor) -> bool:
    if x.device.type == "meta":     # (the precompile sweep runs the host path on meta tensors)
        return False
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    try:
        import triton  # noqa: F401
    except Exception:       # pragma: no cover - torch without triton
        return False
    return True


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def gva_sum_kernel(x, out, M, RATIO: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
            # rows m of out: out[m, :] = sum_j x[m * RATIO + j, :]; 64-bit offsets (x may pass 2^31 elements)
            rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
            cols = tl.arange(0, D)
            mask = (rows < M)[:, None]
            src = x + (rows * (RATIO * D))[:, None] + cols[None, :]
            acc = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            for j in tl.static_range(1, RATIO):
                acc += tl.load(src + j * D, mask=mask, other=0.0).to(tl.float32)
            y = acc.to(out.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(out + (rows * D)[:, None] + cols[None, :], y, mask=mask)

        _KERNEL = gva_sum_kernel
    return _KERNEL


def _torch_sum(x: torch.Tensor, ratio: int, dtype: torch.dtype) -> torch.Tensor:
    NT, Hv, D = x.shape
    parts = x.view(NT, Hv // ratio, ratio, D).unbind(2)
    out = torch.empty(NT, Hv // ratio, D, dtype=dtype, device=x.device)
    if ratio == 2:
        return torch.add(parts[0], parts[1], out=out)
    acc = parts[0].float() + parts[1]         # fp32 partial sums, one rounding at the end
    for part in parts[2:-1]:
        acc += part
    return torch.add(acc, parts[-1], out=out)


def gva_sum(x: torch.Tensor, ratio: int, dtype: torch.dtype, use_triton=None) -> torch.Tensor:
    """``x`` ``[NT, Hv, D]`` (one gradient per value head; fp32, or 16-bit as the tilelang backward writes
    them) -> ``[NT, Hv // ratio, D]`` in ``dtype``: the sum over the ``ratio`` value heads that share a
    query/key head, in fp32, rounded once.  ``use_triton``: None follows ``FLASHQLA_GVA_SUM`` (see the module
    docstring); True / False force it (tests)."""
    if ratio == 1:
        return x.to(dtype)
    NT, Hv, D = x.shape
    if use_triton is None:
        use_triton = gva_sum_impl() == "triton" and _triton_ok(x) and x.is_contiguous() and D & (D - 1) == 0
    if not use_triton:
        return _torch_sum(x, ratio, dtype)
    import triton

    out = torch.empty(NT, Hv // ratio, D, dtype=dtype, device=x.device)
    M = NT * (Hv // ratio)
    block_m = max(1, _BLOCK_ELEMS // D)
    if M:
        with (torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()):
            _kernel()[(triton.cdiv(M, block_m),)](x, out, M, RATIO=ratio, D=D, BLOCK_M=block_m, num_warps=4)
    return out

