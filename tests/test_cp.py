"""Single-device exact context parallelism (flashqla.cp): CP on vs off vs the float64 oracle.

Forward and backward, segment counts 2..7 (and splits that are not multiples of 64), g = 0 heads next to
strong-decay heads (-exp(A_log) * softplus(x), A_log up to log 16), varlen with short unsplit sequences,
length-0/1 sequences, several split sequences of different segment counts, GVA, the fused L2 norm, h0 and
the final state on and off; the three ways of computing the segment maps M (fused into the backend's
first pass, a separate backend pass, torch ops) against each other and against ``transition_matrices``;
no host sync on a warm call (but the one read of the window lengths when windows are taken); windows
(negligible segment maps skipped, forward and backward) against the oracle and windows="off", their norm
bound against the true token maps, random cases (hypothesis); on a GPU, CUDA-graph capture of forward +
backward.  Backends: "reference"
always, "cpu" when built.  Outputs are poisoned with NaN.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import os
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import flashqla
import flashqla.cp as cpmod
from flashqla.cp_bounds import token_log_bound
from flashqla.cp import (CPCostModel, CPPlan, chunk_gated_delta_rule_cp, cp_plan, segment_plan, split_even,
                         transition_matrices)
from flashqla.dispatch import fake_device, get_backend
from flashqla.testing import Case, make_inputs, oracle, poisoned_outputs, rel_l2, warm_up_for_capture

TOL = 1e-5
NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")
_ORACLE: dict = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tensors are tiny: extra intra-op threads only contend (10x slower on a loaded 2-core box).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _fresh_window_memo():
    # a plan's first call reads its windows before running, later ones check them afterwards: each test
    # starts from the first call, whatever ran before it
    cpmod.clear_window_memo()
    yield


def _oracle(case, inputs, key):
    if key not in _ORACLE:
        _ORACLE[key] = oracle(case, inputs)
    return _ORACLE[key]


def _backends():
    out = [pytest.param("reference", id="reference")]
    ok, why = get_backend("cpu").available()
    out.append(pytest.param("cpu", id="cpu", marks=() if ok else pytest.mark.skip(reason=f"cpu backend: {why}")))
    return out


def _mixed_gate(inputs, case):
    """Head 0: g = 0 (no decay); the last head: strong decay with A_log = log 16; the rest as generated."""
    gen = torch.Generator().manual_seed(7)
    g = inputs["g"].clone()
    g[..., 0] = 0.0
    x = torch.randn(g[..., -1].shape, generator=gen)
    g[..., -1] = -16.0 * torch.nn.functional.softplus(x)
    inputs["g"] = g.to(inputs["g"].dtype)
    return inputs


def _run(fn, case, inputs, **kw):
    """fn(q, k, v, g, beta, ...) -> (o, ht); returns outputs and gradients for the cotangents do / dht."""
    leaves = {n: inputs[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    h0 = inputs["initial_state"]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_()
    with poisoned_outputs("cpu"):
        o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=case.scale,
                   initial_state=h0, output_final_state=case.ht, use_qk_l2norm_in_kernel=case.l2norm,
                   cu_seqlens=inputs["cu_seqlens"], **kw)
        outs, couts = [o], [inputs["do"]]
        if case.ht:
            outs.append(ht)
            couts.append(inputs["dht"])
        else:
            assert ht is None
        wrt = [leaves[n] for n in ("q", "k", "v", "g", "beta")] + ([h0] if h0 is not None else [])
        grads = torch.autograd.grad(outs, wrt, couts)
    res = {"o": o.detach(), "ht": None if ht is None else ht.detach()}
    for n, t in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
        res[n] = t
    return res


def _compare(res, ref, tol, what):
    errs = {n: rel_l2(res[n], ref[n]) for n in NAMES if ref.get(n) is not None}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{what}: rel-L2 above {tol}: {bad} (all: {errs})"
    return errs


# (case, segments) — segments as chunk_gated_delta_rule_cp takes them
CASES = [
    (Case("long_2seg", 1, 2, 32, 32, B=1, T=260), 2),
    (Case("long_3seg_noh0", 1, 2, 32, 32, B=1, T=200, h0=False), 3),
    (Case("long_7seg_no_ht", 1, 2, 32, 32, B=1, T=450, ht=False), 7),
    (Case("dense_b2_mixed", 2, 4, 32, 32, B=2, T=200), [[64, 128, 8], 2]),
    (Case("not_64_multiple", 1, 2, 32, 32, B=1, T=200), [[37, 100, 1, 62]]),
    (Case("varlen_short_unsplit", 1, 2, 32, 32, seqlens=(0, 1, 63, 300, 130, 64)), [1, 1, 1, 4, 2, 1]),
    (Case("varlen_gva_l2norm", 1, 4, 32, 32, seqlens=(150, 33, 200), l2norm=True), [2, 1, 3]),
    (Case("strong_decay", 1, 2, 32, 32, seqlens=(260, 7), gate="strong"), 3),
    (Case("zero_decay", 1, 2, 32, 32, B=1, T=260, gate="zero"), 4),
    (Case("zero_decay_noh0_k16_v48", 2, 2, 16, 48, B=1, T=150, gate="zero", h0=False, scale=0.7), 3),
    # several split sequences with different segment counts (the scan's lane prefixes), short ones between
    (Case("varlen_unequal_chains", 1, 2, 32, 32, seqlens=(300, 5, 450, 130, 0, 200)), [3, 1, 6, 2, 1, 4]),
    (Case("varlen_unequal_noh0_noht", 2, 4, 32, 32, seqlens=(130, 450, 64, 300), h0=False, ht=False,
          l2norm=True), [2, 5, 1, 3]),
    (Case("dense_b3_all_split", 1, 2, 32, 32, B=3, T=200, gate="strong"), 3),
]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case,segments", [pytest.param(c, s, id=c.name) for c, s in CASES])
def test_cp_matches_oracle_and_plain_op(backend, case, segments):
    inputs = make_inputs(case, torch.float32, seed=3)
    if case.gate == "logsigmoid":
        inputs = _mixed_gate(inputs, case)
    ref = _oracle(case, inputs, case.name)
    plan = cp_plan(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                   cu_seqlens=inputs["cu_seqlens"], segments=segments)
    assert plan.enabled and plan.max_segments >= 2, plan.describe()
    cp = _run(chunk_gated_delta_rule_cp, case, inputs, backend=backend, segments=segments)
    plain = _run(flashqla.chunk_gated_delta_rule, case, inputs, backend=backend)
    _compare(plain, ref, TOL, f"{backend} without CP vs oracle")
    _compare(cp, ref, TOL, f"{backend} CP {plan.describe()} vs oracle")
    _compare(cp, plain, TOL, f"{backend} CP vs without CP")


def test_cp_float64_matches_oracle_tightly():
    case = Case("f64", 1, 2, 16, 16, seqlens=(290, 20), gate="strong")
    inputs = make_inputs(case, torch.float64, seed=1)
    inputs = _mixed_gate(inputs, case)
    ref = oracle(case, inputs)
    cp = _run(chunk_gated_delta_rule_cp, case, inputs, backend="reference", segments=[5, 1])
    _compare(cp, ref, 1e-11, "float64 CP vs oracle")


def _token_product(k, g, beta):
    """The definition: prod_t exp(g_t) (I - beta_t k_t k_t^T), latest on the left.  k [L, H, K]."""
    L, H, K = k.shape
    M = torch.eye(K, dtype=k.dtype).expand(H, K, K).clone()
    for t in range(L):
        f = torch.eye(K, dtype=k.dtype) - beta[t][:, None, None] * k[t][:, :, None] * k[t][:, None, :]
        M = torch.exp(g[t])[:, None, None] * (f @ M)
    return M


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_transition_matrices_match_token_product(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    T, Hqk, Hv, K = 400, 1, 3, 16
    k = torch.randn(1, T, Hqk, K, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen, dtype=torch.float64))
    g[..., 0] = 0.0                                                    # no decay
    g[..., 2] = -16.0 * torch.nn.functional.softplus(g[..., 2])        # strong decay
    beta = torch.sigmoid(torch.randn(1, T, Hv, generator=gen, dtype=torch.float64))
    ranges = [(0, 64), (64, 1), (65, 200), (265, 135), (10, 0), (3, 130)]
    for l2 in (False, True):
        kn = flashqla.reference.l2norm(k) if l2 else torch.nn.functional.normalize(k, dim=-1)
        kin = k if l2 else kn
        # memory_budget=1 forces one chunk per block: the running product over blocks is exercised too
        for budget in (1, 256 << 20):
            M = transition_matrices(kin.to(dtype), g.to(dtype), beta.to(dtype), ranges, use_qk_l2norm=l2,
                                    memory_budget=budget)
            assert M.shape == (len(ranges), Hv, K, K) and M.dtype == dtype
            for r, (s, L) in enumerate(ranges):
                ref = _token_product(kn[0, s:s + L].repeat_interleave(Hv // Hqk, 1), g[0, s:s + L], beta[0, s:s + L])
                assert rel_l2(M[r], ref) <= tol, (r, s, L, l2, budget)


def test_split_even_and_plan_rules():
    assert split_even(0, 4) == (0,)
    assert split_even(100, 4) == (64, 36)
    assert split_even(640, 4) == (192, 192, 128, 128)
    for L, n in ((1000, 3), (4097, 8), (64, 5), (65, 2)):
        s = split_even(L, n)
        assert sum(s) == L and all(x > 0 for x in s) and all(x % 64 == 0 for x in s[:-1])
    # few heads, one long sequence, many SMs: split into chunk multiples
    p = segment_plan([65536], num_heads=4, sm_count=132)
    assert p.enabled and p.max_segments >= 4, p.describe()
    assert sum(p.segments[0]) == 65536 and all(x % 64 == 0 for x in p.segments[0])
    assert "on" in p.describe() and "SMs" in p.describe()
    # many (sequence, head) lanes already fill the SMs: no CP
    p = segment_plan([4096] * 64, num_heads=32, sm_count=132)
    assert not p.enabled and "no gain" in p.describe()
    # short sequences are never split, long ones in the same call are
    p = segment_plan([100, 65536, 300], num_heads=2, sm_count=132)
    assert p.enabled and p.segments[0] == (100,) and p.segments[2] == (300,) and len(p.segments[1]) > 1
    p = segment_plan([300, 200], num_heads=2, sm_count=132)
    assert not p.enabled and "minimum segment" in p.describe()
    # more SMs never makes the plan split less
    few = segment_plan([32768], num_heads=8, sm_count=8).max_segments
    many = segment_plan([32768], num_heads=8, sm_count=264).max_segments
    assert many >= few
    # forced segment length
    p = segment_plan([1000, 10], num_heads=2, sm_count=1, segment_len=256)
    assert p.segments == ((256, 256, 256, 232), (10,))


def test_plan_from_call_and_auto_path():
    case = Case("auto", 1, 2, 32, 32, seqlens=(300, 40))
    x = make_inputs(case, torch.float32, seed=5)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    free = CPCostModel(pass_overhead=0.0, scan_step=0.0, window_host=0.0)  # toy size: fixed overheads dominate
    with fake_device("cpu", None, sm_count=132):
        plan = cp_plan(*args, cu_seqlens=x["cu_seqlens"], min_segment_len=128, cost=free)
    assert isinstance(plan, CPPlan) and plan.enabled and plan.segments[1] == (40,), plan.describe()
    # the plan object itself can be passed back; results match the oracle
    ref = oracle(case, x)
    res = _run(chunk_gated_delta_rule_cp, case, x, backend="reference", segments=plan)
    _compare(res, ref, TOL, "CP with a CPPlan")
    # auto plan on this CPU (few threads, short sequences): CP stays off and the plain op runs
    plan = cp_plan(*args, cu_seqlens=x["cu_seqlens"])
    assert not plan.enabled
    a = _run(chunk_gated_delta_rule_cp, case, x, backend="reference")
    b = _run(flashqla.chunk_gated_delta_rule, case, x, backend="reference")
    for n in NAMES:
        assert torch.equal(a[n], b[n]), n
    # sm_count and min_segment_len reach the model through the op
    c = _run(chunk_gated_delta_rule_cp, case, x, backend="reference", sm_count=132, min_segment_len=128,
             cost=free)
    assert cp_plan(*args, cu_seqlens=x["cu_seqlens"], sm_count=132, min_segment_len=128, cost=free).enabled
    _compare(c, ref, TOL, "CP with an auto plan")


def test_no_grad_forward_and_bad_segments():
    case = Case("nograd", 1, 2, 16, 16, B=1, T=200)
    x = make_inputs(case, torch.float32, seed=2)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    ref = oracle(case, x, grads=False)
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule_cp(*args, initial_state=x["initial_state"], output_final_state=True,
                                          backend="reference", segments=3)
    assert rel_l2(o, ref["o"]) <= TOL and rel_l2(ht, ref["ht"]) <= TOL
    for bad in (0, [[100, 50]], [[200, 0]], [2, 2], True):
        with pytest.raises((ValueError, TypeError)):
            chunk_gated_delta_rule_cp(*args, backend="reference", segments=bad)
    # T == 0 is the plain op's empty call
    e = [t[:, :0] for t in args]
    o, ht = chunk_gated_delta_rule_cp(*e, output_final_state=True, backend="reference", segments=2)
    assert o.shape == (1, 0, 2, 16) and ht.shape == (1, 2, 16, 16)
    assert math.isfinite(float(o.sum()))


# ------------------------------------------------------------------------------------------------------
# The segment maps M: fused into the backend's first pass, a separate backend pass, torch ops
# ------------------------------------------------------------------------------------------------------

MODE_CASES = [
    (Case("modes_kv_varlen", 1, 2, 32, 32, seqlens=(300, 5, 450, 130, 0, 200)), [3, 1, 6, 2, 1, 4]),
    (Case("modes_k16_v48_dense", 2, 4, 16, 48, B=2, T=200, l2norm=True), [3, 4]),
    (Case("modes_k48_v16_noh0", 1, 2, 48, 16, seqlens=(260, 40), h0=False, gate="zero"), [4, 1]),
]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("transitions", ["auto", "kernel", "torch"])
@pytest.mark.parametrize("case,segments", [pytest.param(c, s, id=c.name) for c, s in MODE_CASES])
def test_cp_transition_modes(backend, transitions, case, segments):
    inputs = make_inputs(case, torch.float32, seed=4)
    if case.gate == "logsigmoid":
        inputs = _mixed_gate(inputs, case)
    ref = _oracle(case, inputs, case.name)
    cp = _run(chunk_gated_delta_rule_cp, case, inputs, backend=backend, segments=segments,
              transitions=transitions)
    plain = _run(flashqla.chunk_gated_delta_rule, case, inputs, backend=backend)
    _compare(cp, ref, TOL, f"{backend} CP transitions={transitions} vs oracle")
    _compare(cp, plain, TOL, f"{backend} CP transitions={transitions} vs without CP")


def _upload_cpu():
    return functools.partial(cpmod._upload, device=torch.device("cpu"), keep=None)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("needs_grad", [False, True])
def test_kernel_transitions_equal_torch_transitions(backend, needs_grad):
    """M (and S_local) out of the backend's forward (v = 0, start state I) == transition_matrices, row by
    row, for every mode of the first phase; and the rows are the segments the scan needs."""
    case = Case("m", 1, 4, 32, 32, seqlens=(300, 5, 450, 130, 200), l2norm=True)
    x = _mixed_gate(make_inputs(case, torch.float32, seed=11), case)
    segs = ((64, 128, 108), (5,), (64,) * 6 + (66,), (64, 66), (100, 100))
    xp = tuple(x[n] for n in ("q", "k", "v", "g", "beta"))
    h0 = x["initial_state"]
    eng = cpmod._Engine(backend, 32 ** -0.5, True, None, torch.float32)
    out = {}
    for mode in ("fused", "kernel", "torch"):
        prog = cpmod._Program(segs, True, needs_grad, mode, _upload_cpu())
        with torch.no_grad():
            out[mode] = cpmod._phase1(eng, prog, xp, h0)
    prog = cpmod._Program(segs, True, needs_grad, "torch", _upload_cpu())
    # the M rows are the segments p >= 1 (up to the last one when the backward needs it), position-major
    lanes = [2, 0, 3, 4]   # decreasing segment count, stable
    nl = [len(segs[n]) for n in lanes]
    starts = [sum(map(sum, segs[:n])) for n in range(len(segs))]
    want = [(starts[lanes[l]] + sum(segs[lanes[l]][:p]), segs[lanes[l]][p])
            for p in range(1, max(nl)) for l in range(len(lanes)) if p < (nl[l] if needs_grad else nl[l] - 1)]
    assert prog.m_ranges == want
    M_ref = transition_matrices(x["k"], x["g"], x["beta"], want, use_qk_l2norm=True)
    for mode, (S, M) in out.items():
        assert M.shape == M_ref.shape, mode
        assert rel_l2(M, M_ref) <= TOL, (mode, rel_l2(M, M_ref))
        assert rel_l2(S, out["torch"][0]) <= TOL, mode
    # S_local of a first segment is its true end state (it starts from the caller's h0)
    ref = oracle(Case("seg0", 1, 4, 32, 32, seqlens=(64,), l2norm=True),
                 {**{n: x[n][:, starts[2]:starts[2] + 64] for n in ("q", "k", "v", "g", "beta")},
                  "initial_state": h0[2:3], "cu_seqlens": None, "do": None, "dht": None}, grads=False)
    assert rel_l2(out["fused"][0][0], ref["ht"][0]) <= TOL


def test_fused_first_pass_is_one_launch_and_final_pass_no_gather(monkeypatch):
    """K == V: phase 1 is ONE backend forward (S_local and M together); the final pass runs on views of the
    caller's tokens (no copy); without gradients a single split sequence needs no gather at all when
    it has two segments."""
    case = Case("launches", 1, 2, 32, 32, seqlens=(300, 40, 260))
    x = make_inputs(case, torch.float32, seed=2)
    meta = flashqla.prepare_varlen(x["cu_seqlens"])
    calls = []
    real = cpmod._Engine.forward_call

    def spy(self, q, k, v, g, beta, cu, h0, out_final, needs_grad):
        calls.append(dict(T=q.shape[1], same_qk=q is k, nseq=len(cu.cu_seqlens_cpu) - 1, v_ptr=v.data_ptr(),
                          h0=None if h0 is None else h0.shape[0]))
        return real(self, q, k, v, g, beta, cu, h0, out_final, needs_grad)

    monkeypatch.setattr(cpmod._Engine, "forward_call", spy)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with torch.no_grad():
        chunk_gated_delta_rule_cp(*args, initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
                                  varlen_meta=meta, backend="reference", segments=[4, 1, 3])
    assert len(calls) == 2, calls
    # phase 1: S rows (3 + 2) and M rows (2 + 1), q = k, one packed batch
    assert calls[0]["same_qk"] and calls[0]["nseq"] == 8 and calls[0]["h0"] == 8
    # final pass: every segment, the caller's v itself
    assert calls[1]["nseq"] == 8 and calls[1]["T"] == 600 and calls[1]["v_ptr"] == x["v"].data_ptr()
    calls.clear()
    with torch.no_grad():
        chunk_gated_delta_rule_cp(*args, cu_seqlens=x["cu_seqlens"], varlen_meta=meta, backend="reference",
                                  segments=[2, 1, 1])
    assert len(calls) == 2 and calls[0]["nseq"] == 1 and calls[0]["h0"] is None
    assert calls[0]["v_ptr"] == x["v"].data_ptr()   # the first segment is a view: nothing gathered


# ------------------------------------------------------------------------------------------------------
# No host sync, cached metadata
# ------------------------------------------------------------------------------------------------------

_SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "tensor", "as_tensor", "cpu",
            "numpy", "pin_memory", "from_numpy", "nonzero", "unique", "masked_select"}


class _HostOps(TorchFunctionMode):
    """Records tensor functions that read device values on the host or build tensors from host data."""

    def __init__(self):
        super().__init__()
        self.bad = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        kw = kwargs or {}
        if name in _SYNCING:
            self.bad.append(name)
        elif name == "to" and (any(isinstance(a, (str, torch.device)) for a in args[1:]) or "device" in kw):
            self.bad.append("to(device)")
        return func(*args, **kw)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("transitions,windows", [("auto", "off"), ("torch", "auto"), ("auto", "auto")])
def test_warm_cp_call_reads_nothing_on_the_host(backend, transitions, windows):
    """After one call with the same plan, forward + backward make no device->host read, build no tensor from
    host data and move nothing between devices (what a CUDA graph capture needs) — except, with windows, the
    one read of the window lengths (under capture the op takes no windows)."""
    case = Case("sync", 1, 2, 32, 32, seqlens=(300, 5, 450, 130, 0, 200))
    x = make_inputs(case, torch.float32, seed=6)
    meta = flashqla.prepare_varlen(x["cu_seqlens"])
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]

    def run():
        o, ht = chunk_gated_delta_rule_cp(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                          cu_seqlens=x["cu_seqlens"], varlen_meta=meta, backend=backend,
                                          segments=[3, 1, 6, 2, 1, 4], transitions=transitions, windows=windows)
        return torch.autograd.grad([o, ht], leaves, [x["do"], x["dht"]])

    first = run()
    n_cached = len(cpmod._CACHE)
    with _HostOps() as rec:
        again = run()
    taken = windows == "auto" and transitions == "auto"       # windows need M from the kernel (K == V)
    assert rec.bad == (["tolist"] if taken else []), rec.bad
    assert len(cpmod._CACHE) == n_cached   # nothing rebuilt
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_hot_path_source_has_no_host_reads():
    """Code structure: the functions run on every call never call .item()/.tolist()/.cpu()/.numpy() or build
    tensors from Python data (torch.tensor); host lists are uploaded once per plan by _device_cached."""
    hot = [cpmod._CPFunction.forward, cpmod._CPFunction.backward, cpmod._run_pass, cpmod._phase1,
           cpmod._gather, cpmod._bmm_into, cpmod._Idx.take, cpmod._Idx.put, cpmod.chunk_gated_delta_rule_cp,
           cpmod._Engine.forward_call]
    for fn in hot:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("item", "tolist", "cpu", "numpy", "pin_memory"):
                raise AssertionError(f"{fn.__qualname__} calls .{node.attr}")
            if isinstance(node, ast.Attribute) and node.attr in ("tensor", "as_tensor") and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch":
                raise AssertionError(f"{fn.__qualname__} calls torch.{node.attr}")


def test_device_cache_keeps_graph_entries():
    saved = cpmod._CACHE.copy()
    try:
        cpmod._CACHE.clear()
        dev = torch.device("cpu")
        cpmod._device_cached("pinned-by-graph", dev, lambda up: up([1, 2, 3]))
        cpmod._CACHE[("pinned-by-graph", "cpu")][1] = True   # as if a captured graph used it
        for i in range(cpmod._CACHE_MAX + 5):
            t = cpmod._device_cached(("k", i), dev, lambda up, i=i: up([i]))
            assert int(t[0]) == i
        assert ("pinned-by-graph", "cpu") in cpmod._CACHE
        assert len(cpmod._CACHE) <= cpmod._CACHE_MAX + 1
        built = []
        cpmod._device_cached(("k", cpmod._CACHE_MAX + 4), dev, lambda up: built.append(1))
        assert not built   # a hit
    finally:
        cpmod._CACHE.clear()
        cpmod._CACHE.update(saved)


def test_bad_transitions_argument():
    case = Case("badtr", 1, 2, 16, 16, B=1, T=130)
    x = make_inputs(case, torch.float32)
    with pytest.raises(ValueError, match="transitions"):
        chunk_gated_delta_rule_cp(x["q"], x["k"], x["v"], x["g"], x["beta"], backend="reference", segments=2,
                                  transitions="fast")


# ------------------------------------------------------------------------------------------------------
# Windows: negligible segment maps are not computed (inference forwards)
# ------------------------------------------------------------------------------------------------------

def _spy_calls(monkeypatch, order=None):
    """The backend passes CP runs (tokens, sequences), in order; each also logged as "pass" in ``order``."""
    calls = []
    real = cpmod._Engine.forward_call

    def spy(self, q, k, v, g, beta, cu, h0, out_final, needs_grad):
        calls.append(dict(T=q.shape[1], nseq=len(cu.cu_seqlens_cpu) - 1))
        if order is not None:
            order.append("pass")
        return real(self, q, k, v, g, beta, cu, h0, out_final, needs_grad)

    monkeypatch.setattr(cpmod._Engine, "forward_call", spy)
    return calls


def _late_decay(inputs):
    """Every head: no decay (g = 0) over the first 700 tokens of the packed batch, strong decay after; so
    the maps of the early segments are not negligible and those of the late ones are."""
    g = inputs["g"].clone()
    g[:, :700] = 0.0
    g[:, 700:] = g[:, 700:] * 8.0 - 2.0
    inputs["g"] = g
    return inputs


WINDOW_CASES = [
    (Case("win_logsigmoid", 2, 4, 32, 32, seqlens=(3000, 40, 1800)), [6, 1, 4], "all"),
    (Case("win_strong_gva_l2", 1, 4, 32, 32, seqlens=(1300, 5, 700), gate="strong", l2norm=True), [5, 1, 3],
     "some"),
    (Case("win_zero", 1, 2, 32, 32, B=1, T=1200, gate="zero"), 5, "none"),
    (Case("win_mixed_heads", 1, 2, 32, 32, B=1, T=1200), 5, "none"),     # head 0 has g = 0: no window
    (Case("win_late_decay", 1, 2, 32, 32, B=1, T=1600, h0=True), 6, "some"),
    (Case("win_noh0_dense", 2, 4, 32, 32, B=2, T=1800, h0=False, ht=False), 4, "all"),
]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case,segments,expect", [pytest.param(c, s, e, id=c.name) for c, s, e in WINDOW_CASES])
def test_windows_match_oracle_and_shrink_phase1(backend, case, segments, expect, monkeypatch):
    """An inference forward with windows gives the float64 oracle's o and final state, as windows="off"
    does; phase 1 runs fewer tokens exactly where the gates make segment maps negligible."""
    x = make_inputs(case, torch.float32, seed=4)
    if case.name == "win_mixed_heads":
        x = _mixed_gate(x, case)
    if case.name == "win_late_decay":
        x = _late_decay(x)
    ref = oracle(case, x, grads=False)
    calls = _spy_calls(monkeypatch)
    res = {}
    for w in ("first", "auto", "off"):
        # (a plan's first call runs the fixed structure and keeps its windows; the next one takes them)
        calls.clear()
        with torch.no_grad(), poisoned_outputs("cpu"):
            o, ht = chunk_gated_delta_rule_cp(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=case.scale,
                                              initial_state=x["initial_state"], output_final_state=case.ht,
                                              use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=x["cu_seqlens"],
                                              backend=backend, segments=segments,
                                              windows="auto" if w == "first" else w)
        res[w] = (o, ht, [c["T"] for c in calls])
        assert rel_l2(o, ref["o"]) <= TOL, (w, rel_l2(o, ref["o"]))
        if case.ht:
            assert rel_l2(ht, ref["ht"]) <= TOL, (w, rel_l2(ht, ref["ht"]))
    assert res["first"][2] == res["off"][2]
    phase1_auto, phase1_off = res["auto"][2][0], res["off"][2][0]
    if expect == "none":
        assert phase1_auto == phase1_off
    elif expect == "all":
        # no M row is left: phase 1 is the windows alone, a fraction of the non-last segments
        assert phase1_auto * 3 <= phase1_off, (phase1_auto, phase1_off)
    else:
        assert phase1_auto < phase1_off, (phase1_auto, phase1_off)
    assert res["auto"][2][1] == res["off"][2][1]      # the final pass is the same


GRAD_WINDOW_CASES = [
    (Case("gwin_logsigmoid_h0", 1, 2, 32, 32, B=1, T=1800), 4, True),
    (Case("gwin_varlen_gva_l2", 1, 4, 32, 32, seqlens=(1500, 40, 1100), l2norm=True), [5, 1, 3], True),
    (Case("gwin_mixed_heads", 1, 2, 32, 32, B=1, T=1800), 4, False),     # head 0 has g = 0: no window
    (Case("gwin_late_decay_noht", 1, 2, 32, 32, B=1, T=1800, ht=False), 5, True),   # trailing: some
    # segments that are not whole chunks (a 1-token one has no leading window: the full first pass runs)
    (Case("gwin_odd_splits", 1, 2, 32, 32, seqlens=(1538, 100)), [[1000, 538], 1], True),
    (Case("gwin_odd_splits_1tok", 1, 2, 32, 32, seqlens=(1538, 100)), [[37, 700, 1, 800], 2], False),
]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case,segments,leading", [pytest.param(c, s, w, id=c.name) for c, s, w in GRAD_WINDOW_CASES])
def test_windows_with_gradients(backend, case, segments, leading, monkeypatch):
    """Training CP with windows: outputs and every gradient match the float64 oracle and windows="off"; where
    every segment has a leading window the backward's first full pass is replaced by a pass over them."""
    x = make_inputs(case, torch.float32, seed=5)
    if case.name == "gwin_mixed_heads":
        x = _mixed_gate(x, case)
    if case.name == "gwin_late_decay_noht":
        x = _late_decay(x)
    used = []
    real = cpmod._lead_dh0
    monkeypatch.setattr(cpmod, "_lead_dh0", lambda *a, **k: used.append(1) or real(*a, **k))
    ref = _oracle(case, x, case.name)
    first = _run(chunk_gated_delta_rule_cp, case, x, backend=backend, segments=segments)
    assert not used                                   # a plan's first call: the fixed structure
    _compare(first, ref, TOL, "first call")
    res = _run(chunk_gated_delta_rule_cp, case, x, backend=backend, segments=segments)
    assert bool(used) == leading
    _compare(res, ref, TOL, "windows with gradients")
    off = _run(chunk_gated_delta_rule_cp, case, x, backend=backend, segments=segments, windows="off")
    _compare(res, off, TOL, "windows vs off")


