"""The GDN gate and write strength from a layer's raw projections, in one pass: ``gdn_gating``.

Qwen3-Next / Qwen3.5 layers do not project ``g`` and ``beta`` directly: per token and value head they
project ``a`` and ``b`` and keep per-head parameters ``A_log`` and ``dt_bias``::

    g    = -exp(A_log) * softplus(a + dt_bias)       (log-space decay, float32)
    beta = sigmoid(b)

Written in PyTorch that is six elementwise kernels and their temporaries; serving engines fuse it (vLLM's
``fused_gdn_gating``), and users of GDN kernels ask for it.  Here one Triton kernel reads ``a`` and ``b``
once and writes ``g`` (float32) and ``beta`` (``b``'s dtype unless ``beta_dtype`` says otherwise); on the CPU
(or with ``impl="torch"``) the same formulas run in PyTorch.  Gradients flow to all four inputs (a custom
autograd function; the backward is PyTorch, float32): ``d a = dg * (-exp(A_log)) * sigmoid(a + dt_bias)``,
``d dt_bias`` its sum over tokens, ``d A_log = sum(dg * g)``, ``d b = dbeta * beta * (1 - beta)``.

``softplus`` follows ``torch.nn.functional.softplus`` (beta 1): ``x`` itself above ``threshold`` (20), so a
large ``a`` never overflows.  Kernel grid: ``cdiv(numel, 1024)`` programs of 1024 elements, 4 warps; the head
of element ``i`` is ``i % Hv`` (``a`` and ``b`` are made contiguous).
"""

from __future__ import annotations

from typing import Optional

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def gdn_gating_ref(A_log, a, dt_bias, b, beta_dtype=None, threshold: float = 20.0):
    """The formulas in PyTorch (float32 math, or float64 for float64 inputs); differentiable."""
    work = torch.float64 if a.dtype == torch.float64 else torch.float32
    x = a.to(work) + dt_bias.to(work)
    g = -torch.exp(A_log.to(work)) * torch.nn.functional.softplus(x, beta=1.0, threshold=threshold)
    beta = torch.sigmoid(b.to(work))
    return g.to(torch.float32 if work == torch.float32 else work), beta.to(beta_dtype or b.dtype)


