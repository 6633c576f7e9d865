"""flashqla's ops as ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` keeps them whole.

Importing this module registers, in the ``flashqla`` namespace:

* ``torch.ops.flashqla.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
  use_qk_l2norm_in_kernel, cu_seqlens, backend, state_layout="KV") -> (o, final_state)``: the chunk op of
  :mod:`flashqla.api` (dispatch included).  A custom op cannot return None: without ``output_final_state``
  the second output is an empty tensor.  The final state is float32 (float64 when v is float64), in
  ``state_layout`` (``"VK"``: ``initial_state`` and final state ``[N, Hv, V, K]``).
* ``torch.ops.flashqla.chunk_gated_delta_rule_backward(...) -> (dq, dk, dv, dg, dbeta, dh0)``: its
  backward, registered with ``register_autograd`` on the op above.  Autograd graphs (compiled ones
  included) cannot carry a backend's Python-side residuals across the op boundary, so this backward
  *recomputes the forward* (``chunk_gated_delta_rule_fwd(for_backward=True)``) and then runs the backend's
  backward: one extra forward per backward, like activation checkpointing.  ``dh0`` is empty when there
  was no initial state.
* ``torch.ops.flashqla.gated_delta_rule_decode(q, k, v, g, beta, state, state_indices, scale,
  use_qk_l2norm_in_kernel, state_layout, impl, check_indices) -> o``: :func:`flashqla.decode.gated_delta_rule_decode`,
  declared as mutating ``state`` (the pool is updated in place).  Inference only (no autograd).

Each has a fake (meta) implementation, so tracing never runs a kernel.  The Python wrappers below
(:func:`chunk_gated_delta_rule`, :func:`gated_delta_rule_decode`) take the same arguments as the eager
ops and return ``None`` for a final state that was not requested.  :func:`chunk_gated_delta_rule` uses the
custom op while compiling and for grad-free calls; an eager call that needs gradients goes straight to
:func:`flashqla.chunk_gated_delta_rule` (its autograd Function keeps the backend's residuals, so no
recompute).

Varlen: the op takes ``cu_seqlens`` and checks it on the host inside the op (one device->host copy per
call); a sync-free varlen call (CUDA graphs) is :func:`flashqla.chunk_gated_delta_rule` with
``varlen_meta=``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from . import api
from .decode import gated_delta_rule_decode as _decode_eager
from .validation import check_state_layout

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_decode"]


def _state_dtype(v: Tensor) -> torch.dtype:
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def _unaliased(out: Tensor, *inputs: Optional[Tensor]) -> Tensor:
    """Custom-op outputs may not alias inputs; copy in the (unexpected) case a backend returned one."""
    if out.numel() == 0:
        return out
    ptr = out.untyped_storage().data_ptr()
    for x in inputs:
        if x is not None and x.numel() and x.untyped_storage().data_ptr() == ptr:
            return out.clone()
    return out


@contextlib.contextmanager
def _autograd_dispatch_restored():
    """A custom op's implementation runs below the Autograd dispatch key (nothing it does is recorded),
    but a backend's backward may differentiate with autograd (the reference backend recomputes its
    forward under ``enable_grad``): put the Autograd keys back for the duration."""
    try:
        K = torch._C.DispatchKey
        exclude = torch._C._dispatch_tls_local_exclude_set()
        for key in (K.AutogradFunctionality, K.AutogradOther, K.AutogradNestedTensor):
            exclude = exclude.remove(key)
        guard = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)
    except (AttributeError, RuntimeError):  # pragma: no cover - private API moved in this torch
        guard = contextlib.nullcontext()
    with guard:
        yield


# --------------------------------------------------------------------------------------------------
# chunk op


@torch.library.custom_op("flashqla::chunk_gated_delta_rule", mutates_args=())
def _chunk_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
              initial_state: Optional[Tensor], output_final_state: bool, use_qk_l2norm_in_kernel: bool,
              cu_seqlens: Optional[Tensor], backend: str, state_layout: str = "KV") -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        o, ht = api.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                           state_layout=state_layout,
                                           output_final_state=output_final_state,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                           cu_seqlens=cu_seqlens, backend=backend)
    o = o.contiguous()
    ht = v.new_empty(0, dtype=_state_dtype(v)) if ht is None else ht.to(_state_dtype(v)).contiguous()
    ins = (q, k, v, g, beta, initial_state, cu_seqlens)
    return _unaliased(o, *ins), _unaliased(ht, *ins)


@_chunk_op.register_fake
def _chunk_fake(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, backend, state_layout="KV"):
    check_state_layout(state_layout)
    B, T, Hv, V = v.shape
    K = q.shape[-1]
    o = v.new_empty(B, T, Hv, V)
    if output_final_state:
        N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
        inner = (K, V) if state_layout == "KV" else (V, K)
        ht = v.new_empty(N, Hv, *inner, dtype=_state_dtype(v))
    else:
        ht = v.new_empty(0, dtype=_state_dtype(v))
    return o, ht


@torch.library.custom_op("flashqla::chunk_gated_delta_rule_backward", mutates_args=())
def _chunk_bwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                  initial_state: Optional[Tensor], output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                  cu_seqlens: Optional[Tensor], backend: str, do: Tensor, dht: Optional[Tensor],
                  state_layout: str = "KV") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if dht is not None and (not output_final_state or dht.numel() == 0):
        dht = None
    if q.shape[0] == 0 or q.shape[1] == 0:
        # No tokens: the state passes through unchanged, so dh0 = dht and the rest is empty.
        grads = [torch.zeros_like(x) for x in (q, k, v, g, beta)]
        if initial_state is None:
            dh0 = v.new_empty(0, dtype=_state_dtype(v))
        else:
            dh0 = torch.zeros_like(initial_state) if dht is None else dht.to(initial_state.dtype).clone()
        return (*grads, dh0)
    with _autograd_dispatch_restored(), torch.no_grad():
        _, _, ctx = api.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                   output_final_state=output_final_state,
                                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                   cu_seqlens=cu_seqlens, backend=backend,
                                                   state_layout=state_layout, for_backward=True)
        dq, dk, dv, dg, dbeta, dh0 = api.chunk_gated_delta_rule_bwd(ctx, do, dht)
    ins = (q, k, v, g, beta, initial_state, do, dht)
    outs = []
    for gr, x in zip((dq, dk, dv, dg, dbeta), (q, k, v, g, beta)):
        gr = torch.zeros_like(x) if gr is None else gr.to(x.dtype).contiguous()
        outs.append(_unaliased(gr, *ins))
    if initial_state is None:
        dh0 = v.new_empty(0, dtype=_state_dtype(v))
    else:
        dh0 = torch.zeros_like(initial_state) if dh0 is None else dh0.to(initial_state.dtype).contiguous()
        dh0 = _unaliased(dh0, *ins)
    return (*outs, dh0)


@_chunk_bwd_op.register_fake
def _chunk_bwd_fake(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    cu_seqlens, backend, do, dht, state_layout="KV"):
    dh0 = v.new_empty(0, dtype=_state_dtype(v)) if initial_state is None else torch.empty_like(initial_state)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _chunk_setup_context(ctx, inputs, output):
    (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens, backend,
     state_layout) = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.state_layout = state_layout
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.use_qk_l2norm = use_qk_l2norm
    ctx.backend = backend


def _chunk_backward(ctx, do, dht):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    if not ctx.output_final_state:
        dht = None
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.flashqla.chunk_gated_delta_rule_backward(
        q, k, v, g, beta, ctx.scale, initial_state, ctx.output_final_state, ctx.use_qk_l2norm, cu_seqlens,
        ctx.backend, do.contiguous(), None if dht is None else dht.contiguous(), ctx.state_layout)
    return (dq, dk, dv, dg, dbeta, None, dh0 if initial_state is not None else None, None, None, None, None, None)


_chunk_op.register_autograd(_chunk_backward, setup_context=_chunk_setup_context)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
                           initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Optional[Tensor] = None,
                           backend: str = "auto", *, state_layout: str = "KV"):
    """:func:`flashqla.chunk_gated_delta_rule` through the custom op: ``(o, final_state or None)``.

    ``state_layout="VK"``: ``initial_state`` and the final state are ``[N, Hv, V, K]``."""
    check_state_layout(state_layout)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    if needs_grad and not torch.compiler.is_compiling():
        return api.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                          backend=backend, state_layout=state_layout)
    o, ht = torch.ops.flashqla.chunk_gated_delta_rule(
        q, k, v, g, beta, None if scale is None else float(scale), initial_state, bool(output_final_state),
        bool(use_qk_l2norm_in_kernel), cu_seqlens, backend, state_layout)
    return o, (ht if output_final_state else None)


# --------------------------------------------------------------------------------------------------
# decode op


@torch.library.custom_op("flashqla::gated_delta_rule_decode", mutates_args=("state",))
def _decode_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
               state_indices: Optional[Tensor], scale: Optional[float], use_qk_l2norm_in_kernel: bool,
               state_layout: str, impl: str, check_indices: Optional[bool]) -> Tensor:
    o = _decode_eager(q, k, v, g, beta, state, state_indices, scale=scale,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_layout=state_layout, impl=impl,
                      check_indices=check_indices)
    return _unaliased(o.contiguous(), q, k, v, g, beta, state, state_indices)


@_decode_op.register_fake
def _decode_fake(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm_in_kernel, state_layout, impl,
                 check_indices):
    B, T, Hv, V = v.shape
    return v.new_empty(B, T, Hv, V)


def gated_delta_rule_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                            state_indices: Optional[Tensor] = None, scale: Optional[float] = None,
                            use_qk_l2norm_in_kernel: bool = False, state_layout: str = "KV", *,
                            impl: str = "auto", check_indices: Optional[bool] = None) -> Tensor:
    """:func:`flashqla.decode.gated_delta_rule_decode` through the custom op (``state`` updated in place)."""
    return torch.ops.flashqla.gated_delta_rule_decode(
        q, k, v, g, beta, state, state_indices, None if scale is None else float(scale),
        bool(use_qk_l2norm_in_kernel), state_layout, impl, check_indices)