def _scaled_gates(x, factor):
    return {**x, "g": x["g"] * factor}


def _infer_cp(inputs, windows="auto", *, backend, segments):
    """An inference CP call with the final state, outputs poisoned."""
    with torch.no_grad(), poisoned_outputs("cpu"):
        return chunk_gated_delta_rule_cp(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                                         initial_state=inputs["initial_state"], output_final_state=True,
                                         cu_seqlens=inputs["cu_seqlens"], backend=backend, segments=segments,
                                         windows=windows)


@pytest.mark.parametrize("backend", _backends())
def test_repeated_call_checks_its_windows_after_launching(backend, monkeypatch):
    """No call reads its window lengths before running: a plan's first call runs the fixed structure, a
    repeated call the plan's windows, and both read this call's lengths only after every backend pass is
    launched (no read in the middle); both match windows="off" and the oracle."""
    case = Case("spec_windows", 1, 2, 32, 32, seqlens=(2000, 700))
    x = make_inputs(case, torch.float32, seed=11)
    ref = oracle(case, x, grads=False)
    order = []
    calls = _spy_calls(monkeypatch, order)
    real_read, real_finish = cpmod._boundary_windows, cpmod._finish_read
    monkeypatch.setattr(cpmod, "_boundary_windows", lambda *a, **kw: order.append("read first") or real_read(*a, **kw))
    monkeypatch.setattr(cpmod, "_finish_read", lambda p: order.append("read after") or real_finish(p))
    call = functools.partial(_infer_cp, backend=backend, segments=[4, 2])
    first = call(x)
    assert order == ["pass", "pass", "read after"], order       # the fixed structure, read at the end
    order.clear()
    again = call(x)
    assert order == ["pass", "pass", "read after"], order       # the windows, read at the end
    passes = [c["T"] for c in calls]
    assert passes[2] * 2 <= passes[0], passes                   # phase 1: the windows alone
    order.clear()
    off = call(x, windows="off")
    for a, b, r in zip(again, first, (ref["o"], ref["ht"])):
        assert rel_l2(a, r) <= TOL and rel_l2(b, r) <= TOL
    for a, b in zip(again, off):
        assert rel_l2(a, b) <= TOL


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("second", ["slower", "no_decay_head"])
def test_repeated_call_runs_again_when_its_windows_fall_short(backend, second, monkeypatch):
    """A repeated call whose gates need longer windows than the plan's last ones (slower decay), or none at all
    (a g = 0 head), runs again with the wider configuration: exact (the oracle, windows="off"), and the plan
    keeps the wider windows, so a call like the first is served without running twice."""
    case = Case("spec_widen", 1, 2, 32, 32, seqlens=(6000, 300))
    fast = make_inputs(case, torch.float32, seed=12)
    fast["g"] = fast["g"] * 4.0 - 1.0                  # about -4 per token: windows of one chunk
    if second == "slower":
        # about -0.12 per token: windows of ~20 chunks, where the first call's one-chunk windows would drop
        # terms of e^-8 (caught by the tolerance)
        other = _scaled_gates(fast, 0.03)
    else:
        other = {**fast, "g": fast["g"].clone()}
        other["g"][..., 0] = 0.0                      # head 0 never decays: no window anywhere
    calls = _spy_calls(monkeypatch)
    call = functools.partial(_infer_cp, backend=backend, segments=[4, 1])
    call(fast)                                        # the fixed structure; the plan keeps one-chunk windows
    calls.clear()
    call(fast)
    narrow = calls[0]["T"]
    calls.clear()
    got = call(other)
    passes = [c["T"] for c in calls]
    assert len(passes) == 4, passes                   # ran, found its windows short, ran again
    assert passes[2] > narrow, (passes, narrow)
    ref = oracle(case, other, grads=False)
    off = call(other, windows="off")
    for a, b, r in zip(got, off, (ref["o"], ref["ht"])):
        assert rel_l2(a, r) <= TOL and rel_l2(a, b) <= TOL
    calls.clear()
    again = call(fast)
    assert len(calls) == 2, calls                     # the wider windows cover the fast gates
    ref_fast = oracle(case, fast, grads=False)
    for a, r in zip(again, (ref_fast["o"], ref_fast["ht"])):
        assert rel_l2(a, r) <= TOL


