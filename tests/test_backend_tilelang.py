"""Tests of the TileLang (Hopper) backend.

* CPU: a PyTorch emulation of exactly the per-chunk steps the kernels do (same masking of rows past a
  sequence end, same folded scalings, same 16-bit rounding points) against the float64 oracle:
  in float64 it must match to round-off (the algebra of the decomposition), with 16-bit rounding it
  must sit inside the bf16/fp16 tolerances with margin (the precision plan).
* ``compile``: every kernel variant lowers for ``{"kind": "cuda", "arch": "sm_90a"}`` without a GPU,
  and the generated source uses wgmma and TMA.
* ``gpu``: the backend itself against the oracle (skips without CUDA / sm_90).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess

import pytest
import torch

import flashqla
from flashqla.reference import recurrent_gated_delta_rule_ref
from flashqla.testing import TOLERANCES, Case, make_inputs, oracle, rel_l2, run_case, standard_cases

C = 64
HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None


# ----------------------------------------------------------------------------------------------------
# Emulation of the kernels' per-chunk steps
# ----------------------------------------------------------------------------------------------------

def _rnd(x, dt):
    """Round to the kernels' 16-bit operand dtype (identity for float64 emulation)."""
    return x if dt is None else x.to(dt).to(x.dtype)


def emulate_forward(q, k, v, g, beta, scale, h0, cu, l2norm, dt, save=False):
    """Mirror of chunk_intra_sm90 + chunk_fwd_sm90.  ``dt``: the 16-bit dtype whose rounding points are
    emulated (None: exact, in the compute dtype of the inputs).  Returns (o, ht[, saved])."""
    cd = torch.float64 if dt is None else torch.float32
    B, Tn, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    ratio = Hv // Hqk
    cu = [b * Tn for b in range(B + 1)] if cu is None else [int(x) for x in cu]
    NT = B * Tn
    q, k = (x.reshape(NT, Hqk, K).to(cd).repeat_interleave(ratio, 1) for x in (q, k))
    v = v.reshape(NT, Hv, V).to(cd)
    g = g.reshape(NT, Hv).to(cd)
    beta = beta.reshape(NT, Hv).to(cd)
    N = len(cu) - 1
    o = torch.full((NT, Hv, V), float("nan"), dtype=cd)
    ht = torch.empty(N, Hv, K, V, dtype=cd)
    idx = torch.arange(C)
    strict = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    eye = torch.eye(C, dtype=cd)
    saved = []
    for n in range(N):
        S = h0[n].to(cd).clone() if h0 is not None else torch.zeros(Hv, K, V, dtype=cd)
        nch = (cu[n + 1] - cu[n] + C - 1) // C
        for ci in range(nch):
            bos, eos = cu[n] + ci * C, cu[n + 1]
            rows = torch.arange(bos, bos + C)
            valid = rows < eos                      # rows past the end of this sequence
            inb = rows < NT                         # rows past the tensor: TMA zero fill
            rr = rows.clamp(max=NT - 1)
            # [H, C, *]: rows past eos read the *next* sequence's q/k/v, as the kernels' tiles do
            kc = torch.where(inb[:, None, None], k[rr], 0.).transpose(0, 1)
            qc = torch.where(inb[:, None, None], q[rr], 0.).transpose(0, 1)
            vc = torch.where(inb[:, None, None], v[rr], 0.).transpose(0, 1)
            gc = torch.where(valid[:, None], g[rr], 0.).T
            bc = torch.where(valid[:, None], beta[rr], 0.).T
            if l2norm:
                nk = torch.rsqrt((kc * kc).sum(-1) + 1e-6)
                nq = torch.rsqrt((qc * qc).sum(-1) + 1e-6)
            else:
                nk = torch.ones(Hv, C, dtype=cd)
                nq = torch.ones(Hv, C, dtype=cd)
            # ---- chunk_intra_sm90
            G = gc.cumsum(-1)
            KK = kc @ kc.transpose(-1, -2)
            A = torch.where(strict, KK * (nk[:, :, None] * nk[:, None, :]) * bc[:, :, None]
                            * torch.exp(G[:, :, None] - G[:, None, :]), 0.)
            X = torch.linalg.solve_triangular(eye + A, eye.expand(Hv, C, C), upper=False,
                                              unitriangular=True)
            Xw = _rnd(X * (bc * torch.exp(G) * nk)[:, None, :], dt)
            Xu = _rnd(X * bc[:, None, :], dt)
            w = _rnd(Xw @ kc, dt)
            u = _rnd(Xu @ vc, dt)
            # ---- chunk_fwd_sm90
            Sb = _rnd(S, dt)
            vn = torch.where(valid[None, :, None], u - w @ Sb, 0.)
            vnb = _rnd(vn, dt)
            P = _rnd(torch.where(incl[None], (qc @ kc.transpose(-1, -2)) * (nq[:, :, None] * nk[:, None, :])
                                 * torch.exp(G[:, :, None] - G[:, None, :]), 0.), dt)
            oc = scale * ((qc @ Sb) * (nq * torch.exp(G))[:, :, None] + P @ vnb)
            nv = int(valid.sum())
            o[bos:bos + nv] = _rnd(oc[:, :nv], dt).transpose(0, 1)
            GC = G[:, -1]
            vd = _rnd(vn * (nk * torch.exp(GC[:, None] - G))[:, :, None], dt)
            if save:
                saved.append(dict(n=n, bos=bos, eos=eos, G=G, X=X, w=w, u=u, h=Sb, v_new=vnb))
            S = torch.exp(GC)[:, None, None] * S + kc.transpose(-1, -2) @ vd
        ht[n] = S
    o = o.reshape(B, Tn, Hv, V)
    return (o, ht, saved) if save else (o, ht)


