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


def emulate_backward(q, k, v, g, beta, scale, h0, cu, l2norm, dt, do, dht, saved):
    """Mirror of chunk_bwd_state_sm90 + chunk_bwd_dqk_v2_sm90 + chunk_bwd_wy_v2_sm90, fed with the forward
    emulation's saved chunk quantities.  Returns (dq, dk, dv, dg, dbeta, dh0)."""
    cd = torch.float64 if dt is None else torch.float32
    B, Tn, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    ratio = Hv // Hqk
    cu = [b * Tn for b in range(B + 1)] if cu is None else [int(x) for x in cu]
    NT = B * Tn
    qr, kr = (x.reshape(NT, Hqk, K).to(cd).repeat_interleave(ratio, 1) for x in (q, k))
    vr = v.reshape(NT, Hv, V).to(cd)
    br = beta.reshape(NT, Hv).to(cd)
    dor = do.reshape(NT, Hv, V).to(cd)
    N = len(cu) - 1
    dq = torch.zeros(NT, Hv, K, dtype=cd); dk = torch.zeros(NT, Hv, K, dtype=cd)
    dv = torch.zeros(NT, Hv, V, dtype=cd); dg = torch.zeros(NT, Hv, dtype=cd); db = torch.zeros(NT, Hv, dtype=cd)
    dh0 = torch.zeros(N, Hv, K, V, dtype=cd)
    idx = torch.arange(C)
    strict = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    by_seq = {}
    for s in saved:
        by_seq.setdefault(s["n"], []).append(s)
    R = lambda x: _rnd(x, dt)
    for n in range(N):
        chunks = by_seq.get(n, [])
        dS = dht[n].to(cd).clone() if dht is not None else torch.zeros(Hv, K, V, dtype=cd)
        per_chunk = []
        # ---- BK2: serial reverse
        for ch in reversed(chunks):
            bos, eos, G = ch["bos"], ch["eos"], ch["G"]
            rows = torch.arange(bos, bos + C); valid = rows < eos; inb = rows < NT; rr = rows.clamp(max=NT - 1)
            kc = torch.where(inb[:, None, None], kr[rr], 0.).transpose(0, 1)
            qc = torch.where(inb[:, None, None], qr[rr], 0.).transpose(0, 1)
            doc = torch.where(inb[:, None, None], dor[rr], 0.).transpose(0, 1)
            if l2norm:
                nk = torch.rsqrt((kc * kc).sum(-1) + 1e-6); nq = torch.rsqrt((qc * qc).sum(-1) + 1e-6)
            else:
                nk = torch.ones(Hv, C, dtype=cd); nq = torch.ones(Hv, C, dtype=cd)
            GC = G[:, -1]
            D = torch.exp(GC[:, None] - G)
            dSb = R(dS)
            # Pt[j, r] = k_j . q_r * nk_j nq_r exp(G_r - G_j), r >= j, r valid
            Pt = (kc @ qc.transpose(-1, -2)) * (nk[:, :, None] * nq[:, None, :]) * torch.exp(G[:, None, :] - G[:, :, None])
            Pt = R(torch.where((incl.T)[None] & valid[None, None, :], Pt * scale, 0.))
            acc1 = kc @ dSb
            acc2 = Pt @ doc
            dvn = torch.where(valid[None, :, None], acc2 + (D * nk)[:, :, None] * acc1, 0.)
            dvnb = R(dvn)
            dOs = R(torch.where(valid[None, :, None], doc * (scale * nq * torch.exp(G))[:, :, None], 0.))
            dS_prev = torch.exp(GC)[:, None, None] * dS + qc.transpose(-1, -2) @ dOs + ch["w"].transpose(-1, -2) @ R(-dvn)
            per_chunk.append(dict(ch=ch, dSb=dSb, dvnb=dvnb))
            dS = dS_prev
        dh0[n] = dS
        # ---- BK3a / BK3b: parallel per chunk
        for pc in per_chunk:
            ch, dSb, dvnb = pc["ch"], pc["dSb"], pc["dvnb"]
            bos, eos, G, S, vn, X, w = ch["bos"], ch["eos"], ch["G"], ch["h"], ch["v_new"], ch["X"], ch["w"]
            rows = torch.arange(bos, bos + C); valid = rows < eos; inb = rows < NT; rr = rows.clamp(max=NT - 1)
            kc = torch.where(inb[:, None, None], kr[rr], 0.).transpose(0, 1)
            qc = torch.where(inb[:, None, None], qr[rr], 0.).transpose(0, 1)
            vc = torch.where(inb[:, None, None], vr[rr], 0.).transpose(0, 1)
            doc = torch.where(valid[:, None, None], dor[rr], 0.).transpose(0, 1)   # dO rows past eos masked
            bc = torch.where(valid[:, None], br[rr], 0.).T
            if l2norm:
                nk = torch.rsqrt((kc * kc).sum(-1) + 1e-6); nq = torch.rsqrt((qc * qc).sum(-1) + 1e-6)
            else:
                nk = torch.ones(Hv, C, dtype=cd); nq = torch.ones(Hv, C, dtype=cd)
            GC = G[:, -1]; Gam = torch.exp(G); D = torch.exp(GC[:, None] - G)
            Gd = G[:, :, None] - G[:, None, :]
            E = torch.exp(torch.where(incl[None], Gd, -float('inf')))
            # 3a
            dOSt = doc @ S.transpose(-1, -2)                      # [C, K]
            dPm = scale * (doc @ vn.transpose(-1, -2))            # [C, C]
            QK = qc @ kc.transpose(-1, -2)
            Pm = torch.where(incl[None], QK * (nq[:, :, None] * nk[:, None, :]) * E, 0.)
            dQK = torch.where(incl[None], dPm * E, 0.)
            dqh = scale * Gam[:, :, None] * dOSt + R(dQK * nk[:, None, :]) @ kc
            vdS = vn @ dSb.transpose(-1, -2)                      # [C, K]
            dkh = R(dQK * nq[:, :, None]).transpose(-1, -2) @ qc + D[:, :, None] * vdS
            dw = R(-(dvnb @ S.transpose(-1, -2)))
            Z = dPm * Pm
            dG = scale * Gam * nq * (qc * dOSt).sum(-1)           # o inter
            dG = dG + Z.sum(-1) - Z.sum(-2)
            dD = nk * (kc * vdS).sum(-1)
            dG = dG - D * dD
            dG[:, -1] += torch.exp(GC) * (S * dSb).sum((-1, -2)) + (D * dD).sum(-1)
            # 3b
            Xb = R(X)
            Bw = R(kc * (bc * Gam * nk)[:, :, None]); Bu = R(vc * bc[:, :, None])
            dX = dw @ Bw.transpose(-1, -2) + dvnb @ Bu.transpose(-1, -2)
            dBw = Xb.transpose(-1, -2) @ dw
            dBu = Xb.transpose(-1, -2) @ dvnb
            dA = -(R(Xb.transpose(-1, -2) @ R(dX)) @ Xb.transpose(-1, -2))
            dA = torch.where(strict[None], dA, 0.)
            KKn = (kc @ kc.transpose(-1, -2)) * (nk[:, :, None] * nk[:, None, :])
            A = torch.where(strict[None], bc[:, :, None] * KKn * E, 0.)
            W = dA * bc[:, :, None] * E
            Wsym = R((W + W.transpose(-1, -2)) * nk[:, None, :])
            dkh = dkh + (bc * Gam)[:, :, None] * dBw + Wsym @ kc
            dvc = bc[:, :, None] * dBu
            dbc = Gam * nk * (dBw * kc).sum(-1) + (dBu * vc).sum(-1) + (dA * KKn * E).sum(-1)
            dG = dG + bc * Gam * nk * (dBw * kc).sum(-1)
            dAA = dA * A
            dG = dG + dAA.sum(-1) - dAA.sum(-2)
            dgc = dG.flip(-1).cumsum(-1).flip(-1)
            if l2norm:
                dqc = nq[:, :, None] * (dqh - (nq * nq * (qc * dqh).sum(-1))[:, :, None] * qc)
                dkc = nk[:, :, None] * (dkh - (nk * nk * (kc * dkh).sum(-1))[:, :, None] * kc)
            else:
                dqc, dkc = dqh, dkh
            nv = int(valid.sum())
            sl = slice(bos, bos + nv)
            # (per value head in 16 bits, then the GVA sum in fp32: chunk_bwd_dqk_v2 / chunk_bwd_wy_v2 + gva.py)
            dq[sl] = R(dqc[:, :nv].transpose(0, 1)); dk[sl] = R(dkc[:, :nv].transpose(0, 1))
            dv[sl] = dvc[:, :nv].transpose(0, 1); dg[sl] = dgc[:, :nv].T; db[sl] = dbc[:, :nv].T
    dq = dq.reshape(NT, Hqk, ratio, K).sum(2).reshape(B, Tn, Hqk, K)
    dk = dk.reshape(NT, Hqk, ratio, K).sum(2).reshape(B, Tn, Hqk, K)
    return dq, dk, dv.reshape(B, Tn, Hv, V), dg.reshape(B, Tn, Hv), db.reshape(B, Tn, Hv), dh0

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


def _emulation_grad_errors(case, dtype, emu_dt):
    inp = make_inputs(case, dtype)
    ref = oracle(case, inp, grads=True)
    scale = case.scale if case.scale is not None else case.K ** -0.5
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, inp["initial_state"],
            inp["cu_seqlens"], case.l2norm, emu_dt)
    o, ht, saved = emulate_forward(*args, save=True)
    grads = emulate_backward(*args, inp["do"], inp["dht"] if case.ht else None, saved)
    errs = {}
    for name, t in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
        if name in ref:
            # the op returns gradients in the input dtypes
            dt_in = inp["initial_state"].dtype if name == "dh0" else (
                inp["g"].dtype if name == "dg" else dtype)
            errs[name] = rel_l2(t.to(dt_in), ref[name])
    return errs


# small cases: the float64 oracle's autograd walks every token
_GRAD_CASES = [
    Case("varlen_tail_h0_ht", 1, 2, 128, 128, seqlens=(1, 70, 0, 64, 9)),
    Case("gva_l2norm", 1, 2, 128, 128, B=2, T=75, l2norm=True),
    Case("strong_decay_no_h0", 1, 1, 128, 128, seqlens=(130,), gate="strong", h0=False),
    Case("no_decay_no_ht", 1, 1, 128, 128, B=1, T=66, gate="zero", ht=False, scale=0.2),
]


@pytest.mark.parametrize("case", _GRAD_CASES, ids=lambda c: c.name)
def test_emulation_backward_exact_math(case):
    """The backward decomposition (three kernels' formulas) equals the oracle's autograd in float64."""
    errs = _emulation_grad_errors(case, torch.float64, None)
    assert all(e < 1e-9 for e in errs.values()), errs


@pytest.mark.parametrize("case", _GRAD_CASES[:2], ids=lambda c: c.name)
def test_emulation_backward_precision_plan(case):
    errs = _emulation_grad_errors(case, torch.bfloat16, torch.bfloat16)
    tol = TOLERANCES["bfloat16"]
    for name, e in errs.items():
        assert e <= 0.8 * tol[name], (name, e, tol[name])


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