@pytest.mark.parametrize("backend", _backends())
def test_repeated_training_call_widens_its_leading_windows(backend, monkeypatch):
    """Training: a repeated call whose gates need longer leading and trailing windows runs again (wider)
    before its backward; outputs and every gradient match windows="off" and the oracle."""
    case = Case("spec_train", 1, 2, 32, 32, B=1, T=4096)
    fast = make_inputs(case, torch.float32, seed=13)
    fast["g"] = fast["g"] * 4.0 - 1.0
    slow = _scaled_gates(fast, 0.03)
    widened = []
    real = cpmod._widen
    monkeypatch.setattr(cpmod, "_widen", lambda *a: widened.append(real(*a)) or widened[-1])
    _run(chunk_gated_delta_rule_cp, case, fast, backend=backend, segments=2)
    _run(chunk_gated_delta_rule_cp, case, fast, backend=backend, segments=2)
    assert not widened
    res = _run(chunk_gated_delta_rule_cp, case, slow, backend=backend, segments=2)
    assert len(widened) == 1 and widened[0][1] is not None and min(widened[0][1].values()) > 1, widened
    _compare(res, oracle(case, slow), TOL, "widened windows with gradients")
    off = _run(chunk_gated_delta_rule_cp, case, slow, backend=backend, segments=2, windows="off")
    _compare(res, off, TOL, "widened windows vs off")


