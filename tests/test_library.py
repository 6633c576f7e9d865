"""torch.library registrations (opcheck, autograd, torch.compile without graph breaks) and the FLA routing."""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import flashqla  # noqa: E402
import flashqla.library as L  # noqa: E402
from flashqla.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref  # noqa: E402
from flashqla.testing import Case, make_inputs, rel_l2  # noqa: E402

OPS = torch.ops.flashqla
NAMES = ("q", "k", "v", "g", "beta")


def _inputs(case, dtype=torch.float32, seed=0):
    x = make_inputs(case, dtype, seed=seed)
    return x, [x[n] for n in NAMES]


def _oracle(case, x, grads=True):
    leaves = [x[n].detach().double().requires_grad_(grads) for n in NAMES]
    h0 = x["initial_state"]
    h0 = None if h0 is None else h0.detach().double().requires_grad_(grads)
    o, ht = recurrent_gated_delta_rule_ref(*leaves, scale=case.scale, initial_state=h0,
                                           output_final_state=case.ht, use_qk_l2norm_in_kernel=case.l2norm,
                                           cu_seqlens=x["cu_seqlens"])
    res = {"o": o.detach(), "ht": None if ht is None else ht.detach()}
    if grads:
        outs, cot = [o], [x["do"].double()]
        if case.ht:
            outs.append(ht)
            cot.append(x["dht"].double())
        wrt = leaves + ([h0] if h0 is not None else [])
        res["grads"] = torch.autograd.grad(outs, wrt, cot)
    return res


# ------------------------------------------------------------------------------------------- opcheck


_QUICK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("case,utils", [
    (Case("dense_h0_ht", 1, 2, 8, 8, B=2, T=6), None),             # None: every opcheck test, AOT included
    (Case("varlen_l2", 1, 2, 16, 8, seqlens=(5, 0, 12), h0=False, ht=True, l2norm=True), _QUICK_UTILS),
    (Case("no_state", 2, 4, 8, 16, B=1, T=9, h0=False, ht=False, scale=0.3), _QUICK_UTILS),
], ids=lambda c: getattr(c, "name", "utils"))
def test_opcheck_chunk(case, utils):
    x, args = _inputs(case)
    tail = (case.scale, x["initial_state"], case.ht, case.l2norm, x["cu_seqlens"], "reference")
    kw = {} if utils is None else {"test_utils": utils}
    torch.library.opcheck(OPS.chunk_gated_delta_rule.default, (*args, *tail), **kw)
    grad_args = [a.clone().requires_grad_() for a in args]
    h0 = None if x["initial_state"] is None else x["initial_state"].clone().requires_grad_()
    torch.library.opcheck(OPS.chunk_gated_delta_rule.default, (*grad_args, case.scale, h0, *tail[2:]), **kw)


@pytest.mark.parametrize("layout", ["KV", "VK"])
def test_opcheck_decode(layout):
    x, args = _inputs(Case("d", 1, 2, 16, 8, B=2, T=2))
    pool = torch.randn(3, 2, 16, 8)
    if layout == "VK":
        pool = pool.transpose(-1, -2).contiguous()
    idx = torch.tensor([2, -1], dtype=torch.int32)
    torch.library.opcheck(OPS.gated_delta_rule_decode.default,
                          (*args, pool, idx, None, True, layout, "auto", None))


# -------------------------------------------------------------------------------- autograd (eager)


@pytest.mark.parametrize("case", [
    Case("dense", 1, 2, 16, 16, B=2, T=40),
    Case("varlen_gva", 1, 4, 16, 8, seqlens=(0, 1, 30, 9), l2norm=True),
    Case("no_ht", 1, 2, 8, 8, B=1, T=10, ht=False),
], ids=lambda c: c.name)
def test_custom_op_autograd_matches_oracle(case):
    """The registered backward (recompute forward + backend backward) against the float64 oracle."""
    x, args = _inputs(case)
    leaves = [a.clone().requires_grad_() for a in args]
    h0 = None if x["initial_state"] is None else x["initial_state"].clone().requires_grad_()
    o, ht = OPS.chunk_gated_delta_rule(*leaves, case.scale, h0, case.ht, case.l2norm, x["cu_seqlens"], "reference")
    if not case.ht:
        assert ht.numel() == 0
    ref = _oracle(case, x)
    assert rel_l2(o, ref["o"]) < 1e-5
    outs, cot = [o], [x["do"]]
    if case.ht:
        assert rel_l2(ht, ref["ht"]) < 1e-5
        outs.append(ht)
        cot.append(x["dht"])
    wrt = leaves + ([h0] if h0 is not None else [])
    grads = torch.autograd.grad(outs, wrt, cot)
    for name, gr, rg in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, ref["grads"]):
        assert gr.dtype == wrt[0].dtype or name in ("dg", "dh0")
        err = rel_l2(gr, rg)
        assert err < 1e-5, f"{name}: {err:.3e}"