def _embedded_cubin(kernel):
    path = getattr(kernel.adapter, "libpath", None)
    if path is None and getattr(kernel, "_tilelang_cache_path", None):
        path = os.path.join(kernel._tilelang_cache_path, "executable.so")
    if path is None or not os.path.exists(path):
        return None
    blob = open(path, "rb").read()
    offs = [m.start() for m in re.finditer(b"\x7fELF", blob)][1:]
    return blob[offs[0]:] if offs else None


def cubin_sass(cubin):
    """The SASS of a cubin (``cuobjdump -sass``), or None where no cuobjdump / cubin."""
    tool = _cuobjdump()
    if tool is None or not cubin:
        return None
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout


def kernel_sass(kernel):
    """The SASS of a compiled TileLang kernel's embedded cubin, or None where no cuobjdump / cubin."""
    return cubin_sass(_embedded_cubin(kernel))


def cubin_wgmma_waits(cubin):
    """(wgmma instructions, wgmma waits) in the SASS of a cubin, or None where no cuobjdump / cubin.
    ptxas serialises every wgmma of a function it cannot pipeline (its C7512 / C7520 "Potential Performance Loss"
    notes, which neither TileLang's build nor the CuTe DSL's shows): each HGMMA is then followed by its own wait,
    where a pipelined GEMM issues its k-steps back to back and waits once (session 16: the whole backward's key
    role at 160 registers; session 24: an if / else around a start state's load)."""
    sass = cubin_sass(cubin)
    return None if sass is None else (sass.count("HGMMA."), sass.count("WARPGROUP.DEPBAR"))


def assert_cubin_pipelined(cubin, label: str) -> None:
    counts = cubin_wgmma_waits(cubin)
    if counts is None:
        return
    mma, waits = counts
    assert mma == 0 or waits < mma, f"{label}: wgmma serialised by ptxas ({mma} HGMMA, {waits} waits)"


def assert_wgmma_pipelined(kernel, label: str) -> None:
    assert_cubin_pipelined(_embedded_cubin(kernel), label)


def resource_usage(kernel) -> str:
    """Registers / spills of a compiled kernel, from the cubin TileLang embeds (best effort)."""
    tool, cubin = _cuobjdump(), _embedded_cubin(kernel)
    if tool is None or cubin is None:
        return "resource usage unavailable"
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    usage = " ".join(line.strip() for line in out.splitlines() if "REG" in line) or "no resource line"
    # the dynamic shared memory size is the last launch argument in TileLang's host stub
    m = re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\);\s*\(\(\(TVMFFIAny\*\)stack_ffi_any\)\[\d+\]"
                   r"\.type_index\) = 0;", kernel.get_host_source())
    if m:
        usage += f" DYN_SMEM:{int(m[-1]) // 1024}KB"
    return usage


def _bwd_variants():
    return [
        ("bwd_state", ("bfloat16", 128, 128, 64, False, False, False)),
        ("bwd_state", ("bfloat16", 128, 128, 64, True, True, True)),
        ("bwd_state", ("float16", 128, 128, 64, True, False, True)),
    ]


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
    # the warp-specialised recurrence: every V-block, every flag both ways
    for dt, bv, l2, h0, ht, save in [("bfloat16", 32, False, False, True, False),
                                     ("bfloat16", 64, True, True, True, True),
                                     ("bfloat16", 128, False, True, False, True),
                                     ("float16", 128, True, False, True, False)]:
        out.append(("fwd_ws", (dt, 128, 128, bv, l2, h0, ht, save)))
    # the experimental options (fast exp2, a fourth warpgroup for the scores)
    out.append(("fwd_ws", ("bfloat16", 128, 128, 32, True, True, True, False, 0, 0, True, True)))
    out.append(("fwd_ws", ("bfloat16", 128, 128, 128, True, False, True, True, 0, 0, False, True)))
    # the register-only state chain (BV = 64), with and without the scores warpgroup
    out.append(("fwd_ws", ("bfloat16", 128, 128, 64, True, True, True, True, 0, 0, True, True, True)))
    out.append(("fwd_ws", ("float16", 128, 128, 64, False, False, True, False, 0, 0, True, False, True)))
    # the diagnostic role trace (benchmarks/trace_ws.py)
    out.append(("fwd_ws", ("bfloat16", 128, 128, 32, False, False, True, False, 0, 0, True, True, False, True)))
    # the scores from stage 1 (pscores; no scores warpgroup), and the stage 1 that writes them
    out.append(("fwd_ws", ("bfloat16", 128, 128, 32, False, True, True, False, 0, 0, True, False, False, False, True,
                           False, True)))
    out.append(("fwd_ws", ("bfloat16", 128, 128, 128, True, False, True, False, 0, 0, True, False, False, False, True,
                           True, True)))
    out.append(("intra", ("bfloat16", "bfloat16", 128, 128, False, False, True, True)))
    out.append(("intra", ("float16", "float32", 128, 128, True, False, True, True)))
    # the output staged in shared memory and written with TMA (ostage), fused and not
    out.append(("fwd_ws", ("bfloat16", 128, 128, 32, True, False, True, False, 0, 0, True, True, False, False, True, True)))
    out.append(("fwd_ws", ("bfloat16", 128, 128, 128, False, True, True, True, 0, 0, True, True, False, False, False, True)))
    # the fused inference forward: stage 1 writes Tb only, the recurrence forms v_new from v (every V-block)
    out.append(("intra", ("bfloat16", "bfloat16", 128, 128, False, False, True)))
    out.append(("intra", ("float16", "float32", 128, 128, True, False, True)))
    # stage 1 launched head-major (FLASHQLA_TILELANG_INTRA_ORDER=head): Tb-only with scores, and w / u
    out.append(("intra", ("bfloat16", "bfloat16", 128, 128, True, False, True, True, True)))
    out.append(("intra", ("bfloat16", "float32", 128, 128, False, True, False, False, True)))
    for dt, bv, l2, h0, ht in [("bfloat16", 32, False, True, True), ("bfloat16", 64, True, False, True),
                               ("bfloat16", 128, False, False, False), ("float16", 128, True, True, True)]:
        out.append(("fwd_ws", (dt, 128, 128, bv, l2, h0, ht, False, 0, 0, True, True, False, False, True)))
    # the fused training forward (FLASHQLA_TILELANG_TRAIN_FUSED): stage 1 writes Tb and X, the fused recurrence saves
    # the chunk states and v_new (default options: fastexp, psplit, ostage)
    out.append(("intra", ("bfloat16", "bfloat16", 128, 128, False, True, True)))
    out.append(("intra", ("float16", "float32", 128, 128, False, True, True)))
    for dt, bv, h0, ht in [("bfloat16", 128, True, True), ("bfloat16", 64, False, True), ("float16", 32, True, False)]:
        out.append(("fwd_ws", (dt, 128, 128, bv, False, h0, ht, True, 0, 0, True, True, False, False, True, True)))
    # the stores that wait for their shared reads a chunk later (async_store, session 24): inference and training,
    # over segments and not
    for dt, bv, l2, save, halo in [("bfloat16", 128, False, False, True), ("bfloat16", 32, True, False, False),
                                   ("bfloat16", 128, False, True, True), ("float16", 64, False, True, False)]:
        out.append(("fwd_ws", (dt, 128, 128, bv, l2, True, True, save, 0, 0, True, True, False, False, True, True,
                               False, False, halo, True)))
    return out


@pytest.mark.compile
@pytest.mark.parametrize("bv,save,halo", [(32, False, False), (128, False, True), (64, True, False),
                                          (128, True, True)])
def test_async_store_waits_before_rewriting(bv, save, halo):
    # async_store: no o store (nor, where the chain stores them, state / v_new save) waits right after it; each
    # role's standalone wait is followed by its own named barrier before the tile is written again (TileLang's
    # partial barrier alone was once placed before the wait, at BV 32), and each role waits once after its loop
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang
    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_fwd_ws_sm90 import (ASTORE_BARRIER_CHAIN, ASTORE_BARRIER_OUTPUT,
                                                                build_fwd_ws)

    def source(async_store):
        kern = tilelang.compile(build_fwd_ws("bfloat16", 128, 128, bv, False, False, True, save, fast_exp=True,
                                             psplit=True, fused=True, ostage=True, halo=halo,
                                             async_store=async_store), out_idx=None, target=TARGET)
        return kern.get_kernel_source()

    src = source(True)
    lines = [ln.strip() for ln in src.splitlines()]
    # stores waited for at once: only the v_new saves of the walk over segments (by the output warpgroup)
    immediate = sum(1 for a, b in zip(lines, lines[1:]) if a == "tl::tma_store_arrive();" and
                    b.startswith("tl::tma_store_wait"))
    assert immediate == (1 if save and halo else 0)
    assert src.count("tl::tma_store(") == source(False).count("tl::tma_store(")
    standalone = [i for i, ln in enumerate(lines) if ln.startswith("tl::tma_store_wait") and
                  lines[i - 1] != "tl::tma_store_arrive();"]
    barriers = [int(re.match(r"tl::__sync_thread_partial\((\d+), 128\);", lines[i + 1]).group(1))
                for i in standalone if lines[i + 1].startswith("tl::__sync_thread_partial(")]
    in_loop = len(barriers)
    # the output's wait before o_s, the chain's before S_s and (unless the output saves it) v_new; one after
    # each role's loop, with no barrier behind it
    want_output, want_chain = 1, (1 if not save else (1 if halo else 2))
    if not save:
        want_chain = 0
    assert sorted(barriers) == sorted([ASTORE_BARRIER_OUTPUT] * want_output + [ASTORE_BARRIER_CHAIN] * want_chain)
    assert len(standalone) - in_loop == 1 + (1 if save else 0)


def _bwd_ws_variants():
    out = [("bwd_state_ws", ("bfloat16", 128, 128, 64, False, False, False)),
           ("bwd_state_ws", ("bfloat16", 128, 128, 32, True, True, True)),
           ("bwd_state_ws", ("float16", 128, 128, 64, True, True, False))]
    return out


# the most shared memory one CTA may hold on sm_90 (227 KB, static and dynamic together)
_SM90_SMEM = 232448


def assert_resources(kernel, max_regs=None, max_dyn_smem_kb=None) -> str:
    """A compiled kernel's resource usage (printed and returned): no local memory, and at most ``max_regs`` registers
    per thread / ``max_dyn_smem_kb`` of dynamic shared memory where given (what its CTAs per SM rest on)."""
    usage = resource_usage(kernel)
    print(usage)
    assert "LOCAL:0" in usage or "unavailable" in usage, usage
    regs = re.search(r"REG:(\d+)", usage)
    assert max_regs is None or regs is None or int(regs.group(1)) <= max_regs, usage
    smem = re.search(r"DYN_SMEM:(\d+)KB", usage)
    assert max_dyn_smem_kb is None or smem is None or int(smem.group(1)) <= max_dyn_smem_kb, usage
    return usage


def _smem_bytes(kernel, usage: str) -> int:
    """Static + dynamic shared memory of a compiled kernel (the dynamic size from the host stub, as
    resource_usage reads it)."""
    dyn = re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\);\s*\(\(\(TVMFFIAny\*\)stack_ffi_any\)\[\d+\]"
                     r"\.type_index\) = 0;", kernel.get_host_source())
    static = re.search(r"SHARED:(\d+)", usage)
    return (int(dyn[-1]) if dyn else 0) + (int(static.group(1)) if static else 0)