def test_window_configurations_widen_per_row():
    """_covers / _widen: per row the longer window; a row without a window (0) runs in full from then on; the
    leading windows are dropped (a full backward pass) as soon as one row has none."""
    used = ({(0, 0): 2, (0, 1): 4}, {(0, 1): 2})
    assert cpmod._covers(used, {(0, 0): 1, (0, 1): 4}, {(0, 1): 2})
    assert not cpmod._covers(used, {(0, 0): 4, (0, 1): 4}, {(0, 1): 2})
    assert not cpmod._covers(used, {(0, 0): 0, (0, 1): 4}, {(0, 1): 2})
    assert not cpmod._covers(used, {(0, 0): 1, (0, 1): 1}, {(0, 1): 4})
    assert cpmod._widen(used, {(0, 0): 4, (0, 1): 1}, {(0, 1): 1}) == ({(0, 0): 4, (0, 1): 4}, {(0, 1): 2})
    assert cpmod._widen(used, {(0, 0): 0, (0, 1): 8}, {(0, 1): 0}) == ({(0, 0): 0, (0, 1): 8}, None)
    assert cpmod._widen(used, {(0, 0): 0, (0, 1): 0}, {(0, 1): 1}) == (None, {(0, 1): 2})
    # a row that runs in full covers anything, and stays in full
    full = ({(0, 0): 0, (0, 1): 4}, None)
    assert cpmod._covers(full, {(0, 0): 0, (0, 1): 2}, {})
    assert cpmod._widen(full, {(0, 0): 1, (0, 1): 2}, {(0, 1): 1}) == ({(0, 0): 0, (0, 1): 4}, None)