def test_wrapper_returns_none_without_final_state_and_eager_grads_use_api():
    case = Case("w", 1, 2, 8, 8, B=1, T=12)
    x, args = _inputs(case)
    o, ht = L.chunk_gated_delta_rule(*args, initial_state=x["initial_state"], backend="reference")
    assert ht is None
    v = args[2].clone().requires_grad_()
    o2, _ = L.chunk_gated_delta_rule(args[0], args[1], v, args[3], args[4], initial_state=x["initial_state"],
                                     backend="reference")
    # eager + grad goes to flashqla's own autograd Function (residuals kept, no recompute)
    assert "ChunkGatedDeltaRule" in type(o2.grad_fn).__name__
    torch.testing.assert_close(o, o2.detach())


def test_chunk_op_zero_tokens():
    case = Case("z", 1, 2, 8, 8, B=2, T=3)
    x, args = _inputs(case)
    empty = [a[:, :0].clone().requires_grad_() for a in args]
    h0 = x["initial_state"].clone().requires_grad_()
    o, ht = OPS.chunk_gated_delta_rule(*empty, None, h0, True, False, None, "reference")
    assert o.shape == (2, 0, 2, 8) and torch.equal(ht, x["initial_state"])
    (dh0,) = torch.autograd.grad(ht, [h0], x["dht"])
    torch.testing.assert_close(dh0, x["dht"])


# ---------------------------------------------------------------------------------- torch.compile


def _graph_ops(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_compile_fullgraph_prefill_then_decode_inductor():
    """One compiled function: chunk prefill (state out) + a decode step on the pool; no graph breaks."""
    case = Case("c", 1, 2, 16, 16, B=2, T=20)
    x, _ = _inputs(case)
    pre = [x[n][:, :19] for n in NAMES]
    dec = [x[n][:, 19:] for n in NAMES]
    seen = {}

    def record(gm, example_inputs):
        seen["ops"] = _graph_ops(gm)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    def step(q, k, v, g, beta, qd, kd, vd, gd, bd, pool, slots, h0):
        o, ht = L.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         backend="reference")
        od = L.gated_delta_rule_decode(qd, kd, vd, gd, bd, pool, slots, state_layout="VK")
        return o, ht, od

    torch._dynamo.reset()
    f = torch.compile(step, fullgraph=True, backend=record)
    pool = torch.randn(4, 2, 16, 16)
    slots = torch.tensor([3, -1], dtype=torch.int32)
    p_c, p_e = pool.clone(), pool.clone()
    res_c = f(*pre, *dec, p_c, slots, x["initial_state"])
    res_e = step(*pre, *dec, p_e, slots, x["initial_state"])
    assert seen["ops"] & {"flashqla.chunk_gated_delta_rule", "flashqla.chunk_gated_delta_rule.default"}
    assert seen["ops"] & {"flashqla.gated_delta_rule_decode", "flashqla.gated_delta_rule_decode.default"}
    for a, b in zip(res_c, res_e):
        assert rel_l2(a, b) < 1e-6
    assert rel_l2(p_c, p_e) < 1e-6 and not torch.equal(p_c, pool), "the compiled call must update the pool"
    # and against the oracle
    ref_o, ref_h = recurrent_gated_delta_rule_ref(*(t.double() for t in pre), initial_state=x["initial_state"].double(),
                                                  output_final_state=True)
    assert rel_l2(res_c[0], ref_o) < 1e-5 and rel_l2(res_c[1], ref_h) < 1e-5