@pytest.mark.compile
@pytest.mark.parametrize("kind,args", _fwd_variants() + _bwd_variants() + _bwd_ws_variants(),
                         ids=lambda x: str(x).replace(" ", ""))
def test_kernels_lower_for_sm90a(kind, args):
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang
    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_bwd_state_sm90 import build_bwd_state
    from flashqla.backends.tilelang.chunk_bwd_state_ws_sm90 import build_bwd_state_ws
    from flashqla.backends.tilelang.chunk_fwd_sm90 import build_fwd
    from flashqla.backends.tilelang.chunk_fwd_ws_sm90 import build_fwd_ws
    from flashqla.backends.tilelang.chunk_intra_sm90 import build_intra

    builder = {"intra": build_intra, "fwd": build_fwd, "fwd_ws": build_fwd_ws, "bwd_state": build_bwd_state,
               "bwd_state_ws": build_bwd_state_ws}[kind]
    kern = tilelang.compile(builder(*args), out_idx=None, target=TARGET)
    src = kern.get_kernel_source()
    assert "wgmma" in src, "no wgmma in the generated source"
    assert "tma_load" in src or "cp.async.bulk.tensor" in src, "no TMA load in the generated source"
    usage = resource_usage(kern)
    print(f"{kind}{args}: {usage}")
    assert "LOCAL:0" in usage or "unavailable" in usage, f"register spills: {usage}"
    assert_wgmma_pipelined(kern, f"{kind}{args}")
    if kind in ("fwd", "bwd_state") or (kind == "fwd_ws" and (args[3] > 64 or (len(args) > 11 and args[11]))):
        # warp-specialised pipelines: a TMA producer branch and setmaxnreg on the consumer side
        assert "warpgroup_reg_alloc" in src or "setmaxnreg" in src
    if kind == "fwd_ws":
        from flashqla.backends.tilelang.chunk_fwd_ws_sm90 import TRACE_EVENTS
        traced = len(args) > 13 and args[13]
        assert src.count("clock64()") == (len(TRACE_EVENTS) if traced else 0)
    if kind == "fwd_ws" and len(args) > 15 and args[15]:
        assert "tma_store" in src, "ostage: the output tile should leave through a TMA store"
    if kind == "fwd_ws" and len(args) > 14 and args[14] and not (len(args) > 16 and args[16]):
        # fused: the state chain runs k Sb, Tb Y and the update; the output and scores warpgroups as before
        assert src.count("wgmma_ss<") == 6, "fused: expected six shared-operand wgmma"
    if kind == "intra" and len(args) > 6 and args[6]:
        # Tb only: one k k^T product, no w / u products (with the scores also q k^T)
        assert src.count("wgmma_ss<") == (2 if len(args) > 7 and args[7] else 1)
    if kind == "fwd_ws" and len(args) > 16 and args[16]:
        # pscores: k Sb, Tb Y, the update, q Sb and P v_new; no q k^T in the kernel
        assert src.count("wgmma_ss<") == 5
    if kind == "fwd_ws" and len(args) > 12 and args[12]:
        # tchain: both state-chain products take their A operand from registers
        assert src.count("wgmma_rs<") == 2, "tchain: expected two register-operand wgmma in the state chain"
    if kind in ("fwd_ws", "bwd_state_ws"):
        # three roles, each waiting on mbarriers; the consumers sync only their own warpgroup
        # (a whole-CTA barrier inside a role would deadlock: only the one after the barrier init)
        assert src.count("__syncthreads()") == 1
        assert src.count(".wait(") >= (7 if kind == "fwd_ws" else 5)
    if kind == "bwd_state_ws":
        assert _smem_bytes(kern, usage) <= _SM90_SMEM, usage


def test_v_block_follows_the_longest_sequence():
    # the recurrence's makespan is its longest walk: 28672 + 4096 tokens picks the V-block of one sequence
    # (session 7: 8/32 28672+4096 ran at two sequences' BV 64, 1.153 ms, against 1.022 for 1x32768 at BV 32)
    from flashqla import prepare_varlen
    from flashqla.backends.tilelang import ops
    from flashqla.dispatch.device import fake_device

    def bv(seqlens, Hv):
        cu = torch.tensor([0] + [sum(seqlens[:i + 1]) for i in range(len(seqlens))], dtype=torch.int32)
        meta = ops.chunk_meta(prepare_varlen(cu), 1, sum(seqlens), torch.device("cpu"))
        with fake_device("cuda", (9, 0), sm_count=132):
            return ops.fwd_ws_bv(meta.busy_seqs or meta.num_seqs, Hv, 128, torch.device("cpu")), meta.busy_seqs

    assert bv([32768], 32) == (32, 1.0)
    b, busy = bv([28672, 4096], 32)
    assert b == 32 and abs(busy - 32768 / 28672) < 1e-9
    assert bv([8192] * 4, 32)[0] == 128 and bv([28672, 4096], 64)[0] == 64 and bv([16384] * 2, 64)[0] == 128
    with fake_device("cuda", (9, 0), sm_count=132):
        assert ops.fwd_ws_bv(2, 32, 128, torch.device("cpu")) == 64      # equal lengths: as before


def test_trace_buffer_selects_the_traced_kernel(monkeypatch):
    # benchmarks/trace_ws.py sets ops.TRACE_BUFFER; the ws kernel key then asks for trace=True, and the
    # buffer is what the launch passes; unset, a placeholder goes in its place
    from flashqla.backends.tilelang import ops
    keys = []
    monkeypatch.setattr(ops, "get_kernel", lambda name, builder, key: keys.append(key))
    ops.fwd_ws_kernel(torch.bfloat16, 128, 128, False, False, True, False, 32)
    # (key entries 12.. are tchain, trace, fused, ostage, pscores, trailing False ones left out)
    assert not keys[-1][13:14] or keys[-1][13] is False
    assert ops._trace_arg(torch.device("cpu")).shape == (1, 1)
    buf = torch.zeros(16, 64, dtype=torch.int64)
    monkeypatch.setattr(ops, "TRACE_BUFFER", buf)
    ops.fwd_ws_kernel(torch.bfloat16, 128, 128, False, False, True, False, 32)
    assert keys[-1][12:14] == (False, True) and ops._trace_arg(torch.device("cpu")) is buf


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


# every case at the auto V-block (""), four of them at each forced one
def _gpu_inference_builds(case, monkeypatch, stage1: str, **env):
    # an inference forward under the environment ``env`` against the oracle; its stage-1 kernel is built
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from flashqla.backends.tilelang import _compile
    _gpu_case(case, torch.bfloat16)
    assert any(name == stage1 for name, _ in _compile.cached_kernels())


_FUSED_PARAMS = [pytest.param(c, "", id=f"{c.name}-bvauto") for c in _GPU_FWD_CASES] + [
    pytest.param(c, bv, id=f"{c.name}-bv{bv}") for bv in ("32", "64", "128") for c in _GPU_FWD_CASES
    if c.name in ("dense_h0_ht", "varlen_len1_tail", "varlen_l2norm", "strong_decay")]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case,bv", _FUSED_PARAMS)
def test_gpu_forward_fused_matches_oracle(case, bv, monkeypatch):
    # the fused inference forward (Tb-only stage 1, v_new formed in the recurrence) at every V-block;
    # run_case's forward needs no gradient, so it takes the fused path.  The options are named: left to
    # the per-call choice, few walks at BV 32 would take the scores from stage 1 (the next test's form)
    _gpu_inference_builds(case, monkeypatch, "fwd_intra_tb_sm90", FLASHQLA_TILELANG_FWD="fused",
                          FLASHQLA_TILELANG_BV=bv, FLASHQLA_TILELANG_WS_OPTS="fastexp,psplit,ostage")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", _GPU_FWD_CASES, ids=lambda c: c.name)
def test_gpu_forward_intra_inv_mma_matches_oracle(case, monkeypatch):
    # FLASHQLA_TILELANG_INTRA_INV=mma (session 25): stage 1's inverse as 3xTF32 mma.sync products.  The inference
    # forward (Tb), the fused training forward (Tb and X, ahead of the whole-V backward) and the unfused one (w, u
    # and X) against the oracle; and its outputs against the CUDA-core inverse's, which they should match to about
    # the bf16 rounding of Tb
    from flashqla.backends.tilelang import _compile
    from flashqla.testing import make_inputs
    monkeypatch.setenv("FLASHQLA_TILELANG_WS_OPTS", "fastexp,psplit,ostage")

    def forward():
        x = make_inputs(case, torch.bfloat16, "cuda", 0)
        return flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=case.scale,
                                               initial_state=x["initial_state"], output_final_state=True,
                                               use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=x["cu_seqlens"],
                                               backend="tilelang")
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_INV", "fma")
    o_fma, _ = forward()
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_INV", "mma")
    o_mma, _ = forward()
    torch.cuda.synchronize()
    assert bool(torch.isfinite(o_mma).all())
    diff = float((o_mma.float() - o_fma.float()).norm() / o_fma.float().norm().clamp_min(1e-30))
    assert diff < 5e-3, diff
    _gpu_inference_builds(case, monkeypatch, "fwd_intra_tb_sm90", FLASHQLA_TILELANG_FWD="fused")
    # (key entry 13, ops.intra_tb_kernel / intra_kernel; a dense call's key also ends in its uniform flag)
    assert any(n == "fwd_intra_tb_sm90" and k[12:13] == (True,) for n, k in _compile.cached_kernels())
    _gpu_case(case, torch.bfloat16, grads=True)
    if not case.l2norm:
        monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "0")
        monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "ws")
        _gpu_case(case, torch.bfloat16, grads=True)
        assert any(n == "fwd_intra_sm90" and k[12:13] == (True,) for n, k in _compile.cached_kernels())


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", _GPU_FWD_CASES, ids=lambda c: c.name)
def test_gpu_intra_persist_is_bitwise_the_per_chunk_ctas(case, monkeypatch):
    # FLASHQLA_TILELANG_INTRA_PERSIST (session 25; auto, the default since 26): stage 1's Tb forms as persistent CTAs
    # that prefetch their next chunk; the same formulas, so the inference forward and the fused training forward with
    # its backward are bitwise those of one CTA per chunk (dense calls: the uniform row lookup; varlen: the table)
    from flashqla.backends.tilelang import _compile
    monkeypatch.setenv("FLASHQLA_TILELANG_WS_OPTS", "fastexp,psplit,ostage")
    _assert_bitwise_under(case, monkeypatch, "FLASHQLA_TILELANG_INTRA_PERSIST", "0", "1")
    # (persist is the last key entry of ops.intra_tb_kernel)
    assert any(n == "fwd_intra_tb_sm90" and len(k) == 15 and k[-1] is True for n, k in _compile.cached_kernels())
    _gpu_case(case, torch.bfloat16)