@pytest.mark.parametrize("backend", _backends())
def test_windows_keep_a_nan_in_its_sequence(backend):
    """A NaN gate in one sequence: that sequence's windows are refused (NaN compares false) and its outputs go
    NaN, as in the plain op; every other sequence stays finite and matches the oracle."""
    case = Case("win_nan", 1, 2, 32, 32, seqlens=(1500, 1200, 900))
    x = make_inputs(case, torch.float32, seed=9)
    ref = oracle(case, x, grads=False)
    x["g"] = x["g"].clone()
    x["g"][0, 1500 + 600, 1] = float("nan")          # second sequence, second head
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule_cp(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                          output_final_state=True, cu_seqlens=x["cu_seqlens"], backend=backend,
                                          segments=[4, 4, 3])
    a, b = 1500, 2700
    assert torch.isnan(o[0, a + 600:b, 1]).any() and torch.isnan(ht[1, 1]).any()
    for lo, hi, n in ((0, a, 0), (b, 3600, 2)):
        assert torch.isfinite(o[0, lo:hi]).all() and torch.isfinite(ht[n]).all()
        assert rel_l2(o[0, lo:hi], ref["o"][0, lo:hi]) <= TOL and rel_l2(ht[n], ref["ht"][n]) <= TOL


def test_bad_windows_argument():
    case = Case("win_bad", 1, 2, 32, 32, B=1, T=300)
    x = make_inputs(case, torch.float32, seed=5)
    with pytest.raises(ValueError, match="windows"):
        chunk_gated_delta_rule_cp(x["q"], x["k"], x["v"], x["g"], x["beta"], backend="reference", segments=4,
                                  windows="on")


