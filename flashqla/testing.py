"""Shared correctness machinery: cases, input generation, the float64 oracle comparison, poisoning.

Used by the test suite (``tests/test_correctness.py``) and by ``python -m flashqla check``, so both
judge a backend by the same cases and the same thresholds.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from .reference import recurrent_gated_delta_rule_ref

# Relative L2 error thresholds vs the float64 oracle, one row per input dtype ("float32-tc": fp32 inputs on
# tensor cores, whose fp32 matmuls run in tf32).  Keys: o, ht (final state), and each gradient.
TOLERANCES: dict[str, dict[str, float]] = {
    "float64":    dict(o=1e-10, ht=1e-10, dq=1e-10, dk=1e-10, dv=1e-10, dg=1e-10, dbeta=1e-10, dh0=1e-10),
    "float32":    dict(o=1e-5, ht=1e-5, dq=1e-5, dk=1e-5, dv=1e-5, dg=1e-5, dbeta=1e-5, dh0=1e-5),
    "float32-tc": dict(o=2e-3, ht=2e-3, dq=5e-3, dk=5e-3, dv=5e-3, dg=1e-2, dbeta=1e-2, dh0=5e-3),
    "bfloat16":   dict(o=5e-3, ht=5e-3, dq=1e-2, dk=1e-2, dv=1e-2, dg=2e-2, dbeta=2e-2, dh0=1e-2),
    "float16":    dict(o=5e-3, ht=5e-3, dq=1e-2, dk=1e-2, dv=1e-2, dg=2e-2, dbeta=2e-2, dh0=1e-2),
}

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@dataclass(frozen=True)
class Case:
    """One correctness case.  ``seqlens`` given -> varlen (B = 1 packed); else ``B`` sequences of ``T``."""

    name: str
    Hqk: int = 2
    Hv: int = 4
    K: int = 64
    V: int = 64
    B: int = 1
    T: int = 100
    seqlens: Optional[tuple] = None
    h0: bool = True
    ht: bool = True
    l2norm: bool = False
    gate: str = "logsigmoid"      # or "strong" (-exp(A_log) * softplus(x), A_log up to log 16) or "zero"
    scale: Optional[float] = None

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens) if self.seqlens is not None else self.B

    @property
    def tokens(self) -> int:
        return sum(self.seqlens) if self.seqlens is not None else self.B * self.T


def standard_cases(K: int = 64, V: int = 64, long: bool = False) -> list[Case]:
    """The shared suite's cases (GVA grids scaled down in T; ``long`` makes sequences longer)."""
    t = 4 if long else 1
    cases = [
        Case("dense_h0_ht", 2, 4, K, V, B=2, T=100 * t),
        Case("dense_no_state", 2, 4, K, V, B=2, T=70 * t, h0=False, ht=False),
        Case("varlen_odd", 1, 2, K, V, seqlens=(0, 1, 63, 64, 65, 130)),
        Case("varlen_l2norm", 2, 4, K, V, seqlens=(33, 0, 97 * t), l2norm=True),
        Case("strong_decay", 1, 2, K, V, seqlens=(130 * t, 7), gate="strong"),
        Case("no_decay", 1, 2, K, V, B=1, T=90 * t, gate="zero"),
        Case("single_token", 1, 2, K, V, B=3, T=1),
        Case("exact_chunk", 1, 1, K, V, B=1, T=64, scale=0.3),
        Case("gva_2_8", 2, 8, K, V, seqlens=(40 * t, 25)),
        Case("gva_4_16", 4, 16, K, V, B=1, T=33 * t),
        Case("gva_16_32", 16, 32, K, V, seqlens=(20, 30 * t)),
        Case("gva_16_64", 16, 64, K, V, B=1, T=17 * t, h0=False),
    ]
    return cases


