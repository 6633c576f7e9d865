"""The native cpu backend against the float64 oracle (backend-specific cases beyond the shared suite).

fp32 inputs: o, final state and every gradient within 1e-5 relative L2 of the float64 token-by-token
oracle.  bf16 inputs: the oracle runs on the bf16-rounded inputs; the fp32 final state must be within
1e-4, and o / the gradients (which come back in bf16) within their own bf16 rounding error plus 1e-4.
Every output is allocated under a NaN-filling hook, so anything the kernels leave unwritten fails.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashqla
import flashqla.backends.cpu as cpu_backend
from flashqla.dispatch import get_backend
from flashqla.testing import Case, make_inputs, oracle, poisoned_outputs, rel_l2

BE = get_backend("cpu")
_OK, _WHY = BE.available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"cpu backend unavailable: {_WHY}")

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
ODD = (0, 1, 63, 64, 65, 130)


def _run(case: Case, dtype, seed=0, inputs=None):
    """Run the op on backend "cpu" with poisoned outputs; returns (inputs, results dict)."""
    inp = inputs if inputs is not None else make_inputs(case, dtype, seed=seed)
    leaves = {n: inp[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    h0 = inp["initial_state"]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_(True)
    with poisoned_outputs("cpu"):
        o, ht = flashqla.chunk_gated_delta_rule(
            leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=case.scale,
            initial_state=h0, output_final_state=case.ht, use_qk_l2norm_in_kernel=case.l2norm,
            cu_seqlens=inp["cu_seqlens"], backend="cpu")
        outs, couts = [o], [inp["do"]]
        if case.ht:
            outs.append(ht)
            couts.append(inp["dht"])
        wrt = [leaves[n] for n in ("q", "k", "v", "g", "beta")] + ([h0] if h0 is not None else [])
        gr = torch.autograd.grad(outs, wrt, couts)
    res = {"o": o, "ht": ht}
    for n, t in zip(GRADS, gr):
        res[n] = t
    return inp, res


def _cases():
    out = []
    for l2 in (False, True):
        for h0 in (False, True):
            out.append(Case(f"odd_l2{int(l2)}_h0{int(h0)}", 1, 2, 32, 48, seqlens=ODD, h0=h0, ht=True, l2norm=l2))
    out += [
        Case("gva_2_8_strong", 2, 8, 32, 32, seqlens=(66, 0, 1, 12), l2norm=True, gate="strong"),
        Case("gva_4_16_strong_h0", 4, 16, 16, 32, seqlens=(65, 3), gate="strong", h0=True, ht=False),
        Case("gva_2_8_dense", 2, 8, 48, 16, B=2, T=40, h0=True, ht=False),
        Case("odd_dims_strong", 1, 1, 37, 50, seqlens=(130, 1, 64), gate="strong", l2norm=True),
        Case("no_state_out", 1, 2, 64, 64, B=1, T=129, h0=False, ht=False, scale=0.7),
        Case("head_dim_256", 1, 1, 256, 256, B=1, T=70),
    ]
    return out


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_fp32_matches_oracle(case):
    inp, res = _run(case, torch.float32)
    ref = oracle(case, inp)
    errs = {"o": rel_l2(res["o"], ref["o"])}
    if case.ht:
        errs["ht"] = rel_l2(res["ht"], ref["ht"])
    else:
        assert res["ht"] is None
    for n in GRADS:
        if n == "dh0" and not case.h0:
            continue
        errs[n] = rel_l2(res[n], ref[n])
    bad = {n: e for n, e in errs.items() if not e <= 1e-5}
    assert not bad, f"{case.name}: relative L2 errors above 1e-5: {bad} (all: {errs})"


@pytest.mark.parametrize("case", [
    Case("bf16_odd_l2", 2, 4, 32, 32, seqlens=ODD, h0=True, l2norm=True, gate="strong"),
    Case("bf16_dense", 1, 2, 64, 64, B=2, T=70, h0=True),
], ids=lambda c: c.name)
def test_bf16_matches_oracle_on_rounded_inputs(case):
    inp, res = _run(case, torch.bfloat16)
    ref = oracle(case, inp)  # the oracle reads the bf16 values, upcast to float64
    assert res["o"].dtype == torch.bfloat16
    assert rel_l2(res["ht"], ref["ht"]) <= 1e-4
    if case.h0:
        assert rel_l2(res["dh0"], ref["dh0"]) <= 1e-4  # fp32 like the state
    for n in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        x, r = res[n], ref[n]
        floor = rel_l2(r.to(x.dtype), r)  # the error of merely rounding the exact answer to x's dtype
        e = rel_l2(x, r)
        assert e <= 1.1 * floor + 1e-4, f"{n}: rel L2 {e:.2e} vs rounding floor {floor:.2e}"


def test_mixed_gate_dtypes_and_fp16():
    case = Case("mixed", 1, 2, 32, 32, seqlens=(70, 5), h0=True, l2norm=True)
    base = make_inputs(case, torch.float32, seed=3)
    inp = dict(base)
    inp.update(q=base["q"].half(), k=base["k"].half(), v=base["v"].half(), g=base["g"].bfloat16(),
               beta=base["beta"].half(), do=base["do"].half())
    _, res = _run(case, None, inputs=inp)
    ref = oracle(case, inp)
    assert res["o"].dtype == torch.float16 and res["dg"].dtype == torch.bfloat16
    assert rel_l2(res["ht"], ref["ht"]) <= 1e-4
    for n in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        floor = rel_l2(ref[n].to(res[n].dtype), ref[n])
        assert rel_l2(res[n], ref[n]) <= 1.1 * floor + 1e-4, n


def test_isa_variants_agree():
    """The generic / AVX2 / AVX-512 kernels (whichever this CPU runs) agree with the oracle."""
    mod = cpu_backend._load()
    case = Case("isa", 1, 2, 40, 24, seqlens=(100, 1), l2norm=True)
    inp = make_inputs(case, torch.float32, seed=1)
    ref = oracle(case, inp)
    tried = []
    try:
        for isa in ("generic", "avx2", "avx512"):
            if not mod.set_isa(isa):
                continue
            assert mod.isa() == isa
            tried.append(isa)
            _, res = _run(case, None, inputs=inp)
            for n in ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"):
                assert rel_l2(res[n], ref[n]) <= 1e-5, (isa, n)
    finally:
        mod.set_isa("")
    assert "generic" in tried


def test_supports_and_priorities():
    from flashqla.dispatch.device import DeviceInfo
    from flashqla.dispatch.spec import CallSpec
    assert BE.priorities == {"cpu": 20}
    base = dict(device=DeviceInfo("cpu"), dtype="float32", g_dtype="float32", beta_dtype="float32",
                state_dtype=None, K=128, V=128, Hqk=2, Hv=8, varlen=False, has_initial_state=False,
                output_final_state=False, use_qk_l2norm=False, needs_grad=True)
    assert BE.supports(CallSpec(**base))[0]
    ok, why = BE.supports(CallSpec(**dict(base, dtype="float64")))
    assert not ok and "float64" in why
    ok, why = BE.supports(CallSpec(**dict(base, g_dtype="float64")))
    assert not ok
    ok, why = BE.supports(CallSpec(**dict(base, device=DeviceInfo("cuda", (9, 0)))))
    assert not ok
    # float64 inputs under auto fall through to the reference
    case = Case("f64", 1, 1, 16, 16, B=1, T=10)
    inp = make_inputs(case, torch.float64)
    d = flashqla.explain(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    assert d.chosen == "reference"
    inp32 = make_inputs(case, torch.float32)
    assert flashqla.explain(inp32["q"], inp32["k"], inp32["v"], inp32["g"], inp32["beta"]).chosen == "cpu"


def test_forward_only_no_grad_outputs_written():
    case = Case("fwd_only", 2, 4, 64, 32, seqlens=(1, 0, 130, 20), h0=True, ht=True, l2norm=True)
    inp = make_inputs(case, torch.float32, seed=5)
    with torch.no_grad(), poisoned_outputs("cpu"):
        o, ht = flashqla.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                                initial_state=inp["initial_state"], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, cu_seqlens=inp["cu_seqlens"],
                                                backend="cpu")
    ref = oracle(case, inp, grads=False)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_l2(o, ref["o"]) <= 1e-5 and rel_l2(ht, ref["ht"]) <= 1e-5
    # the zero-length sequence passes its initial state through unchanged
    assert torch.equal(ht[1], inp["initial_state"][1])


def test_unbuilt_module_is_reported(monkeypatch):
    """A failed import makes available() say why, and backend="cpu" raises with that reason."""
    monkeypatch.setattr(cpu_backend, "_mod", None)
    monkeypatch.setattr(cpu_backend, "_import_error", "ImportError: simulated missing build")
    ok, why = BE.available()
    assert not ok and "simulated missing build" in why
    case = Case("x", 1, 1, 16, 16, B=1, T=5)
    inp = make_inputs(case, torch.float32)
    with pytest.raises(ValueError, match="simulated missing build"):
        flashqla.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], backend="cpu")
    # auto falls back to the reference
    assert flashqla.explain(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"]).chosen == "reference"
