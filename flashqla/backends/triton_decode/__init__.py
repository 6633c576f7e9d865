"""Triton implementation of :func:`flashqla.decode.gated_delta_rule_decode` (see ``kernel.py``).

This package is not a chunk-op backend (it does not register with the dispatch registry); the decode
op's own dispatch in :mod:`flashqla.decode` calls :func:`available`, :func:`supports` and :func:`run`.
Triton is imported lazily, on the first call of ``available()`` or ``run()``.
"""

from __future__ import annotations

import functools
import os

import torch

NAME = "triton"
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_IO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=None)
def _import_kernel():
    from . import kernel
    return kernel


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available():
    """``(ok, reason)``: triton importable.  Never raises."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    try:
        _import_kernel()
    except Exception as exc:  # pragma: no cover
        return False, f"the decode kernel failed to import ({type(exc).__name__}: {exc})"
    return True, f"triton {triton.__version__}" + (" (interpreter)" if interpreting() else "")


def supports(device: torch.device, io_dtype, g_dtype, beta_dtype, state_dtype, K: int, V: int):
    """``(ok, reason)`` for one call, from its device, dtypes and head dims."""
    if device.type == "cuda":
        if torch.version.hip is None:
            major, _ = torch.cuda.get_device_capability(device)
            if major < 8:
                return False, f"needs an NVIDIA GPU of SM80 or newer, got sm_{major}x"
    elif device.type == "cpu":
        if not interpreting():
            return False, "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
    else:
        return False, f"device type {device.type!r} is not supported"
    if io_dtype not in _IO_DTYPES:
        return False, f"q/k/v dtype {io_dtype} not supported (float32, bfloat16, float16)"
    for nm, dt in (("g", g_dtype), ("beta", beta_dtype)):
        if dt not in _IO_DTYPES:
            return False, f"{nm} dtype {dt} not supported (float32, bfloat16, float16)"
    if state_dtype not in _STATE_DTYPES:
        return False, f"state dtype {state_dtype} not supported (float32, bfloat16, float16)"
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        return False, f"head dims K = {K}, V = {V} over {MAX_HEAD_DIM}"
    return True, "ok"


def _tune() -> dict:
    """``FLASHQLA_DECODE_TUNE="bv=16,warps=2"``: override the V block and the warps (device sweeps)."""
    out = {}
    for part in os.environ.get("FLASHQLA_DECODE_TUNE", "").split(","):
        key, sep, val = part.strip().partition("=")
        if not sep:
            continue
        if key not in ("bv", "warps") or not val.isdigit() or int(val) < 1 or int(val) & (int(val) - 1):
            raise ValueError(f"FLASHQLA_DECODE_TUNE: bad entry {part!r} (bv=<power of 2>, warps=<power of 2>)")
        out[key] = int(val)
    return out


def _block_sizes(K: int, V: int, rows: int = 1 << 30) -> tuple[int, int, int]:
    """(BK, BV, warps) for ``rows`` = batch x value heads.

    H200 sweep (results/h200_2026-12-03_s3run1_decode.md, fp32 pool, K = V = 128): a 64-wide V block on 4
    warps streams the pool fastest once there are enough rows to fill the GPU (91% of the copy floor at
    batch 256, 1.26x FLA over the grid); with few rows (batch 8 x 32 or 64 heads) more, smaller programs
    on one warp win (11.2 vs 13.0 us at 16/32)."""
    import triton
    BK = triton.next_power_of_2(K)
    BVmax = triton.next_power_of_2(V)
    if rows <= 512 and BK <= 128:
        BV, warps = 16, 1
    else:
        # the fp32 state tile stays at <= 8192 values (64 registers per thread on 4 warps)
        BV, warps = (64 if BK <= 128 else 32), 4
    BV = min(BV, BVmax)
    tune = _tune()
    BV = min(tune.get("bv", BV), BVmax)
    return BK, BV, tune.get("warps", warps)


def run(q, k, v, g, beta, state, state_indices, scale: float, use_qk_l2norm: bool, state_vk: bool):
    """Launch the kernel; ``state`` is updated in place.  Inputs are validated by the caller: the last
    dim of q/k/v is contiguous, the inner two dims of ``state`` are contiguous."""
    kern = _import_kernel()
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    P = state.shape[0]
    o = torch.empty(B, T, Hv, V, dtype=v.dtype, device=v.device)
    if B == 0 or T == 0:
        return o
    BK, BV, warps = _block_sizes(K, V, B * Hv)
    has_idx = state_indices is not None
    grid = (B * triton_cdiv(V, BV), Hv)
    kern.gdn_decode_kernel[grid](
        q, k, v, g, beta, o, state, state_indices if has_idx else state,
        T, P, float(scale),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), g.stride(2),
        beta.stride(0), beta.stride(1), beta.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        state.stride(0), state.stride(1),
        K=K, V=V, GROUP=Hv // Hqk, BK=BK, BV=BV, NV=triton_cdiv(V, BV), STATE_VK=bool(state_vk), USE_L2NORM=bool(use_qk_l2norm),
        HAS_INDICES=has_idx, num_warps=warps, num_stages=1,
    )
    return o


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


_TT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_for_target(capability: tuple = (9, 0), K: int = 128, V: int = 128, group: int = 2,
                       io_dtype=torch.bfloat16, g_dtype=torch.float32, state_dtype=torch.float32,
                       state_vk: bool = True, use_qk_l2norm: bool = True, has_indices: bool = True):
    """Compile the kernel for a CUDA target without a GPU (compile-only checks).

    The arguments mirror one launch; integer arguments get the divisibility-by-16 attribute a real launch
    with model-sized heads gets (except those the kernel keeps out of specialisation), so the code is
    the code a GPU would run.  Returns triton's CompiledKernel (``.asm["ptx"]``, ``.asm["cubin"]``).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreting():
        # triton.language consults the interpreter flag while generating code, so a process that has it
        # set cannot compile (run this in a subprocess without TRITON_INTERPRET).
        raise RuntimeError("compile_for_target needs TRITON_INTERPRET unset")
    fn = _import_kernel().gdn_decode_kernel
    BK, BV, warps = _block_sizes(K, V)
    ptr = {"q_ptr": io_dtype, "k_ptr": io_dtype, "v_ptr": io_dtype, "o_ptr": io_dtype, "beta_ptr": io_dtype,
           "g_ptr": g_dtype, "state_ptr": state_dtype}
    const = dict(K=K, V=V, GROUP=group, BK=BK, BV=BV, NV=triton_cdiv(V, BV), STATE_VK=bool(state_vk), USE_L2NORM=bool(use_qk_l2norm),
                 HAS_INDICES=bool(has_indices))
    unaligned = {"T", "P", "sq_b", "sk_b", "sv_b", "sg_b", "sbt_b", "so_b", "sg_h", "sbt_h", "scale"}
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in const:
            sig[n] = "constexpr"
            continue
        if n == "idx_ptr":
            sig[n] = "*i32"
        elif n in ptr:
            sig[n] = "*" + _TT[ptr[n]]
        else:
            sig[n] = "fp32" if n == "scale" else "i32"
        if n not in unaligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    num_warps = warps
    cap = capability[0] * 10 + capability[1]
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", cap, 32), options=dict(num_warps=num_warps, num_stages=1))