def _emulation_errors(case, dtype, emu_dt):
    inp = make_inputs(case, dtype)
    ref = oracle(case, inp, grads=False)
    scale = case.scale if case.scale is not None else case.K ** -0.5
    h0 = inp["initial_state"]
    o, ht = emulate_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, h0,
                            inp["cu_seqlens"], case.l2norm, emu_dt)
    errs = {"o": rel_l2(o, ref["o"])}
    if case.ht:
        errs["ht"] = rel_l2(ht, ref["ht"])
    return errs


_EMU_CASES = [c for c in standard_cases(128, 128) if c.name not in ("gva_16_64",)] + [
    Case("gate_minus_1e4", 1, 2, 128, 128, seqlens=(70, 5), gate="strong"),
]


@pytest.mark.parametrize("case", _EMU_CASES, ids=lambda c: c.name)
def test_emulation_exact_math(case):
    """The decomposition (masking, folded scalings, UT inverse, fused output) is exact in float64."""
    errs = _emulation_errors(case, torch.float64, None)
    assert all(e < 1e-10 for e in errs.values()), errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [c for c in _EMU_CASES if c.name in (
    "dense_h0_ht", "varlen_odd", "varlen_l2norm", "strong_decay", "no_decay", "gva_2_8")], ids=lambda c: c.name)
def test_emulation_precision_plan(case, dtype):
    """With the kernels' 16-bit rounding points the error stays well inside the tolerances."""
    errs = _emulation_errors(case, dtype, dtype)
    tol = TOLERANCES[str(dtype).replace("torch.", "")]
    for name, e in errs.items():
        assert e <= 0.85 * tol[name], (name, e, tol[name])


def test_emulation_strong_gate_is_finite():
    """g = -1e4 on every token: outputs finite and equal to the oracle."""
    case = Case("g_1e4", 1, 2, 128, 128, seqlens=(70, 1, 64))
    inp = make_inputs(case, torch.bfloat16)
    inp["g"] = torch.full_like(inp["g"], -1e4)
    ref = recurrent_gated_delta_rule_ref(*(inp[n].double() for n in ("q", "k", "v", "g", "beta")),
                                         initial_state=inp["initial_state"].double(), output_final_state=True,
                                         cu_seqlens=inp["cu_seqlens"])
    o, ht = emulate_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 128 ** -0.5,
                            inp["initial_state"], inp["cu_seqlens"], False, torch.bfloat16)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_l2(o, ref[0]) < 5e-3 and rel_l2(ht, ref[1]) < 5e-3


# ----------------------------------------------------------------------------------------------------
# Compile-only tests (no GPU needed)
# ----------------------------------------------------------------------------------------------------

def _cuobjdump():
    try:
        import triton
        p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(p):
            return p
    except Exception:
        pass
    for d in ("/usr/local/cuda/bin",):
        p = os.path.join(d, "cuobjdump")
        if os.path.exists(p):
            return p
    return None