def test_compile_fullgraph_training_step_grads():
    """Compiled forward + backward through the chunk op (aot_eager: AOT autograd, no C++ build)."""
    case = Case("t", 1, 2, 16, 8, B=2, T=30)
    x, args = _inputs(case)
    leaves = [a.clone().requires_grad_() for a in args]
    h0 = x["initial_state"].clone().requires_grad_()

    def loss_fn(q, k, v, g, beta, h0, do, dht):
        o, ht = L.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         backend="reference")
        return (o * do).sum() + (ht * dht).sum()

    torch._dynamo.reset()
    f = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    loss = f(*leaves, h0, x["do"], x["dht"])
    grads = torch.autograd.grad(loss, leaves + [h0])
    ref = _oracle(case, x)
    for name, gr, rg in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, ref["grads"]):
        assert rel_l2(gr, rg) < 1e-5, name


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA or the Triton interpreter")
def test_compile_decode_triton_impl():
    case = Case("d", 1, 2, 16, 16, B=2, T=1)
    x, args = _inputs(case)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args = [a.to(dev) for a in args]
    pool = torch.randn(3, 2, 16, 16, device=dev)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=dev)

    def step(q, k, v, g, beta, pool, slots):
        return L.gated_delta_rule_decode(q, k, v, g, beta, pool, slots, impl="triton")

    torch._dynamo.reset()
    p1, p2 = pool.clone(), pool.clone()
    o1 = torch.compile(step, fullgraph=True, backend="aot_eager")(*args, p1, slots)
    o2 = flashqla.decode.gated_delta_rule_decode(*args, p2, slots, impl="torch")
    assert rel_l2(o1, o2) < 1e-5 and rel_l2(p1, p2) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["KV", "VK"])
def test_compile_fullgraph_cuda_training_prefill_and_decode(layout):
    """On the GPU, with the backends auto picks there (K = V = 128, bf16): one inductor-compiled function
    with the chunk op (forward + backward through AOT autograd) and a decode step on the pool."""
    case = Case("g", 2, 4, 128, 128, B=2, T=100, l2norm=True)
    x, args = _inputs(case, torch.bfloat16)
    args = [a.cuda() for a in args]
    assert args[3].dtype == torch.float32  # g
    leaves = [a.clone().requires_grad_() for a in args]
    Hv, K, V = 4, 128, 128
    h0 = torch.zeros(2, Hv, K, V, device="cuda")
    dec = [a[:, :1].detach().clone() for a in args]
    pool = torch.randn(3, Hv, *((K, V) if layout == "KV" else (V, K)), device="cuda") * 0.1
    slots = torch.tensor([2, 0], dtype=torch.int32, device="cuda")

    def step(q, k, v, g, beta, qd, kd, vd, gd, bd, pool, slots):
        o, ht = L.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
        od = L.gated_delta_rule_decode(qd, kd, vd, gd, bd, pool, slots, use_qk_l2norm_in_kernel=True,
                                       state_layout=layout)
        return o.float().square().sum() + ht.sum(), od

    torch._dynamo.reset()
    f = torch.compile(step, fullgraph=True)
    p_c, p_e = pool.clone(), pool.clone()
    loss_c, od_c = f(*leaves, *dec, p_c, slots)
    g_c = torch.autograd.grad(loss_c, leaves)
    leaves_e = [a.detach().clone().requires_grad_() for a in args]
    loss_e, od_e = step(*leaves_e, *dec, p_e, slots)
    g_e = torch.autograd.grad(loss_e, leaves_e)
    assert rel_l2(loss_c, loss_e) < 1e-3 and rel_l2(od_c, od_e) < 1e-3 and rel_l2(p_c, p_e) < 1e-5
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), g_c, g_e):
        assert rel_l2(a, b) < 1e-2, name


# ------------------------------------------------------------------------------------ FLA routing


def _fake_fla_chunk(calls):
    """FLA's documented semantics, written with flashqla's reference (stands in for FLA's kernel)."""

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                               allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               chunk_indices=None, cp_context=None, **kwargs):
        calls.append(dict(kwargs, cp_context=cp_context))
        state_v_first = state_v_first or kwargs.pop("transpose_state_layout", False)
        if kwargs.get("use_gate_in_kernel"):
            gg = g.float() + (kwargs["dt_bias"].float() if kwargs.get("dt_bias") is not None else 0)
            g = -kwargs["A_log"].float().exp() * torch.nn.functional.softplus(gg)
        if use_beta_sigmoid_in_kernel:
            beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
        h0 = initial_state
        if h0 is not None and state_v_first:
            h0 = h0.transpose(-1, -2)
        o, ht = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=scale, initial_state=h0,
                                           output_final_state=output_final_state,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                           cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist())
        if ht is not None and state_v_first:
            ht = ht.transpose(-1, -2)
        return o, ht

    return chunk_gated_delta_rule


