"""The public API around the kernels: the two reference forms, fwd/bwd split, autograd plumbing."""

from __future__ import annotations

import torch

import flashqla
from flashqla.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from flashqla.testing import Case, make_inputs, rel_l2


def test_reference_forms_agree_float64():
    for case in (Case("a", 2, 8, 32, 48, seqlens=(0, 1, 64, 130, 77), l2norm=True),
                 Case("b", 1, 2, 16, 16, B=2, T=129, gate="strong")):
        x = make_inputs(case, torch.float64)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        kw = dict(initial_state=x["initial_state"], output_final_state=True, cu_seqlens=x["cu_seqlens"],
                  use_qk_l2norm_in_kernel=case.l2norm)
        o1, h1 = recurrent_gated_delta_rule_ref(*args, **kw)
        o2, h2 = chunk_gated_delta_rule_ref(*args, **kw)
        assert rel_l2(o2, o1) <= 1e-10 and rel_l2(h2, h1) <= 1e-10


def test_fwd_bwd_split_equals_autograd():
    case = Case("s", 2, 4, 32, 32, seqlens=(70, 30))
    x = make_inputs(case, torch.float32)
    args = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    h0 = x["initial_state"].clone().requires_grad_()
    o, ht = flashqla.chunk_gated_delta_rule(*args, initial_state=h0, output_final_state=True,
                                            cu_seqlens=x["cu_seqlens"])
    grads = torch.autograd.grad([o, ht], args + [h0], [x["do"], x["dht"]])
    o2, ht2, ctx = flashqla.chunk_gated_delta_rule_fwd(*[a.detach() for a in args], initial_state=h0.detach(),
                                                       output_final_state=True, cu_seqlens=x["cu_seqlens"])
    grads2 = flashqla.chunk_gated_delta_rule_bwd(ctx, x["do"], x["dht"])
    torch.testing.assert_close(o, o2)
    torch.testing.assert_close(ht, ht2)
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b)


def test_no_final_state_returns_none_and_grads_flow():
    case = Case("n", 1, 2, 16, 16, B=2, T=50, h0=False, ht=False)
    x = make_inputs(case, torch.float32)
    v = x["v"].clone().requires_grad_()
    o, ht = flashqla.chunk_gated_delta_rule(x["q"], x["k"], v, x["g"], x["beta"])
    assert ht is None and o.dtype == v.dtype
    o.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all()


def test_bf16_output_dtype_and_state_fp32():
    case = Case("d", 1, 2, 16, 16, B=1, T=30)
    x = make_inputs(case, torch.bfloat16)
    o, ht = flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                            initial_state=x["initial_state"], output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32


def test_context_parallel_flag_and_explain():
    case = Case("cp", 1, 2, 32, 32, seqlens=(300, 70), gate="zero")  # g = 0: segments truly depend on each other
    x = make_inputs(case, torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(initial_state=x["initial_state"], output_final_state=True, cu_seqlens=x["cu_seqlens"])
    o1, h1 = flashqla.chunk_gated_delta_rule(*args, **kw)
    o2, h2 = flashqla.chunk_gated_delta_rule(*args, **kw, context_parallel=3)
    assert rel_l2(o2, o1) <= 1e-5 and rel_l2(h2, h1) <= 1e-5
    d = flashqla.explain(*args, **kw)
    assert "context_parallel='auto' would" in str(d)


def test_inference_calls_skip_the_autograd_node(monkeypatch):
    """A call with nothing to differentiate runs the backend directly (the autograd node was ~20% of a small
    call's host time); one with inputs that require grad still builds the node, and both agree."""
    import flashqla.api as api
    entered = []
    orig = api._ChunkGatedDeltaRule.forward

    def spy(ctx, *a):
        entered.append(1)
        return orig(ctx, *a)

    monkeypatch.setattr(api._ChunkGatedDeltaRule, "forward", staticmethod(spy))
    case = Case("nograd", 1, 2, 16, 16, B=1, T=70)
    x = make_inputs(case, torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with torch.no_grad():
        o, ht = flashqla.chunk_gated_delta_rule(*args, initial_state=x["initial_state"], output_final_state=True,
                                                backend="reference")
    o2, ht2 = flashqla.chunk_gated_delta_rule(*args, output_final_state=False, backend="reference")
    assert not entered and o.grad_fn is None and o2.grad_fn is None and ht2 is None
    leaves = [t.clone().requires_grad_() for t in args]
    o3, ht3 = flashqla.chunk_gated_delta_rule(*leaves, initial_state=x["initial_state"], output_final_state=True,
                                              backend="reference")
    assert entered and o3.grad_fn is not None
    assert torch.equal(o3.detach(), o) and torch.equal(ht3.detach(), ht)


def test_api_host_time_script_runs(capsys):
    """benchmarks/api_host_time.py (the host-time loop quoted in the session-9 notes) runs here."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "api_host_time.py"
    spec = importlib.util.spec_from_file_location("api_host_time", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--calls", "5"]) == 0
    out = capsys.readouterr().out
    assert "op, no grad" in out and "us/call" in out