def make_gate(shape, kind: str, generator: torch.Generator) -> torch.Tensor:
    if kind == "zero":
        return torch.zeros(shape)
    x = torch.randn(shape, generator=generator)
    if kind == "strong":
        Hv = shape[-1]
        a_log = torch.linspace(0.0, math.log(16.0), Hv)
        return -torch.exp(a_log) * torch.nn.functional.softplus(x)
    return torch.nn.functional.logsigmoid(x)


def make_inputs(case: Case, dtype: torch.dtype, device="cpu", seed: int = 0) -> dict:
    """Random inputs for ``case`` (never zeros): q, k (L2-normalised unless the kernel does it), v, g, beta,
    initial_state, cu_seqlens, plus random output cotangents do / dht."""
    gen = torch.Generator().manual_seed(seed)
    B, T = (1, case.tokens) if case.seqlens is not None else (case.B, case.T)
    q = torch.randn(B, T, case.Hqk, case.K, generator=gen)
    k = torch.randn(B, T, case.Hqk, case.K, generator=gen)
    if not case.l2norm:
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, case.Hv, case.V, generator=gen)
    g = make_gate((B, T, case.Hv), case.gate, gen)
    beta = torch.sigmoid(torch.randn(B, T, case.Hv, generator=gen))
    N = case.num_seqs
    h0 = torch.randn(N, case.Hv, case.K, case.V, generator=gen) * 0.5 if case.h0 else None
    do = torch.randn(B, T, case.Hv, case.V, generator=gen)
    dht = torch.randn(N, case.Hv, case.K, case.V, generator=gen) if case.ht else None
    cu = None
    if case.seqlens is not None:
        cu = torch.tensor([0] + list(torch.tensor(case.seqlens).cumsum(0).tolist()), dtype=torch.int32)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    g_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(g_dtype), beta=beta.to(dtype),
               initial_state=None if h0 is None else h0.to(state_dtype), cu_seqlens=cu,
               do=do.to(dtype), dht=None if dht is None else dht.to(state_dtype))
    return {n: (None if t is None else t.to(device)) for n, t in out.items()}


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (inf when x has a NaN/Inf; 0/0 counts as 0)."""
    x = x.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    if x.shape != ref.shape:
        raise AssertionError(f"shape {tuple(x.shape)} != reference shape {tuple(ref.shape)}")
    if not torch.isfinite(x).all():
        return math.inf
    den = ref.norm().item()
    num = (x - ref).norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def oracle(case: Case, inputs: dict, grads: bool = True) -> dict:
    """Float64 token-by-token results (o, ht, and the gradients for the cotangents do/dht)."""
    dev = inputs["q"].device  # float64 on the inputs' device: a GPU walks the tokens far faster
    leaves = {n: inputs[n].detach().to(dev, torch.float64).requires_grad_(grads)
              for n in ("q", "k", "v", "g", "beta")}
    h0 = inputs["initial_state"]
    h0 = None if h0 is None else h0.detach().to(dev, torch.float64).requires_grad_(grads)
    cu = inputs["cu_seqlens"]
    with torch.enable_grad():
        o, ht = recurrent_gated_delta_rule_ref(
            leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=case.scale,
            initial_state=h0, output_final_state=case.ht, use_qk_l2norm_in_kernel=case.l2norm,
            cu_seqlens=None if cu is None else cu.cpu(), compute_dtype=torch.float64)
        res = {"o": o.detach(), "ht": None if ht is None else ht.detach()}
        if grads:
            for n, (t, w) in _input_grads(case, inputs, o, ht, leaves, h0, torch.float64).items():
                res[n] = torch.zeros_like(w) if t is None else t
    return res


def _input_grads(case: Case, inputs: dict, o, ht, leaves: dict, h0, cot_dtype=None) -> dict:
    """{grad name: (gradient or None, the input it is for)} for the cotangents do (and dht)."""
    cast = (lambda t: t.detach().to(cot_dtype)) if cot_dtype is not None else (lambda t: t)
    outs, couts = [o], [cast(inputs["do"])]
    if case.ht:
        outs.append(ht)
        couts.append(cast(inputs["dht"]))
    wrt = [leaves[n] for n in ("q", "k", "v", "g", "beta")] + ([h0] if h0 is not None else [])
    gr = torch.autograd.grad(outs, wrt, couts, allow_unused=True)
    names = ["dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if h0 is not None else [])
    return {n: (t, w) for n, t, w in zip(names, gr, wrt)}


class _PoisonEmpty(TorchFunctionMode):
    """Fill every float tensor made by torch.empty / empty_like / new_empty with NaN, so output that a
    backend forgets to write shows up as NaN instead of as whatever the allocator left there."""

    _FACTORIES = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._FACTORIES and isinstance(out, torch.Tensor) and out.is_floating_point():
            with torch.no_grad():
                out.fill_(float("nan"))
        return out


@contextlib.contextmanager
def poisoned_outputs(device) -> Iterator[None]:
    """Inside: fresh allocations hold NaN (Python-side factories, and on CUDA the caching allocator's
    recycled blocks, which a native kernel's own allocations would reuse)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        n = min(free // 8, 1 << 28) // 4
        junk = torch.full((n,), float("nan"), dtype=torch.float32, device=dev)
        del junk  # returns NaN-filled blocks to the caching allocator for reuse
    with _PoisonEmpty():
        yield


@dataclass
class CaseResult:
    case: Case
    backend: str
    dtype: str
    errors: dict = field(default_factory=dict)
    tolerances: dict = field(default_factory=dict)

    @property
    def failures(self) -> dict:
        return {n: (e, self.tolerances[n]) for n, e in self.errors.items()
                if not (e <= self.tolerances[n])}

    @property
    def ok(self) -> bool:
        return not self.failures


def warm_up_for_capture(*fns, reps: int = 1) -> None:
    """Run each of ``fns`` ``reps`` times on a side stream, then make the current stream wait for it: the
    warm-up CUDA graph capture needs (kernels compile, one-time uploads happen, allocations settle) off
    the stream that will be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(reps):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(side)


def tolerance_key(dtype: torch.dtype, device_type: str, exact_fp32: bool) -> str:
    name = str(dtype).replace("torch.", "")
    if name == "float32" and not exact_fp32:
        return "float32-tc"
    return name


def run_case(op, case: Case, backend: str, dtype: torch.dtype, device="cpu", grads: bool = True,
             exact_fp32: bool = True, seed: int = 0, ref: Optional[dict] = None) -> CaseResult:
    """Run ``op`` (flashqla.chunk_gated_delta_rule) on ``case`` with poisoned outputs and compare every
    output (and gradient, when ``grads``) with the float64 oracle."""
    inputs = make_inputs(case, dtype, device, seed)
    ref = ref if ref is not None else oracle(case, inputs, grads)
    leaves = {n: inputs[n].detach().clone().requires_grad_(grads) for n in ("q", "k", "v", "g", "beta")}
    h0 = inputs["initial_state"]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_(grads)
    with poisoned_outputs(device):
        o, ht = op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=case.scale,
                   initial_state=h0, output_final_state=case.ht, use_qk_l2norm_in_kernel=case.l2norm,
                   cu_seqlens=inputs["cu_seqlens"], backend=backend)
        errors = {"o": rel_l2(o, ref["o"])}
        if case.ht:
            errors["ht"] = rel_l2(ht, ref["ht"])
        elif ht is not None:
            raise AssertionError("final state returned although output_final_state=False")
        if grads:
            for n, (t, _) in _input_grads(case, inputs, o, ht, leaves, h0).items():
                if t is None:
                    raise AssertionError(f"{backend}: no gradient for {n}")
                errors[n] = rel_l2(t, ref[n])
    key = tolerance_key(dtype, torch.device(device).type, exact_fp32)
    return CaseResult(case, backend, key, errors, {n: TOLERANCES[key][n] for n in errors})


def scaled(case: Case, **changes) -> Case:
    return replace(case, **changes)
