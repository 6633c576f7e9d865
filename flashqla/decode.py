"""Decode and multi-token verify on a state pool: :func:`gated_delta_rule_decode`.

Serving engines keep one recurrent state per request slot in a pool ``[P, Hv, K, V]`` (or ``[P, Hv, V, K]``,
``state_layout="VK"``) and run a few tokens per step.  This op applies the token recurrence of
:mod:`flashqla.reference` to ``T >= 1`` tokens of each batch row, reading and updating the pool row
``state_indices[b]`` in place::

    S <- exp(g_t) S + beta_t k_t (v_t - exp(g_t) S^T k_t)^T        o_t = scale S^T q_t

It is inference-only (no autograd) and never synchronises with the host except for the optional check of
the index values (``check_indices``), which is skipped during CUDA graph capture.

Implementations, chosen by ``impl="auto"`` (or named):

* ``"triton"``: :mod:`flashqla.backends.triton_decode` -- one program per (batch row, value head, V block),
  the state tile in registers, fp32 math, fused L2 norm.  The default on CUDA GPUs other than sm_90; on the CPU only when named,
  under ``TRITON_INTERPRET=1`` (for tests).
* ``"torch"``: PyTorch, vectorised over the batch and the heads, a loop over the T tokens.  The default on
  the CPU and the fallback for what the Triton kernel does not support (float64).  With ``state_indices``
  it gathers the live rows with a boolean mask, which synchronises on CUDA: on a GPU only the Triton and
  TileLang paths are CUDA-graph capturable.
* ``"tilelang"``: :mod:`flashqla.backends.tilelang.decode_sm90` -- Hopper (sm_90a), one CTA per (batch row,
  value head, V block), the thread mapping chosen per pool layout so loads stay coalesced (``[V, K]``:
  lanes along K, warp-shuffle sums; ``[K, V]``: lanes along V, per-group partials in shared memory);
  contiguous pools only (a strided pool view goes to triton).  The default on
  sm_90 (measured faster than triton on the H200 decode bench).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .reference import L2NORM_EPS
from .validation import check_state_layout

__all__ = ["gated_delta_rule_decode", "decode_implementations", "choose_decode_impl"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# --------------------------------------------------------------------------------------------------
# validation


def _tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _validate(q, k, v, g, beta, state, state_indices, scale, state_layout, check_indices):
    q, k, v, g, beta, state = (_tensor(x, n) for x, n in
                               ((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta"), (state, "state")))
    check_state_layout(state_layout, rows="P")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, T, Hqk, K], got shape {tuple(q.shape)}")
    B, T, Hqk, K = q.shape
    if tuple(k.shape) != (B, T, Hqk, K):
        raise ValueError(f"k must have shape [B, T, Hqk, K] = {(B, T, Hqk, K)} (same as q), got {tuple(k.shape)}")
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must be 4-D [B, T, Hv, V] with B, T = {B}, {T} as in q, got {tuple(v.shape)}")
    Hv, V = v.shape[2], v.shape[3]
    for x, n in ((g, "g"), (beta, "beta")):
        if tuple(x.shape) != (B, T, Hv):
            raise ValueError(f"{n} must have shape [B, T, Hv] = {(B, T, Hv)}, got {tuple(x.shape)}")
    if Hqk == 0 or Hv == 0 or Hv % Hqk != 0:
        raise ValueError(f"the value heads Hv = {Hv} (v.shape[2]) must be a positive multiple of the query/key "
                         f"heads Hqk = {Hqk} (q.shape[2])")
    if K == 0 or V == 0:
        raise ValueError(f"head dims must be positive, got K = {K} (q.shape[3]), V = {V} (v.shape[3])")
    for x, n in ((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta")):
        if x.dtype not in _FLOATS:
            raise TypeError(f"{n} must be a floating tensor (float16, bfloat16, float32 or float64), got {x.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if state.dtype not in _STATE_DTYPES:
        raise TypeError(f"state must be float32 or bfloat16 (also float16; float64 on the torch path), "
                        f"got {state.dtype}")
    inner = (K, V) if state_layout == "KV" else (V, K)
    if state.dim() != 4 or tuple(state.shape[1:]) != (Hv,) + inner:
        lay = "[P, Hv, K, V]" if state_layout == "KV" else "[P, Hv, V, K]"
        raise ValueError(f"state must be a pool {lay} = [P, {Hv}, {inner[0]}, {inner[1]}] for "
                         f"state_layout={state_layout!r}, got {tuple(state.shape)}")
    if state.stride(3) != 1 or state.stride(2) != state.shape[3]:
        raise ValueError(f"state's inner two dims must be contiguous (it is updated in place), got strides "
                         f"{tuple(state.stride())}")
    P = state.shape[0]
    dev = q.device
    for x, n in ((k, "k"), (v, "v"), (g, "g"), (beta, "beta"), (state, "state")):
        if x.device != dev:
            raise ValueError(f"{n} is on {x.device} but q is on {dev}: all tensors must be on one device")
    if scale is not None:
        if isinstance(scale, (torch.Tensor, bool)) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale must be finite, got {scale}")
    scale = float(K ** -0.5 if scale is None else scale)
    if state_indices is None:
        if P < B:
            raise ValueError(f"without state_indices batch row b uses pool row b, so the pool needs P >= B = {B} "
                             f"rows, got P = {P} (state.shape[0])")
    else:
        _tensor(state_indices, "state_indices")
        if state_indices.dtype != torch.int32:
            raise TypeError(f"state_indices must be int32 [B], got {state_indices.dtype} "
                            "(use state_indices.to(torch.int32))")
        if tuple(state_indices.shape) != (B,):
            raise ValueError(f"state_indices must have shape [B] = ({B},), got {tuple(state_indices.shape)}")
        if state_indices.device != dev:
            raise ValueError(f"state_indices is on {state_indices.device} but q is on {dev}: "
                             "all tensors must be on one device")
        if _should_check(state_indices, check_indices):
            _check_index_values(state_indices, P)
    return scale


def _should_check(idx: torch.Tensor, check_indices: Optional[bool]) -> bool:
    if idx.is_cuda and torch.cuda.is_current_stream_capturing():
        if check_indices:
            raise RuntimeError("check_indices=True reads the indices on the host, which cannot happen during "
                               "CUDA graph capture: pass check_indices=None or False")
        return False
    return True if check_indices is None else bool(check_indices)


def _check_index_values(idx: torch.Tensor, P: int) -> None:
    vals = idx.tolist()  # one device->host copy on CUDA
    bad = [(i, x) for i, x in enumerate(vals) if x < -1 or x >= P]
    if bad:
        i, x = bad[0]
        raise ValueError(f"state_indices[{i}] = {x} is out of range: entries must be a pool row in [0, {P}) "
                         f"(P = state.shape[0]) or -1 for a padded slot")
    seen: dict[int, int] = {}
    for i, x in enumerate(vals):
        if x >= 0:
            if x in seen:
                raise ValueError(f"state_indices[{seen[x]}] and state_indices[{i}] both name pool row {x}: "
                                 "two batch rows cannot update one state in place")
            seen[x] = i


# --------------------------------------------------------------------------------------------------
# implementations


def _torch_decode(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, state_vk):
    """PyTorch path: gather the live rows, run the T tokens vectorised over (rows, heads), scatter back."""
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    cd = torch.float64 if torch.float64 in (q.dtype, g.dtype, beta.dtype, state.dtype) else torch.float32
    o = torch.zeros(B, T, Hv, V, dtype=v.dtype, device=v.device)
    if B == 0 or T == 0:
        return o
    P = state.shape[0]
    if state_indices is None:
        rows = torch.arange(B, device=q.device)
        live = None
    else:
        idx = state_indices.long()
        # Out-of-range entries are treated like -1 (only reachable with check_indices=False).
        keep = (idx >= 0) & (idx < P)
        live = keep.nonzero().squeeze(1)
        rows = idx[live]
    if live is not None:
        q, k, v, g, beta = (x[live] for x in (q, k, v, g, beta))
    n = rows.shape[0]
    if n == 0:
        return o
    S = state[rows].to(cd)
    if state_vk:
        S = S.transpose(-1, -2)                    # [n, Hv, K, V]
    qf, kf, vf, gf, bf = (x.to(cd) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + L2NORM_EPS)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + L2NORM_EPS)
    ratio = Hv // Hqk
    if ratio > 1:
        qf = qf.repeat_interleave(ratio, dim=2)
        kf = kf.repeat_interleave(ratio, dim=2)
    qf = qf * scale
    outs = []
    for t in range(T):
        S = S * torch.exp(gf[:, t])[..., None, None]
        kt = kf[:, t]
        pred = torch.einsum("nhkv,nhk->nhv", S, kt)
        delta = (vf[:, t] - pred) * bf[:, t][..., None]
        S = S + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("nhkv,nhk->nhv", S, qf[:, t]))
    out = torch.stack(outs, 1).to(v.dtype)
    if live is None:
        o = out
    else:
        o.index_copy_(0, live, out)
    if state_vk:
        S = S.transpose(-1, -2)
    state.index_copy_(0, rows, S.to(state.dtype))
    return o


def _triton_available():
    from .backends import triton_decode
    return triton_decode.available()


def _triton_supports(q, v, g, beta, state):
    from .backends import triton_decode
    return triton_decode.supports(q.device, q.dtype, g.dtype, beta.dtype, state.dtype, q.shape[-1], v.shape[-1])


def _triton_decode(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, state_vk):
    from .backends import triton_decode
    # The kernel takes arbitrary outer strides but needs each vector contiguous.
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return triton_decode.run(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, state_vk)


def _torch_supports(q, v, g, beta, state):
    return True, "any device and dtype"


def _tilelang_available():
    # the chunk backend's verdict (cached there): whether tilelang imports, with its version
    from .dispatch import get_backend
    return get_backend("tilelang")._tilelang_importable()


def _tilelang_supports(q, v, g, beta, state):
    from .backends.tilelang import decode_sm90 as tk
    if q.device.type != "cuda":
        return False, f"needs a CUDA device of capability 9.0 (sm_90a build), got {q.device.type}"
    from .dispatch.device import detect
    cap = detect(q.device).capability
    if cap is None or tuple(cap) != (9, 0):
        return False, f"the kernel is built for sm_90a (capability 9.0), this device is {cap}"
    for nm, x in (("q/k/v", q), ("g", g), ("beta", beta), ("state", state)):
        if x.dtype not in tk._TL:
            return False, f"{nm} dtype {x.dtype} not supported (float32, bfloat16, float16)"
    K, V = q.shape[-1], v.shape[-1]
    if not tk.supported_head_dims(K, V, tk.MIN_BV):
        return False, (f"head dims K = {K}, V = {V}: needs K a multiple of 32 in [32, 256] and V a multiple "
                       f"of {tk.MIN_BV}")
    if not state.is_contiguous():
        return False, "the pool must be contiguous (a strided view of a larger pool goes to triton)"
    return True, "ok"


def _tilelang_decode(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, state_vk):
    from .backends.tilelang import decode_sm90
    return decode_sm90.run(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, state_vk)


@dataclass(frozen=True)
class DecodeImpl:
    """One decode implementation.  ``auto_on``: device types where ``impl="auto"`` may pick it, in order
    of preference given by ``rank`` (lower first)."""

    name: str
    rank: int
    auto_on: tuple
    available: Callable[[], tuple]
    supports: Callable[..., tuple]
    run: Optional[Callable]


_IMPLS: dict[str, DecodeImpl] = {
    # H200 (results/h200_2026-12-03_s4run3_decode.md): tilelang 1.28x FLA fused_recurrent on both pool
    # layouts, triton 1.26x ([K, V]) / 1.18x ([V, K]); tilelang serves only sm_90, triton every other GPU
    "tilelang": DecodeImpl("tilelang", 0, ("cuda",), _tilelang_available, _tilelang_supports, _tilelang_decode),
    "triton": DecodeImpl("triton", 1, ("cuda",), _triton_available, _triton_supports, _triton_decode),
    "torch": DecodeImpl("torch", 9, ("cuda", "cpu"), lambda: (True, "built in"), _torch_supports, _torch_decode),
}


def decode_implementations() -> dict[str, tuple]:
    """``name -> (available, reason)`` for every decode implementation."""
    out = {}
    for name, im in sorted(_IMPLS.items(), key=lambda kv: kv[1].rank):
        try:
            out[name] = tuple(im.available())
        except Exception as exc:  # a broken implementation must not break the listing
            out[name] = (False, f"check raised {type(exc).__name__}: {exc}")
    return out


def _verdict(im: DecodeImpl, q, v, g, beta, state):
    try:
        ok, why = im.available()
        if not ok:
            return False, f"unavailable: {why}"
        return tuple(im.supports(q, v, g, beta, state))
    except Exception as exc:
        return False, f"check raised {type(exc).__name__}: {exc}"


def choose_decode_impl(q, v, g, beta, state, impl: str = "auto") -> tuple[str, dict]:
    """The implementation a call would use and every verdict (``name -> reason``).

    ``impl="auto"`` (or ``FLASHQLA_DECODE_IMPL`` when set) walks the implementations allowed on the device
    in order; a named one never falls back and raises ``ValueError`` with its reason."""
    if not isinstance(impl, str):
        raise TypeError(f"impl must be a string ('auto' or one of {sorted(_IMPLS)}), got {type(impl).__name__}")
    requested = impl
    env = os.environ.get("FLASHQLA_DECODE_IMPL", "").strip()
    if impl == "auto" and env and env != "auto":
        requested = env
    reasons: dict[str, str] = {}
    if requested != "auto":
        if requested not in _IMPLS:
            raise ValueError(f"unknown decode impl {requested!r}; choose 'auto' or one of {sorted(_IMPLS)}")
        ok, why = _verdict(_IMPLS[requested], q, v, g, beta, state)
        reasons[requested] = why
        if not ok:
            src = " (from FLASHQLA_DECODE_IMPL)" if requested != impl else ""
            raise ValueError(f"decode impl {requested!r}{src} cannot serve this call: {why}")
        return requested, reasons
    dev = q.device.type
    for im in sorted(_IMPLS.values(), key=lambda x: x.rank):
        if dev not in im.auto_on:
            reasons[im.name] = f"not chosen automatically on {dev}"
            continue
        ok, why = _verdict(im, q, v, g, beta, state)
        reasons[im.name] = why
        if ok:
            return im.name, reasons
    raise ValueError(f"no decode implementation serves this call: {reasons}")  # unreachable: torch serves all


# --------------------------------------------------------------------------------------------------
# the op


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_layout: str = "KV",
    *,
    impl: str = "auto",
    check_indices: Optional[bool] = None,
) -> torch.Tensor:
    """Run ``T`` tokens of each batch row through the recurrence, updating the state pool in place.

    Args:
        q, k: ``[B, T, Hqk, K]``; v: ``[B, T, Hv, V]`` (``Hv % Hqk == 0``, value head ``h`` reads q/k head
            ``h // (Hv // Hqk)``), one dtype.  Outer dims may be strided (views of a fused projection).
        g: ``[B, T, Hv]`` log-space decay; beta: ``[B, T, Hv]``.
        state: the pool, ``[P, Hv, K, V]`` (``state_layout="KV"``) or ``[P, Hv, V, K]`` (``"VK"``), float32 or
            bfloat16 (float16 too), inner two dims contiguous.  Updated in place; the math is fp32 and the
            state is rounded to the pool's dtype once, after the last of the T tokens.
        state_indices: int32 ``[B]``: the pool row of each batch row, ``-1`` for a padded slot (skipped:
            its state is untouched and its output rows are zeros).  None: row ``b`` uses pool row ``b``.
        scale: defaults to ``K ** -0.5``.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K (``x * rsqrt(sum(x^2) + 1e-6)``).
        state_layout: ``"KV"`` or ``"VK"``.
        impl: ``"auto"``, ``"triton"``, ``"tilelang"`` or ``"torch"`` (see :func:`decode_implementations`).
        check_indices: check the index values (range, duplicates) on the host.  Default (None): yes, except
            during CUDA graph capture; on CUDA this costs one device->host copy per call, so serving loops
            pass False.  Unchecked out-of-range entries are treated as padded slots (never written).

    Returns:
        ``o`` ``[B, T, Hv, V]`` in v's dtype.
    """
    scale = _validate(q, k, v, g, beta, state, state_indices, scale, state_layout, check_indices)
    name, _ = choose_decode_impl(q, v, g, beta, state, impl)
    with torch.no_grad():
        return _IMPLS[name].run(q, k, v, g, beta, state, state_indices, scale, bool(use_qk_l2norm_in_kernel),
                                state_layout == "VK")
