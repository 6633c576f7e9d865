"""Dispatch rules with faked devices (no GPU needed), registration of a toy backend, explain()."""

from __future__ import annotations

import os

import pytest
import torch

import flashqla
from flashqla.dispatch import Backend, BackendUnavailableError, fake_device, get_backend, match_priority, \
    register_backend, unregister_backend
from flashqla.reference import chunk_gated_delta_rule_ref
from flashqla.testing import Case, make_inputs, run_case


def _inputs(dtype=torch.float32, K=64, **kw):
    x = make_inputs(Case("d", 2, 4, K, K, B=1, T=40, **kw), dtype)
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


def test_priority_patterns():
    pr = {"sm_90": 30, "sm_9x": 20, "sm_80+": 10, "cuda": 1}
    assert match_priority(pr, "sm_90", (9, 0)) == 30
    assert match_priority(pr, "sm_91", (9, 1)) == 20
    assert match_priority(pr, "sm_86", (8, 6)) == 10
    assert match_priority(pr, "sm_100", (10, 0)) == 10
    assert match_priority(pr, "sm_75", (7, 5)) == 1
    assert match_priority({"sm_80+": 10}, "sm_75", (7, 5)) is None
    assert match_priority(pr, "cpu", None) is None


def test_cpu_explain_names_chosen_and_rejects_gpu_backends():
    d = flashqla.explain(*_inputs())
    chosen = d.chosen
    native_ok, _ = flashqla.get_backend("cpu").available()
    assert chosen == ("cpu" if native_ok else "reference")
    reasons = d.reasons()
    for gpu in ("tilelang", "cutlass", "triton"):
        assert gpu in reasons and reasons[gpu], f"no reason given for {gpu}"
        verdict = next(c.verdict for c in d.candidates if c.name == gpu)
        assert verdict in ("not for this device", "rejected")
    assert "chosen" in str(d) and "cpu" in str(d)


@pytest.mark.parametrize("cap,order", [((9, 0), ["tilelang", "cutlass", "triton", "reference"]),
                                       ((8, 0), ["triton", "reference"]),
                                       ((8, 9), ["triton", "reference"]),
                                       ((10, 0), ["triton", "reference"])])
def test_gpu_order_with_faked_capability(cap, order, monkeypatch):
    monkeypatch.setenv("FLASHQLA_SPEED_TABLE", "0")  # declared priorities alone
    with fake_device("cuda", cap):
        d = flashqla.explain(*_inputs(torch.bfloat16, K=128))
    ranked = [c.name for c in d.candidates if c.priority is not None]
    assert ranked == order, str(d)
    assert d.spec.device.arch == f"sm_{cap[0]}{cap[1]}"


class ToyBackend(Backend):
    """Serves a fake future architecture by running the chunked reference (a test double, never shipped)."""

    name = "toy"
    priorities = {"sm_120": 1000}
    calls = 0

    def supports(self, spec):
        return (spec.K == 64, "toy serves K=64 only")

    def forward(self, spec, x):
        ToyBackend.calls += 1
        o, ht = chunk_gated_delta_rule_ref(x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state,
                                           x.output_final_state, x.use_qk_l2norm,
                                           None if x.varlen is None else x.varlen.cu_seqlens_cpu)
        return o, ht, (), None


@pytest.fixture
def toy():
    b = register_backend(ToyBackend())
    ToyBackend.calls = 0
    yield b
    unregister_backend("toy")


def test_registered_toy_backend_is_chosen_for_its_arch(toy):
    args = _inputs()
    with fake_device("cuda", (12, 0)):
        d = flashqla.explain(*args)
        assert d.chosen == "toy", str(d)
        o, _ = flashqla.chunk_gated_delta_rule(*args)
    assert ToyBackend.calls == 1
    ref, _ = chunk_gated_delta_rule_ref(*args)
    torch.testing.assert_close(o, ref)
    # not chosen on other architectures, and its own rejection reason is reported
    with fake_device("cuda", (9, 0)):
        assert flashqla.explain(*args).chosen != "toy"
    with fake_device("cuda", (12, 0)):
        d = flashqla.explain(*_inputs(K=32))
        assert d.chosen != "toy" and "K=64 only" in d.reasons()["toy"]


def test_new_arch_priority_for_existing_backend():
    ref = flashqla.get_backend("reference")
    with fake_device("cuda", (12, 1)):
        before = flashqla.explain(*_inputs())
        register_backend(ref, {"sm_121": 5000}, replace=True)
        try:
            after = flashqla.explain(*_inputs())
        finally:
            from flashqla.dispatch import registry
            registry._EXTRA_PRIORITIES.pop("reference", None)
    assert next(c.priority for c in after.candidates if c.name == "reference") == 5000
    assert next(c.priority for c in before.candidates if c.name == "reference") == 0