# long enough that a persistent CTA walks several chunks at one CTA per SM (nprog < chunks per head)
_PERSIST_WALK_CASES = [
    Case("persist_dense", 2, 16, 128, 128, B=2, T=4100),      # (a partial last chunk in each sequence)
    Case("persist_varlen", 2, 16, 128, 128, seqlens=(1000, 3000, 333, 0, 65, 1, 640)),
    Case("persist_varlen_gva4", 4, 16, 128, 128, seqlens=(4100, 77, 2048), gate="strong"),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", _PERSIST_WALK_CASES, ids=lambda c: c.name)
def test_gpu_intra_persist_walks_several_chunks(case, monkeypatch):
    # the persistent stage 1 where each CTA walks several chunks (its next-chunk prefetch, the chunk table's rows
    # for unequal lengths, sequences of 0 / 1 tokens between them): FLASHQLA_TILELANG_INTRA_PERSIST_CTAS=1 gives
    # SMs // Hv CTAs per head, fewer than the chunks; bitwise one CTA per chunk, and the oracle
    from flashqla.backends.tilelang import ops
    from flashqla.dispatch.device import detect
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_PERSIST_CTAS", "1")
    lens = case.seqlens or (case.T,) * case.B
    chunks = sum(-(-n // ops.CHUNK) for n in lens)
    assert ops.intra_persist_programs(chunks, case.Hv, torch.device("cuda")) * 2 <= chunks, \
        (chunks, detect(torch.device("cuda")).sm_count)
    _assert_bitwise_under(case, monkeypatch, "FLASHQLA_TILELANG_INTRA_PERSIST", "0", "1")
    _gpu_case(case, torch.bfloat16, grads=True)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", [c for c in _GPU_FWD_CASES if c.seqlens is None], ids=lambda c: c.name)
def test_gpu_uniform_rows_are_bitwise_the_table_lookup(case, monkeypatch):
    # FLASHQLA_TILELANG_INTRA_UNIFORM (session 25, default 1): dense calls' stage 1 finds its rows from the chunk
    # number; inference and training forward and the backward, bitwise those of the table lookup
    _assert_bitwise_under(case, monkeypatch, "FLASHQLA_TILELANG_INTRA_UNIFORM", "0", "1")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("inv", ["fma", "mma"])
@pytest.mark.parametrize("case", _GPU_FWD_CASES, ids=lambda c: c.name)
def test_gpu_forward_intra_compact_matches_oracle(case, inv, monkeypatch):
    # FLASHQLA_TILELANG_INTRA_COMPACT=1 (session 20): stage 1's Tb forms with XOR-swizzled, unpadded A and X tiles
    # (A over the k tile), inference (Tb) and the fused training forward (Tb and X, ahead of the whole-V backward);
    # with either inverse (session 25: the tensor-core one reads the swizzled tiles through flq_inv64_mma_sw)
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_COMPACT", "1")
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_INV", inv)
    # (compact is a form of the per-chunk CTAs: the persistent form, the default on dense calls, would replace it)
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_PERSIST", "0")
    _gpu_inference_builds(case, monkeypatch, "fwd_intra_tb_sm90", FLASHQLA_TILELANG_FWD="fused",
                          FLASHQLA_TILELANG_WS_OPTS="fastexp,psplit,ostage")
    from flashqla.backends.tilelang import _compile
    # (compact is key entry 12, ops.intra_tb_kernel: a default Tb key also ends in True, its tb_only flag)
    assert any(n == "fwd_intra_tb_sm90" and k[11:12] == (True,) for n, k in _compile.cached_kernels())
    if not case.l2norm:
        monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "1")
        monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "whole")
        _gpu_case(case, torch.bfloat16, grads=True)
        assert any(n == "fwd_intra_tbx_sm90" and k[11:12] == (True,) for n, k in _compile.cached_kernels())


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("bv", ["32", "64", "128"])
@pytest.mark.parametrize("case", [c for c in _GPU_FWD_CASES if c.name in ("dense_h0_ht", "varlen_len1_tail",
                                                                         "varlen_l2norm", "strong_decay",
                                                                         "gva_4_16")], ids=lambda c: c.name)
def test_gpu_forward_pscores_matches_oracle(case, bv, monkeypatch):
    # the scores from stage 1 (pscores), inference forward
    _gpu_inference_builds(case, monkeypatch, "fwd_intra_tbs_sm90", FLASHQLA_TILELANG_WS_OPTS="fastexp,pscores",
                          FLASHQLA_TILELANG_BV=bv)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("bv", ["32", "128"])
@pytest.mark.parametrize("case", [c for c in _GPU_FWD_CASES if c.name in ("dense_h0_ht", "varlen_len1_tail",
                                                                         "varlen_l2norm")], ids=lambda c: c.name)
def test_gpu_forward_ostage_matches_oracle(case, bv, monkeypatch):
    # the TMA-stored output (ostage), inference (fused) and training forwards, full and partial chunks
    monkeypatch.setenv("FLASHQLA_TILELANG_WS_OPTS", "fastexp,psplit,ostage")
    monkeypatch.setenv("FLASHQLA_TILELANG_BV", bv)
    _gpu_case(case, torch.bfloat16)
    _gpu_case(case, torch.bfloat16, grads=True)


def _assert_bitwise_under(case, monkeypatch, var: str, off: str, on: str) -> None:
    """An inference forward, a training forward and its backward under ``var=off`` and then ``var=on``: every output
    and gradient bitwise the same (for switches that reorganise kernels without changing their arithmetic)."""
    from flashqla.testing import make_inputs
    x = make_inputs(case, torch.bfloat16, "cuda", 0)
    do = torch.randn_like(x["v"])

    def run():
        kw = dict(scale=case.scale, initial_state=x["initial_state"], output_final_state=True,
                  use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=x["cu_seqlens"], backend="tilelang")
        o, ht = flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
        o2, ht2 = flashqla.chunk_gated_delta_rule(*leaves, x["g"], x["beta"], **kw)
        return [o, ht, o2.detach(), ht2.detach(), *torch.autograd.grad(o2, leaves, do)]

    monkeypatch.setenv(var, off)
    want = run()
    monkeypatch.setenv(var, on)
    got = run()
    torch.cuda.synchronize()
    for name, a, b in zip(("o", "ht", "o (training)", "ht (training)", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{var}={on}: {name}"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("seg", ["off", "2"])
@pytest.mark.parametrize("bv", ["32", "64", "128"])
@pytest.mark.parametrize("case", [c for c in _GPU_FWD_CASES if c.name in ("dense_h0_ht", "varlen_len1_tail",
                                                                         "varlen_l2norm")], ids=lambda c: c.name)
def test_gpu_async_store_is_bitwise_the_waiting_one(case, bv, seg, monkeypatch):
    # WS option astore (session 24): the o stores and the chain's saves wait for their shared reads a chunk later;
    # the inference forward, and the training forward with its backward, bitwise those of the waiting stores, whole
    # walks and walks over segments of two chunks (the halo path)
    monkeypatch.setenv("FLASHQLA_TILELANG_BV", bv)
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", seg)
    _assert_bitwise_under(case, monkeypatch, "FLASHQLA_TILELANG_WS_OPTS", "fastexp,psplit,ostage",
                          "fastexp,psplit,ostage,astore")
    from flashqla.backends.tilelang import _compile
    assert any(n == "fwd_recurrent_ws_sm90" and len(k) >= 20 and k[19] for n, k in _compile.cached_kernels())
    _gpu_case(case, torch.bfloat16)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", [c for c in _GPU_FWD_CASES if c.name in ("dense_h0_ht", "varlen_len1_tail",
                                                                         "varlen_l2norm")], ids=lambda c: c.name)
def test_gpu_forward_intra_head_major_matches_oracle(case, monkeypatch):
    # stage 1 launched head-major (FLASHQLA_TILELANG_INTRA_ORDER=head), inference (Tb-only, with and without
    # the scores) and training (w / u) forwards
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_ORDER", "head")
    monkeypatch.setenv("FLASHQLA_TILELANG_WS_OPTS", "fastexp,psplit,ostage")
    _gpu_case(case, torch.bfloat16)
    _gpu_case(case, torch.bfloat16, grads=True)
    monkeypatch.setenv("FLASHQLA_TILELANG_WS_OPTS", "fastexp,pscores,ostage")
    _gpu_case(case, torch.bfloat16)


@pytest.mark.gpu
@needs_sm90
def test_gpu_trace_stamps_and_same_output(monkeypatch):
    # the traced kernel (benchmarks/trace_ws.py) computes what the plain one does, and every role stamps
    # every traced chunk with a clock that moves forward (one 71-chunk walk: with the in-kernel CP's segments the
    # first CTA would walk only a few of the 64 traced chunks)
    from flashqla.backends.tilelang import ops
    from flashqla.backends.tilelang.chunk_fwd_ws_sm90 import TRACE_CHUNKS, TRACE_EVENTS
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", "off")
    case = Case("trace", 2, 4, 128, 128, seqlens=(64 * 70 + 5,), h0=False)
    x = make_inputs(case, torch.bfloat16, "cuda")

    def call():
        return flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True,
                                               cu_seqlens=x["cu_seqlens"], backend="tilelang")
    o_plain, ht_plain = call()
    buf = torch.zeros(len(TRACE_EVENTS), TRACE_CHUNKS, dtype=torch.int64, device="cuda")
    monkeypatch.setattr(ops, "TRACE_BUFFER", buf)
    o_tr, ht_tr = call()
    torch.cuda.synchronize()
    # same math; the stamps only add instructions around it (expected bitwise equal, checked to 1e-5)
    assert rel_l2(o_tr, o_plain) <= 1e-5 and rel_l2(ht_tr, ht_plain) <= 1e-5
    t = buf.cpu()
    chain_ready = t[0]
    assert (chain_ready > 0).all() and (chain_ready[1:] > chain_ready[:-1]).all()
    for e, (name, role) in enumerate(TRACE_EVENTS):
        if role == "scores" and not (t[e] > 0).any():
            continue        # (the scores role runs only where pscores is chosen for the call)
        assert (t[e] > 0).all(), f"event {name!r} not stamped on every chunk"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("opts", ["fastexp,psplit,tchain", "tchain"])
@pytest.mark.parametrize("case", _GPU_FWD_CASES, ids=lambda c: c.name)
def test_gpu_forward_tchain_matches_oracle(case, opts, monkeypatch):
    # the register-only state chain (BV = 64), forward and the saved states of a training forward
    monkeypatch.setenv("FLASHQLA_TILELANG_BV", "64")
    monkeypatch.setenv("FLASHQLA_TILELANG_WS_OPTS", opts)
    _gpu_case(case, torch.bfloat16)
    if case.name in ("dense_h0_ht", "varlen_len1_tail", "varlen_l2norm"):
        _gpu_case(case, torch.bfloat16, grads=True)


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
def test_gpu_beta_dtypes_and_auto_dispatch(monkeypatch):
    monkeypatch.setenv("FLASHQLA_SPEED_TABLE", "0")  # priorities alone: the measured table may prefer triton
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


