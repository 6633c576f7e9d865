"""Single-device exact context parallelism (flashqla.cp): CP on vs off vs the float64 oracle.

Forward and backward, segment counts 2..7 (and splits that are not multiples of 64), g = 0 heads next to
strong-decay heads (-exp(A_log) * softplus(x), A_log up to log 16), varlen with short unsplit sequences,
length-0/1 sequences, GVA, the fused L2 norm, h0 and the final state on and off.  Backends: "reference"
always, "cpu" when built.  Outputs are poisoned with NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashqla
from flashqla.cp import (CPCostModel, CPPlan, chunk_gated_delta_rule_cp, cp_plan, segment_plan, split_even,
                         transition_matrices)
from flashqla.dispatch import fake_device, get_backend
from flashqla.testing import Case, make_inputs, oracle, poisoned_outputs, rel_l2

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
    free = CPCostModel(pass_overhead=0.0)  # at this toy size the fixed overheads would dominate
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
