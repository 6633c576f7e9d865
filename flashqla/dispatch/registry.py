"""The backend registry and the selection rule.

A backend is a small object (subclass :class:`Backend`) with

* ``name`` and ``priorities``: architecture pattern -> priority (higher is tried first).  Patterns:
  ``"cpu"``, an exact ``"sm_90"``, a major family ``"sm_9x"``, or ``"sm_80+"`` (capability >= 8.0).
  ``"cuda"`` matches any CUDA device.  The most specific matching pattern wins (exact > family >
  open range > "cuda");
* ``available()`` -> ``(ok, reason)``: its framework imports, its native module was built;
* ``supports(spec)`` -> ``(ok, reason)``: arch, dtypes, head dims, features of this call;
* ``forward(spec, inputs)`` -> ``(o, final_state, saved_tensors, aux)``;
* ``backward(spec, saved_tensors, aux, do, dht)`` -> ``(dq, dk, dv, dg, dbeta, dh0)``; it may be called
  more than once on the same ``saved`` (context parallelism does), so it must not consume them.

Selection under ``backend="auto"`` walks the backends that have a priority for the device's
architecture, highest first, and takes the first that is available and supports the call; every
rejection is recorded with its reason.  ``FLASHQLA_BACKEND=<name>`` turns ``"auto"`` into that name,
``FLASHQLA_DISABLE=a,b`` removes backends from ``"auto"``.  Where ``speed_table.TABLE`` holds measurements for
the architecture, backends it measured swap priority slots so the one fastest at the nearest measured shape
is tried first (``measured_order``); ``explain()`` says so.  A backend asked for by name never falls
back: :class:`BackendUnavailableError` (a ``ValueError``) says why it cannot serve the call.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from .spec import CallSpec

log = logging.getLogger("flashqla")

Verdict = tuple[bool, str]


class BackendUnavailableError(ValueError):
    """The requested backend cannot serve this call (the message says why)."""


class BackendRuntimeError(RuntimeError):
    """A backend's kernels failed to compile or launch (the message names backend and configuration)."""


# (backend name, CallSpec) -> why it failed at run time in this process; "auto" skips such pairs.
_RUNTIME_FAILURES: dict = {}


class KernelBuildError(RuntimeError):
    """A kernel failed to compile: names the backend, the kernel and its compile key (the configuration).
    Dispatch treats it like any run-time failure: ``auto`` moves to the next backend and explain() says why."""

    def __init__(self, backend: str, kernel: str, key, exc: BaseException):
        self.backend, self.kernel, self.key = backend, kernel, key
        # (the whole message on one line, cut at 400 characters: a compiler's first line is often only where)
        msg = " | ".join(x.strip() for x in str(exc).strip().splitlines() if x.strip())
        super().__init__(f"{backend} kernel {kernel} failed to compile for key {key}: {type(exc).__name__}: "
                         f"{msg[:400] if msg else '(no message)'}")


def record_runtime_failure(name: str, spec: CallSpec, exc: BaseException) -> str:
    why = f"failed at run time on this configuration: {type(exc).__name__}: {str(exc).strip()[:300] or '(no message)'}"
    _RUNTIME_FAILURES[(name, spec)] = why
    log.warning("flashqla: backend %s failed for %s (%s); auto dispatch skips it for this configuration",
                name, spec.summary(), why)
    return why


