"""Backend "triton": its own checks beyond the shared suite (tests/test_correctness.py).

Without a CUDA device the kernels run in Triton's interpreter on the CPU (fp32 inputs only, small
shapes: the interpreter is slow).  TRITON_INTERPRET must be set before any triton kernel module is
imported; tests/conftest.py does it too, this module does it again so it also runs on its own.
GPU-only tests (bf16/fp16 tolerances, CUDA-graph capture) carry the ``gpu`` marker.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import flashqla  # noqa: E402
from flashqla.dispatch import fake_device, get_backend  # noqa: E402
from flashqla.testing import (Case, make_inputs, oracle, poisoned_outputs, rel_l2, run_case,  # noqa: E402
                              warm_up_for_capture)
from flashqla.validation import validate  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"

# The L2 norm fused into the kernels (FLASHQLA_TRITON_L2=fused) faults on the H200 (ops.l2_mode: a
# miscompilation of the serial kernels under triton 3.6, device run 8; session 13 run 2 hit it again in the
# bf16 case of the kept-inverse test and lost every later test of that process to the dead context): on a GPU
# the fused form is not run here; the interpreter checks it.
FUSED_L2_ON_CPU = pytest.mark.skipif(CUDA, reason="FLASHQLA_TRITON_L2=fused faults on the H200 (ops.l2_mode)")
BACKEND = "triton"

pytestmark = pytest.mark.skipif(not get_backend(BACKEND).available()[0],
                                reason=f"triton backend unavailable: {get_backend(BACKEND).available()[1]}")

# fp32 inputs compute with full-fp32 dots, on the GPU as in the interpreter
FWD_TOL = 1e-4
GRAD_TOL = 1e-3


def _spec(dtype=torch.float32, K=64, V=64, device="cpu"):
    q = torch.randn(1, 8, 2, K, dtype=dtype, device=device)
    v = torch.randn(1, 8, 4, V, dtype=dtype, device=device)
    g = torch.randn(1, 8, 4, device=device)
    spec, _, _ = validate(q, q, v, g, g, needs_grad=False)
    return spec


# --- dispatch contract ---------------------------------------------------------------------------

def test_supports_rejects_with_reasons():
    be = get_backend(BACKEND)
    assert be.priorities == {"sm_80+": 10}
    ok, why = be.supports(_spec(K=32, V=32))
    assert not ok and "K = 32" in why
    ok, why = be.supports(_spec(K=64, V=256))
    assert not ok and "V = 256" in why
    with fake_device("cuda", (7, 5), "T4"):
        ok, why = be.supports(_spec())
    assert not ok and "8.0" in why
    with fake_device("cuda", (9, 0), "H200"):
        assert be.supports(_spec(torch.bfloat16, 128, 128))[0]
        assert be.supports(_spec(torch.float16, 64, 128))[0]
        ok, why = be.supports(_spec(torch.float64))
        assert not ok and "float64" in why
    if not CUDA:
        ok, why = be.supports(_spec(torch.bfloat16))
        assert not ok and "interpreter" in why


# --- forward vs the float64 oracle ---------------------------------------------------------------

FWD_CASES = [
    Case("dense_b2", 2, 2, 64, 64, B=2, T=100),
    Case("varlen_0_1_65", 1, 2, 64, 64, seqlens=(0, 1, 65, 64)),
    Case("gva_1_4_l2norm", 1, 4, 64, 64, B=1, T=70, l2norm=True),
    Case("no_state_k64_v128", 1, 1, 64, 128, B=1, T=90, h0=False, ht=False),
    Case("strong_decay", 1, 2, 64, 64, seqlens=(130, 7), gate="strong"),
]


@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: c.name)
def test_forward_fp32_matches_oracle(case):
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, DEV, grads=False)
    assert all(e <= FWD_TOL for e in res.errors.values()), res.errors


def _extreme_gate_inputs(T=96, Hv=2, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, T, 1, 64, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, 64, generator=gen), dim=-1)
    v = torch.randn(1, T, Hv, 64, generator=gen)
    # gates of -1e4 between runs of exact zeros: the cumulative gate reaches ~-3e5 inside a chunk, and
    # the decays across the zero runs must still be exactly 1
    g = -1e4 * torch.rand(1, T, Hv, generator=gen)
    g = torch.where(torch.rand(1, T, Hv, generator=gen) < 0.5, torch.zeros_like(g), g)
    beta = torch.rand(1, T, Hv, generator=gen)
    h0 = torch.randn(1, Hv, 64, 64, generator=gen)
    return q, k, v, g, beta, h0


def test_forward_extreme_gates_finite_and_accurate():
    q, k, v, g, beta, h0 = _extreme_gate_inputs()
    with poisoned_outputs(DEV):
        o, ht = flashqla.chunk_gated_delta_rule(*(x.to(DEV) for x in (q, k, v, g, beta)),
                                                initial_state=h0.to(DEV), output_final_state=True,
                                                backend=BACKEND)
    ro, rht = flashqla.recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g.double(),
                                                      beta.double(), initial_state=h0.double(),
                                                      output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_l2(o, ro) <= FWD_TOL and rel_l2(ht, rht) <= FWD_TOL


def test_forward_with_prepared_varlen_meta_matches():
    case = Case("meta", 2, 2, 64, 64, seqlens=(65, 1, 30))
    x = make_inputs(case, torch.float32, DEV)
    meta = flashqla.prepare_varlen(x["cu_seqlens"])
    o, ht = flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                            initial_state=x["initial_state"], output_final_state=True,
                                            cu_seqlens=x["cu_seqlens"], varlen_meta=meta, backend=BACKEND)
    ref = oracle(case, x, grads=False)
    assert rel_l2(o, ref["o"]) <= FWD_TOL and rel_l2(ht, ref["ht"]) <= FWD_TOL


@pytest.mark.parametrize("fuse", [0, 1], ids=["three_kernel", "fused_output"])
def test_forward_both_paths(monkeypatch, fuse):
    # the forward either fuses the output into the state pass or runs a separate output kernel
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", f"fwd.fuse={fuse},output.bv=64,state.bv=32")
    case = Case("paths", 1, 2, 64, 128, seqlens=(70, 1, 0, 64), l2norm=True)
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, DEV, grads=False)
    assert all(e <= FWD_TOL for e in res.errors.values()), res.errors


@pytest.mark.parametrize("tune", ["fwd.fuse=0,serial.seg=1", "fwd.fuse=1,fwd.tb=1,serial.seg=2",
                                  "fwd.fuse=0,state.t=1,state.bv=64,serial.seg=1",
                                  "fwd.fuse=1,fused.t=1,fused.bv=32,serial.seg=1"],
                         ids=["unfused", "fused_tb", "transposed", "transposed_fused"])
@pytest.mark.parametrize("grads", [False, True], ids=["fwd", "fwdbwd"])
def test_forward_walk_in_segments_with_halo(monkeypatch, tune, grads):
    # serial.seg: the forward walk (and the backward's recompute) cut into segments, each starting in a halo
    # before it (backends/tilelang/segments.py); strong gates give halos of a chunk or two, zero gates none (the
    # walk starts at the sequence start), h0 only where a walk starts there
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", tune + ",output.bv=64")
    from flashqla.backends.triton import ops as tops
    calls = []
    real = tops.segment_split
    monkeypatch.setattr(tops, "segment_split", lambda *a, **kw: calls.append(real(*a, **kw)) or calls[-1])
    for case in (Case("seg_strong", 1, 2, 64, 64, seqlens=(64 * 5 + 3, 1, 0, 130), gate="strong"),
                 Case("seg_zero_l2", 1, 2, 64, 64, B=2, T=64 * 3 + 7, gate="zero", l2norm=True)):
        res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, DEV, grads=grads)
        assert res.ok if grads else all(e <= FWD_TOL for e in res.errors.values()), (case.name, res.errors)
    splits = [c for c in calls if c is not None]
    assert splits, "no call was split"
    tables, starts = splits[0]
    assert bool((starts.cpu() > tables.seg_table.cpu()[:, 1:2]).any()), "no walk started in a halo"


@pytest.mark.parametrize("tune", ["serial.bseg=1", "serial.bseg=2,bstate.ldv=0",
                                  "serial.bseg=1,bstate.t=1,bstate.bv=64", "serial.bseg=1,fwd.savet=0",
                                  "serial.bseg=1,serial.seg=2"],
                         ids=["local_dv", "recomputed_dv", "transposed", "no_kept_inverse", "both_split"])
def test_state_gradient_walk_in_segments_with_halo(monkeypatch, tune):
    # serial.bseg: the state-gradient walk cut into segments, each starting in a halo past its end (from dS = 0, or
    # from dht at the sequence end); dh0 from a sequence's first segment only.  With the local dv the halo's chunks
    # recompute their intra-chunk dv_new: the stored tile belongs to the next segment, which completes it in place
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", tune + ",output.bv=64")
    from flashqla.backends.triton import ops as tops
    calls = []
    real = tops.segment_split
    monkeypatch.setattr(tops, "segment_split", lambda *a, **kw: calls.append((kw.get("backward", False),
                                                                             real(*a, **kw))) or calls[-1][1])
    for case in (Case("bseg_strong", 1, 2, 64, 64, seqlens=(64 * 5 + 3, 1, 0, 130), gate="strong"),
                 Case("bseg_zero_l2", 1, 2, 64, 64, B=2, T=64 * 3 + 7, gate="zero", l2norm=True),
                 Case("bseg_gva_logsigmoid", 1, 4, 64, 64, seqlens=(64 * 6, 64 * 2 + 9))):
        res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, DEV, grads=True)
        assert res.ok, (case.name, res.failures)
    splits = [c for bwd, c in calls if bwd and c is not None]
    assert splits, "no backward walk was split"
    tables, ends = splits[0]
    assert bool((ends.cpu() < tables.seg_table_bwd.cpu()[:, 1:2]).any()), "no walk ended in a halo"
    assert bool((ends.cpu() > tables.chunk_offsets.cpu()[1:, None]).any()), "no walk had a halo"


@pytest.mark.parametrize("tune", ["fwd.fuse=0,state.t=1,state.bv=64,bstate.t=1,bstate.bv=64",
                                  "fwd.fuse=1,fused.t=1,fused.bv=32,bstate.t=1"],
                         ids=["transposed_state", "transposed_fused"])
def test_forward_transposed_state_kernel(monkeypatch, tune):
    # TRANSPOSED: the same recurrences with the state held as S^T (forward, recompute and state gradient)
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", tune + ",output.bv=64")
    case = Case("transposed", 1, 2, 64, 128, seqlens=(70, 1, 0, 64), l2norm=True)
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, DEV, grads=True)
    assert res.ok, res.failures


def test_launch_choices_follow_the_h200_sweep(monkeypatch):
    # the unfused/fused switch and the state kernel's pipeline depth, as measured (ops docstrings)
    from types import SimpleNamespace

    from flashqla.backends.triton import ops
    monkeypatch.setattr(ops, "_sm_count", lambda device: 132)
    monkeypatch.delenv("FLASHQLA_TRITON_TUNE", raising=False)
    geo = lambda n, hv: SimpleNamespace(N=n, busy=float(n), Hv=hv, V=128)  # noqa: E731
    dev = torch.device("cpu")
    assert not ops.fuse_forward_output(geo(1, 8), dev)        # 32 programs: latency-bound, unfused
    assert not ops.fuse_forward_output(geo(1, 32), dev)       # 128
    assert ops.fuse_forward_output(geo(4, 32), dev)           # 512: fused (was unfused at 4 per SM)
    assert ops.fuse_forward_output(geo(8, 32), dev)
    bv_geo = lambda n, hv, ieee=False: SimpleNamespace(busy=float(n), Hv=hv, V=128, ieee=ieee)  # noqa: E731
    assert ops._state_bv(bv_geo(1, 8), dev, True) == 16                   # Tb form, 64 programs at 16
    assert ops._state_bv(bv_geo(1, 16), dev, True) == 16                  # 128 <= 132
    assert ops._state_bv(bv_geo(1, 32), dev, True) == 32                  # 256 at 16: too many
    assert ops._state_bv(bv_geo(1, 8), dev) == 16                         # the w/u path too (session 14)
    assert ops._state_bv(bv_geo(1, 16), dev) == 16 and ops._state_bv(bv_geo(1, 32), dev) == 32
    assert ops._state_bv(bv_geo(1, 8, True), dev) == 32                   # fp32 w/u: 16 not measured
    assert ops._state_bv(bv_geo(4, 64), dev, True) == 64
    # the state gradient: the widest V-block whose programs fit one per SM, BV 64 past the BV-32 wave
    monkeypatch.setattr(ops, "_smem_per_block", lambda device: 227 * 1024)
    bst = lambda n, hv, ieee=False: ops._bstate_cfg(bv_geo(n, hv, ieee), dev)  # noqa: E731
    assert bst(1, 8)["bv"] == 16 and bst(1, 16)["bv"] == 16              # 64 / 128 BV-16 programs
    assert bst(1, 16)["stages"] == 3 and bst(1, 16)["warps"] == 4
    assert bst(1, 32)["bv"] == 32 and bst(1, 32)["stages"] == 3           # 128 BV-32 programs (16/32 1x32k)
    assert bst(1, 64)["bv"] == 64 and bst(1, 64)["warps"] == 8            # 256 BV-32 programs (16/64 1x32k)
    assert bst(4, 32)["bv"] == 64 and bst(4, 32)["stages"] == 2
    assert bst(1, 8, True)["bv"] == 32 and bst(4, 32, True)["bv"] == 32   # fp32: 32 throughout
    monkeypatch.setattr(ops, "_smem_per_block", lambda device: 0)
    assert bst(1, 32)["stages"] == 2                                      # no room for a third stage
    # the chunk-parallel gradient kernels: 4 warps on sm_90 for 16-bit inputs, 8 otherwise
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert ops._grads_warps("dqk", bv_geo(1, 8), cuda)["warps"] == 4
    assert ops._grads_warps("wy", bv_geo(1, 8), cuda)["warps"] == 4
    assert ops._grads_warps("dqk", bv_geo(1, 8, True), cuda)["warps"] == 8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert ops._grads_warps("dqk", bv_geo(1, 8), cuda)["warps"] == 8
    assert ops._grads_warps("wy", bv_geo(1, 8), dev)["warps"] == 8
    monkeypatch.setattr(ops, "_state3_per_sm", lambda device: 1)          # sm_80: one 3-stage program per SM
    assert ops._state_stages(128, 32, dev) == 3 and ops._state_stages(32, 32, dev) == 3
    assert ops._state_stages(146, 32, dev) == 2
    assert ops._state_stages(512, 32, dev) == 2 and ops._state_stages(64, 64, dev) == 2
    monkeypatch.setattr(ops, "_state3_per_sm", lambda device: 2)          # sm_90: two fit
    assert ops._state_stages(146, 32, dev) == 3 and ops._state_stages(256, 32, dev) == 2   # w/u path
    assert ops._state_stages(146, 32, dev, True) == 3 and ops._state_stages(256, 32, dev, True) == 3  # Tb
    assert ops._state_stages(512, 32, dev, True) == 2 and ops._state_stages(128, 64, dev) == 2
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", "fwd.fuse=0")
    assert not ops.fuse_forward_output(geo(8, 32), dev)
    # unequal lengths count the sequences in flight over the longest walk (sum / max), not all of them
    from flashqla import prepare_varlen
    cu = torch.tensor([0, 28672, 32768], dtype=torch.int32)
    real = ops.Geometry(torch.empty(1, 32768, 16, 128), torch.empty(1, 32768, 64, 128), prepare_varlen(cu))
    assert real.N == 2 and abs(real.busy - 32768 / 28672) < 1e-9
    assert ops.Geometry(torch.empty(3, 100, 2, 64), torch.empty(3, 100, 4, 64), None).busy == 3.0


@pytest.mark.parametrize("mode", ["separate", pytest.param("fused", marks=FUSED_L2_ON_CPU)])
def test_l2_norm_modes_match_oracle(monkeypatch, mode):
    # separate (default): q/k normalised up front, kernels without the option, dq/dk mapped back through
    # the norm's Jacobian on the host; fused: the norm inside every kernel (faulted on the H200, run 8,
    # so not the default; still checked here under the interpreter).  fp32: to 1e-4 / 1e-3.
    monkeypatch.setenv("FLASHQLA_TRITON_L2", mode)
    case = Case("l2_separate", 1, 2, 64, 64, seqlens=(70, 1, 0, 33), l2norm=True)
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, DEV, grads=True)
    fwd = {n: e for n, e in res.errors.items() if n in ("o", "ht")}
    grads = {n: e for n, e in res.errors.items() if n not in ("o", "ht")}
    assert set(grads) >= {"dq", "dk", "dv", "dg", "dbeta"}
    assert all(e <= FWD_TOL for e in fwd.values()), fwd
    assert all(e <= GRAD_TOL for e in grads.values()), grads
    monkeypatch.setenv("FLASHQLA_TRITON_L2", "elsewhere")
    with pytest.raises(ValueError, match="FLASHQLA_TRITON_L2"):
        run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, DEV, grads=False)


@pytest.mark.gpu
def test_gpu_fused_l2_is_refused(monkeypatch):
    # the fused L2 form faults on the H200 (ops.l2_mode): on a GPU the op refuses it with the variable's name
    # before any kernel runs, rather than crash the context
    monkeypatch.setenv("FLASHQLA_TRITON_L2", "fused")
    case = Case("l2_refused", 1, 2, 64, 64, seqlens=(70, 1), l2norm=True)
    with pytest.raises(ValueError, match="FLASHQLA_TRITON_L2"):
        run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.bfloat16, "cuda", grads=False)
    monkeypatch.setenv("FLASHQLA_TRITON_L2", "separate")
    assert run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.bfloat16, "cuda", grads=False).ok


def test_tune_override_is_checked(monkeypatch):
    from flashqla.backends.triton import ops
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", "dqk.bv=32, wy.warps=4")
    assert ops.tune("dqk")["bv"] == 32 and ops.tune("wy")["warps"] == 4 and ops.tune("prep")["warps"] == 0
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", "dqk.blocks=3")
    with pytest.raises(ValueError, match="FLASHQLA_TRITON_TUNE"):
        ops.tune("dqk")


# --- backward vs the float64 oracle --------------------------------------------------------------

BWD_CASES = [
    Case("bwd_varlen_0_1_65", 1, 2, 64, 64, seqlens=(0, 1, 65, 64)),
    Case("bwd_gva_1_4_l2norm", 1, 4, 64, 64, B=1, T=70, l2norm=True),
    Case("bwd_b2_no_state_k64_v128", 1, 1, 64, 128, B=2, T=70, h0=False, ht=False),
    Case("bwd_strong_decay_h0_only", 1, 2, 64, 64, seqlens=(130, 7), gate="strong", ht=False),
]


@pytest.mark.parametrize("bv", [16, 64])
def test_backward_state_gradient_block_widths(monkeypatch, bv):
    # the state-gradient walk at the V-blocks ops._bstate_cfg may choose besides the default's 32 (BV 64 where
    # the programs are many, 16 by request), with the intra-chunk dv_new from the prep: fp32 against the oracle
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", f"bstate.bv={bv}")
    case = Case("bwd_bv", 1, 2, 64, 128, seqlens=(0, 1, 65, 64))       # V = 128: 8, 4 or 2 V-blocks
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, DEV, grads=True)
    grads = {n: e for n, e in res.errors.items() if n not in ("o", "ht")}
    assert set(grads) >= {"dq", "dk", "dv", "dg", "dbeta"}
    assert all(e <= GRAD_TOL for e in grads.values()), grads


@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: c.name)
def test_backward_fp32_matches_oracle(case):
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, DEV, grads=True)
    fwd = {n: e for n, e in res.errors.items() if n in ("o", "ht")}
    grads = {n: e for n, e in res.errors.items() if n not in ("o", "ht")}
    assert set(grads) >= {"dq", "dk", "dv", "dg", "dbeta"}
    assert all(e <= FWD_TOL for e in fwd.values()), fwd
    assert all(e <= GRAD_TOL for e in grads.values()), grads


def test_backward_extreme_gates_finite_and_accurate():
    q, k, v, g, beta, h0 = _extreme_gate_inputs(T=70, Hv=1)
    leaves = [x.to(DEV).requires_grad_() for x in (q, k, v, g, beta, h0)]
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(v.shape, generator=gen)
    dht = torch.randn(h0.shape, generator=gen)
    with poisoned_outputs(DEV):
        o, ht = flashqla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                                backend=BACKEND)
        got = torch.autograd.grad([o, ht], leaves, [do.to(DEV), dht.to(DEV)])
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    ro, rht = flashqla.recurrent_gated_delta_rule_ref(*ref_leaves[:5], initial_state=ref_leaves[5],
                                                      output_final_state=True)
    ref = torch.autograd.grad([ro, rht], ref_leaves, [do.double(), dht.double()])
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, ref):
        assert torch.isfinite(a).all(), name
        assert rel_l2(a, b) <= GRAD_TOL, (name, rel_l2(a, b))


def test_fwd_bwd_api_with_meta_is_deterministic():
    case = Case("api", 1, 2, 64, 64, seqlens=(65, 1, 20))
    x = make_inputs(case, torch.float32, DEV)
    meta = flashqla.prepare_varlen(x["cu_seqlens"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    outs = []
    for _ in range(2):
        o, ht, ctx = flashqla.chunk_gated_delta_rule_fwd(*args, initial_state=x["initial_state"],
                                                         output_final_state=True, cu_seqlens=x["cu_seqlens"],
                                                         varlen_meta=meta, backend=BACKEND)
        outs.append((o, ht) + tuple(flashqla.chunk_gated_delta_rule_bwd(ctx, x["do"], x["dht"])))
    ref = oracle(case, x, grads=True)
    for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), outs[0], outs[1]):
        assert torch.equal(a, b), f"{name} differs between two identical runs"
        tol = FWD_TOL if name in ("o", "ht") else GRAD_TOL
        assert rel_l2(a, ref[name]) <= tol, (name, rel_l2(a, ref[name]))


@contextlib.contextmanager
def _bounds_checked_interpreter():
    """Make the Triton interpreter check that every active lane of every load and store falls inside a
    tensor passed to the kernel (an out-of-bounds read would be silent here but NaN-poisoned on a GPU).
    Yields the list of violations.  Patches interpreter internals; skips if they are not there."""
    try:
        import numpy as np
        import triton.runtime.interpreter as interp
        ge, ib = interp.GridExecutor, interp.InterpreterBuilder
        orig = (ge._init_args_hst, ib.create_masked_load, ib.create_masked_store)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"interpreter internals changed: {exc}")
    ranges, found = [], []

    def init(self, args_dev, kwargs):
        args_hst, kwargs_hst = orig[0](self, args_dev, kwargs)
        ranges.clear()
        for a in list(args_hst) + list(kwargs_hst.values()):
            if isinstance(a, torch.Tensor):
                st = a.untyped_storage()
                ranges.append((st.data_ptr(), st.data_ptr() + st.nbytes(), getattr(self.fn, "__name__", "?")))
        return args_hst, kwargs_hst

    def check(ptrs, mask, what):
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        p = np.asarray(ptrs.data).astype(np.uint64).ravel()
        m = np.broadcast_to(np.asarray(mask.data).astype(bool), np.asarray(ptrs.data).shape).ravel()
        act = p[m]
        ok = np.zeros(act.shape, bool)
        for lo, hi, _ in ranges:
            ok |= (act >= lo) & (act + size <= hi)
        if not ok.all():
            found.append((ranges[0][2] if ranges else "?", what, int((~ok).sum())))

    def load(self, ptrs, mask, other, *a, **k):
        check(ptrs, mask, "load")
        return orig[1](self, ptrs, mask, other, *a, **k)

    def store(self, ptrs, value, mask, *a, **k):
        check(ptrs, mask, "store")
        return orig[2](self, ptrs, value, mask, *a, **k)

    ge._init_args_hst, ib.create_masked_load, ib.create_masked_store = init, load, store
    try:
        yield found
    finally:
        ge._init_args_hst, ib.create_masked_load, ib.create_masked_store = orig


@pytest.mark.skipif(CUDA, reason="interpreter check (CPU)")
@pytest.mark.parametrize("grads", [True, False], ids=["fwd_bwd", "inference_tb"])
@pytest.mark.parametrize("fuse", [0, 1], ids=["three_kernel", "fused_output"])
def test_no_out_of_bounds_access_in_interpreter(monkeypatch, fuse, grads):
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", f"fwd.fuse={fuse}" + ("" if grads else ",fwd.tb=1"))
    case = Case("bounds", 1, 2, 64, 64, seqlens=(0, 1, 65, 0, 2), l2norm=True)
    with _bounds_checked_interpreter() as violations:
        res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, DEV, grads=grads)
    assert not violations, f"out-of-bounds accesses (kernel, kind, lanes): {sorted(set(violations))}"
    assert res.ok, res.failures


# --- the inference forward in Tb form (ops.use_tb_forward) --------------------------------------------

TB_CASE = Case("tb", 1, 4, 64, 128, seqlens=(0, 1, 130, 0, 63), l2norm=True)   # GVA 1:4, h0 and ht


@contextlib.contextmanager
def _counting_preps(monkeypatch):
    """Counts the calls of ops.prep (w, u), ops.prep_tb (Tb only) and ops.prep_from_t (w, u from the kept
    inverse) made inside."""
    from flashqla.backends.triton import ops
    calls = {"prep": 0, "prep_tb": 0, "prep_from_t": 0}

    def counted(name):
        real = getattr(ops, name)

        def wrapper(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return wrapper

    for name in calls:
        monkeypatch.setattr(ops, name, counted(name))
    yield calls


@pytest.mark.parametrize("tune,l2", [("fwd.fuse=1", "separate"),
                                     pytest.param("fwd.fuse=1", "fused", marks=FUSED_L2_ON_CPU),
                                     ("fwd.fuse=0,state.bv=32,output.bv=64", "separate"),
                                     pytest.param("fwd.fuse=1,fused.t=1", "fused", marks=FUSED_L2_ON_CPU),
                                     ("fwd.fuse=0,state.t=1,state.bv=64", "separate"),
                                     ("fwd.fuse=0,state.bv=16", "separate")],
                         ids=["fused_output", "fused_output_l2_in_kernel", "three_kernel", "fused_output_transposed",
                              "three_kernel_transposed", "three_kernel_bv16"])
def test_tb_forward_matches_oracle(monkeypatch, tune, l2):
    # varlen with length-0 / length-1 sequences and a 63-token tail, GVA, h0 / ht, L2 norm; every state
    # kernel form (output fused or not, state transposed or not) and both places of the L2 norm
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", tune + ",fwd.tb=1")
    monkeypatch.setenv("FLASHQLA_TRITON_L2", l2)
    with _counting_preps(monkeypatch) as calls:
        res = run_case(flashqla.chunk_gated_delta_rule, TB_CASE, BACKEND, torch.float32, DEV, grads=False)
    assert calls == {"prep": 0, "prep_tb": 1, "prep_from_t": 0}
    assert all(e <= FWD_TOL for e in res.errors.values()), res.errors


@pytest.mark.parametrize("fuse", [1, 0], ids=["fused_output", "three_kernel"])
def test_tb_forward_strong_decay_without_h0(monkeypatch, fuse):
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", f"fwd.fuse={fuse},fwd.tb=1")
    case = Case("tb_strong", 1, 2, 64, 64, seqlens=(130, 7), gate="strong", h0=False)
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, DEV, grads=False)
    assert all(e <= FWD_TOL for e in res.errors.values()), res.errors


@pytest.mark.parametrize("fuse", [1, 0], ids=["fused_output", "three_kernel"])
def test_tb_forward_isolates_sequences(monkeypatch, fuse):
    # NaN in every input of the middle sequence: the sequences before (its chunk tail is padding that
    # lies over the NaN tokens) and after must come out exact, as if that sequence held zeros
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", f"fwd.fuse={fuse},fwd.tb=1")
    case = Case("tb_nan", 1, 2, 64, 64, seqlens=(70, 20, 33))
    x = make_inputs(case, torch.float32, DEV)
    bad = slice(70, 90)
    for n in ("q", "k", "v", "g", "beta"):
        x[n][:, bad] = 0.0
    ref = oracle(case, x, grads=False)
    for n in ("q", "k", "v", "g", "beta"):
        x[n][:, bad] = float("nan")
    with poisoned_outputs(DEV):
        o, ht = flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                initial_state=x["initial_state"], output_final_state=True,
                                                cu_seqlens=x["cu_seqlens"], backend=BACKEND)
    keep = torch.ones(case.tokens, dtype=torch.bool)
    keep[bad] = False
    assert rel_l2(o[:, keep], ref["o"][:, keep]) <= FWD_TOL
    assert rel_l2(ht[[0, 2]], ref["ht"][[0, 2]]) <= FWD_TOL


def test_training_forward_keeps_the_wu_path(monkeypatch):
    # the Tb form only when no backward follows (its o would differ in the last bits from the w/u
    # recompute the backward runs), with fwd.tb=1 (the default); fwd.tb=0 turns it off.  The training forward
    # keeps its inverse and the backward forms w / u from it (fwd.savet=1, the default)
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", "fwd.tb=1")
    case = Case("tb_switch", 1, 2, 64, 64, seqlens=(9, 5))
    x = make_inputs(case, torch.float32, DEV)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(initial_state=x["initial_state"], output_final_state=True, cu_seqlens=x["cu_seqlens"], backend=BACKEND)
    with _counting_preps(monkeypatch) as calls:
        leaves = [t.detach().clone().requires_grad_() for t in args]
        o, _ = flashqla.chunk_gated_delta_rule(*leaves, **kw)
        assert calls == {"prep": 1, "prep_tb": 0, "prep_from_t": 0}
        o.sum().backward()                                   # the backward: w / u from the kept inverse
        assert calls == {"prep": 1, "prep_tb": 0, "prep_from_t": 1}
        flashqla.chunk_gated_delta_rule_fwd(*args, **kw, for_backward=True)
        assert calls == {"prep": 2, "prep_tb": 0, "prep_from_t": 1}
        flashqla.chunk_gated_delta_rule_fwd(*args, **kw, for_backward=False)
        with torch.no_grad():
            flashqla.chunk_gated_delta_rule(*leaves, **kw)
        assert calls == {"prep": 2, "prep_tb": 2, "prep_from_t": 1}
        monkeypatch.setenv("FLASHQLA_TRITON_TUNE", "fwd.tb=0")
        flashqla.chunk_gated_delta_rule(*args, **kw)
        assert calls == {"prep": 3, "prep_tb": 2, "prep_from_t": 1}
        monkeypatch.setenv("FLASHQLA_TRITON_TUNE", "fwd.savet=0")
        leaves = [t.detach().clone().requires_grad_() for t in args]
        o, _ = flashqla.chunk_gated_delta_rule(*leaves, **kw)
        o.sum().backward()                                   # fwd.savet=0: the backward recomputes the inverse
        assert calls == {"prep": 5, "prep_tb": 2, "prep_from_t": 1}


def _grads_under_tunes(monkeypatch, case, dtype, tunes):
    """The gradients (dq, dk, dv, dg, dbeta, dh0) of one call on ``case`` with o and ht both in the loss, under
    each FLASHQLA_TRITON_TUNE setting of ``tunes`` (same inputs and upstream gradient for all)."""
    x = make_inputs(case, dtype, DEV)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(output_final_state=True, cu_seqlens=x["cu_seqlens"], use_qk_l2norm_in_kernel=case.l2norm,
              backend=BACKEND)
    do = torch.randn_like(x["v"])
    out = []
    for tune in tunes:
        monkeypatch.setenv("FLASHQLA_TRITON_TUNE", tune)
        leaves = [t.detach().clone().requires_grad_() for t in args]
        h0 = x["initial_state"].detach().clone().requires_grad_()
        o, ht = flashqla.chunk_gated_delta_rule(*leaves, initial_state=h0, **kw)
        out.append(torch.autograd.grad((o.float() * do.float()).sum() + ht.sum(), leaves + [h0]))
    return out


@pytest.mark.parametrize("fuse", [0, 1], ids=["three_kernel", "fused_output"])
def test_longest_first_order_changes_nothing_but_the_order(monkeypatch, fuse):
    # serial.order=1 (ops._serial_grid): the serial kernels launch the longest walks first through the meta's
    # walk_order; every program computes what it did before, so the outputs and gradients are bitwise those
    # of the 2-D grid (a wrong sequence, head or V-block mapping would show at once), inference and training
    case = Case("order", 1, 2, 64, 64, seqlens=(1, 130, 0, 65, 200), l2norm=True)
    x = make_inputs(case, torch.float32, DEV)
    meta = flashqla.prepare_varlen(x["cu_seqlens"])
    assert meta.walk_order.tolist() == [4, 1, 3, 0, 2]
    tunes = [f"serial.order={order},fwd.fuse={fuse}" for order in (0, 1)]
    outs = []
    for tune in tunes:
        monkeypatch.setenv("FLASHQLA_TRITON_TUNE", tune)
        with torch.no_grad():
            outs.append(flashqla.chunk_gated_delta_rule(
                x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True,
                cu_seqlens=x["cu_seqlens"], use_qk_l2norm_in_kernel=True, backend=BACKEND))
    outs = [list(o) + list(g) for o, g in zip(outs, _grads_under_tunes(monkeypatch, case, torch.float32, tunes))]
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("l2", ["separate", pytest.param("fused", marks=FUSED_L2_ON_CPU)])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
                         ids=["fp32", "bf16"])     # (the interpreter serves fp32 only)
def test_kept_inverse_backward_matches_recompute(monkeypatch, l2, dtype):
    # the backward from the forward's kept inverse (fwd.savet=1) against the one that recomputes it: the same
    # inverse in fp32 (its stored copy is fp32 for fp32 inputs), the w / u products unchanged, so the gradients
    # agree to rounding; in bf16 the stored inverse is rounded once more than the recomputed fp32 one
    monkeypatch.setenv("FLASHQLA_TRITON_L2", l2)
    case = Case("savet", 1, 2, 64, 64, seqlens=(70, 1, 33), l2norm=True)
    kept, recomputed = _grads_under_tunes(monkeypatch, case, dtype, ["fwd.savet=1", "fwd.savet=0"])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b, name in zip(kept, recomputed, ("dq", "dk", "dv", "dg", "dbeta", "dh0")):
        assert rel_l2(a.float(), b.float()) <= tol, (name, rel_l2(a.float(), b.float()))


@pytest.mark.parametrize("l2", ["separate", pytest.param("fused", marks=FUSED_L2_ON_CPU)])
@pytest.mark.parametrize("transposed", [0, 1])
def test_local_dv_backward_matches_in_loop(monkeypatch, l2, transposed):
    # the intra-chunk part of dv_new formed by the kept-inverse prep and completed in place by the state-gradient
    # kernel (bstate.ldv=1, the default) against the same part formed inside that kernel's serial loop
    # (bstate.ldv=0): the same products in fp32, so the gradients agree to rounding; a wrong mask, gate or
    # scale in either form, or a tile completed twice or not at all, would be far outside 1e-5
    monkeypatch.setenv("FLASHQLA_TRITON_L2", l2)
    case = Case("ldv", 1, 2, 64, 64, seqlens=(70, 1, 0, 33, 64), l2norm=True)
    local, in_loop = _grads_under_tunes(monkeypatch, case, torch.float32,
                                        [f"bstate.ldv={ldv},bstate.t={transposed}" for ldv in (1, 0)])
    for a, b, name in zip(local, in_loop, ("dq", "dk", "dv", "dg", "dbeta", "dh0")):
        assert rel_l2(a, b) <= 1e-5, (name, rel_l2(a, b))


# --- compile-only (no GPU): the real compiler, not the interpreter ----------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("dtype,head_dim,ones", [("bfloat16", 128, False), ("float16", 64, False),
                                                 ("float32", 128, False), ("bfloat16", 128, True)])
def test_kernels_compile_for_sm80_and_sm90(dtype, head_dim, ones):
    # every kernel with all features on, default launch configs; fails on a compile error or on more
    # shared memory than the smallest GPU of the family has (99 KB for sm_8x: sm_86 / sm_89).
    # ones: every integer argument Triton specializes set to 1, as a one-head launch compiles (a Python int
    # there, so `Hv.to(...)` broke the H200's Hv=1 case while the interpreter, wrapping every argument, passed)
    import subprocess
    import sys

    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("the triton wheel ships no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    arches = ["90"] if dtype == "float32" or ones else ["90", "80"]  # fp32 at 128 is refused on the 99 KB parts
    proc = subprocess.run([sys.executable, "-m", "flashqla.backends.triton.aot", "--arch", *arches,
                           "--dtype", dtype, "--head-dim", str(head_dim)] + (["--ones"] if ones else []),
                          capture_output=True, text=True, env=env, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


# --- GPU only ------------------------------------------------------------------------------------

GPU_CASES = [
    Case("gpu_dense", 2, 4, 128, 128, B=2, T=300),
    Case("gpu_varlen", 2, 8, 128, 128, seqlens=(0, 1, 65, 300, 129), l2norm=True),
    Case("gpu_gva_16_64", 16, 64, 128, 128, B=1, T=200, h0=False),
    Case("gpu_k64", 1, 2, 64, 64, seqlens=(200, 7), gate="strong"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_half_precision_forward_backward(case, dtype):
    # thresholds: flashqla.testing.TOLERANCES (o/ht 5e-3, dq/dk/dv/dh0 1e-2, dg/dbeta 2e-2)
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, dtype, "cuda", grads=True)
    assert res.ok, res.failures


@pytest.mark.gpu
@pytest.mark.parametrize("tune", ["fwd.fuse=1", "fwd.fuse=0", "fwd.fuse=0,state.bv=16"],
                         ids=["fused_output", "three_kernel", "three_kernel_bv16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_half_precision_tb_forward(case, dtype, tune, monkeypatch):
    # the inference forward (no grads: ops.use_tb_forward), to the forward tolerances of the w/u path
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", tune + ",fwd.tb=1")
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, dtype, "cuda", grads=False)
    assert res.ok, res.failures


@pytest.mark.gpu
@pytest.mark.parametrize("tune", ["fwd.fuse=0,state.t=1,state.bv=64,state.warps=4,bstate.t=1,bstate.bv=64",
                                  "fwd.fuse=1,fused.t=1,fused.bv=64,fused.warps=4,bstate.t=1"],
                         ids=["state_t", "fused_t"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_transposed_state_forward_backward(case, tune, monkeypatch):
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", tune)
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.bfloat16, "cuda", grads=True)
    assert res.ok, res.failures


@pytest.mark.gpu
@pytest.mark.parametrize("tune", ["bstate.bv=64", "bstate.bv=32,bstate.stages=3", "bstate.bv=32,bstate.stages=2",
                                  "bstate.ldv=0", "wy.warps=8,dqk.warps=8", "state.bv=32"],
                         ids=["bstate_bv64_8warps", "bstate_bv32_3stages", "bstate_bv32_2stages", "bstate_in_loop_dv",
                              "grads_8warps", "state_bv32"])
@pytest.mark.parametrize("case", GPU_CASES[1:3], ids=lambda c: c.name)
def test_gpu_backward_launch_forms(case, tune, monkeypatch):
    # every launch form ops._bstate_cfg / _grads_warps / _state_bv may pick (the small test cases get only the
    # few-program one by default: BV 16 walks, 4-warp gradient kernels), and the in-loop intra-chunk dv_new,
    # against the oracle in bf16
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", tune)
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.bfloat16, "cuda", grads=True)
    assert res.ok, res.failures


@pytest.mark.gpu
def test_gpu_fp32_forward_backward():
    case = Case("gpu_fp32", 2, 4, 128, 128, seqlens=(1, 100, 200), l2norm=True)
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, "cuda", grads=True)
    for n, e in res.errors.items():
        assert e <= (FWD_TOL if n in ("o", "ht") else GRAD_TOL), (n, e)


@pytest.mark.gpu
def test_gpu_cuda_graph_forward_backward():
    case = Case("graph", 2, 4, 128, 128, seqlens=(0, 1, 65, 300), l2norm=True)
    x = make_inputs(case, torch.bfloat16, "cuda")
    meta = flashqla.prepare_varlen(x["cu_seqlens"])
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]

    def run():
        o, ht = flashqla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"],
                                                varlen_meta=meta, backend=BACKEND)
        grads = torch.autograd.grad([o, ht], leaves, [x["do"], x["dht"]])
        return (o.detach(), ht.detach()) + tuple(grads)

    warm_up_for_capture(run)  # compilation outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    with torch.no_grad():
        leaves[2].mul_(0.5)  # new values in the captured input buffers
    graph.replay()
    eager = run()
    torch.cuda.synchronize()
    # deterministic kernels: replay and eager agree bit for bit
    for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), captured, eager):
        assert torch.equal(a, b), name
        assert not math.isnan(a.float().sum().item()), name


# --- GPU diagnosis of the non-finite gpu_varlen result seen on the H200 (run 2, 2026-12-02) -----------

def _nonfinite_where(name, t, cu=None, per_chunk=False):
    """A short description of where ``t`` is not finite (token ranges / chunk ids, heads)."""
    bad = ~torch.isfinite(t.float())
    if not bad.any():
        return None
    idx = bad.nonzero().cpu()
    if per_chunk:                      # [chunks, Hv, ...]
        return f"{name}: {int(bad.sum())} non-finite, chunks {sorted(set(idx[:, 0].tolist()))[:12]}, " \
               f"heads {sorted(set(idx[:, 1].tolist()))[:12]}"
    toks = sorted(set(idx[:, 1].tolist()))
    seqs = sorted(set(int(torch.searchsorted(cu.cpu(), torch.tensor(x), right=True)) - 1 for x in toks)) \
        if cu is not None else None
    return f"{name}: {int(bad.sum())} non-finite, tokens {toks[:6]}..{toks[-3:]}, sequences {seqs}, " \
           f"heads {sorted(set(idx[:, 2].tolist()))[:12]}"


@pytest.mark.gpu
def test_gpu_diagnose_short_sequences(monkeypatch, capsys):
    """Stage-by-stage finiteness and a feature bisection for the case that failed on the H200.

    Prints a table (run with -s); fails if any configuration gives non-finite values, naming it.
    """
    from flashqla.backends.triton import ops

    lines, failing = [], []
    base = dict(Hqk=2, Hv=8, K=128, V=128)
    variants = [("as failed", dict(seqlens=(0, 1, 65, 300, 129), l2norm=True)),
                ("no l2norm", dict(seqlens=(0, 1, 65, 300, 129), l2norm=False)),
                ("no h0", dict(seqlens=(0, 1, 65, 300, 129), l2norm=True, h0=False)),
                ("no len-0/1 seqs", dict(seqlens=(65, 300, 129), l2norm=True)),
                ("no len-0 seq", dict(seqlens=(1, 65, 300, 129), l2norm=True)),
                ("no len-1 seq", dict(seqlens=(0, 65, 300, 129), l2norm=True)),
                ("no 1-token chunk", dict(seqlens=(0, 2, 66, 300, 130), l2norm=True))]
    tunes = ["", "fwd.fuse=0", "fwd.fuse=1", "fused.stages=1,state.stages=1,bstate.stages=1",
             "prep.stages=1,dqk.stages=1,wy.stages=1,output.stages=1"]
    for tune_str in tunes:
        monkeypatch.setenv("FLASHQLA_TRITON_TUNE", tune_str)
        for label, kw in variants:
            case = Case(f"diag-{label}", base["Hqk"], base["Hv"], base["K"], base["V"], **kw)
            res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.bfloat16, "cuda", grads=True)
            bad = sorted(n for n, e in res.errors.items() if not math.isfinite(e))
            lines.append(f"tune={tune_str or 'default':<58} {label:<18} ok={res.ok!s:<5} "
                         f"non-finite={bad} max err={max(res.errors.values()):.2e}")
            if not res.ok:
                failing.append((tune_str, label, res.failures))

    # stage by stage, default configuration, the failing inputs
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", "")
    case = Case("diag", 2, 8, 128, 128, seqlens=(0, 1, 65, 300, 129), l2norm=True)
    x = make_inputs(case, torch.bfloat16, "cuda")
    meta = flashqla.prepare_varlen(x["cu_seqlens"])
    cu = x["cu_seqlens"]
    # the kernels as the op runs them: with the L2 norm inside only in the "fused" mode (see ops.l2_mode)
    fused = ops.l2_mode() == "fused"
    qq, kk = (x["q"], x["k"]) if fused else (ops._l2_normalise(x["q"]), ops._l2_normalise(x["k"]))
    with poisoned_outputs("cuda"):
        geo = ops.Geometry(qq, x["v"], meta)
        w, u, G, Tm = ops.prep(geo, kk, x["v"], x["g"], x["beta"], fused, store_t=True)
        w2, u2, G2, _ = ops.prep(geo, kk, x["v"], x["g"], x["beta"], fused, store_t=False)
        h, vn, ht_u = ops.state_fwd(geo, qq, kk, w, u, G, x["initial_state"], True, fused)
        o_u = ops.output(geo, qq, kk, G, h, vn, 128 ** -0.5, fused, torch.bfloat16)
        o_f, _, ht_f = ops.state_fwd(geo, qq, kk, w, u, G, x["initial_state"], True, fused,
                                     128 ** -0.5, fuse_output=True)
        dh, dvn, dh0 = ops.state_bwd(geo, qq, kk, w, G, x["do"], x["dht"], True, 128 ** -0.5, fused)
        dq, dk, dv, dbeta, dg = ops.grads(geo, qq, kk, x["v"], x["beta"], G, Tm, w, u, h, [dh], vn, dvn,
                                          x["do"], 128 ** -0.5, fused)
        torch.cuda.synchronize()
    stages = [("prep(store_t) w", w, False), ("prep(store_t) u", u, False), ("prep Tinv", Tm, True),
              ("prep(fwd) w", w2, False), ("prep(fwd) u", u2, False), ("state h", h, True),
              ("state v_new", vn, False), ("output o (3-kernel)", o_u, False), ("fused o", o_f, False),
              ("bwd state dh", dh, True), ("bwd state dv_new", dvn, False), ("dq", dq, False),
              ("dk", dk, False), ("dv", dv, False), ("dbeta", dbeta.unsqueeze(-1), False),
              ("dg", dg.unsqueeze(-1), False)]
    for name, t, per_chunk in stages:
        where = _nonfinite_where(name, t, cu, per_chunk)
        lines.append(where or f"{name}: finite")
    for name, t in (("ht (3-kernel)", ht_u), ("ht (fused)", ht_f), ("dh0", dh0), ("G planes", G)):
        lines.append(f"{name}: {'finite' if torch.isfinite(t).all() else 'NON-FINITE'}")
    lines.append(f"w store_t vs fwd equal: {torch.equal(w, w2)}, u: {torch.equal(u, u2)}, G: {torch.equal(G, G2)}")
    lines.append(f"o fused vs 3-kernel max diff: {(o_f.float() - o_u.float()).abs().max().item():.3e}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert not failing, f"configurations with errors over tolerance: {failing}"
