"""The shared correctness suite: every backend available on this machine against the float64 oracle.

Each profile is (backend, device, dtype, head dim); each case (flashqla.testing.standard_cases) covers
varlen with length-0/1/odd sequences, GVA grids scaled down in T, initial/final state on and off, the fused
L2 norm, strong and zero decay.  Outputs are poisoned with NaN before every call.  Thresholds: the one
table flashqla.testing.TOLERANCES.
"""

from __future__ import annotations

import os

import pytest
import torch

import flashqla
from flashqla.dispatch import get_backend
from flashqla.testing import run_case, standard_cases

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (backend, device, dtype, head dim, exact fp32 math?, case subset or None for all)
_INTERPRETER_CASES = {"dense_h0_ht", "varlen_odd", "varlen_l2norm", "strong_decay", "gva_2_8", "single_token"}
PROFILES = [
    ("reference", "cpu", torch.float64, 64, True, None),
    ("reference", "cpu", torch.float32, 64, True, None),
    ("cpu", "cpu", torch.float32, 64, True, None),
    ("cpu", "cpu", torch.bfloat16, 64, True, None),
]
if CUDA:
    PROFILES += [
        ("triton", "cuda", torch.bfloat16, 128, False, None),
        ("triton", "cuda", torch.float16, 64, False, None),
        ("tilelang", "cuda", torch.bfloat16, 128, False, None),
        ("cutlass", "cuda", torch.bfloat16, 128, False, None),
    ]
elif INTERPRET:
    PROFILES.append(("triton", "cpu", torch.float32, 64, True, _INTERPRETER_CASES))


def _params():
    out = []
    for name, dev, dt, d, exact, subset in PROFILES:
        for case in standard_cases(d, d, long=(dev == "cuda")):
            if subset is not None and case.name not in subset:
                continue
            pid = f"{name}-{dev}-{str(dt).replace('torch.', '')}-{case.name}"
            marks = [pytest.mark.gpu] if dev == "cuda" else []
            out.append(pytest.param(name, dev, dt, exact, case, id=pid, marks=marks))
    return out


@pytest.mark.parametrize("backend,device,dtype,exact,case", _params())
def test_backend_matches_oracle(backend, device, dtype, exact, case):
    be = get_backend(backend)
    ok, why = be.available()
    if not ok:
        pytest.skip(f"backend {backend} not available here: {why}")
    res = run_case(flashqla.chunk_gated_delta_rule, case, backend, dtype, device,
                   grads=be.has_backward, exact_fp32=exact)
    assert res.ok, f"{backend} {case.name} {res.dtype}: errors over tolerance {res.failures} (all: {res.errors})"