@pytest.mark.parametrize("l2norm", [False, True])
def test_token_log_bound_bounds_the_token_map(l2norm):
    """log ||exp(g) (I - beta k k^T)||_2 <= the bound, for unnormalised k, beta in [-1, 3] and any g."""
    gen = torch.Generator().manual_seed(11)
    T, Hqk, Hv, K = 200, 2, 4, 16
    k = torch.randn(1, T, Hqk, K, generator=gen, dtype=torch.float64) * torch.rand(1, T, Hqk, 1, generator=gen,
                                                                                    dtype=torch.float64) * 2
    g = torch.randn(1, T, Hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, T, Hv, generator=gen, dtype=torch.float64) * 4 - 1
    bound = token_log_bound(k, g, beta, l2norm)
    kk = cpmod.l2norm(k) if l2norm else k
    kk = kk[0].repeat_interleave(Hv // Hqk, dim=1)                       # [T, Hv, K]
    A = torch.eye(K, dtype=torch.float64) - beta[0][..., None, None] * kk[..., :, None] * kk[..., None, :]
    actual = g[0] + torch.log(torch.linalg.matrix_norm(A, ord=2))
    assert (actual <= bound.double() + 1e-6).all(), float((actual - bound).max())
    assert (bound - actual).max() < 1.0       # and not vacuous


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("l2norm,ratio,dt", [(False, 2, torch.bfloat16), (True, 1, torch.float32),
                                               (False, 4, torch.float16)])
def test_window_count_kernel_matches_torch(dev, l2norm, ratio, dt):
    """The one-launch window counts (first chunk count under the threshold, the largest head) against the
    torch ops, with GVA, forward and backward token orders: rows that find a window early, late and never, a
    short padded row, a NaN gate (no window from its chunk on, but a window found before it stands)."""
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU run needs the Triton interpreter (TRITON_INTERPRET=1, set on GPU-less machines)")
    from flashqla.cp_bounds import window_counts, window_counts_ref
    gen = torch.Generator().manual_seed(5)
    T, Hqk, K = 900, 2, 32
    Hv = Hqk * ratio
    k = (torch.randn(1, T, Hqk, K, generator=gen) * 0.15).to(dt)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen)) * 0.5
    g[0, 600:700] = 0.0                       # no decay at all here: the row over it finds no window
    g[0, 400, -1] = float("nan")              # a NaN in the last head
    beta = torch.rand(1, T, Hv, generator=gen).to(dt)
    beta[0, 800:] = 3.0                       # and here beta ||k||^2 > 2: bounds above 0 (a longer window)
    k, g, beta = k.to(dev), g.to(dev), beta.to(dev)
    ends = ((0, 300, True), (300, 600, False), (600, 700, True), (350, 500, False), (420, 900, False),
            (0, 30, True))
    n, idx = cpmod._window_index(ends, lambda v, d: v.to(d).to(dev))
    for thr in (-20.0, -60.0, -150.0):
        got = window_counts(k, g, beta, idx, n, l2norm, thr, force_kernel=True).cpu()
        want = window_counts_ref(k, g, beta, idx, n, l2norm, thr).cpu()
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want), (thr, got, want)
    # the cases are not vacuous: some rows find a window, the flat and the NaN rows do not
    want = window_counts_ref(k, g, beta, idx, n, l2norm, -20.0).cpu().tolist()
    assert want[0] > 0 and want[4] > 0 and want[2] == 0 and want[3] == 0 and want[5] == 0, want


_BOUNDS_AOT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashqla import cp_bounds
counts = cp_bounds._kernel()
target = GPUTarget("cuda", 90, 32)
sig = {"k_ptr": "*bf16", "g_ptr": "*fp32", "b_ptr": "*bf16", "idx_ptr": "*i64", "out_ptr": "*i64",
       "threshold": "fp32", "stride_kt": "i32", "stride_kh": "i32", "stride_gt": "i32", "stride_bt": "i32"}
for l2 in (False, True):
    consts = dict(n=32, Hqk=2, RATIO=4, Hv=8, K=128, HV_P=8, L2=l2, C=64)
    sig_l2 = dict(sig, **{c: "constexpr" for c in consts})
    ptx = triton.compile(ASTSource(counts, sig_l2, constexprs=consts), target=target).asm["ptx"]
    assert "ld.global" in ptx and "st.global" in ptx