class Backend:
    """Base class of every backend; subclasses override what they need."""

    name: str = ""
    description: str = ""
    priorities: Mapping[str, int] = {}
    has_backward: bool = True

    def available(self) -> Verdict:
        return True, "built in"

    def supports(self, spec: CallSpec) -> Verdict:
        return True, "ok"

    def forward(self, spec: CallSpec, inputs: "FwdInputs"):
        raise NotImplementedError

    def backward(self, spec: CallSpec, saved: Sequence[Any], aux: Any, do, dht):
        raise NotImplementedError(f"backend {self.name!r} has no backward")

    def version(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"<flashqla backend {self.name}>"


@dataclass
class FwdInputs:
    """Validated, contiguous forward inputs (what a backend's forward receives)."""

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any
    scale: float
    initial_state: Any
    cu_seqlens: Any            # device int32 [N+1] or None
    varlen: Any                # flashqla.varlen.VarlenMeta or None
    output_final_state: bool
    use_qk_l2norm: bool
    options: Mapping[str, Any] = field(default_factory=dict)


_PATTERN = re.compile(r"^sm_(\d+)(\d)(\+)?$|^sm_(\d+)x$")


def match_priority(priorities: Mapping[str, int], arch: str, capability) -> Optional[int]:
    """Priority of the most specific pattern matching ``arch`` (None when nothing matches)."""
    if arch in priorities:
        return priorities[arch]
    if capability is None:
        return None
    # "cuda" is the catch-all for any CUDA device, the least specific pattern of all.
    best: Optional[tuple[int, int]] = (-1, priorities["cuda"]) if "cuda" in priorities else None
    for pat, prio in priorities.items():
        m = _PATTERN.match(pat)
        if not m:
            continue
        if m.group(4) is not None:
            ok, spec_level = capability[0] == int(m.group(4)), 1
        elif m.group(3):
            ok, spec_level = tuple(capability) >= (int(m.group(1)), int(m.group(2))), 0
        else:
            ok, spec_level = False, 2  # exact patterns were handled above
        if ok and (best is None or spec_level > best[0]):
            best = (spec_level, prio)
    return None if best is None else best[1]


_REGISTRY: dict[str, Backend] = {}
_EXTRA_PRIORITIES: dict[str, dict[str, int]] = {}
_logged_choices: set = set()


def register_backend(backend: Backend, priorities: Optional[Mapping[str, int]] = None,
                     replace: bool = False) -> Backend:
    """Register ``backend`` (an instance of a :class:`Backend` subclass).

    ``priorities`` (architecture pattern -> priority) adds to or overrides the backend's own, which is
    how a new architecture is taught to an existing backend: ``register_backend(b, {"sm_120": 50},
    replace=True)``.  Returns the backend.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend expects a flashqla.dispatch.Backend instance, got {type(backend)!r}")
    if not backend.name or not re.match(r"^[a-z][a-z0-9_]*$", backend.name):
        raise ValueError(f"backend name must be lower-case identifier, got {backend.name!r}")
    if backend.name in _REGISTRY and not replace and _REGISTRY[backend.name] is not backend:
        raise ValueError(f"a backend named {backend.name!r} is already registered (pass replace=True)")
    _REGISTRY[backend.name] = backend
    if priorities:
        _EXTRA_PRIORITIES.setdefault(backend.name, {}).update(priorities)
    return backend


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)
    _EXTRA_PRIORITIES.pop(name, None)


def get_backend(name: str) -> Backend:
    _ensure_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; registered: {', '.join(sorted(_REGISTRY))} (or 'auto')") from None


def list_backends() -> list[str]:
    _ensure_builtins()
    return list(_REGISTRY)


def priority_of(backend: Backend, spec_or_arch, capability=None) -> Optional[int]:
    if isinstance(spec_or_arch, CallSpec):
        arch, capability = spec_or_arch.device.arch, spec_or_arch.device.capability
    else:
        arch = spec_or_arch
    merged = dict(backend.priorities)
    merged.update(_EXTRA_PRIORITIES.get(backend.name, {}))
    return match_priority(merged, arch, capability)


_builtins_loaded = False


def _ensure_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        from .. import backends  # noqa: F401  (registers the built-in backends)


@dataclass
class Candidate:
    name: str
    priority: Optional[int]
    verdict: str          # "chosen", "ok" (would serve, lower priority), "rejected", "not for this device"
    reason: str


@dataclass
class Decision:
    spec: CallSpec
    requested: str
    chosen: Optional[str]
    candidates: list[Candidate]
    note: str = ""
    context_parallel: str = ""   # what the CP cost model decides for this call (filled in by explain())
    forward: str = ""            # how the chosen backend would run the forward's state walk (filled in by explain())
    backward: str = ""           # which backward the chosen backend would run, and why (filled in by explain())

    def __str__(self) -> str:
        lines = [f"flashqla dispatch for {self.spec.summary()}",
                 f"requested: {self.requested}" + (f" ({self.note})" if self.note else ""),
                 f"chosen: {self.chosen or 'none'}"]
        if self.context_parallel:
            lines.append(f"context parallelism: {self.context_parallel}")
        if self.forward:
            lines.append(f"forward: {self.forward}")
        if self.backward:
            lines.append(f"backward: {self.backward}")
        width = max([len(c.name) for c in self.candidates] + [7])
        for c in self.candidates:
            prio = "-" if c.priority is None else str(c.priority)
            lines.append(f"  {c.name:<{width}}  prio {prio:>4}  {c.verdict:<18} {c.reason}")
        return "\n".join(lines)

    def reasons(self) -> dict[str, str]:
        return {c.name: c.reason for c in self.candidates}


def _check(backend: Backend, spec: CallSpec, auto: bool = False) -> Verdict:
    if auto and (backend.name, spec) in _RUNTIME_FAILURES:
        return False, _RUNTIME_FAILURES[(backend.name, spec)]
    try:
        ok, why = backend.available()
        if not ok:
            return False, f"unavailable: {why}"
        ok, why = backend.supports(spec)
        if not ok:
            return False, why
        if spec.needs_grad and not backend.has_backward:
            return False, "has no backward and this call needs gradients"
        return True, why
    except Exception as exc:  # a broken backend must not break dispatch
        return False, f"check raised {type(exc).__name__}: {exc}"


def measured_order(spec: CallSpec) -> Optional[tuple[list[str], str]]:
    """Backends of ``spec``'s architecture ordered by the nearest measured shape in ``speed_table.TABLE``.

    Nearness: the recurrence's parallel width (Hv x sequences) first, tokens per sequence second, on a log
    scale; only rows of the same mode (forward, or forward+backward when the call needs gradients) count.
    ``FLASHQLA_SPEED_TABLE=0`` turns this off (priorities alone decide).
    """
    if os.environ.get("FLASHQLA_SPEED_TABLE", "1") == "0":
        return None
    from .speed_table import TABLE

    mode = "fwdbwd" if spec.needs_grad else "fwd"
    rows = [r for r in TABLE.get(spec.device.arch, []) if r["mode"] == mode]
    if not rows:
        return None
    width = max(1, spec.Hv * spec.num_seqs)
    per_seq = max(1, spec.tokens // max(1, spec.num_seqs))

    def distance(r):
        return abs(math.log(r["width"] / width)) + 0.5 * abs(math.log(r["tokens_per_seq"] / per_seq))

    best = min(rows, key=distance)
    times = ", ".join(f"{n} {best['ms'][n]:.3f} ms" for n in best["order"])
    return list(best["order"]), f"ordered by measured speed at the nearest shape {best['row']} ({mode}: {times})"


def _disabled() -> set[str]:
    raw = os.environ.get("FLASHQLA_DISABLE", "")
    return {x.strip() for x in raw.split(",") if x.strip()}


_RANKINGS: dict = {}


def _ranking(spec: CallSpec) -> tuple:
    """``([(priority, name, backend)] best first, note)``: the declared priorities, reordered by the
    measured speed table.  Pure in what the key holds, so it is remembered: dispatch runs on every call,
    and on a slow host this was a large part of an eager call's Python."""
    from . import speed_table
    width = max(1, spec.Hv * spec.num_seqs)
    per_seq = max(1, spec.tokens // max(1, spec.num_seqs))
    key = (spec.device.arch, spec.device.capability, spec.needs_grad, width, per_seq,
           tuple((n, id(b), id(b.priorities)) for n, b in _REGISTRY.items()), repr(_EXTRA_PRIORITIES),
           os.environ.get("FLASHQLA_SPEED_TABLE"), id(speed_table.TABLE))
    hit = _RANKINGS.get(key)
    if hit is not None:
        return hit[0], hit[1]
    prios = {name: priority_of(b, spec) for name, b in _REGISTRY.items()}
    why = ""
    measured = measured_order(spec)
    if measured is not None:
        order, reason = measured
        present = [n for n in order if prios.get(n) is not None]
        slots = sorted((prios[n] for n in present), reverse=True)
        if [prios[n] for n in present] != slots:
            prios.update(zip(present, slots))
            why = reason
        elif len(present) > 1:
            # (explain() says why the winner won either way)
            why = f"{reason}; the declared priorities agree"
    ranked = [(prios[name], name, b) for name, b in _REGISTRY.items()]
    ranked.sort(key=lambda x: (x[0] is None, -(x[0] or 0), x[1]))
    if len(_RANKINGS) > 4096:
        _RANKINGS.clear()
    # (the entry holds the table and, through ``ranked``, the backends: the ids in its key stay theirs)
    _RANKINGS[key] = (ranked, why, speed_table.TABLE)
    return ranked, why


def decide(spec: CallSpec, backend: str = "auto", complete: bool = True) -> Decision:
    """Evaluate every backend for ``spec``; choose one per the rules in the module docstring.

    ``complete=False`` (:func:`select`, on every call): stop at the chosen backend, and check no backend
    other than a requested one; the candidates list then holds only what was checked.  ``explain()``
    always evaluates every backend."""
    _ensure_builtins()
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string ('auto' or a backend name), got {type(backend).__name__}")
    requested, note = backend, ""
    env = os.environ.get("FLASHQLA_BACKEND", "").strip()
    if backend == "auto" and env and env != "auto":
        requested, note = env, "from FLASHQLA_BACKEND"
    if requested != "auto" and requested not in _REGISTRY:
        get_backend(requested)  # raises with the list of names
    disabled = _disabled()
    ranked, why = _ranking(spec)
    if why:
        note = (note + "; " if note else "") + why
    candidates: list[Candidate] = []
    chosen: Optional[str] = None
    for prio, name, b in ranked:
        if not complete and chosen is not None:
            break
        if requested != "auto" and name != requested:
            if not complete:
                continue
            ok, why = _check(b, spec) if prio is not None else (False, f"no priority for {spec.device.arch}")
            candidates.append(Candidate(name, prio, "not requested", why if not ok else "would serve"))
            continue
        if requested == "auto" and prio is None:
            candidates.append(Candidate(name, prio, "not for this device",
                                        f"declares no priority for {spec.device.arch}"))
            continue
        if requested == "auto" and name in disabled:
            candidates.append(Candidate(name, prio, "rejected", "disabled by FLASHQLA_DISABLE"))
            continue
        ok, why = _check(b, spec, auto=requested == "auto")
        if ok and chosen is None:
            chosen = name
            reason = f"requested by name: {why}" if requested != "auto" else (
                f"highest-priority backend that serves this call ({why})")
            candidates.append(Candidate(name, prio, "chosen", reason))
        elif ok:
            candidates.append(Candidate(name, prio, "ok", f"would serve, lower priority than {chosen}"))
        else:
            candidates.append(Candidate(name, prio, "rejected", why))
    return Decision(spec, requested, chosen, candidates, note)


def select(spec: CallSpec, backend: str = "auto") -> tuple[Backend, Decision]:
    """The backend that serves ``spec``; raises ``BackendUnavailableError`` saying why when none does."""
    # (under "auto" the partial decision stops only at a choice: when none serves, it has checked every
    # backend, and the error below lists them all)
    d = decide(spec, backend, complete=False)
    if d.chosen is None:
        if d.requested != "auto":
            why = next(c.reason for c in d.candidates if c.name == d.requested)
            raise BackendUnavailableError(
                f"flashqla backend {d.requested!r} cannot serve this call ({spec.summary()}): {why}"
                + (" [set by FLASHQLA_BACKEND]" if d.note else ""))
        raise BackendUnavailableError("no flashqla backend can serve this call:\n" + str(d))
    key = (d.chosen, spec)
    if key not in _logged_choices:
        _logged_choices.add(key)
        log.info("flashqla: %s -> backend %s", spec.summary(), d.chosen)
    return _REGISTRY[d.chosen], d