def test_named_backend_never_falls_back(toy):
    args = _inputs(K=32)
    with fake_device("cuda", (12, 0)):
        with pytest.raises(BackendUnavailableError, match="K=64 only"):
            flashqla.chunk_gated_delta_rule(*args, backend="toy")
    with pytest.raises(ValueError, match="unknown backend"):
        flashqla.chunk_gated_delta_rule(*args, backend="nope")
    with fake_device("cuda", (7, 5)):  # triton serves SM80+ only
        with pytest.raises(BackendUnavailableError, match="'triton' cannot serve"):
            flashqla.chunk_gated_delta_rule(*args, backend="triton")


def test_env_override_and_disable(monkeypatch, toy):
    args = _inputs()
    monkeypatch.setenv("FLASHQLA_BACKEND", "reference")
    d = flashqla.explain(*args)
    assert d.chosen == "reference" and "FLASHQLA_BACKEND" in str(d)
    monkeypatch.setenv("FLASHQLA_BACKEND", "toy")
    flashqla.chunk_gated_delta_rule(*args)  # asked by name, toy runs on any device it supports
    assert ToyBackend.calls == 1
    with pytest.raises(BackendUnavailableError, match="FLASHQLA_BACKEND"):
        flashqla.chunk_gated_delta_rule(*_inputs(K=32))  # ... and never falls back when it cannot
    monkeypatch.delenv("FLASHQLA_BACKEND")
    monkeypatch.setenv("FLASHQLA_DISABLE", "cpu")
    d = flashqla.explain(*args)
    assert d.chosen == "reference" and "FLASHQLA_DISABLE" in d.reasons()["cpu"]


class LazyBackend(Backend):
    """Returns unwritten (torch.empty) outputs: the suite's poisoning must catch it."""

    name = "lazy"
    priorities = {}
    has_backward = False

    def forward(self, spec, x):
        o, ht = chunk_gated_delta_rule_ref(x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state,
                                           x.output_final_state, x.use_qk_l2norm,
                                           None if x.varlen is None else x.varlen.cu_seqlens_cpu)
        lazy = torch.empty_like(o)
        lazy[:, : o.shape[1] // 2] = o[:, : o.shape[1] // 2]  # forgets the second half
        return lazy, ht, (), None


def test_harness_catches_unwritten_outputs():
    register_backend(LazyBackend())
    try:
        res = run_case(flashqla.chunk_gated_delta_rule, Case("c", 1, 2, 16, 16, B=1, T=80), "lazy",
                       torch.float32, grads=False)
    finally:
        unregister_backend("lazy")
    assert not res.ok and "o" in res.failures


def test_harness_catches_wrong_math():
    class Wrong(LazyBackend):
        name = "wrong"

        def forward(self, spec, x):
            o, ht, s, a = ToyBackend.forward(self, spec, x)
            return o * 1.001, ht, s, a

    register_backend(Wrong())
    try:
        res = run_case(flashqla.chunk_gated_delta_rule, Case("c", 1, 2, 16, 16, B=1, T=80), "wrong",
                       torch.float32, grads=False)
    finally:
        unregister_backend("wrong")
    assert res.failures.keys() == {"o"}


def test_measured_speed_table_orders_sm90_backends(monkeypatch):
    from flashqla.dispatch import registry

    table = {"sm_90": [
        {"mode": "fwd", "width": 32, "tokens_per_seq": 32768, "order": ["triton", "tilelang"],
         "ms": {"triton": 3.0, "tilelang": 3.9}, "row": "16/32 1x32768", "source": "test"},
        {"mode": "fwd", "width": 256, "tokens_per_seq": 1024, "order": ["tilelang", "triton"],
         "ms": {"triton": 0.74, "tilelang": 0.65}, "row": "16/32 8x1024", "source": "test"}]}
    monkeypatch.setattr("flashqla.dispatch.speed_table.TABLE", table)

    def ranked(T, seqlens):
        x = make_inputs(Case("m", 16, 32, 128, 128, seqlens=seqlens, h0=False, ht=False), torch.bfloat16)
        with fake_device("cuda", (9, 0)):
            d = flashqla.explain(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu_seqlens"],
                                 needs_grad=False)
        return [c.name for c in d.candidates if c.priority is not None], d

    order, d = ranked(None, (4000,))
    assert order.index("triton") < order.index("tilelang") and "measured speed" in str(d)
    order, d = ranked(None, (128,) * 8)
    assert order.index("tilelang") < order.index("triton")
    assert "measured speed at the nearest shape 16/32 8x1024" in str(d) and "priorities agree" in str(d)
    monkeypatch.setenv("FLASHQLA_SPEED_TABLE", "0")
    order, d = ranked(None, (4000,))
    assert order.index("tilelang") < order.index("triton") and "measured speed" not in str(d)
    assert registry.measured_order  # the hook stays importable for tools


class CrashingBackend(Backend):
    """Its kernels fail to launch: auto must move on, a named request must raise naming it."""

    name = "crashy"
    priorities = {"cpu": 1000}
    has_backward = False

    def forward(self, spec, x):
        raise RuntimeError("launch failed: too many resources requested")


def test_runtime_failure_moves_auto_to_next_backend():
    from flashqla.dispatch import BackendRuntimeError, registry

    register_backend(CrashingBackend())
    try:
        args = _inputs()
        o, _ = flashqla.chunk_gated_delta_rule(*args)  # crashy fails, the next backend serves
        ref, _ = chunk_gated_delta_rule_ref(*args)
        torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)
        d = flashqla.explain(*args, needs_grad=False)
        assert d.chosen != "crashy" and "failed at run time" in d.reasons()["crashy"]
        with pytest.raises(BackendRuntimeError, match="'crashy' failed at run time.*too many resources"):
            flashqla.chunk_gated_delta_rule(*args, backend="crashy")
    finally:
        unregister_backend("crashy")
        registry._RUNTIME_FAILURES.clear()


