"""``state_layout="VK"`` on the chunk op: initial and final state ``[N, Hv, V, K]`` (serving engines' pools).

The op transposes the state around the backends, so a VK call must agree with the KV call on everything
(o, the final state and every gradient, dh0 included), up to the transposes of the state tensors.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import flashqla  # noqa: E402
import flashqla.library as L  # noqa: E402
from flashqla.decode import gated_delta_rule_decode  # noqa: E402
from flashqla.dispatch import get_backend  # noqa: E402
from flashqla.testing import GRAD_NAMES, TOLERANCES, Case, make_inputs, oracle, rel_l2  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")


def _t(x):
    """KV <-> VK (contiguous); None stays None."""
    return None if x is None else x.transpose(-1, -2).contiguous()


def _run(op, case, x, layout, backend, **extra):
    """``op`` on the inputs ``x`` (KV-layout state tensors) with ``state_layout=layout``; returns o, the
    final state and the gradients with every state tensor brought back to KV for comparison."""
    leaves = [x[n].detach().clone().requires_grad_() for n in NAMES]
    h0 = x["initial_state"]
    h0 = None if h0 is None else (h0 if layout == "KV" else _t(h0)).detach().clone().requires_grad_()
    o, ht = op(*leaves, scale=case.scale, initial_state=h0, output_final_state=case.ht,
               use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=x["cu_seqlens"], backend=backend,
               state_layout=layout, **extra)
    outs, cot = [o], [x["do"]]
    if case.ht:
        N, Hv = case.num_seqs, case.Hv
        want = (N, Hv, case.K, case.V) if layout == "KV" else (N, Hv, case.V, case.K)
        assert tuple(ht.shape) == want and ht.is_contiguous()
        outs.append(ht)
        cot.append(x["dht"] if layout == "KV" else _t(x["dht"]))
    else:
        assert ht is None
    wrt = leaves + ([h0] if h0 is not None else [])
    grads = list(torch.autograd.grad(outs, wrt, cot))
    if h0 is not None:
        assert grads[5].shape == h0.shape
        if layout == "VK":
            grads[5] = _t(grads[5])
    res = {"o": o.detach(), "ht": None if ht is None else (ht if layout == "KV" else _t(ht)).detach()}
    res.update(zip(GRAD_NAMES, grads))
    return res


def _assert_same(a, b, tol=0.0, what=""):
    assert a.keys() == b.keys()
    for n in a:
        if a[n] is None:
            assert b[n] is None, n
            continue
        err = rel_l2(a[n], b[n])
        assert err <= tol, f"{what} {n}: VK vs KV rel err {err:.3e}"


CASES = [
    Case("dense", 2, 4, 16, 8, B=2, T=37),                              # K != V: a swapped state would show
    Case("varlen", 1, 2, 8, 16, seqlens=(5, 0, 70, 1), l2norm=True),
    Case("no_h0", 1, 2, 16, 8, B=1, T=20, h0=False),
    Case("no_ht", 1, 2, 8, 16, B=2, T=9, ht=False, scale=0.4),
]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_vk_matches_kv_and_oracle(backend, case):
    ok, why = get_backend(backend).available()
    if not ok:
        pytest.skip(f"backend {backend} not available here: {why}")
    x = make_inputs(case, torch.float32, seed=3)
    kv = _run(flashqla.chunk_gated_delta_rule, case, x, "KV", backend)
    vk = _run(flashqla.chunk_gated_delta_rule, case, x, "VK", backend)
    _assert_same(vk, kv, 1e-6, backend)
    ref = oracle(case, x)
    for n, val in vk.items():
        if val is not None:
            assert rel_l2(val, ref[n]) <= TOLERANCES["float32"][n], n


def test_vk_gradcheck_float64():
    """Finite differences on the VK path itself (tiny float64 case, reference backend)."""
    case = Case("gc", 1, 1, 3, 2, seqlens=(2, 3))
    x = make_inputs(case, torch.float64, seed=1)
    h0 = _t(x["initial_state"]).requires_grad_()
    v = x["v"].clone().requires_grad_()

    def f(v, h0):
        o, ht = flashqla.chunk_gated_delta_rule(x["q"], x["k"], v, x["g"], x["beta"], initial_state=h0,
                                                output_final_state=True, cu_seqlens=x["cu_seqlens"],
                                                backend="reference", state_layout="VK")
        return o, ht

    assert torch.autograd.gradcheck(f, (v, h0), fast_mode=True)


def test_fwd_bwd_split_vk():
    case = Case("split", 1, 2, 16, 8, seqlens=(30, 11))
    x = make_inputs(case, torch.float32, seed=4)
    kv = _run(flashqla.chunk_gated_delta_rule, case, x, "KV", "reference")
    args = [x[n] for n in NAMES]
    o, ht, ctx = flashqla.chunk_gated_delta_rule_fwd(*args, initial_state=_t(x["initial_state"]),
                                                     output_final_state=True, cu_seqlens=x["cu_seqlens"],
                                                     backend="reference", state_layout="VK")
    assert ht.shape == (2, 2, 8, 16) and ht.is_contiguous()
    grads = flashqla.chunk_gated_delta_rule_bwd(ctx, x["do"], _t(x["dht"]))
    assert grads[5].shape == (2, 2, 8, 16)
    got = {"o": o, "ht": _t(ht), **dict(zip(GRAD_NAMES, grads[:5] + (_t(grads[5]),)))}
    _assert_same(got, kv, 1e-6, "fwd/bwd split")


def test_context_parallel_vk():
    case = Case("cp", 1, 2, 16, 8, seqlens=(200, 70), gate="zero")
    x = make_inputs(case, torch.float32, seed=5)
    kv = _run(flashqla.chunk_gated_delta_rule, case, x, "KV", "reference")
    vk = _run(flashqla.chunk_gated_delta_rule, case, x, "VK", "reference", context_parallel=3)
    _assert_same(vk, kv, 1e-5, "context_parallel=3")


def test_zero_tokens_vk_passes_state_through():
    h0 = torch.randn(2, 2, 8, 16, requires_grad=True)   # VK: V = 8, K = 16
    q = torch.randn(2, 0, 1, 16)
    v = torch.randn(2, 0, 2, 8)
    g, beta = torch.zeros(2, 0, 2), torch.ones(2, 0, 2)
    o, ht = flashqla.chunk_gated_delta_rule(q, q, v, g, beta, initial_state=h0, output_final_state=True,
                                            state_layout="VK")
    assert o.shape == (2, 0, 2, 8) and torch.equal(ht, h0)
    dht = torch.randn_like(ht)
    (dh0,) = torch.autograd.grad(ht, [h0], dht)
    torch.testing.assert_close(dh0, dht)
    _, ht = flashqla.chunk_gated_delta_rule(q, q, v, g, beta, output_final_state=True, state_layout="VK")
    assert ht.shape == (2, 2, 8, 16) and not ht.any()


# ------------------------------------------------------------------------------------------ validation


def _val_args():
    case = Case("val", 1, 2, 16, 8, B=2, T=5)
    x = make_inputs(case, torch.float32)
    return [x[n] for n in NAMES], x["initial_state"]


@pytest.mark.parametrize("bad", ["kv", "XY", "", None, 1])
@pytest.mark.parametrize("entry", ["api", "library", "explain", "fwd", "cp"])
def test_bad_layout_value_raises(bad, entry):
    args, h0 = _val_args()
    kw = dict(initial_state=h0, output_final_state=True, state_layout=bad)
    fn = {"api": flashqla.chunk_gated_delta_rule, "library": L.chunk_gated_delta_rule,
          "explain": flashqla.explain, "fwd": flashqla.chunk_gated_delta_rule_fwd,
          "cp": lambda *a, **k: flashqla.chunk_gated_delta_rule(*a, **k, context_parallel=2)}[entry]
    with pytest.raises(ValueError, match="state_layout"):
        fn(*args, **kw)


@pytest.mark.parametrize("entry", ["api", "library", "explain", "fwd", "cp"])
def test_wrong_vk_shape_names_expected_layout(entry):
    args, h0 = _val_args()   # h0 is KV [2, 2, 16, 8]: wrong for VK, which wants [2, 2, 8, 16]
    fn = {"api": flashqla.chunk_gated_delta_rule, "library": L.chunk_gated_delta_rule,
          "explain": flashqla.explain, "fwd": flashqla.chunk_gated_delta_rule_fwd,
          "cp": lambda *a, **k: flashqla.chunk_gated_delta_rule(*a, **k, context_parallel=2)}[entry]
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, Hv, V, K\].*\(2, 2, 8, 16\)"):
        fn(*args, initial_state=h0, output_final_state=True, state_layout="VK")
    # and the KV message is unchanged for a VK-shaped state under the default layout
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, Hv, K, V\]"):
        fn(*args, initial_state=_t(h0), output_final_state=True)


def test_explain_notes_the_layout():
    args, h0 = _val_args()
    d = flashqla.explain(*args, initial_state=_t(h0), output_final_state=True, state_layout="VK")
    assert "state_layout='VK'" in str(d) and d.chosen is not None
    assert d.spec.state_layout == "KV"   # what the backends are asked to serve


# ---------------------------------------------------------------------------------- custom op / compile


def test_opcheck_chunk_vk():
    case = Case("op", 1, 2, 16, 8, B=2, T=6)
    x = make_inputs(case, torch.float32)
    args = [x[n].clone().requires_grad_() for n in NAMES]
    h0 = _t(x["initial_state"]).requires_grad_()
    torch.library.opcheck(torch.ops.flashqla.chunk_gated_delta_rule.default,
                          (*args, None, h0, True, False, None, "reference", "VK"),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_custom_op_vk_matches_kv():
    """The registered autograd of the custom op (recompute + backward) with a VK state."""
    case = Case("op", 1, 2, 16, 8, seqlens=(9, 0, 20))
    x = make_inputs(case, torch.float32, seed=6)
    kv = _run(flashqla.chunk_gated_delta_rule, case, x, "KV", "reference")

    def op(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
           backend, state_layout):
        o, ht = torch.ops.flashqla.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state,
                                                          output_final_state, use_qk_l2norm_in_kernel,
                                                          cu_seqlens, backend, state_layout)
        return o, ht

    vk = _run(op, case, x, "VK", "reference")
    _assert_same(vk, kv, 1e-6, "custom op")


def test_compile_fullgraph_vk_training_step():
    """torch.compile(fullgraph=True) over the library wrapper with state_layout='VK', forward + backward."""
    case = Case("c", 1, 2, 16, 8, B=2, T=12)
    x = make_inputs(case, torch.float32, seed=7)
    kv = _run(flashqla.chunk_gated_delta_rule, case, x, "KV", "reference")
    seen = {}

    def record(gm, example_inputs):
        seen["ops"] = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend("aot_eager")(gm, example_inputs)

    def loss_parts(q, k, v, g, beta, h0):
        return L.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        backend="reference", state_layout="VK")

    torch._dynamo.reset()
    f = torch.compile(loss_parts, fullgraph=True, backend=record)

    def op(*args, **kw):
        return f(*args[:5], kw["initial_state"])

    vk = _run(op, case, x, "VK", "reference")
    assert seen["ops"] & {"flashqla.chunk_gated_delta_rule", "flashqla.chunk_gated_delta_rule.default"}
    _assert_same(vk, kv, 1e-6, "compiled")


# ------------------------------------------------------------------------------------- prefill -> decode


def test_vk_prefill_then_vk_decode_equals_one_prefill():
    """Prefill with a VK state; its final state goes straight into a VK decode pool (no transpose)."""
    gen = torch.Generator().manual_seed(11)
    B, Hqk, Hv, K, V, T0, T1 = 2, 1, 2, 16, 8, 29, 3
    case = Case("pd", Hqk, Hv, K, V, B=B, T=T0 + T1)
    x = make_inputs(case, torch.float32, seed=12)
    h0_vk = torch.randn(B, Hv, V, K, generator=gen) * 0.5
    full_o, full_h = flashqla.chunk_gated_delta_rule(*(x[n] for n in NAMES), initial_state=h0_vk,
                                                     output_final_state=True, backend="reference",
                                                     state_layout="VK")
    kv_o, kv_h = flashqla.chunk_gated_delta_rule(*(x[n] for n in NAMES), initial_state=_t(h0_vk),
                                                 output_final_state=True, backend="reference")
    assert rel_l2(full_o, kv_o) < 1e-6 and rel_l2(_t(full_h), kv_h) < 1e-6
    o0, h = flashqla.chunk_gated_delta_rule(*(x[n][:, :T0] for n in NAMES), initial_state=h0_vk,
                                            output_final_state=True, backend="reference", state_layout="VK")
    pool = torch.full((4, Hv, V, K), float("nan"))
    slots = torch.tensor([1, 3], dtype=torch.int32)
    pool[slots.long()] = h
    outs = [o0]
    for a, b in ((T0, T0 + 1), (T0 + 1, T0 + T1)):
        outs.append(gated_delta_rule_decode(*(x[n][:, a:b] for n in NAMES), state=pool, state_indices=slots,
                                            state_layout="VK", impl="torch"))
    assert rel_l2(torch.cat(outs, 1), full_o) < 1e-5
    assert rel_l2(pool[slots.long()], full_h) < 1e-5


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    Case("gpu_dense", 2, 4, 128, 128, B=2, T=300),
    Case("gpu_varlen", 1, 2, 128, 128, seqlens=(1, 200, 0, 129), l2norm=True),
    Case("gpu_no_ht", 2, 4, 128, 128, B=1, T=100, ht=False),
], ids=lambda c: c.name)
def test_vk_matches_kv_cuda_auto(case):
    x = make_inputs(case, torch.bfloat16, device="cuda", seed=8)
    d = flashqla.explain(*(x[n] for n in NAMES), initial_state=_t(x["initial_state"]), output_final_state=case.ht,
                         use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=x["cu_seqlens"], needs_grad=True,
                         state_layout="VK")
    if d.chosen is None:
        pytest.skip(f"no backend serves this on this GPU:\n{d}")
    kv = _run(flashqla.chunk_gated_delta_rule, case, x, "KV", "auto")
    vk = _run(flashqla.chunk_gated_delta_rule, case, x, "VK", "auto")
    # the same backend computes both from the same KV state; only nondeterministic accumulation may differ
    _assert_same(vk, kv, 2e-3, f"cuda ({d.chosen})")
    ref = oracle(case, x)
    for n, val in vk.items():
        if val is not None:
            assert rel_l2(val, ref[n]) <= TOLERANCES["bfloat16"][n], f"{d.chosen} {n}"