_GPU_BWD_CASES = [
    Case("bwd_dense_h0_ht", 2, 4, 128, 128, B=2, T=150),
    Case("bwd_varlen_len1_tail", 1, 2, 128, 128, seqlens=(1, 63, 64, 65, 130, 0, 7)),
    Case("bwd_l2norm_gva", 2, 8, 128, 128, seqlens=(33, 0, 100), l2norm=True),
    Case("bwd_strong_decay", 1, 2, 128, 128, seqlens=(200, 7), gate="strong"),
    Case("bwd_no_state", 1, 2, 128, 128, B=1, T=129, h0=False, ht=False),
    Case("bwd_no_decay_scale", 1, 1, 128, 128, B=1, T=64, gate="zero", scale=0.3),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", _GPU_BWD_CASES, ids=lambda c: c.name)
def test_gpu_backward_matches_oracle(case):
    _gpu_case(case, torch.bfloat16, grads=True)


@pytest.mark.gpu
@needs_sm90
def test_gpu_backward_fp16():
    _gpu_case(Case("bwd_fp16", 1, 2, 128, 128, seqlens=(70, 100), l2norm=True), torch.float16, grads=True)


@pytest.mark.gpu
@needs_sm90
def test_gpu_backward_gate_minus_1e4_finite():
    case = Case("bwd_g1e4", 1, 2, 128, 128, seqlens=(130, 1, 64))
    inp = make_inputs(case, torch.bfloat16, "cuda")
    g = inp["g"].clone()
    g[:, ::3] = -1e4
    leaves = [t.detach().clone().requires_grad_() for t in (inp["q"], inp["k"], inp["v"], g, inp["beta"],
                                                            inp["initial_state"])]
    o, ht = flashqla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                            cu_seqlens=inp["cu_seqlens"], backend="tilelang")
    grads = torch.autograd.grad([o, ht], leaves, [inp["do"], inp["dht"]])
    assert all(torch.isfinite(t).all() for t in grads)


# ----------------------------------------------------------------------------------------------------
# Host path with simulated kernels (CPU): the backend's real forward/backward glue (buffers, chunk
# metadata, argument order, GVA sums) runs with every TileLang kernel replaced by a PyTorch model of
# its contract, after checking each call's arguments against the real prim_func signature.
# ----------------------------------------------------------------------------------------------------

_TORCH_DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int32": torch.int32,
             "int64": torch.int64}


def _check_signature(func, args):
    """dtype, rank, static dims and symbolic-dim consistency of ``args`` against a prim_func."""
    env = {}
    tensors = []
    for p, a in zip(func.params, args):
        if p in func.buffer_map:
            b = func.buffer_map[p]
            assert isinstance(a, torch.Tensor), f"{b.name}: expected a tensor, got {type(a).__name__}"
            assert a.dtype == _TORCH_DT[str(b.dtype)], f"{b.name}: dtype {a.dtype}, kernel wants {b.dtype}"
            assert a.dim() == len(b.shape), f"{b.name}: rank {a.dim()}, kernel wants {len(b.shape)}"
            assert a.is_contiguous(), f"{b.name} is not contiguous"
            tensors.append((str(b.name), [str(s) for s in b.shape], a))
        else:
            assert not isinstance(a, torch.Tensor), f"scalar {p} got a tensor"
    assert len(func.params) == len(args), f"{len(args)} arguments for {len(func.params)} parameters"
    for _, dims, a in tensors:                      # bind plain symbols first
        for d, n in zip(dims, a.shape):
            if d.isidentifier():
                assert env.setdefault(d, n) == n, f"symbol {d} bound to {env[d]} and {n}"
    for _, dims, a in tensors:                      # "N + 1" binds N when nothing else does
        for d, n in zip(dims, a.shape):
            m = re.fullmatch(r"(\w+) \+ 1", d)
            if m and m.group(1) not in env:
                env[m.group(1)] = n - 1
    for name, dims, a in tensors:                   # then check every dim expression
        for d, n in zip(dims, a.shape):
            assert eval(d, {}, dict(env)) == n, f"{name}: dim {d} = {n} but symbols give {eval(d, {}, dict(env))}"


def _rows(x, bos, n_total):
    """Rows bos .. bos+64 of a packed [NT, H, D] tensor as a kernel tile sees them (zero past NT)."""
    idx = torch.arange(bos, bos + C)
    out = x[idx.clamp(max=n_total - 1)].float()
    out[idx >= n_total] = 0
    return out


def _chunk_rows(cu, cidx_row):
    n, i = int(cidx_row[0]), int(cidx_row[1])
    bos, eos = int(cu[n]) + i * C, int(cu[n + 1])
    return bos, eos, torch.arange(bos, bos + C) < eos


def _norms(x, l2norm):
    return torch.rsqrt((x * x).sum(-1) + 1e-6) if l2norm else torch.ones(x.shape[:-1])


def _heads(x, ratio):
    """[C, Hqk, D] tile -> [Hv, C, D] (value head h reads query/key head h // ratio)."""
    return x.repeat_interleave(ratio, 1).transpose(0, 1)


def _sim_chunk_inverse(k, g, beta, cu, cidx_row, ratio, l2norm):
    """Stage 1's per-chunk quantities (steps 1-5 of chunk_intra_sm90): rows, k tile, beta, row factors,
    G and X = (I + A)^-1, per value head."""
    NT, Hv = g.shape[0], g.shape[1]
    idx = torch.arange(C)
    strict = idx[:, None] > idx[None, :]
    bos, eos, valid = _chunk_rows(cu, cidx_row)
    kc = _heads(_rows(k, bos, NT), ratio)
    gc = torch.where(valid[:, None], _rows(g[:, :, None], bos, NT)[..., 0], 0.).T
    bc = torch.where(valid[:, None], _rows(beta[:, :, None], bos, NT)[..., 0], 0.).T
    nk = _norms(kc, l2norm)
    G = gc.cumsum(-1)
    A = torch.where(strict, (kc @ kc.transpose(-1, -2)) * nk[:, :, None] * nk[:, None, :] * bc[:, :, None]
                    * torch.exp(G[:, :, None] - G[:, None, :]), 0.)
    X = torch.linalg.solve_triangular(torch.eye(C) + A, torch.eye(C).expand(Hv, C, C), upper=False,
                                      unitriangular=True)
    return bos, kc, bc, nk, G, X


def _sim_intra(key, k, v, g, beta, cu, cidx, w_out, u_out, G_out, X_out, ratio):
    # (trailing key entries: tb_only, scores, head_major; the grid order does not change the results)
    dt, _, K, V, l2norm, save_x = key[:6]
    assert len(key) == 6 or not key[6]
    for c in range(cidx.shape[0]):
        bos, kc, bc, nk, G, X = _sim_chunk_inverse(k, g, beta, cu, cidx[c], ratio, l2norm)
        vc = _rows(v, bos, v.shape[0]).transpose(0, 1)
        w_out[c] = ((X * (bc * torch.exp(G) * nk)[:, None, :]).to(w_out.dtype).float() @ kc).to(w_out.dtype)
        u_out[c] = ((X * bc[:, None, :]).to(u_out.dtype).float() @ vc).to(u_out.dtype)
        G_out[c] = G
        if save_x:
            X_out[c] = X


def _sim_intra_tb(key, q, k, g, beta, cu, cidx, Tb_out, P_out, G_out, ratio):
    # build_intra(tb_only=True): Tb = X diag(beta) in the input dtype and G; with scores (key entry 8) also
    # the masked, decayed scores P (q and P_out are placeholders otherwise)
    dt, _, K, V, l2norm, save_x, tb_only = key[:7]
    assert tb_only
    for c in range(cidx.shape[0]):
        _, _, bc, _, G, X = _sim_chunk_inverse(k, g, beta, cu, cidx[c], ratio, l2norm)
        Tb_out[c] = (X * bc[:, None, :]).to(Tb_out.dtype)
        G_out[c] = G
    if not (len(key) > 7 and key[7]):
        return
    NT = g.shape[0]
    idx = torch.arange(C)
    incl = idx[:, None] >= idx[None, :]
    for c in range(cidx.shape[0]):
        bos, _, _ = _chunk_rows(cu, cidx[c])
        qc, kc = _heads(_rows(q, bos, NT), ratio), _heads(_rows(k, bos, NT), ratio)
        Gc = G_out[c]
        P_out[c] = torch.where(incl, (qc @ kc.transpose(-1, -2)) * _norms(qc, l2norm)[:, :, None]
                               * _norms(kc, l2norm)[:, None, :] * torch.exp(Gc[:, :, None] - Gc[:, None, :]),
                               0.).to(P_out.dtype)


def _sim_intra_tbx(key, k, g, beta, cu, cidx, Tb_out, X_out, G_out, ratio):
    # build_intra(tb_only=True, save_x=True), the fused training forward's stage 1: Tb, X and G
    dt, _, K, V, l2norm, save_x, tb_only = key[:7]
    assert tb_only and save_x
    for c in range(cidx.shape[0]):
        _, _, bc, _, G, X = _sim_chunk_inverse(k, g, beta, cu, cidx[c], ratio, l2norm)
        Tb_out[c] = (X * bc[:, None, :]).to(Tb_out.dtype)
        X_out[c] = X.to(X_out.dtype)
        G_out[c] = G


def _sim_fwd(key, q, k, w, u, G, cu, coff, h0, o, ht, h_out, vn_out, scale, ratio, scores=None):
    dt, K, V, BV, l2norm, has_h0, store_ht, save = key[:8]   # (the ws kernel adds its ring layout)
    # the ws kernel's 15th key entry: fused (w holds Tb, u holds the packed v rows)
    fused = len(key) > 14 and key[14]
    NT, Hv = o.shape[0], o.shape[1]
    idx = torch.arange(C)
    incl = idx[:, None] >= idx[None, :]
    for n in range(cu.shape[0] - 1):
        S = h0[n].clone() if has_h0 else torch.zeros(Hv, K, V)
        for i in range(int(coff[n + 1] - coff[n])):
            c = int(coff[n]) + i
            bos, eos = int(cu[n]) + i * C, int(cu[n + 1])
            valid = torch.arange(bos, bos + C) < eos
            qc, kc = _heads(_rows(q, bos, NT), ratio), _heads(_rows(k, bos, NT), ratio)
            nq, nk = _norms(qc, l2norm), _norms(kc, l2norm)
            Gc = G[c]
            Sb = S.to(o.dtype).float()
            if fused:
                vc = _rows(u, bos, NT).transpose(0, 1)
                Y = torch.where(valid[None, :, None], vc - (torch.exp(Gc) * nk)[:, :, None] * (kc @ Sb), 0.)
                vn = w[c].float() @ Y.to(o.dtype).float()
            else:
                vn = torch.where(valid[None, :, None], u[c].float() - w[c].float() @ Sb, 0.)
            vnb = vn.to(o.dtype).float()
            if save:
                h_out[c] = Sb.to(h_out.dtype)
                vn_out[c] = vnb.to(vn_out.dtype)
            if scores is not None:
                P = scores[c].float()
            else:
                P = torch.where(incl, (qc @ kc.transpose(-1, -2)) * nq[:, :, None] * nk[:, None, :]
                                * torch.exp(Gc[:, :, None] - Gc[:, None, :]), 0.).to(o.dtype).float()
            oc = scale * ((qc @ Sb) * (nq * torch.exp(Gc))[:, :, None] + P @ vnb)
            nv = int(valid.sum())
            o[bos:bos + nv] = oc[:, :nv].transpose(0, 1).to(o.dtype)
            vd = (vn * (nk * torch.exp(Gc[:, -1:] - Gc))[:, :, None]).to(o.dtype).float()
            S = torch.exp(Gc[:, -1])[:, None, None] * S + kc.transpose(-1, -2) @ vd
        if store_ht:
            ht[n] = S