def _check(A_log, a, dt_bias, b, beta_dtype):
    for name, t in (("A_log", A_log), ("a", a), ("dt_bias", dt_bias), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gdn_gating: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"gdn_gating: {name} must be a floating tensor (float32/bfloat16/float16/float64), "
                            f"got {t.dtype}")
    if a.dim() < 1 or a.shape != b.shape:
        raise ValueError(f"gdn_gating: a and b must have the same shape [..., Hv], got a {tuple(a.shape)} and "
                         f"b {tuple(b.shape)}")
    Hv = a.shape[-1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if tuple(t.shape) != (Hv,):
            raise ValueError(f"gdn_gating: {name} must be [Hv] = [{Hv}] (Hv = the last dim of a), got "
                             f"{tuple(t.shape)}")
    devs = {t.device for t in (A_log, a, dt_bias, b)}
    if len(devs) != 1:
        raise ValueError(f"gdn_gating: A_log, a, dt_bias and b must be on one device, got {sorted(map(str, devs))}")
    if beta_dtype is not None and beta_dtype not in _FLOATS:
        raise TypeError(f"gdn_gating: beta_dtype must be a floating dtype, got {beta_dtype}")


def _use_triton(x: torch.Tensor, impl: str) -> bool:
    if impl == "torch":
        return False
    try:
        from .backends.triton.ops import interpreting
    except ImportError:
        if impl == "triton":
            raise ValueError("gdn_gating: impl='triton' but triton is not importable") from None
        return False
    ok = x.is_cuda or interpreting()
    if impl == "triton" and not ok:
        raise ValueError("gdn_gating: impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    return ok and x.dtype != torch.float64


_kernel = None


def _get_kernel():
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def gdn_gating_kernel(A_log_ptr, a_ptr, dt_ptr, b_ptr, g_ptr, beta_ptr, numel, Hv, threshold,
                          BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < numel
        h = offs % Hv
        x = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32) + tl.load(dt_ptr + h, mask=m, other=0.0).to(tl.float32)
        # softplus with torch's threshold; log(1 + e^x) for x <= threshold, where e^x cannot overflow
        sp = tl.where(x > threshold, x, tl.log(1.0 + tl.exp(tl.minimum(x, threshold))))
        g = -tl.exp(tl.load(A_log_ptr + h, mask=m, other=0.0).to(tl.float32)) * sp
        tl.store(g_ptr + offs, g, mask=m)
        bb = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(beta_ptr + offs, (1.0 / (1.0 + tl.exp(-bb))).to(beta_ptr.dtype.element_ty), mask=m)

    _kernel = gdn_gating_kernel
    return _kernel


def _forward_triton(A_log, a, dt_bias, b, beta_dtype, threshold):
    import triton

    from .backends.triton.ops import _device_guard
    a_c, b_c = a.contiguous(), b.contiguous()
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(a.shape, dtype=beta_dtype or b.dtype, device=a.device)
    n = a_c.numel()
    if n:
        BLOCK = 1024
        with _device_guard(a):
            _get_kernel()[(triton.cdiv(n, BLOCK),)](A_log.contiguous(), a_c, dt_bias.contiguous(), b_c, g, beta,
                                                     n, a.shape[-1], float(threshold), BLOCK=BLOCK, num_warps=4)
    return g, beta


class _GDNGating(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A_log, a, dt_bias, b, beta_dtype, threshold, triton_path):
        if triton_path:
            g, beta = _forward_triton(A_log, a, dt_bias, b, beta_dtype, threshold)
        else:
            with torch.no_grad():
                g, beta = gdn_gating_ref(A_log, a, dt_bias, b, beta_dtype, threshold)
        ctx.save_for_backward(A_log, a, dt_bias, b)
        ctx.threshold = threshold
        return g, beta

    @staticmethod
    def backward(ctx, dg, dbeta):
        A_log, a, dt_bias, b = ctx.saved_tensors
        work = torch.float64 if a.dtype == torch.float64 else torch.float32
        x = a.to(work) + dt_bias.to(work)
        ea = torch.exp(A_log.to(work))
        lead = tuple(range(a.dim() - 1))
        dA_log = da = ddt = db = None
        if dg is not None:
            dgw = dg.to(work)
            dsp = torch.where(x > ctx.threshold, torch.ones_like(x), torch.sigmoid(x))
            dx = -dgw * ea * dsp
            da = dx.to(a.dtype)
            ddt = dx.sum(lead).to(dt_bias.dtype) if lead else dx.to(dt_bias.dtype)
            sp = torch.nn.functional.softplus(x, beta=1.0, threshold=ctx.threshold)
            gd = -dgw * ea * sp
            dA_log = (gd.sum(lead) if lead else gd).to(A_log.dtype)
        if dbeta is not None:
            s = torch.sigmoid(b.to(work))
            db = (dbeta.to(work) * s * (1 - s)).to(b.dtype)
        return dA_log, da, ddt, db, None, None, None


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor, *,
               beta_dtype: Optional[torch.dtype] = None, threshold: float = 20.0, impl: str = "auto"):
    """``(g, beta)`` for :func:`flashqla.chunk_gated_delta_rule` from a layer's raw projections.

    Args:
        A_log, dt_bias: ``[Hv]`` per-head parameters.
        a, b: ``[..., Hv]`` per-token projections (e.g. ``[B, T, Hv]``), same shape.
        beta_dtype: dtype of ``beta`` (default ``b.dtype``); ``g`` is always float32 (float64 for float64 inputs).
        threshold: softplus switches to the identity above it (torch's default 20).
        impl: ``"auto"`` (the Triton kernel on CUDA, PyTorch elsewhere), ``"triton"`` or ``"torch"``.

    Differentiable in all four inputs.  See the module docstring for the formulas.
    """
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"gdn_gating: impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    _check(A_log, a, dt_bias, b, beta_dtype)
    return _GDNGating.apply(A_log, a, dt_bias, b, beta_dtype, float(threshold), _use_triton(a, impl))