def resource_usage(kernel) -> str:
    """Registers / spills of a compiled kernel, from the cubin TileLang embeds (best effort)."""
    tool = _cuobjdump()
    path = getattr(kernel.adapter, "libpath", None)
    if path is None and getattr(kernel, "_tilelang_cache_path", None):
        path = os.path.join(kernel._tilelang_cache_path, "executable.so")
    if tool is None or path is None or not os.path.exists(path):
        return "resource usage unavailable"
    blob = open(path, "rb").read()
    offs = [m.start() for m in re.finditer(b"\x7fELF", blob)][1:]
    if not offs:
        return "resource usage unavailable (no embedded cubin)"
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(blob[offs[0]:])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(line.strip() for line in out.splitlines() if "REG" in line) or "no resource line"


def _fwd_variants():
    out = []
    # (kind, builder args) covering every flag both ways and both dtypes
    for dt in ("bfloat16", "float16"):
        out.append(("intra", (dt, dt, 128, 128, False, False)))
    out.append(("intra", ("bfloat16", "float32", 128, 128, True, True)))
    out.append(("intra", ("float16", "bfloat16", 128, 128, True, False)))
    for dt, l2, h0, ht, save in [("bfloat16", False, False, False, False),
                                 ("bfloat16", True, True, True, True),
                                 ("float16", True, False, True, False),
                                 ("float16", False, True, False, True)]:
        out.append(("fwd", (dt, 128, 128, 64, l2, h0, ht, save)))
    return out


@pytest.mark.compile
@pytest.mark.parametrize("kind,args", _fwd_variants(), ids=lambda x: str(x).replace(" ", ""))
def test_forward_kernels_lower_for_sm90a(kind, args):
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang
    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_fwd_sm90 import build_fwd
    from flashqla.backends.tilelang.chunk_intra_sm90 import build_intra

    builder = {"intra": build_intra, "fwd": build_fwd}[kind]
    kern = tilelang.compile(builder(*args), out_idx=None, target=TARGET)
    src = kern.get_kernel_source()
    assert "wgmma" in src, "no wgmma in the generated source"
    assert "tma_load" in src or "cp.async.bulk.tensor" in src, "no TMA load in the generated source"
    print(f"{kind}{args}: {resource_usage(kern)}")
    if kind == "fwd":
        # warp-specialised: a producer branch with setmaxnreg on the consumer side
        assert "warpgroup_reg_alloc" in src or "setmaxnreg" in src


def test_backend_registered_and_rejects_cpu():
    from flashqla.dispatch import get_backend
    from flashqla.dispatch.device import fake_device

    be = get_backend("tilelang")
    assert be.priorities == {"sm_90": 30}
    x = make_inputs(Case("d", 1, 2, 128, 128, B=1, T=10), torch.bfloat16)
    d = flashqla.explain(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert "tilelang" in d.reasons()
    with fake_device("cuda", (9, 0)):
        spec = flashqla.explain(x["q"], x["k"], x["v"], x["g"], x["beta"]).spec
    ok, why = be.supports(spec)
    assert ok, why
    with fake_device("cuda", (8, 0)):
        spec80 = flashqla.explain(x["q"], x["k"], x["v"], x["g"], x["beta"]).spec
    ok, why = be.supports(spec80)
    assert not ok and "sm_90" in why
    x64 = make_inputs(Case("d", 1, 2, 64, 64, B=1, T=10), torch.bfloat16)
    with fake_device("cuda", (9, 0)):
        spec64 = flashqla.explain(x64["q"], x64["k"], x64["v"], x64["g"], x64["beta"]).spec
    ok, why = be.supports(spec64)
    assert not ok and "128" in why
    x32 = make_inputs(Case("d", 1, 2, 128, 128, B=1, T=10), torch.float32)
    with fake_device("cuda", (9, 0)):
        spec32 = flashqla.explain(x32["q"], x32["k"], x32["v"], x32["g"], x32["beta"]).spec
    ok, why = be.supports(spec32)
    assert not ok and "bfloat16" in why


# ----------------------------------------------------------------------------------------------------
# GPU tests (an H200 / H100 runs them)
# ----------------------------------------------------------------------------------------------------

def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")


def _gpu_case(case, dtype=torch.bfloat16, grads=False, seed=0):
    res = run_case(flashqla.chunk_gated_delta_rule, case, "tilelang", dtype, "cuda", grads=grads,
                   exact_fp32=False, seed=seed)
    print(case.name, str(dtype), {k: f"{v:.2e}" for k, v in res.errors.items()})
    assert res.ok, f"{case.name}: {res.failures} (all {res.errors})"
    return res


_GPU_FWD_CASES = [
    Case("dense_h0_ht", 2, 4, 128, 128, B=2, T=300),
    Case("dense_no_state", 2, 4, 128, 128, B=2, T=129, h0=False, ht=False),
    Case("varlen_len1_tail", 1, 2, 128, 128, seqlens=(1, 63, 64, 65, 200, 0, 7)),
    Case("varlen_l2norm", 2, 4, 128, 128, seqlens=(33, 0, 390), l2norm=True),
    Case("strong_decay", 1, 2, 128, 128, seqlens=(520, 7), gate="strong"),
    Case("no_decay", 1, 2, 128, 128, B=1, T=360, gate="zero"),
    Case("single_token", 1, 2, 128, 128, B=3, T=1),
    Case("gva_4_16", 4, 16, 128, 128, B=1, T=132),
    Case("gva_16_64", 16, 64, 128, 128, seqlens=(68, 20), h0=False),
    Case("scale", 1, 1, 128, 128, B=1, T=64, scale=0.3),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", _GPU_FWD_CASES, ids=lambda c: c.name)
def test_gpu_forward_matches_oracle(case):
    _gpu_case(case, torch.bfloat16)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", [c for c in _GPU_FWD_CASES if c.name in ("dense_h0_ht", "varlen_l2norm",
                                                                         "gva_4_16")], ids=lambda c: c.name)