print("ALL OK")
'''


def run_compile_script(text: str, tmp_path) -> None:
    """Run ``text`` (a script that compiles Triton kernels for a GPU target and prints ``ALL OK``) in a fresh
    process without the interpreter, with this checkout on its path."""
    import subprocess
    import sys
    pytest.importorskip("triton")
    script = tmp_path / "aot_script.py"
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.pathsep + \
        env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_window_count_kernel_compiles_for_sm90(tmp_path):
    """The window-count kernel compiles for sm_90 without a GPU: the interpreter runs its Python, this
    checks the compiler takes it."""
    run_compile_script(_BOUNDS_AOT, tmp_path)


def test_window_maps_are_below_the_threshold(monkeypatch):
    """The windows a segment gets have maps under exp(threshold) (checked with transition_matrices at a
    threshold float64 can see): the trailing window's, and the leading window's; half of each (before the
    power-of-two rounding) is not always enough."""
    monkeypatch.setattr(cpmod, "NEGLIGIBLE_LOG_BOUND", -20.0)
    case = Case("win_thr", 1, 2, 32, 32, B=1, T=2000)
    x = make_inputs(case, torch.float64, seed=8)
    x["g"] = x["g"] * 0.2                      # slow enough that windows span several chunks
    segs = (split_even(2000, 4),)
    trail, lead = cpmod._boundary_windows(x["k"], x["g"], x["beta"], False, [0], segs, leading=True)
    rows, ranges = cpmod._window_rows([0], segs)
    assert list(trail) == rows and list(lead) == rows[1:]
    assert all(w > 1 for w in trail.values()) and all(w > 1 for w in lead.values()), (trail, lead)
    wins = {"trail": [(b - trail[r] * 64, trail[r] * 64) for r, (a, b) in zip(rows, ranges)],
            "lead": [(a, lead[r] * 64) for r, (a, b) in zip(rows, ranges) if r in lead]}
    for name, win in wins.items():
        M = transition_matrices(x["k"], x["g"], x["beta"], win)
        assert (torch.linalg.matrix_norm(M, ord=2) <= math.exp(-20.0)).all(), name
        half = [(s + (L - (L // 128) * 64 if name == "trail" else 0), (L // 128) * 64) for s, L in win]
        Mh = transition_matrices(x["k"], x["g"], x["beta"], half)
        assert (torch.linalg.matrix_norm(Mh, ord=2).amax(-1) > math.exp(-20.0) * 1e-3).any(), name


@st.composite
def _cp_window_cases(draw):
    seqlens = tuple(draw(st.lists(st.sampled_from([0, 1, 63, 130, 700, 1500]), min_size=1, max_size=4)))
    if max(seqlens) < 700:
        seqlens = seqlens + (1500,)
    hqk = draw(st.sampled_from([1, 2]))
    case = Case("hyp_cpw", hqk, hqk * draw(st.sampled_from([1, 2])), 16, 16, seqlens=seqlens,
                h0=draw(st.booleans()), ht=draw(st.booleans()), l2norm=draw(st.booleans()),
                gate=draw(st.sampled_from(["logsigmoid", "strong", "zero"])))
    segments = [draw(st.integers(1, 4)) for _ in seqlens]
    return case, segments, draw(st.sampled_from(["none", "late", "mixed"])), draw(st.booleans())


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=_cp_window_cases(), seed=st.integers(0, 2**16))
# the draw where the plain fp32 op's dg is 1.07e-5 from the float64 oracle (session 8's review)
@example(args=(Case("hyp_cpw", 1, 1, 16, 16, seqlens=(700,), h0=False, ht=False, l2norm=False), [1], "mixed", True),
         seed=611)
def test_random_cp_with_windows_matches_oracle(args, seed):
    """Random varlen partitions, segment counts, gates (decaying, g = 0, g = 0 then decaying, a g = 0 head),
    flags, with and without gradients: CP with windows matches the float64 oracle."""
    case, segments, gate_edit, grads = args
    x = make_inputs(case, torch.float32, seed=seed)
    if gate_edit == "late":
        x = _late_decay(x)
    elif gate_edit == "mixed":
        x = _mixed_gate(x, case)
    backend = "cpu" if get_backend("cpu").available()[0] else "reference"
    # a plan's first call runs the fixed structure; the second one the windows it kept
    cpmod.clear_window_memo()
    if grads:
        ref = oracle(case, x)
        # CP may not lose accuracy against CP off (issue #8); where the plain fp32 op itself is past TOL (a
        # strong-decay single head: its dg reached 1.07e-5, the fp32 reference 1.84e-5) that is the bound
        plain = _run(flashqla.chunk_gated_delta_rule, case, x, backend=backend)
        tol = {n: max(TOL, 2 * rel_l2(plain[n], ref[n])) for n in NAMES if ref.get(n) is not None}
        for _ in range(2):
            res = _run(chunk_gated_delta_rule_cp, case, x, backend=backend, segments=segments)
            errs = {n: rel_l2(res[n], ref[n]) for n in tol}
            bad = {n: (e, tol[n]) for n, e in errs.items() if not e <= tol[n]}
            assert not bad, f"{case} {segments} {gate_edit}: (rel-L2, bound) {bad}"
            assert all(t <= 1e-4 for t in tol.values()), f"plain op far from the oracle: {tol}"
        return
    ref = oracle(case, x, grads=False)
    for _ in range(2):
        with torch.no_grad(), poisoned_outputs("cpu"):
            o, ht = chunk_gated_delta_rule_cp(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                              initial_state=x["initial_state"], output_final_state=case.ht,
                                              use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=x["cu_seqlens"],
                                              backend=backend, segments=segments)
        assert rel_l2(o, ref["o"]) <= TOL
        if case.ht:
            assert rel_l2(ht, ref["ht"]) <= TOL


# ------------------------------------------------------------------------------------------------------
# GPU: CUDA graphs, bf16 agreement with the plain op
# ------------------------------------------------------------------------------------------------------

def _gpu_backends():
    out = []
    for name in ("tilelang", "triton"):
        out.append(pytest.param(name, id=name, marks=pytest.mark.gpu))
    return out


def _gpu_setup(backend, seqlens=(4096, 300, 2048), segments=(4, 1, 2)):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    case = Case("gpu_cp", 2, 8, 128, 128, seqlens=seqlens, l2norm=True)
    x = make_inputs(case, torch.bfloat16, "cuda", seed=1)
    # slow decay on most heads: the state carries across every segment (logsigmoid gates alone forget it)
    x["g"] = x["g"] * torch.logspace(-4, 0, case.Hv, device="cuda")
    meta = flashqla.prepare_varlen(x["cu_seqlens"])
    d = flashqla.explain(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                         output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"],
                         varlen_meta=meta, backend=backend, needs_grad=True)
    if d.chosen != backend:
        pytest.skip(f"{backend} cannot serve: {d.reasons().get(backend)}")
    return case, x, meta, list(segments)


def _gpu_run(x, meta, leaves, backend, segments, **kw):
    o, ht = chunk_gated_delta_rule_cp(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"], varlen_meta=meta,
                                      backend=backend, segments=segments, **kw)
    grads = torch.autograd.grad([o, ht], leaves, [x["do"], x["dht"]])
    return (o.detach(), ht.detach()) + tuple(grads)


@pytest.mark.parametrize("backend", _gpu_backends())
def test_gpu_cp_cuda_graph_forward_backward(backend):
    case, x, meta, segments = _gpu_setup(backend)
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    run = functools.partial(_gpu_run, x, meta, leaves, backend, segments)
    warm_up_for_capture(run)  # outside capture: kernels compile, the plan's metadata is uploaded once
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    with torch.no_grad():
        leaves[2].mul_(0.5)  # new values in the captured input buffers
        leaves[5].mul_(-1.0)
    graph.replay()
    eager = run()
    torch.cuda.synchronize()
    for name, a, b in zip(NAMES, captured, eager):
        assert rel_l2(a, b) <= 1e-5, (name, rel_l2(a, b))
    graph.replay()   # a second replay reads the same cached metadata
    torch.cuda.synchronize()
    for name, a, b in zip(NAMES, captured, eager):
        assert rel_l2(a, b) <= 1e-5, (name, rel_l2(a, b))


@pytest.mark.parametrize("backend", _gpu_backends())
@pytest.mark.parametrize("transitions", ["auto", "torch"])
def test_gpu_cp_matches_plain_bf16(backend, transitions):
    """bf16 CP (M by the kernel or by torch) is as close to the fp32 chunked reference as the plain op."""
    case, x, meta, segments = _gpu_setup(backend)
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    cp = _gpu_run(x, meta, leaves, backend, segments, transitions=transitions)
    plain = _gpu_run(x, meta, leaves, backend, 1)
    ref_leaves = [t.detach().float().requires_grad_() if t.dtype != torch.float32 else t.detach().requires_grad_()
                  for t in leaves]
    ref = _gpu_run({**x, "do": x["do"].float()}, meta, ref_leaves, "reference", 1)
    for name, a, b, r in zip(NAMES, cp, plain, ref):
        e_cp, e_plain = rel_l2(a, r), rel_l2(b, r)
        assert e_cp <= 2.0 * e_plain + 2e-3, (name, e_cp, e_plain)


@pytest.mark.parametrize("backend", _gpu_backends())
def test_gpu_cp_windows_inference_bf16(backend, monkeypatch):
    """An inference forward with windows (logsigmoid gates: every map is negligible) on the GPU kernels: as
    close to the fp32 reference as the plain op, phase 1 only the windows; and under CUDA-graph capture the
    same call takes the fixed structure and agrees with the eager windowed call."""
    case, x, meta, segments = _gpu_setup(backend, seqlens=(8192, 300, 4096), segments=(8, 1, 4))
    x["g"] = torch.nn.functional.logsigmoid(torch.randn_like(x["g"]))
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
              cu_seqlens=x["cu_seqlens"], varlen_meta=meta)
    calls = _spy_calls(monkeypatch)
    with torch.no_grad():
        chunk_gated_delta_rule_cp(*args, backend=backend, segments=segments, **kw)   # first: fixed structure
        calls.clear()
        o_w, ht_w = chunk_gated_delta_rule_cp(*args, backend=backend, segments=segments, **kw)
        phase1 = calls[0]["T"]
        o_p, ht_p = flashqla.chunk_gated_delta_rule(*args, backend=backend, **kw)
        ref = flashqla.chunk_gated_delta_rule(*[t.float() for t in args], backend="reference",
                                              **{**kw, "initial_state": x["initial_state"].float()})
    assert phase1 <= 10 * 4 * 64, phase1          # 10 boundaries, windows of a few chunks, no M rows
    for a, b, r, name in ((o_w, o_p, ref[0], "o"), (ht_w, ht_p, ref[1], "ht")):
        e_w, e_p = rel_l2(a, r), rel_l2(b, r)
        assert e_w <= 2.0 * e_p + 2e-3, (name, e_w, e_p)
    run = lambda: chunk_gated_delta_rule_cp(*args, backend=backend, segments=segments, **kw)  # noqa: E731
    with torch.no_grad():
        warm_up_for_capture(run)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
    graph.replay()
    torch.cuda.synchronize()
    assert rel_l2(captured[0], o_w) <= 5e-3 and rel_l2(captured[1], ht_w) <= 5e-3


@pytest.mark.parametrize("backend", _gpu_backends())
def test_gpu_cp_windows_training_bf16(backend, monkeypatch):
    """Training CP with windows (logsigmoid gates: trailing and leading windows everywhere) on the GPU
    kernels: outputs and gradients as close to the fp32 reference as the plain op; the backward's first
    pass ran over the leading windows."""
    case, x, meta, segments = _gpu_setup(backend, seqlens=(8192, 300, 4096), segments=(8, 1, 4))
    x["g"] = torch.nn.functional.logsigmoid(torch.randn_like(x["g"]))
    used = []
    real = cpmod._lead_dh0
    monkeypatch.setattr(cpmod, "_lead_dh0", lambda *a, **k: used.append(1) or real(*a, **k))
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    _gpu_run(x, meta, leaves, backend, list(segments))          # a plan's first call: the fixed structure
    cp = _gpu_run(x, meta, leaves, backend, list(segments))
    assert used
    plain = _gpu_run(x, meta, leaves, backend, 1)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = _gpu_run({**x, "do": x["do"].float()}, meta, ref_leaves, "reference", 1)
    for name, a, b, r in zip(NAMES, cp, plain, ref):
        e_cp, e_plain = rel_l2(a, r), rel_l2(b, r)
        assert e_cp <= 2.0 * e_plain + 2e-3, (name, e_cp, e_plain)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tilelang@cp8", "triton@cp8"])
def test_gpu_cp_bench_style_capture(name):
    """The bench's graph timing of a forced CP variant, as it runs it: two input copies sharing one
    cu_seqlens / VarlenMeta, warmed up twice on a side stream (windowed eager calls, the second one with the
    read after launching), then both captured in one graph (the fixed structure).  Session 8 saw this
    capture fail ("operation failed due to a previous error during capture") at 2/8 1x32768."""
    from flashqla.cli import bench
    seqlens, Hqk, Hv = [8192], 2, 8
    xs = []
    for seed in (1, 2):
        x = bench.make_inputs(seqlens, Hqk, Hv, dtype=torch.bfloat16, device="cuda", seed=seed)
        if xs:
            x["cu_seqlens"], x["meta"] = xs[0]["cu_seqlens"], xs[0]["meta"]
        else:
            x["meta"] = flashqla.prepare_varlen(x["cu_seqlens"])
        xs.append(x)
    op = bench._flashqla_op(name)
    fns = [bench.make_call(op, x, "fwd") for x in xs]
    eager = [[t.clone() for t in f()] for f in fns]
    r = bench.time_cuda(fns, 0.05, 20, use_graph=True)
    assert r["method"] == "graph", r["note"]
    # the captured fixed structure agrees with the eager windowed calls
    outs = [f() for f in fns]
    for a, b in zip(outs, eager):
        assert rel_l2(a[0], b[0]) <= 5e-3 and rel_l2(a[1], b[1]) <= 5e-3


@pytest.mark.parametrize("backend", _gpu_backends())
def test_gpu_cp_capture_without_cp_warmup(backend):
    """A plan first seen during capture: its metadata is uploaded from pinned memory kept for the graph.  If
    this CUDA/PyTorch cannot pin memory while capturing, xfail: only warmed-up capture (the supported,
    documented pattern) works.  Last in the file: a failed capture must not disturb the other tests."""
    case, x, meta, _ = _gpu_setup(backend)
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    run = functools.partial(_gpu_run, x, meta, leaves, backend)
    warm_up_for_capture(lambda: run([4, 1, 2]))  # kernels compiled (same pass shapes), but the plan below is new
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = run([[1024, 1024, 960, 1088], 1, 2])
    except Exception as exc:
        torch.cuda.synchronize()
        pytest.xfail(f"cold capture unsupported here: {type(exc).__name__}: {str(exc)[:300]} "
                     f"(cause: {exc.__cause__!r})")
    graph.replay()
    eager = run([[1024, 1024, 960, 1088], 1, 2])
    torch.cuda.synchronize()
    for name, a, b in zip(NAMES, captured, eager):
        assert rel_l2(a, b) <= 1e-5, (name, rel_l2(a, b))


def test_auto_plan_declined_where_measured_slower():
    """The automatic plan stays off on backends where CP measured slower on the GPU (triton, tilelang); forced
    segments still run; on the CPU the cost model decides for every backend."""
    from flashqla.cp import auto_declined
    cuda = torch.device("cuda")
    assert "slower" in auto_declined("triton", cuda) and "slower" in auto_declined("tilelang", cuda)
    assert auto_declined("cutlass", cuda) is None
    assert auto_declined("triton", torch.device("cpu")) is None