def test_runtime_failure_fallback_in_fwd_api_too():
    from flashqla.dispatch import registry

    register_backend(CrashingBackend())
    try:
        o, _, ctx = flashqla.chunk_gated_delta_rule_fwd(*_inputs(), for_backward=False)
        assert ctx.backend.name != "crashy"
    finally:
        unregister_backend("crashy")
        registry._RUNTIME_FAILURES.clear()


class UncompilableBackend(Backend):
    """Its kernel goes through the real tilelang compile cache with a builder that fails."""

    name = "uncompilable"
    priorities = {"cpu": 1000}
    has_backward = False

    def forward(self, spec, x):
        from flashqla.backends.tilelang._compile import get_kernel

        def build_broken(K, V):
            raise ValueError("shared memory 300 KB over the 227 KB limit")
        get_kernel("fwd_broken_sm90", build_broken, (spec.K, spec.V))


def test_compile_failure_names_backend_kernel_and_configuration():
    from flashqla.dispatch import BackendRuntimeError, KernelBuildError, registry

    register_backend(UncompilableBackend())
    try:
        args = _inputs()
        o, _ = flashqla.chunk_gated_delta_rule(*args)  # auto: the next backend serves
        d = flashqla.explain(*args, needs_grad=False)
        why = d.reasons()["uncompilable"]
        assert "KernelBuildError" in why and "fwd_broken_sm90" in why and "300 KB" in why
        with pytest.raises(BackendRuntimeError, match="'uncompilable'.*tilelang kernel fwd_broken_sm90 failed to "
                                                      r"compile for key \(\d+, \d+\)") as info:
            flashqla.chunk_gated_delta_rule(*args, backend="uncompilable")
        assert isinstance(info.value.__cause__, KernelBuildError)
    finally:
        unregister_backend("uncompilable")
        registry._RUNTIME_FAILURES.clear()


def test_backends_claimed_for_this_machine_are_available():
    """The per-backend test files skip themselves when their backend is unavailable; this guard keeps such a
    skip from hiding a broken backend that the project claims runs here: the reference and the native cpu
    backend (built by ``pip install -e .``) everywhere, and triton on CUDA or under its interpreter (which
    tests/conftest.py turns on without a GPU)."""
    claimed = ["reference", "cpu"]
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        claimed.append("triton")
    for name in claimed:
        ok, why = get_backend(name).available()
        assert ok, f"backend {name!r} is claimed to run on this machine but is unavailable: {why}"


def test_select_checks_only_what_it_needs_and_explain_checks_all(toy, monkeypatch):
    """On every call ``select`` stops at the backend it picks and checks no other when one is named (host
    time); ``explain`` still evaluates every backend, and an auto call no backend serves still lists all."""
    from flashqla.dispatch.registry import select
    from flashqla.validation import validate
    checked = []
    monkeypatch.setattr(ToyBackend, "supports", lambda self, spec: (checked.append(1), (False, "toy: no"))[1])
    args = _inputs()
    with fake_device("cuda", (12, 0)):      # where toy has a priority, so a complete decision checks it
        spec = validate(*args)[0]
        be, d = select(spec, "reference")
        assert be.name == "reference" and not checked and [c.name for c in d.candidates] == ["reference"]
        d = flashqla.explain(*args, backend="reference")
        assert checked and "toy: no" in d.reasons()["toy"]
        # auto: toy (first by priority) is checked and rejected, the next one serves, the rest are not checked
        be, d = select(spec, "auto")
        names = [c.name for c in d.candidates]
        assert names[0] == "toy" and d.chosen == be.name == names[-1]
        # auto with nothing left to serve: the error lists every backend and why
        others = [n for n in flashqla.list_backends() if n != "toy"]
        monkeypatch.setenv("FLASHQLA_DISABLE", ",".join(others))
        with pytest.raises(BackendUnavailableError) as ei:
            select(spec, "auto")
        msg = str(ei.value)
        assert "toy: no" in msg and all(n in msg for n in others) and "disabled by FLASHQLA_DISABLE" in msg
