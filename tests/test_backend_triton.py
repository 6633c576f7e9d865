"""Backend "triton": its own checks beyond the shared suite (tests/test_correctness.py).

Without a CUDA device the kernels run in Triton's interpreter on the CPU (fp32 inputs only, small
shapes: the interpreter is slow).  TRITON_INTERPRET must be set before any triton kernel module is
imported; tests/conftest.py does it too, this module does it again so it also runs on its own.
GPU-only tests (bf16/fp16 tolerances, CUDA-graph capture) carry the ``gpu`` marker.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import flashqla  # noqa: E402
from flashqla.dispatch import fake_device, get_backend  # noqa: E402
from flashqla.testing import Case, make_inputs, oracle, poisoned_outputs, rel_l2, run_case  # noqa: E402
from flashqla.validation import validate  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
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
def test_gpu_half_precision_forward(case, dtype):
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, dtype, "cuda", grads=False)
    assert res.ok, res.failures


@pytest.mark.gpu
def test_gpu_fp32_forward():
    case = Case("gpu_fp32", 2, 4, 128, 128, seqlens=(1, 100, 200))
    res = run_case(flashqla.chunk_gated_delta_rule, case, BACKEND, torch.float32, "cuda", grads=False)
    assert all(e <= FWD_TOL for e in res.errors.values()), res.errors


@pytest.mark.gpu
def test_gpu_cuda_graph_forward():
    case = Case("graph", 2, 4, 128, 128, seqlens=(0, 1, 65, 300))
    x = make_inputs(case, torch.bfloat16, "cuda")
    meta = flashqla.prepare_varlen(x["cu_seqlens"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])

    def run():
        return flashqla.chunk_gated_delta_rule(*args, initial_state=x["initial_state"], output_final_state=True,
                                               cu_seqlens=x["cu_seqlens"], varlen_meta=meta, backend=BACKEND)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # warm-up (compilation) outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, ht_g = run()
    x["v"].mul_(0.5)  # new values in the captured input buffers
    graph.replay()
    o_eager, ht_eager = run()
    torch.cuda.synchronize()
    # deterministic kernels: replay and eager agree bit for bit
    assert torch.equal(o_g, o_eager) and torch.equal(ht_g, ht_eager)
    assert not math.isnan(o_g.float().sum().item())
