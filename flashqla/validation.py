"""Input validation for the public ops, in one place.

Every malformed input gets a ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape or
value) naming the argument and what was expected, before any backend runs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .dispatch.device import detect
from .dispatch.spec import CallSpec, dtype_name
from .varlen import VarlenMeta, prepare_varlen

MAX_HEAD_DIM = 256
STATE_LAYOUTS = ("KV", "VK")   # initial/final state [N, Hv, K, V] or [N, Hv, V, K]
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _floating(x: torch.Tensor, name: str) -> None:
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {x.dtype}")


def _shape(x: torch.Tensor, name: str, expected: tuple, layout: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, got {tuple(x.shape)}")


def check_state_layout(state_layout, rows: str = "N") -> str:
    """``state_layout`` must be ``"KV"`` (``[N, Hv, K, V]``) or ``"VK"`` (``[N, Hv, V, K]``); ``rows`` names
    the state's first dim in the message (``"P"`` for the decode op's pool)."""
    if not isinstance(state_layout, str) or state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be 'KV' (state [{rows}, Hv, K, V]) or 'VK' (state [{rows}, Hv, V, K]), "
                         f"got {state_layout!r}")
    return state_layout


def validate(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, varlen_meta: Optional[VarlenMeta] = None,
             needs_grad: Optional[bool] = None, state_layout: str = "KV"):
    """Check the op's arguments; returns ``(spec, scale, varlen_meta)``.

    ``state_layout`` is the layout of ``initial_state`` as the caller passes it.  The spec always says
    ``"KV"``: the op hands backends the state as ``[N, Hv, K, V]`` (it transposes a ``"VK"`` state).
    """
    state_layout = check_state_layout(state_layout)
    q, k, v, g, beta = (_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta")))
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, T, Hqk, K], got shape {tuple(q.shape)}")
    B, T, Hqk, K = q.shape
    _shape(k, "k", (B, T, Hqk, K), "[B, T, Hqk, K] (same as q)")
    if v.dim() != 4:
        raise ValueError(f"v must be 4-D [B, T, Hv, V], got shape {tuple(v.shape)}")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must have shape [B, T, Hv, V] with B, T = {B}, {T} as in q, got {tuple(v.shape)}")
    Hv, V = v.shape[2], v.shape[3]
    _shape(g, "g", (B, T, Hv), "[B, T, Hv]")
    _shape(beta, "beta", (B, T, Hv), "[B, T, Hv]")
    if Hqk == 0 or Hv == 0:
        raise ValueError(f"head counts must be positive, got Hqk = {Hqk}, Hv = {Hv}")
    if Hv % Hqk != 0:
        raise ValueError(f"the value heads Hv = {Hv} (v.shape[2]) must be a multiple of the query/key heads "
                         f"Hqk = {Hqk} (q.shape[2])")
    for dim, nm in ((K, "K (q.shape[3])"), (V, "V (v.shape[3])")):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"unsupported head dim {nm} = {dim}: flashqla supports 1..{MAX_HEAD_DIM}")
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        _floating(x, n)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    _floating(g, "g")
    _floating(beta, "beta")
    dev = q.device
    for x, n in ((k, "k"), (v, "v"), (g, "g"), (beta, "beta")):
        if x.device != dev:
            raise ValueError(f"{n} is on {x.device} but q is on {dev}: all tensors must be on one device")
    if scale is not None:
        if isinstance(scale, torch.Tensor) or not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale must be finite, got {scale}")
    scale = float(K ** -0.5 if scale is None else scale)

    if varlen_meta is not None:
        if not isinstance(varlen_meta, VarlenMeta):
            raise TypeError(f"varlen_meta must come from flashqla.prepare_varlen, got {type(varlen_meta).__name__}")
        if cu_seqlens is not None and cu_seqlens is not varlen_meta.cu_seqlens:
            if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.shape != varlen_meta.cu_seqlens.shape:
                raise ValueError("cu_seqlens and varlen_meta describe different batches")
        cu_seqlens = varlen_meta.cu_seqlens
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be an int32 torch.Tensor [N+1], got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype != torch.int32:
            raise TypeError(f"cu_seqlens must be int32 [N+1], got {cu_seqlens.dtype} "
                            "(use cu_seqlens.to(torch.int32))")
        if cu_seqlens.device != dev:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {dev}: "
                             "all tensors must be on one device")
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B = 1, got B = {B} "
                             "(q.shape[0])")
        if varlen_meta is None:
            varlen_meta = prepare_varlen(cu_seqlens, total_tokens=T)
        elif varlen_meta.total_tokens != T:
            raise ValueError(f"cu_seqlens[-1] must equal the number of tokens T = {T}, "
                             f"got {varlen_meta.total_tokens}")
        N = varlen_meta.num_seqs
    else:
        N = B

    if initial_state is not None:
        _tensor(initial_state, "initial_state")
        if initial_state.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"initial_state must be float32 (or float64), got {initial_state.dtype}")
        if state_layout == "KV":
            _shape(initial_state, "initial_state", (N, Hv, K, V), "[N, Hv, K, V]")
        else:
            _shape(initial_state, "initial_state", (N, Hv, V, K), "[N, Hv, V, K] (state_layout='VK')")
        if initial_state.device != dev:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {dev}: "
                             "all tensors must be on one device")

    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    spec = CallSpec(
        device=detect(dev), dtype=dtype_name(q.dtype), g_dtype=dtype_name(g.dtype),
        beta_dtype=dtype_name(beta.dtype),
        state_dtype=dtype_name(initial_state.dtype) if initial_state is not None else None,
        K=K, V=V, Hqk=Hqk, Hv=Hv, varlen=cu_seqlens is not None,
        has_initial_state=initial_state is not None, output_final_state=bool(output_final_state),
        use_qk_l2norm=bool(use_qk_l2norm_in_kernel), needs_grad=bool(needs_grad),
        batch=B, tokens=T, num_seqs=N)
    return spec, scale, varlen_meta