@pytest.fixture
def fake_fla(monkeypatch):
    """A fake ``fla`` package tree in sys.modules (real FLA, if installed, is hidden for the test)."""
    calls: list = []
    fn = _fake_fla_chunk(calls)
    mods = {}
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.gated_delta_rule.chunk", "fla.layers",
                 "fla.layers.gated_deltanet"):
        mods[name] = types.ModuleType(name)
    for name in ("fla.ops", "fla.ops.gated_delta_rule", "fla.ops.gated_delta_rule.chunk",
                 "fla.layers.gated_deltanet"):
        mods[name].chunk_gated_delta_rule = fn
    for name in ("fla.ops", "fla.ops.gated_delta_rule", "fla.ops.gated_delta_rule.chunk"):
        mods[name].chunk_gdn = fn
    mods["fla"].ops = mods["fla.ops"]
    mods["fla.ops"].gated_delta_rule = mods["fla.ops.gated_delta_rule"]
    mods["fla.ops.gated_delta_rule"].chunk = mods["fla.ops.gated_delta_rule.chunk"]
    mods["fla"].layers = mods["fla.layers"]
    mods["fla.layers"].gated_deltanet = mods["fla.layers.gated_deltanet"]
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    from flashqla.integrations import fla as integ
    yield types.SimpleNamespace(fn=fn, calls=calls, mods=mods, integ=integ)
    integ.unpatch()


def _fla_inputs(seed=0, B=2, T=23, H=1, HV=2, K=16, V=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=gen))
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen) * 0.5
    return q, k, v, g, beta, h0


def test_fla_patch_routes_every_module_and_unpatch_restores(fake_fla):
    integ, mods, fn = fake_fla.integ, fake_fla.mods, fake_fla.fn
    integ.patch(backend="reference")
    assert integ.is_patched()
    wrapper = mods["fla.ops.gated_delta_rule"].chunk_gated_delta_rule
    assert wrapper is not fn
    for name in ("fla.ops", "fla.ops.gated_delta_rule.chunk", "fla.layers.gated_deltanet"):
        assert mods[name].chunk_gated_delta_rule is wrapper
    assert mods["fla.ops"].chunk_gdn is wrapper
    # a module imported after patch() copies the patched function; unpatch() restores it as well
    late = types.ModuleType("fla.layers.late")
    late.chunk_gated_delta_rule = mods["fla.ops.gated_delta_rule"].chunk_gated_delta_rule
    sys.modules["fla.layers.late"] = late
    try:
        q, k, v, g, beta, h0 = _fla_inputs()
        before = integ.stats()["flashqla"]
        o, ht = mods["fla.layers.gated_deltanet"].chunk_gated_delta_rule(q, k, v, g, beta, None, h0, True)
        assert fake_fla.calls == [] and integ.stats()["flashqla"] == before + 1
        ref_o, ref_h = recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                      initial_state=h0.double(), output_final_state=True)
        assert rel_l2(o, ref_o) < 1e-5 and rel_l2(ht, ref_h) < 1e-5
        integ.unpatch()
        assert late.chunk_gated_delta_rule is fn
    finally:
        del sys.modules["fla.layers.late"]
    for name in ("fla.ops", "fla.ops.gated_delta_rule", "fla.ops.gated_delta_rule.chunk", "fla.layers.gated_deltanet"):
        assert mods[name].chunk_gated_delta_rule is fn
    assert mods["fla.ops"].chunk_gdn is fn and not integ.is_patched()


