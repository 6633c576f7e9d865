"""Route FLA's ``chunk_gated_delta_rule`` to flashqla, without changing the calling code.

FLA (flash-linear-attention) layers such as ``fla.layers.GatedDeltaNet`` call
``fla.ops.gated_delta_rule.chunk_gated_delta_rule``.  One line sends those calls to
:func:`flashqla.chunk_gated_delta_rule` (same layouts, same math, flashqla's dispatch picks the kernel)::

    import flashqla.integrations.fla as fq_fla
    fq_fla.patch()              # or: with fq_fla.patched(): ...
    model(...)                  # FLA's GatedDeltaNet now runs flashqla's kernels
    fq_fla.unpatch()            # FLA's own function is back

:func:`patch` imports ``fla.ops.gated_delta_rule`` and replaces the function object, under both of its
names (``chunk_gated_delta_rule`` and the alias ``chunk_gdn``), in every ``fla`` module already imported
that holds it (``fla.ops``, ``fla.ops.gated_delta_rule``, its ``chunk`` module, ``fla.layers.*``, ...).
Modules imported later pick the replacement up from the patched package.  Code that took its own
reference to the function before ``patch()`` (``from fla.ops import chunk_gated_delta_rule`` in *your*
module) keeps FLA's; import after patching, or pass ``extra_modules=[your_module]``.

Argument mapping (FLA's keyword names, bound against the installed FLA's own signature, so positional
calls of any FLA version map correctly):

* ``scale``, ``initial_state``, ``output_final_state``, ``use_qk_l2norm_in_kernel``, ``cu_seqlens``: passed
  on (``cu_seqlens`` cast to int32; ``initial_state`` to float32; with ``cu_seqlens_cpu`` the varlen
  metadata is built from the host copy, so the call does not synchronise).
* ``state_v_first`` (and the deprecated ``transpose_state_layout``): the state is ``[N, HV, V, K]``;
  it is transposed in and out.
* ``use_gate_in_kernel`` with ``A_log`` / ``dt_bias``: ``g = -exp(A_log) * softplus(g + dt_bias)`` is computed
  before the call (differentiable).  ``use_beta_sigmoid_in_kernel``: ``beta = sigmoid(beta)``
  (``2 * sigmoid`` with ``allow_neg_eigval``).
* ``chunk_size`` and ``chunk_indices``: ignored (the result does not depend on them).
* Not served by flashqla, so FLA's own function runs: ``cp_context`` (context parallelism), ``head_first``,
  any keyword this module does not know, and, with ``fallback=True`` (the default), a CUDA call that
  flashqla could only serve with its slow PyTorch reference backend.  ``stats()`` counts both paths.

Under ``torch.compile`` the call goes through the ``torch.library`` custom op
(:mod:`flashqla.library`), so FLA models compile without graph breaks in the GDN layer.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from typing import Iterable, Optional

import torch
import torch.nn.functional as F

_NAMES = ("chunk_gated_delta_rule", "chunk_gdn")
_KNOWN = {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
          "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "transpose_state_layout",
          "cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "chunk_size", "cp_context", "use_gate_in_kernel",
          "A_log", "dt_bias", "head_first"}
_FLAGS_DEFAULT_FALSE = ("use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "transpose_state_layout",
                        "use_gate_in_kernel", "use_qk_l2norm_in_kernel", "output_final_state")

_lock = threading.RLock()
_patches: list[tuple[object, str, object]] = []   # (module, attribute, original value)
_state: dict = {"original": None, "wrapper": None}
_stats = {"flashqla": 0, "fla": 0}


def stats() -> dict:
    """How many patched calls flashqla served and how many went to FLA's own function (and why)."""
    return dict(_stats)


def is_patched() -> bool:
    return _state["wrapper"] is not None


def _fla_module():
    try:
        import fla.ops.gated_delta_rule as mod
    except ImportError as exc:
        raise ImportError("flashqla.integrations.fla.patch() needs FLA (pip install flash-linear-attention): "
                          f"{exc}") from exc
    return mod


def _to_fla(original, reason: str, args, kwargs):
    _stats["fla"] += 1
    key = f"fla:{reason}"
    _stats[key] = _stats.get(key, 0) + 1
    return original(*args, **kwargs)


def _make_wrapper(original, backend: str, fallback: bool):
    try:
        sig = inspect.signature(original)
    except (TypeError, ValueError):  # pragma: no cover - builtins
        sig = None
    if sig is not None and any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        sig = None  # a (*args, **kwargs) dispatch wrapper: map q, k, v, g, beta by position only

    @functools.wraps(original)
    def chunk_gated_delta_rule(*args, **kwargs):
        if sig is not None:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return _to_fla(original, "arguments", args, kwargs)
            a = dict(bound.arguments)
            for p in sig.parameters.values():  # flatten FLA's **kwargs into the named ones
                if p.kind is inspect.Parameter.VAR_KEYWORD and p.name in a:
                    a.update(a.pop(p.name))
        else:
            if len(args) > 5:
                return _to_fla(original, "positional arguments", args, kwargs)
            a = dict(zip(("q", "k", "v", "g", "beta"), args), **kwargs)
        unknown = set(a) - _KNOWN
        if unknown:
            return _to_fla(original, "unknown argument " + ",".join(sorted(unknown)), args, kwargs)
        if a.get("cp_context") is not None:
            return _to_fla(original, "cp_context", args, kwargs)
        if a.get("head_first"):
            return _to_fla(original, "head_first", args, kwargs)
        return _call_flashqla(original, a, backend, fallback, args, kwargs)

    chunk_gated_delta_rule.__flashqla_patched__ = True
    chunk_gated_delta_rule.__wrapped_fla__ = original
    return chunk_gated_delta_rule