def _sim_bwd_state(key, q, k, w, G, do, cu, coff, dht, dh_out, dvn_out, dh0, scale, ratio):
    dt, K, V, BV, l2norm, has_dht, need_dh0 = key
    NT, Hv = do.shape[0], do.shape[1]
    idx = torch.arange(C)
    incl = idx[:, None] >= idx[None, :]
    for n in range(cu.shape[0] - 1):
        dS = dht[n].clone() if has_dht else torch.zeros(Hv, K, V)
        nch = int(coff[n + 1] - coff[n])
        for ci in reversed(range(nch)):
            c = int(coff[n]) + ci
            bos, eos = int(cu[n]) + ci * C, int(cu[n + 1])
            valid = torch.arange(bos, bos + C) < eos
            qc, kc = _heads(_rows(q, bos, NT), ratio), _heads(_rows(k, bos, NT), ratio)
            doc = _rows(do, bos, NT).transpose(0, 1)
            nq, nk = _norms(qc, l2norm), _norms(kc, l2norm)
            Gc = G[c]
            dSb = dS.to(dt_of(dh_out)).float()
            dh_out[c] = dSb.to(dh_out.dtype)
            Pt = (kc @ qc.transpose(-1, -2)) * nk[:, :, None] * nq[:, None, :] * torch.exp(Gc[:, None, :] - Gc[:, :, None])
            Pt = torch.where(incl.T[None] & valid[None, None, :], Pt * scale, 0.).to(dh_out.dtype).float()
            dvn = torch.where(valid[None, :, None], Pt @ doc + (nk * torch.exp(Gc[:, -1:] - Gc))[:, :, None] * (kc @ dSb), 0.)
            dvn_out[c] = dvn.to(dvn_out.dtype)
            dos = torch.where(valid[None, :, None], doc * (scale * nq * torch.exp(Gc))[:, :, None], 0.)
            dS = (torch.exp(Gc[:, -1])[:, None, None] * dS + qc.transpose(-1, -2) @ dos.to(dh_out.dtype).float()
                  + w[c].float().transpose(-1, -2) @ (-dvn).to(dh_out.dtype).float())
        if need_dh0:
            dh0[n] = dS


def dt_of(t):
    return t.dtype


def _sim_bwd_state_ws(key, *args):
    # the ws kernel's trailing parameters: the backward segment tables (halo, key entry 8: the grid runs over
    # segments, each gradient walk starts at walk_end[n, h]; placeholders otherwise)
    if len(key) > 7 and key[7]:
        return _sim_bwd_state_halo(key[:7], *args)
    return _sim_bwd_state(key[:7], *args[:13])


def _sim_bwd_state_halo(key, q, k, w, G, do, cu, coff, dht, dh_out, dvn_out, dh0, scale, ratio, seg_table,
                        walk_end):
    # per segment n: every head walks back from its own end chunk (dS = 0, or dht at its sequence's end chunk)
    # to the segment's start; only the segment's own chunks write dh / dv_new, only a sequence's first segment
    # writes dh0; rows are masked by the sequence's end.  One chunk at a time through _sim_bwd_state.
    dt, K, V, BV, l2norm, has_dht, need_dh0 = key
    Hv = do.shape[1]
    for n in range(cu.shape[0] - 1):
        seq, ce, first, seq_eos = (int(x) for x in seg_table[n])
        c0, c1 = int(coff[n]), int(coff[n + 1])
        we = walk_end[n].long()
        assert bool(((we >= c1) & (we <= ce)).all()), (n, we, c1, ce)
        end = int(we.max()) if Hv else c1
        dS = dht[seq].clone() if has_dht and end == ce else torch.zeros(Hv, K, V)
        for c in range(end - 1, c0 - 1, -1):
            reset = we == c + 1
            if bool(reset.any()):
                init = dht[seq] if (has_dht and c + 1 == ce) else torch.zeros(Hv, K, V)
                dS = torch.where(reset[:, None, None], init, dS)
            bos = int(cu[n]) + (c - c0) * C
            one_cu = torch.tensor([bos, seq_eos], dtype=torch.int32)
            one_co = torch.tensor([c, c + 1], dtype=torch.int32)
            dh_tmp = torch.zeros((c + 1,) + tuple(dh_out.shape[1:]), dtype=dh_out.dtype)
            dv_tmp = torch.zeros((c + 1,) + tuple(dvn_out.shape[1:]), dtype=dvn_out.dtype)
            out = torch.empty(1, Hv, K, V)
            _sim_bwd_state((dt, K, V, BV, l2norm, True, True), q, k, w, G, do, one_cu, one_co, dS[None].clone(),
                           dh_tmp, dv_tmp, out, scale, ratio)
            if c < c1:
                dh_out[c] = dh_tmp[c]
                dvn_out[c] = dv_tmp[c]
            dS = out[0]
        if need_dh0 and first:
            dh0[seq] = dS


def _add_pairs(out, per_head):
    """What a gva_pair kernel leaves in ``out`` [NT, Hv / 2, D]: each value head's rows (``per_head`` [NT, Hv, D], 0
    where the kernel stores nothing), rounded, added into its pair's row."""
    for j in range(2):
        out.copy_((out.float() + per_head[:, j::2].float()).to(out.dtype))


def _sim_bwd_dqk(key, q, k, do, G, h, vn, dh, dvn, cu, cidx, dq_out, dkp_out, dw_out, dG_out, scale, ratio):
    # (key entry 6, gva_pair: dq [NT, Hqk, K] summed over GVA pairs, _add_pairs)
    if len(key) > 5 and key[5]:
        per_head = torch.zeros(dq_out.shape[0], do.shape[1], dq_out.shape[2], dtype=dq_out.dtype)
        _sim_bwd_dqk(key[:4], q, k, do, G, h, vn, dh, dvn, cu, cidx, per_head, dkp_out, dw_out, dG_out, scale, ratio)
        return _add_pairs(dq_out, per_head)
    dt, K, V, l2norm = key
    NT, Hv = do.shape[0], do.shape[1]
    idx = torch.arange(C)
    incl = idx[:, None] >= idx[None, :]
    for c in range(cidx.shape[0]):
        bos, eos, valid = _chunk_rows(cu, cidx[c])
        qc, kc = _heads(_rows(q, bos, NT), ratio), _heads(_rows(k, bos, NT), ratio)
        doc = _rows(do, bos, NT).transpose(0, 1)
        nq, nk = _norms(qc, l2norm), _norms(kc, l2norm)
        Gc = G[c]
        S, vnc, dS, dvnc = h[c].float(), vn[c].float(), dh[c].float(), dvn[c].float()
        m = incl[None] & valid[None, :, None]
        E = torch.exp(torch.where(m, Gc[:, :, None] - Gc[:, None, :], -float("inf")))
        dQK = scale * (doc @ vnc.transpose(-1, -2)) * E
        Z = dQK * (qc @ kc.transpose(-1, -2)) * nq[:, :, None] * nk[:, None, :]
        dOS = doc @ S.transpose(-1, -2)
        ginter = scale * torch.exp(Gc) * nq * (qc * dOS).sum(-1)
        dqh = scale * torch.exp(Gc)[:, :, None] * dOS + (dQK * nk[:, None, :]).to(dt_of(dw_out)).float() @ kc
        if l2norm:
            dqh = nq[:, :, None] * (dqh - (nq * nq * (qc * dqh).sum(-1))[:, :, None] * qc)
        nv = int(valid.sum())
        dq_out[bos:bos + nv] = dqh[:, :nv].transpose(0, 1)
        vdS = vnc @ dS.transpose(-1, -2)
        dD = nk * (kc * vdS).sum(-1)
        D = torch.exp(Gc[:, -1:] - Gc)
        dkp_out[c] = D[:, :, None] * vdS + (dQK * nq[:, :, None]).to(dt_of(dw_out)).float().transpose(-1, -2) @ qc
        dw_out[c] = (-(dvnc @ S.transpose(-1, -2))).to(dw_out.dtype)
        dG = torch.where(valid[None], ginter + Z.sum(-1) - Z.sum(-2) - D * dD, 0.)
        dG[:, -1] += torch.exp(Gc[:, -1]) * (S * dS).sum((-1, -2)) + (D * dD).sum(-1)
        dG_out[c] = dG


def _sim_bwd_wy(key, k, v, beta, G, X, dw, du, dkp, dGp, cu, cidx, dk_out, dv_out, dg_out, db_out, ratio):
    # (key entry 7, gva_pair: dk [NT, Hqk, K] summed over GVA pairs, _add_pairs)
    if len(key) > 6 and key[6]:
        per_head = torch.zeros(dk_out.shape[0], v.shape[1], dk_out.shape[2], dtype=dk_out.dtype)
        _sim_bwd_wy(key[:5], k, v, beta, G, X, dw, du, dkp, dGp, cu, cidx, per_head, dv_out, dg_out, db_out, ratio)
        return _add_pairs(dk_out, per_head)
    dt, _, K, V, l2norm = key
    NT, Hv = v.shape[0], v.shape[1]
    lo = _TORCH_DT[dt]
    idx = torch.arange(C)
    strict = idx[:, None] > idx[None, :]
    for c in range(cidx.shape[0]):
        bos, eos, valid = _chunk_rows(cu, cidx[c])
        kc = _heads(_rows(k, bos, NT), ratio)
        vc = _rows(v, bos, NT).transpose(0, 1)
        bc = torch.where(valid[:, None], _rows(beta[:, :, None], bos, NT)[..., 0], 0.).T
        nk = _norms(kc, l2norm)
        Gc = G[c]
        Gam = torch.exp(Gc)
        Xb = X[c].to(lo).float()
        dwc, duc = dw[c].float(), du[c].float()
        Bw = (kc * (bc * Gam * nk)[:, :, None]).to(lo).float()
        Bu = (vc * bc[:, :, None]).to(lo).float()
        dX = dwc @ Bw.transpose(-1, -2) + duc @ Bu.transpose(-1, -2)
        dA = torch.where(strict, -((Xb.transpose(-1, -2) @ dX.to(lo).float()).to(lo).float() @ Xb.transpose(-1, -2)), 0.)
        E = torch.exp(torch.where(strict, Gc[:, :, None] - Gc[:, None, :], -float("inf")))
        KKn = (kc @ kc.transpose(-1, -2)) * nk[:, :, None] * nk[:, None, :] * E
        dAA = dA * KKn * bc[:, :, None]
        W = dA * bc[:, :, None] * E
        Ws = ((W + W.transpose(-1, -2)) * nk[:, None, :]).to(lo).float()
        dBw = Xb.transpose(-1, -2) @ dwc
        dBu = Xb.transpose(-1, -2) @ duc
        bk = Gam * nk * (dBw * kc).sum(-1)
        dkh = dkp[c] + (bc * Gam)[:, :, None] * dBw + Ws @ kc
        if l2norm:
            dkh = nk[:, :, None] * (dkh - (nk * nk * (kc * dkh).sum(-1))[:, :, None] * kc)
        dG = dGp[c] + bc * bk + dAA.sum(-1) - dAA.sum(-2)
        dg = dG.flip(-1).cumsum(-1).flip(-1)
        nv = int(valid.sum())
        dk_out[bos:bos + nv] = dkh[:, :nv].transpose(0, 1)
        dv_out[bos:bos + nv] = (bc[:, :, None] * dBu)[:, :nv].transpose(0, 1)
        dg_out[bos:bos + nv] = dg[:, :nv].T
        db_out[bos:bos + nv] = (bk + (dBu * vc).sum(-1) + (dA * KKn).sum(-1))[:, :nv].T