@pytest.mark.parametrize("kw", [
    dict(output_final_state=True, use_qk_l2norm_in_kernel=True, scale=0.3),
    dict(output_final_state=True, state_v_first=True),
    dict(output_final_state=True, transpose_state_layout=True),
    dict(output_final_state=False, use_gate_in_kernel=True, A_log=torch.tensor([0.1, 1.2]),
         dt_bias=torch.tensor([0.3, -0.2])),
    dict(output_final_state=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    dict(output_final_state=True, varlen=True),
    dict(output_final_state=True, varlen=True, cpu_copy=True, chunk_size=32, chunk_indices=torch.zeros(1)),
], ids=["l2_scale", "v_first", "transpose_deprecated", "gate_in_kernel", "beta_sigmoid", "varlen", "varlen_cpu"])
def test_fla_patch_matches_fla_semantics_with_grads(fake_fla, kw):
    integ, fn = fake_fla.integ, fake_fla.fn
    kw = dict(kw)
    q, k, v, g, beta, h0 = _fla_inputs(seed=2)
    if kw.pop("varlen", False):
        q, k, v, g, beta = (x.reshape(1, -1, *x.shape[2:]) for x in (q, k, v, g, beta))
        kw["cu_seqlens"] = torch.tensor([0, 7, 7, 46], dtype=torch.long)   # FLA passes int64
        h0 = torch.cat([h0, h0[:1]], 0)
        if kw.pop("cpu_copy", False):
            kw["cu_seqlens_cpu"] = kw["cu_seqlens"].clone()
    if kw.get("state_v_first") or kw.get("transpose_state_layout"):
        h0 = h0.transpose(-1, -2).contiguous()
    if kw.get("use_beta_sigmoid_in_kernel"):
        beta = torch.randn_like(beta)
    ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    ref_o, ref_h = fn(*ref_ins[:5], initial_state=ref_ins[5], **kw)
    fake_fla.calls.clear()
    integ.patch(backend="reference")
    fla_fn = fake_fla.mods["fla.ops.gated_delta_rule"].chunk_gated_delta_rule
    o, ht = fla_fn(*ins[:5], initial_state=ins[5], **kw)
    assert fake_fla.calls == [], "the patched call must not reach FLA's function"
    assert rel_l2(o, ref_o) < 1e-5
    if kw.get("output_final_state"):
        assert ht.shape == ref_h.shape and rel_l2(ht, ref_h) < 1e-5
        loss_terms = [(o, torch.ones_like(o)), (ht, torch.ones_like(ht))]
    else:
        assert ht is None
        loss_terms = [(o, torch.ones_like(o))]
    gr = torch.autograd.grad([t for t, _ in loss_terms], ins, [c for _, c in loss_terms])
    ref_terms = [ref_o] + ([ref_h] if kw.get("output_final_state") else [])
    rg = torch.autograd.grad(ref_terms, ref_ins, [c for _, c in loss_terms])
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), gr, rg):
        assert rel_l2(a, b) < 1e-4, name


def test_fla_patch_falls_back_for_what_flashqla_does_not_serve(fake_fla):
    integ, mods = fake_fla.integ, fake_fla.mods
    q, k, v, g, beta, _ = _fla_inputs()
    with integ.patched(backend="reference"):
        f = mods["fla.ops.gated_delta_rule"].chunk_gated_delta_rule
        f(q, k, v, g, beta, cp_context=object())
        assert len(fake_fla.calls) == 1 and fake_fla.calls[0]["cp_context"] is not None
        f(q, k, v, g, beta, some_new_flag=True)
        assert len(fake_fla.calls) == 2
        s = integ.stats()
        assert s.get("fla:cp_context", 0) >= 1 and s.get("fla:unknown argument some_new_flag", 0) >= 1
    assert not integ.is_patched() and mods["fla.ops"].chunk_gated_delta_rule is fake_fla.fn


def test_fla_patch_is_idempotent_and_compiles(fake_fla):
    integ, mods = fake_fla.integ, fake_fla.mods
    integ.patch(backend="reference")
    integ.patch(backend="reference")
    integ.unpatch()
    assert mods["fla.ops.gated_delta_rule"].chunk_gated_delta_rule is fake_fla.fn
    integ.patch(backend="reference")
    layer_mod = mods["fla.layers.gated_deltanet"]
    q, k, v, g, beta, h0 = _fla_inputs()

    def layer(q, k, v, g, beta, h0):
        return layer_mod.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)

    torch._dynamo.reset()
    o, ht = torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, h0)
    ref_o, ref_h = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True, compute_dtype=torch.float64)
    assert rel_l2(o, ref_o) < 1e-5 and rel_l2(ht, ref_h) < 1e-5 and fake_fla.calls == []


def test_fla_patch_without_fla_says_so(monkeypatch):
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("FLA is installed")
    from flashqla.integrations import fla as integ
    with pytest.raises(ImportError, match="needs FLA"):
        integ.patch()


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="FLA is not installed")
def test_fla_patch_against_real_fla():
    import fla.ops.gated_delta_rule as fla_gdr
    from flashqla.integrations import fla as integ
    original = fla_gdr.chunk_gated_delta_rule
    q, k, v, g, beta, h0 = (t.cuda() for t in _fla_inputs(B=2, T=300, H=2, HV=4, K=128, V=128))
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))
    ref_o, ref_h = original(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    with integ.patched():
        assert fla_gdr.chunk_gated_delta_rule is not original
        o, ht = fla_gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert fla_gdr.chunk_gated_delta_rule is original
    assert rel_l2(o, ref_o) < 1e-2 and rel_l2(ht, ref_h) < 1e-2