def _call_flashqla(original, a, backend, fallback, args, kwargs):
    import flashqla
    from flashqla import library
    from flashqla.varlen import VarlenMeta, prepare_varlen

    q, k, v, g, beta = a["q"], a["k"], a["v"], a["g"], a["beta"]
    flag = {n: bool(a.get(n, False)) for n in _FLAGS_DEFAULT_FALSE}
    v_first = flag["state_v_first"] or flag["transpose_state_layout"]
    if flag["use_gate_in_kernel"]:
        A_log, dt_bias = a.get("A_log"), a.get("dt_bias")
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log (FLA's contract)")
        gf = g.float() if dt_bias is None else g.float() + dt_bias.float()
        g = -A_log.float().exp() * F.softplus(gf)
    if flag["use_beta_sigmoid_in_kernel"]:
        beta = torch.sigmoid(beta.float()) * (2.0 if flag["allow_neg_eigval"] else 1.0)
        beta = beta.to(a["beta"].dtype)
    elif flag["allow_neg_eigval"]:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    h0 = a.get("initial_state")
    if h0 is not None:
        if v_first:
            h0 = h0.transpose(-1, -2)
        h0 = h0.float() if h0.dtype not in (torch.float32, torch.float64) else h0
    cu = a.get("cu_seqlens")
    if cu is not None and cu.dtype != torch.int32:
        cu = cu.to(torch.int32)
    scale = a.get("scale")
    out_final = flag["output_final_state"]
    l2 = flag["use_qk_l2norm_in_kernel"]

    if torch.compiler.is_compiling():
        _stats["flashqla"] += 1
        o, ht = library.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                               output_final_state=out_final, use_qk_l2norm_in_kernel=l2,
                                               cu_seqlens=cu, backend=backend)
    else:
        meta: Optional[VarlenMeta] = None
        cu_cpu = a.get("cu_seqlens_cpu")
        if cu is not None:
            if cu_cpu is not None:
                # Build the metadata from the host copy: no device->host sync.
                m = prepare_varlen(cu_cpu.to("cpu", torch.int32))
                dev = cu.device
                meta = VarlenMeta(cu.contiguous(), m.cu_seqlens_cpu, m.chunk_offsets.to(dev, non_blocking=True),
                                  m.chunk_indices.to(dev, non_blocking=True), m.chunk_size)
            else:
                meta = prepare_varlen(cu)
        if fallback and backend == "auto" and q.is_cuda:
            d = flashqla.explain(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=out_final,
                                 use_qk_l2norm_in_kernel=l2, cu_seqlens=cu, varlen_meta=meta)
            if d.chosen in (None, "reference"):
                return _to_fla(original, "no fast flashqla backend", args, kwargs)
        _stats["flashqla"] += 1
        o, ht = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                                output_final_state=out_final, use_qk_l2norm_in_kernel=l2,
                                                cu_seqlens=cu, backend=backend, varlen_meta=meta)
    if ht is not None and v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o, ht


def _candidate_modules(extra: Iterable) -> list:
    mods = [m for name, m in list(sys.modules.items())
            if m is not None and (name == "fla" or name.startswith("fla."))]
    return mods + [m for m in extra if m is not None]


def patch(backend: str = "auto", fallback: bool = True, extra_modules: Iterable = ()) -> None:
    """Send FLA's ``chunk_gated_delta_rule`` calls to flashqla (idempotent; see the module docstring).

    Args:
        backend: flashqla backend for every routed call (``"auto"`` lets flashqla's dispatch choose).
        fallback: on CUDA, call FLA's own function when flashqla has no backend but the slow reference.
        extra_modules: more modules (or objects) whose ``chunk_gated_delta_rule``/``chunk_gdn`` attribute
            should be swapped too (e.g. your own module that imported the function earlier).
    """
    with _lock:
        mod = _fla_module()
        if _state["wrapper"] is not None:
            unpatch()
        original = getattr(mod, "chunk_gated_delta_rule")
        if getattr(original, "__flashqla_patched__", False):  # patched by another copy of this module
            original = original.__wrapped_fla__
        wrapper = _make_wrapper(original, backend, fallback)
        for m in _candidate_modules(extra_modules):
            for name in _NAMES:
                if getattr(m, name, None) is original:
                    _patches.append((m, name, original))
                    setattr(m, name, wrapper)
        _state.update(original=original, wrapper=wrapper)


def unpatch() -> None:
    """Put FLA's own function back everywhere :func:`patch` replaced it (no-op when not patched)."""
    with _lock:
        wrapper = _state["wrapper"]
        while _patches:
            m, name, original = _patches.pop()
            if getattr(m, name, None) is wrapper:
                setattr(m, name, original)
        # Modules imported while patched copied the wrapper from the package: restore those too.
        if wrapper is not None:
            for m in _candidate_modules(()):
                for name in _NAMES:
                    if getattr(m, name, None) is wrapper:
                        setattr(m, name, _state["original"])
        _state.update(original=None, wrapper=None)


@contextlib.contextmanager
def patched(backend: str = "auto", fallback: bool = True, extra_modules: Iterable = ()):
    """``with patched(): ...`` -- :func:`patch` for the duration of the block."""
    patch(backend, fallback, extra_modules)
    try:
        yield
    finally:
        unpatch()