def test_gpu_forward_fp16(case):
    _gpu_case(case, torch.float16)


@pytest.mark.gpu
@needs_sm90
def test_gpu_gate_minus_1e4_finite():
    case = Case("g1e4", 1, 2, 128, 128, seqlens=(130, 1, 64))
    inp = make_inputs(case, torch.bfloat16, "cuda")
    g = inp["g"].clone()
    g[:, ::3] = -1e4
    ref = recurrent_gated_delta_rule_ref(*(inp[n].cpu().double() for n in ("q", "k", "v")), g.cpu().double(),
                                         inp["beta"].cpu().double(), initial_state=inp["initial_state"].cpu().double(),
                                         output_final_state=True, cu_seqlens=inp["cu_seqlens"].cpu())
    o, ht = flashqla.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], g, inp["beta"],
                                            initial_state=inp["initial_state"], output_final_state=True,
                                            cu_seqlens=inp["cu_seqlens"], backend="tilelang")
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_l2(o, ref[0]) <= 5e-3 and rel_l2(ht, ref[1]) <= 5e-3


@pytest.mark.gpu
@needs_sm90
def test_gpu_beta_dtypes_and_auto_dispatch():
    case = Case("beta_f32", 2, 4, 128, 128, seqlens=(100, 37))
    inp = make_inputs(case, torch.bfloat16, "cuda")
    ref = oracle(case, inp, grads=False)
    for bdt in (torch.float32, torch.float16, torch.float64):
        o, ht = flashqla.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"].to(bdt),
                                                initial_state=inp["initial_state"], output_final_state=True,
                                                cu_seqlens=inp["cu_seqlens"], backend="tilelang")
        assert rel_l2(o, ref["o"]) <= 5e-3 and rel_l2(ht, ref["ht"]) <= 5e-3, bdt
    d = flashqla.explain(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], cu_seqlens=inp["cu_seqlens"],
                         needs_grad=False)
    assert d.chosen == "tilelang", str(d)


@pytest.mark.gpu
@needs_sm90
def test_gpu_new_length_does_not_recompile():
    from flashqla.backends.tilelang import _compile

    case = Case("len_a", 2, 4, 128, 128, seqlens=(100, 37))
    _gpu_case(case)
    n0 = _compile.compile_count()
    _gpu_case(Case("len_b", 2, 4, 128, 128, seqlens=(300, 5, 77, 1)))
    _gpu_case(Case("len_c", 2, 4, 128, 128, seqlens=(1000,)), seed=1)
    assert _compile.compile_count() == n0, "a new sequence length compiled again"
    # a different head count and batch layout also reuse the kernels
    _gpu_case(Case("heads", 4, 8, 128, 128, seqlens=(64, 65)))
    assert _compile.compile_count() == n0
