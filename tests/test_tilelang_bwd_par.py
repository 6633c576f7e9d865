"""The per-chunk backward kernels (``chunk_bwd_dqk_v2_sm90``, ``chunk_bwd_wy_v2_sm90``; their first version
was retired in session 9): lowering for sm_90a, the host path with simulated kernels, and CPU proofs of the
rewrites of the math in this second version:

* wy: ``rowsum(dA * KKn * beta)_r = beta_r rowsum(dA * KKn)_r`` (one reduction fewer) and the in-kernel
  order of the dg / dbeta terms, against the first version's formulas in float64;
* dqk: the last row's gate term ``exp(G_last) sum_a sdr_a + sum_t D_t dD_t`` as the kernel splits it
  over 32 lanes (4 + 2 terms per lane, then a butterfly ``warp_reduce_sum``), against a float64 sum;
* wy: the W tile's row stride 65 makes the transposed read of ``W + W^T`` bank-conflict free (the
  per-lane index formula of the generated CUDA, replayed).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None
C = 64


def _v2_variants():
    return [("dqk", ("bfloat16", 128, 128, False)), ("dqk", ("float16", 128, 128, True)),
            ("wy", ("bfloat16", "bfloat16", 128, 128, False)), ("wy", ("float16", "float32", 128, 128, True))]


@pytest.mark.compile
@pytest.mark.parametrize("kind,args", _v2_variants(), ids=lambda x: str(x).replace(" ", ""))
def test_v2_kernels_lower_for_sm90a(kind, args):
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang

    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_bwd_dqk_v2_sm90 import build_bwd_dqk_v2
    from flashqla.backends.tilelang.chunk_bwd_wy_v2_sm90 import build_bwd_wy_v2
    from test_backend_tilelang import resource_usage

    builder = {"dqk": build_bwd_dqk_v2, "wy": build_bwd_wy_v2}[kind]
    kern = tilelang.compile(builder(*args), out_idx=None, target=TARGET)
    src = kern.get_kernel_source()
    assert "wgmma" in src and "tma_load" in src
    usage = resource_usage(kern)
    print(f"{kind}_v2{args}: {usage}")
    assert "LOCAL:0" in usage or "unavailable" in usage, f"register spills: {usage}"
    if kind == "wy":
        # two CTAs per SM: <= 128 registers at 256 threads
        assert "__launch_bounds__(256, 2)" in src
        import re
        m = re.search(r"REG:(\d+)", usage)
        if m:
            assert int(m.group(1)) <= 128
    else:
        # no serial per-thread loop over the K / C rows any more
        assert "for (int a = 0; a < 128" not in src
        assert "warp_reduce_sum" in src


def test_host_path_v2_with_simulated_kernels(monkeypatch):
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import test_backend_tilelang as tb
    from flashqla.backends.tilelang import ops

    calls = []

    def fake_get_kernel(name, builder, key):
        func = builder(*key)

        def run(*args):
            tb._check_signature(func, args)
            calls.append(name)
            with torch.no_grad():
                tb._SIMULATORS[name](key, *args)
        return run

    monkeypatch.setattr(ops, "get_kernel", fake_get_kernel)
    from flashqla.testing import rel_l2, poisoned_outputs, TOLERANCES

    case = tb._HOST_CASES[0]
    be, inp, ref, spec, x = tb.host_backend_inputs(case, needs_grad=True)
    with poisoned_outputs("cpu"):
        o, ht, saved, aux = be.forward(spec, x)
        grads = be.backward(spec, saved, aux, inp["do"], inp["dht"] if case.ht else None)
    assert "bwd_dqk_v2_sm90" in calls and "bwd_wy_v2_sm90" in calls
    tol = TOLERANCES["bfloat16"]
    for name, t in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
        if name in ref:
            assert rel_l2(t, ref[name]) <= tol[name], name


def _chunk(seed, ragged):
    g = torch.Generator().manual_seed(seed)
    G = torch.cumsum(-torch.nn.functional.softplus(torch.randn(C, generator=g, dtype=torch.float64) * 3), 0)
    b = torch.rand(C, generator=g, dtype=torch.float64)
    if ragged:
        b[ragged:] = 0.0
    KK = torch.randn(C, C, generator=g, dtype=torch.float64)
    dAraw = torch.randn(C, C, generator=g, dtype=torch.float64)
    nk = torch.rand(C, generator=g, dtype=torch.float64) + 0.5
    return G, b, KK, dAraw, nk


@pytest.mark.parametrize("seed,ragged", [(0, 0), (1, 37), (2, 1)])
def test_wy_v2_gate_terms_match_v1(seed, ragged):
    """v2's dg / dbeta assembly (fp32, kernel order) equals v1's (float64)."""
    G, b, KK, dAraw, nk = _chunk(seed, ragged)
    r, j = torch.meshgrid(torch.arange(C), torch.arange(C), indexing="ij")
    strict = r > j

    def v1(dt):
        G_, b_, KK_, dA_, nk_ = (t.to(dt) for t in (G, b, KK, dAraw, nk))
        dA = torch.where(strict, -dA_, 0.0)
        KKn = torch.where(strict, KK_ * nk_[:, None] * nk_[None] * torch.exp(G_[:, None] - G_[None]), 0.0)
        dAA = dA * KKn
        bA = dAA.sum(1)
        dAAb = dAA * b_[:, None]
        return bA, dAAb.sum(1), dAAb.sum(0)

    def v2(dt):
        G_, b_, KK_, dA_, nk_ = (t.to(dt) for t in (G, b, KK, dAraw, nk))
        E = torch.exp(torch.where(strict, G_[:, None] - G_[None], torch.zeros((), dtype=dt)))
        KKf = torch.where(strict, -dA_ * KK_ * nk_[:, None] * nk_[None] * E, 0.0)
        bA = KKf.sum(1)
        cA = (KKf * b_[:, None]).sum(0)
        return bA, b_ * bA, cA

    ref = v1(torch.float64)
    got = v2(torch.float32)
    for x, y in zip(got, ref):
        assert torch.isfinite(x).all()
        assert torch.allclose(x.double(), y, rtol=1e-5, atol=1e-5 * float(y.abs().max()) + 1e-12)


def _butterfly(vals):
    """warp_reduce_sum over 32 lanes (xor shuffles 16, 8, 4, 2, 1), every lane ends with the sum."""
    v = vals.clone()
    for off in (16, 8, 4, 2, 1):
        v = v + v[torch.arange(32) ^ off]
    return v


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dqk_v2_last_row_term(seed):
    g = torch.Generator().manual_seed(seed)
    sdr = torch.randn(128, generator=g, dtype=torch.float64)
    dD = torch.randn(C, generator=g, dtype=torch.float64)
    G = torch.cumsum(-torch.rand(C, generator=g, dtype=torch.float64) * 2, 0)
    ref = torch.exp(G[-1]) * sdr.sum() + (torch.exp(G[-1] - G) * dD).sum()
    s32, d32, G32 = sdr.float(), dD.float(), G.float()
    lane = torch.arange(32)
    part = (s32[lane] + s32[lane + 32] + s32[lane + 64] + s32[lane + 96]) * torch.exp(G32[-1]) \
        + torch.exp(G32[-1] - G32[lane]) * d32[lane] + torch.exp(G32[-1] - G32[lane + 32]) * d32[lane + 32]
    tot = _butterfly(part)
    assert torch.allclose(tot, tot[0].expand(32))
    assert abs(float(tot[0]) - float(ref)) <= 1e-5 * (float(sdr.abs().sum() + dD.abs().sum()) + 1)
    # every index 0..127 of sdr and 0..63 of dD is read exactly once
    assert sorted(torch.cat([lane, lane + 32, lane + 64, lane + 96]).tolist()) == list(range(128))
    assert sorted(torch.cat([lane, lane + 32]).tolist()) == list(range(64))


def test_wy_v2_transposed_w_read_is_conflict_free():
    """Ws[r, j] = W[r, j] + W[j, r]: the generated loop (i = 0..15, thread tx) reads W at
    ``i * 4 + (tx >> 6) + (tx & 63) * WPAD`` for the transposed term; 4-byte words, 32 banks."""
    from flashqla.backends.tilelang.chunk_bwd_wy_v2_sm90 import WPAD
    for pad, want_free in ((WPAD, True), (64, False)):
        worst = 1
        for i in range(16):
            for warp in range(8):
                tx = torch.arange(32) + 32 * warp
                word = i * 4 + (tx >> 6) + (tx & 63) * pad
                banks = word % 32
                worst = max(worst, int(torch.bincount(banks, minlength=32).max()))
        assert (worst == 1) == want_free, (pad, worst)


@pytest.mark.parametrize("x16", [False, True], ids=["x_fp32", "x_16bit"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gva_sum_is_the_group_sum_rounded_once(ratio, dtype, impl, x16):
    """``backends.gva.gva_sum`` (session 10: the backwards' GVA sum and cast in one pass; its Triton kernel
    under the interpreter here) against the float64 sum of each query head's value heads, rounded once to the
    output dtype; x itself is left as it was."""
    import functools
    import os

    from flashqla.backends import gva
    if impl == "triton" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
    gva_sum = functools.partial(gva.gva_sum, use_triton=impl == "triton")

    g = torch.Generator().manual_seed(ratio)
    NT, Hqk, D = 37, 3, 16          # NT * Hqk = 111 rows: not a multiple of the kernel's row block
    x = torch.randn(NT, Hqk * ratio, D, generator=g) * torch.logspace(-3, 3, D)
    if x16:                          # the tilelang backward writes its per-value-head dq / dk in 16 bits
        x = x.to(dtype)
    before = x.clone()
    out = gva_sum(x, ratio, dtype)
    assert out.dtype == dtype and out.shape == (NT, Hqk, D)
    ref = x.double().view(NT, Hqk, ratio, D).sum(2)
    # one rounding to dtype after an fp32 sum: within one unit of the dtype's last place of the exact sum
    # (fp32 adds of <= 4 terms are far below that), and exactly the rounded fp32 sum at ratio <= 2
    assert torch.equal(x, before)
    # (atol: fp16's subnormals below its smallest normal number have coarser absolute spacing)
    torch.testing.assert_close(out.double(), ref, rtol=torch.finfo(dtype).eps, atol=torch.finfo(dtype).tiny)
    # (Triton's interpreter narrows fp32 to bf16 by truncation, whatever the rounding asked for; compiled
    # kernels round to nearest even, like torch: the bound above holds for both)
    if ratio <= 2 and not (impl == "triton" and dtype == torch.bfloat16):
        assert torch.equal(out, x.float().view(NT, Hqk, ratio, D).sum(2).to(dtype))
    # value head h belongs to query head h // ratio (a transposed grouping would fail here)
    if ratio > 1:
        y = torch.zeros(NT, Hqk * ratio, D)
        y[:, ratio] = 1.0                           # the first value head of query head 1
        assert gva_sum(y, ratio, dtype)[:, 1].eq(1).all() and gva_sum(y, ratio, dtype)[:, 0].eq(0).all()


def test_gva_sum_switch(monkeypatch):
    """FLASHQLA_GVA_SUM picks the form (the Triton kernel by default where it can run, else torch); a bad
    value raises naming the variable."""
    from flashqla.backends import gva

    calls = []
    monkeypatch.setattr(gva, "_torch_sum", lambda x, r, dt: calls.append("torch") or x[:, ::r].to(dt))
    x = torch.randn(5, 4, 8)
    monkeypatch.setenv("FLASHQLA_GVA_SUM", "torch")
    gva.gva_sum(x, 2, torch.bfloat16)
    assert calls == ["torch"]
    for env in ("triton", None):
        if env is None:
            monkeypatch.delenv("FLASHQLA_GVA_SUM", raising=False)
        else:
            monkeypatch.setenv("FLASHQLA_GVA_SUM", env)
        assert gva.gva_sum_impl() == "triton"
        gva.gva_sum(x, 2, torch.bfloat16)
        # the kernel where Triton can run (CUDA, or the interpreter), else the PyTorch form
        assert calls == ["torch"] * (1 if gva._triton_ok(x) else 2 + (env is None))
    monkeypatch.setenv("FLASHQLA_GVA_SUM", "cuda")
    with pytest.raises(ValueError, match="FLASHQLA_GVA_SUM"):
        gva.gva_sum(x, 2, torch.bfloat16)