def _sim_bwd_whole(key, q, k, v, beta, do, G, X, h, vn, cu, coff, dht, dq_h, dk_h, dv_out, dg_out, db_out, dh0,
                   trace, scale, ratio, seg_table=None, walk_end=None):
    # chunk_bwd_whole_sm90: the CPU model in its w-free order (bwd_fused_ref(w_free=True), the kernel's order) at
    # whole V, with q / k given per value head (ratio 1): dq, dk per value head, as the kernel writes them.  Key
    # entry 10 (halo): the grid runs over segments, each head's walk starts at walk_end[n, h] (_sim_bwd_whole_halo).
    # Entry 11 (gva_pair): dq / dk [NT, Hqk, K], each value head's rows, rounded, added into its pair's row
    if len(key) > 10 and key[10]:
        assert ratio == 2 and dq_h.shape[1] * 2 == v.shape[1], (ratio, dq_h.shape, v.shape)
        per_head = [torch.zeros(dq_h.shape[0], v.shape[1], dq_h.shape[2], dtype=dq_h.dtype) for _ in range(2)]
        _sim_bwd_whole(key[:10], q, k, v, beta, do, G, X, h, vn, cu, coff, dht, *per_head, dv_out, dg_out, db_out,
                       dh0, trace, scale, ratio, seg_table, walk_end)
        # (rows a walk does not store stay 0 here, and adding 0 leaves the output as the kernel leaves it)
        _add_pairs(dq_h, per_head[0])
        _add_pairs(dk_h, per_head[1])
        return
    if len(key) > 9 and key[9]:
        return _sim_bwd_whole_halo(key, q, k, v, beta, do, G, X, h, vn, cu, coff, dht, dq_h, dk_h, dv_out, dg_out,
                                   db_out, dh0, scale, ratio, seg_table, walk_end)
    from flashqla.backends.tilelang.chunk_bwd_fused_ref import bwd_fused_ref
    dt, _, K, V, has_dht, need_dh0 = key[:6]
    qv, kv = q.repeat_interleave(ratio, 1), k.repeat_interleave(ratio, 1)
    w = torch.zeros(G.shape[0], G.shape[1], 64, K)         # not read by the w-free chain
    dq, dk, dv, dg, db, d0 = bwd_fused_ref(qv, kv, v, beta, G, X, h, vn, w, do, dht if has_dht else None,
                                           scale=scale, cu_seqlens=cu, l2norm=False, round_to=dt_of(dq_h),
                                           w_free=True)
    dq_h.copy_(dq.to(dq_h.dtype))
    dk_h.copy_(dk.to(dk_h.dtype))
    dv_out.copy_(dv.to(dv_out.dtype))
    dg_out.copy_(dg)
    db_out.copy_(db.float())
    if need_dh0:
        dh0.copy_(d0)


def _sim_bwd_whole_halo(key, q, k, v, beta, do, G, X, h, vn, cu, coff, dht, dq_h, dk_h, dv_out, dg_out, db_out,
                        dh0, scale, ratio, seg_table, walk_end):
    # per segment n and per distinct walk end e (global chunk, exclusive): the plain model over the tokens from the
    # segment's start to chunk e (or the sequence's end), from dS = 0 (dht at the sequence's end chunk); the heads
    # that end at e keep its gradients of the segment's own rows, a sequence's first segment its dh0
    dt, bdt, K, V, has_dht, need_dh0 = key[:6]
    Hv = v.shape[1]
    for n in range(cu.shape[0] - 1):
        seq, ce, first, seq_eos = (int(x) for x in seg_table[n])
        t0, t1, c0, c1 = int(cu[n]), int(cu[n + 1]), int(coff[n]), int(coff[n + 1])
        we = walk_end[n].long()
        assert bool(((we >= c1) & (we <= ce)).all()), (n, we, c1, ce)
        for e in sorted(set(we.tolist())):
            heads = we == e
            te = min(seq_eos, t0 + (e - c0) * C)
            sub = [torch.zeros(te - t0, *x.shape[1:], dtype=x.dtype) for x in (dq_h, dk_h, dv_out, dg_out, db_out)]
            d0 = torch.zeros(1, Hv, K, V)
            from_dht = has_dht and e == ce
            sub_dht = dht[seq:seq + 1].clone() if from_dht else torch.zeros(1, Hv, K, V)
            _sim_bwd_whole(key[:6], q[t0:te], k[t0:te], v[t0:te], beta[t0:te], do[t0:te], G[c0:e], X[c0:e],
                           h[c0:e], vn[c0:e], torch.tensor([0, te - t0], dtype=torch.int32),
                           torch.tensor([0, e - c0], dtype=torch.int32), sub_dht, *sub, d0, None, scale, ratio)
            for full, part in zip((dq_h, dk_h, dv_out, dg_out, db_out), sub):
                full[t0:t1][:, heads] = part[:t1 - t0][:, heads]
            if need_dh0 and first:
                dh0[seq][heads] = d0[0][heads]


def _sim_fwd_ws(key, *args):
    # the ws kernel's trailing parameters: its (diagnostic) trace buffer, untouched unless built with trace, the
    # scores from stage 1 (pscores, key entry 17; a placeholder otherwise), and the segment tables (halo, key
    # entry 19: the grid runs over segments, each walk starts at walk_from[n, h]; placeholders otherwise)
    pscores = len(key) > 16 and key[16]
    scores = args[15] if pscores else None
    if len(key) > 18 and key[18]:
        return _sim_fwd_halo(key, *args[:14], scores, args[16], args[17])
    return _sim_fwd(key, *args[:14], scores=scores)


def _sim_fwd_halo(key, q, k, w, u, G, cu, coff, h0, o, ht, h_out, vn_out, scale, ratio, scores, seg_table,
                  walk_from):
    # per segment n: every head walks from its own start chunk (zero state, or h0 at its sequence's first chunk)
    # to the segment's end; only the segment's own chunks write o / h_out / vn_out, only a sequence's last
    # segment writes ht.  Heads are walked together from the earliest start; a head's state is reset at its own
    # start chunk
    dt, K, V, BV, l2norm, has_h0, store_ht, save = key[:8]
    Hv = o.shape[1]
    for n in range(cu.shape[0] - 1):
        seq, cs0, last = (int(x) for x in seg_table[n, :3])
        c0, c1 = int(coff[n]), int(coff[n + 1])
        wf = walk_from[n].long()
        assert bool(((wf >= cs0) & (wf <= c0)).all()), (n, wf, cs0, c0)
        start = int(wf.min()) if Hv else c0
        # rows of chunk c: the segment's rows shifted back by whole chunks (halo chunks are whole)
        # (a segment without chunks -- a length-0 sequence -- still hands h0 to ht)
        S = h0[seq].clone() if has_h0 and start == cs0 else torch.zeros(Hv, K, V)
        sub_cu = torch.tensor([int(cu[n]) - (c0 - start) * C, int(cu[n + 1])], dtype=torch.int32)
        sub_co = torch.tensor([start, c1], dtype=torch.int32)
        o_tmp = torch.zeros_like(o)
        h_tmp = torch.zeros((max(c1, 1),) + tuple(h_out.shape[1:]), dtype=h_out.dtype) if save else h_out
        v_tmp = torch.zeros((max(c1, 1),) + tuple(vn_out.shape[1:]), dtype=vn_out.dtype) if save else vn_out
        for c in range(start, c1):
            reset = wf == c
            if bool(reset.any()):
                init = h0[seq] if (has_h0 and c == cs0) else torch.zeros(Hv, K, V)
                S = torch.where(reset[:, None, None], init, S)
            one_cu = torch.tensor([int(sub_cu[0]) + (c - start) * C, int(cu[n + 1])], dtype=torch.int32)
            one_co = torch.tensor([c, c + 1], dtype=torch.int32)
            st = S.clone()[None]
            ht_one = torch.empty(1, Hv, K, V)
            _sim_fwd(key[:5] + (True, True, save) + key[8:], q, k, w, u, G, one_cu, one_co, st, o_tmp, ht_one,
                     h_tmp, v_tmp, scale, ratio, scores=scores)
            S = ht_one[0]
        o[int(cu[n]):int(cu[n + 1])] = o_tmp[int(cu[n]):int(cu[n + 1])]
        if save:
            h_out[c0:c1] = h_tmp[c0:c1]
            vn_out[c0:c1] = v_tmp[c0:c1]
        if store_ht and last:
            ht[seq] = S


def _sim_intra_persist(key, k, g, beta, cu, cidx, Tb_out, X_out, G_out, ratio, nprog):
    # build_intra(persist=True) (key entry 15): the Tb form's outputs, and X where saved; CTA (p, h) walks chunks p,
    # p + nprog, ... so every chunk is written once as long as 1 <= nprog <= NC
    dt, _, K, V, l2norm, save_x, tb_only = key[:7]
    assert tb_only and key[14] and 1 <= nprog <= max(cidx.shape[0], 1), (key, nprog)
    written = torch.zeros(cidx.shape[0], dtype=torch.int64)
    for p in range(nprog):
        for c in range(p, cidx.shape[0], nprog):
            _, _, bc, _, G, X = _sim_chunk_inverse(k, g, beta, cu, cidx[c], ratio, l2norm)
            Tb_out[c] = (X * bc[:, None, :]).to(Tb_out.dtype)
            if save_x:
                X_out[c] = X.to(X_out.dtype)
            G_out[c] = G
            written[c] += 1
    assert bool((written == 1).all())


def _sim_intra_tb_any(key, *args):
    return (_sim_intra_persist if len(key) > 14 and key[14] else _sim_intra_tb)(key, *args)


def _sim_intra_tbx_any(key, *args):
    return (_sim_intra_persist if len(key) > 14 and key[14] else _sim_intra_tbx)(key, *args)


_SIMULATORS = {"fwd_intra_sm90": _sim_intra, "fwd_intra_tb_sm90": _sim_intra_tb_any,
               "fwd_intra_tbs_sm90": _sim_intra_tb, "fwd_intra_tbx_sm90": _sim_intra_tbx_any,
               "fwd_recurrent_sm90": _sim_fwd, "fwd_recurrent_ws_sm90": _sim_fwd_ws,
               "bwd_state_sm90": _sim_bwd_state, "bwd_state_ws_sm90": _sim_bwd_state_ws,
               "bwd_dqk_v2_sm90": _sim_bwd_dqk, "bwd_wy_v2_sm90": _sim_bwd_wy,
               "bwd_whole_sm90": _sim_bwd_whole}


class _SimCalls(list):
    """The simulated kernels' names in call order (a list), and ``keys``: (name, compile key) of each call."""

    def __init__(self):
        super().__init__()
        self.keys = []


@pytest.fixture
def simulated_kernels(monkeypatch):
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here (the prim_func signatures are checked)")
    from flashqla.backends.tilelang import ops

    calls = _SimCalls()

    def fake_get_kernel(name, builder, key):
        func = builder(*key)

        def run(*args):
            _check_signature(func, args)
            calls.append(name)
            calls.keys.append((name, key))
            with torch.no_grad():
                _SIMULATORS[name](key, *args)
        return run

    monkeypatch.setattr(ops, "get_kernel", fake_get_kernel)
    return calls


_HOST_CASES = [
    Case("host_varlen_gva_l2", 1, 2, 128, 128, seqlens=(1, 70, 0, 64, 9), l2norm=True),
    Case("host_dense_no_state", 2, 4, 128, 128, B=2, T=66, h0=False, ht=False),
    Case("host_varlen_gva_state", 2, 4, 128, 128, seqlens=(1, 70, 0, 129, 9), l2norm=False),
]


def host_backend_inputs(case, needs_grad: bool):
    """(tilelang backend, inputs, float64 oracle, call spec, FwdInputs) of a host-path case, validated as on
    an sm_90 device (the kernels themselves are simulated: ``simulated_kernels``)."""
    from flashqla.dispatch import FwdInputs, get_backend
    from flashqla.dispatch.device import fake_device
    from flashqla.validation import validate

    be = get_backend("tilelang")
    inp = make_inputs(case, torch.bfloat16)
    ref = oracle(case, inp, grads=needs_grad)
    with fake_device("cuda", (9, 0)):
        spec, scale, meta = validate(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], case.scale,
                                     inp["initial_state"], case.ht, case.l2norm, inp["cu_seqlens"],
                                     needs_grad=needs_grad)
    x = FwdInputs(q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"], scale=scale,
                  initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"], varlen=meta,
                  output_final_state=case.ht, use_qk_l2norm=case.l2norm)
    return be, inp, ref, spec, x


@pytest.mark.parametrize("fwd", ["fused", "ws", "fused-pscores", "fused-auto"])
@pytest.mark.parametrize("case", _HOST_CASES, ids=lambda c: c.name)
def test_host_path_inference_forward(case, fwd, simulated_kernels, monkeypatch):
    # an inference forward (nothing saved): "fused" runs the Tb-only stage 1 and the fused recurrence
    # ("-pscores": stage 1 also writes the scores, the recurrence reads them; "-auto": the default options,
    # which choose pscores per call)
    from flashqla.backends.tilelang import ops
    monkeypatch.delenv("FLASHQLA_TILELANG_WS_OPTS", raising=False)
    if fwd == "fused-pscores":
        monkeypatch.setenv("FLASHQLA_TILELANG_WS_OPTS", "fastexp,pscores")
        first = "fwd_intra_tbs_sm90"
    elif fwd == "fused-auto":
        from flashqla.dispatch.device import fake_device
        lens = case.seqlens or (case.T,) * case.B
        n = sum(lens) / max(lens)           # VarlenMeta.busy_seqs: the walks in flight over the longest one
        with fake_device("cuda", (9, 0)):
            bv = ops.fwd_ws_bv(n, case.Hv, case.V, torch.device("cpu"))
        first = "fwd_intra_tbs_sm90" if ops.fwd_pscores(True, bv, n, case.Hv) else "fwd_intra_tb_sm90"
    else:
        if fwd == "fused":
            monkeypatch.setenv("FLASHQLA_TILELANG_WS_OPTS", "fastexp,psplit,ostage")
        first = "fwd_intra_tb_sm90" if fwd == "fused" else "fwd_intra_sm90"
    monkeypatch.setenv("FLASHQLA_TILELANG_FWD", fwd.split("-")[0])
    be, inp, ref, spec, x = host_backend_inputs(case, needs_grad=False)
    from flashqla.testing import poisoned_outputs
    with poisoned_outputs("cpu"):
        o, ht, saved, aux = be.forward(spec, x)
    assert saved == ()
    assert simulated_kernels == [first, "fwd_recurrent_ws_sm90"]
    tol = TOLERANCES["bfloat16"]
    assert rel_l2(o, ref["o"]) <= tol["o"], rel_l2(o, ref["o"])
    if case.ht:
        assert rel_l2(ht, ref["ht"]) <= tol["ht"], rel_l2(ht, ref["ht"])


@pytest.mark.parametrize("case", _HOST_CASES, ids=lambda c: c.name)
def test_host_path_intra_persist(case, simulated_kernels, monkeypatch):
    # FLASHQLA_TILELANG_INTRA_PERSIST=1: the inference forward's and the fused training forward's stage 1 take the
    # persistent kernel (its signature and CTAs per head checked against the simulated kernel), the rest unchanged
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_PERSIST", "1")
    monkeypatch.setenv("FLASHQLA_TILELANG_WS_OPTS", "fastexp,psplit,ostage")
    monkeypatch.setenv("FLASHQLA_TILELANG_FWD", "fused")
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "1")
    monkeypatch.setenv("FLASHQLA_TILELANG_GVA", "host")
    from flashqla.testing import poisoned_outputs
    tol = TOLERANCES["bfloat16"]
    be, inp, ref, spec, x = host_backend_inputs(case, needs_grad=False)
    with poisoned_outputs("cpu"):
        o, ht, saved, aux = be.forward(spec, x)
    assert simulated_kernels == ["fwd_intra_tb_sm90", "fwd_recurrent_ws_sm90"]
    assert simulated_kernels.keys[0][1][14:] == (True,)
    assert rel_l2(o, ref["o"]) <= tol["o"], rel_l2(o, ref["o"])
    if case.l2norm:
        return      # (the whole-V backward, which the fused training forward needs, takes no L2 norm)
    simulated_kernels.clear()
    simulated_kernels.keys.clear()
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "whole")
    be, inp, ref, spec, x = host_backend_inputs(case, needs_grad=True)
    with poisoned_outputs("cpu"):
        o, ht, saved, aux = be.forward(spec, x)
        monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "ws")
        grads = be.backward(spec, saved, aux, inp["do"], inp["dht"] if case.ht else None)
    assert simulated_kernels == ["fwd_intra_tbx_sm90", "fwd_recurrent_ws_sm90", "bwd_whole_sm90"]
    assert simulated_kernels.keys[0][1][14:] == (True,)
    assert rel_l2(o, ref["o"]) <= tol["o"], rel_l2(o, ref["o"])
    for name, gr in zip(("dq", "dk", "dv"), grads[:3]):
        assert rel_l2(gr, ref[name]) <= tol[name], (name, rel_l2(gr, ref[name]))


@pytest.mark.parametrize("variant", ["ws", "serial", "ws-noopts", "fused", "whole-bwd", "whole-bwd-gvapair",
                                     "ws-gvapair", "train-fused"])
@pytest.mark.parametrize("case", _HOST_CASES, ids=lambda c: c.name)
def test_host_path_with_simulated_kernels(case, variant, simulated_kernels, monkeypatch):
    # (a training forward under "fused" keeps the unfused kernels: the backward needs w; "whole-bwd" is the
    # whole-V fused backward, which calls with the L2 norm do not take; "whole-bwd-gvapair": the same with the GVA
    # pair sum in the kernel, FLASHQLA_TILELANG_GVA=pair, at ratio 2 only; "train-fused":
    # FLASHQLA_TILELANG_TRAIN_FUSED, the fused training forward ahead of the whole-V backward -- which the backward
    # then runs whatever FLASHQLA_TILELANG_BWD says by then)
    bwd = None
    gva_pair = variant.endswith("-gvapair")
    # (the pair sum is the default since session 23: the other variants ask for the separate sum)
    monkeypatch.setenv("FLASHQLA_TILELANG_GVA", "pair" if gva_pair else "host")
    if gva_pair:
        variant = variant[:-len("-gvapair")]
    train_fused = variant == "train-fused"
    if train_fused:
        monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "1")
        variant = "whole-bwd"
    if variant == "ws-noopts":
        monkeypatch.setenv("FLASHQLA_TILELANG_WS_OPTS", "none")
        variant = "ws"
    if variant == "whole-bwd":
        variant, bwd = "ws", variant.split("-")[0]
    monkeypatch.setenv("FLASHQLA_TILELANG_FWD", "fused" if train_fused else variant)
    if variant == "fused":
        variant = "ws"
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD", bwd or variant)
    be, inp, ref, spec, x = host_backend_inputs(case, needs_grad=True)
    ok, why = be.supports(spec)
    assert ok, why
    from flashqla.testing import poisoned_outputs
    with poisoned_outputs("cpu"):
        o, ht, saved, aux = be.forward(spec, x)
        if train_fused:
            monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "ws")
        grads = be.backward(spec, saved, aux, inp["do"], inp["dht"] if case.ht else None)
    sfx = "_ws" if variant == "ws" else ""
    if train_fused and not case.l2norm:
        assert simulated_kernels == ["fwd_intra_tbx_sm90", "fwd_recurrent_ws_sm90", "bwd_whole_sm90"]
    elif bwd == "whole" and not case.l2norm:
        assert simulated_kernels == ["fwd_intra_sm90", "fwd_recurrent_ws_sm90", f"bwd_{bwd}_sm90"]
        # (key entry 11: the in-kernel GVA pair sum, where asked for and the ratio is 2)
        pair_key = [k for n, k in simulated_kernels.keys if n == "bwd_whole_sm90"][0][10:11] == (True,)
        assert pair_key == (gva_pair and case.Hv == 2 * case.Hqk), simulated_kernels.keys
    else:
        assert simulated_kernels == ["fwd_intra_sm90", f"fwd_recurrent{sfx}_sm90", f"bwd_state{sfx}_sm90",
                                     "bwd_dqk_v2_sm90", "bwd_wy_v2_sm90"]
        # (the split backward's dqk / wy keys end in the GVA pair flag where asked for and the ratio is 2)
        keys = dict(simulated_kernels.keys)
        pair = gva_pair and case.Hv == 2 * case.Hqk
        assert (keys["bwd_dqk_v2_sm90"][5:] == (True,)) == pair and (keys["bwd_wy_v2_sm90"][6:] == (True,)) == pair
    errs = {"o": rel_l2(o, ref["o"])}
    if case.ht:
        errs["ht"] = rel_l2(ht, ref["ht"])
    else:
        assert ht is None
    for name, t in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
        if name in ref:
            errs[name] = rel_l2(t, ref[name])
        else:
            assert t is None, name
    tol = TOLERANCES["bfloat16"]
    assert all(e <= tol[n] for n, e in errs.items()), errs


@pytest.mark.compile
def test_hw_ex2_forward_kernels_lower():
    """``FLASHQLA_TILELANG_EX2=approx`` in the forward: stage 1's Tb form and the fused ws recurrence take each
    exponential as one MUFU.EX2 with no subnormal-range test (exp2f's FSETP, the only FSETP in these kernels)."""
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang
    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_fwd_ws_sm90 import build_fwd_ws
    from flashqla.backends.tilelang.chunk_intra_sm90 import build_intra

    def sass(func):
        text = kernel_sass(tilelang.compile(func, out_idx=None, target=TARGET))
        if text is None:
            pytest.skip("no cuobjdump / embedded cubin here")
        return text

    # the keys the inference forward uses at 16/32 (ops.intra_tb_kernel, ops.fwd_ws_kernel with fused=True)
    intra = ("bfloat16", "bfloat16", 128, 128, False, False, True, False, False, 128)
    ws = ("bfloat16", 128, 128, 128, False, False, False, False, 2, 1, True, True, False, False, True, True, False)
    for build, args in ((build_intra, intra), (build_fwd_ws, ws)):
        accurate, fast = sass(build(*args)), sass(build(*args, True))
        assert fast.count("MUFU.EX2") == accurate.count("MUFU.EX2") > 0, build.__name__
        assert fast.count("FSETP") == 0 < accurate.count("FSETP"), build.__name__
