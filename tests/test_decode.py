"""gated_delta_rule_decode: the pool-based decode / verify op, its torch and Triton implementations.

Every result is compared with the float64 token recurrence (flashqla.reference) run row by row from the
pool row's initial state.  The Triton kernel runs under TRITON_INTERPRET=1 when there is no GPU (set
below, before anything imports the kernel).
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import flashqla  # noqa: E402
from flashqla.decode import choose_decode_impl, decode_implementations, gated_delta_rule_decode  # noqa: E402
from flashqla.reference import recurrent_gated_delta_rule_ref  # noqa: E402
from flashqla.testing import TOLERANCES, poisoned_outputs, rel_l2, warm_up_for_capture  # noqa: E402

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_triton_ok, _triton_why = decode_implementations()["triton"]
# On the CPU the Triton kernel only runs under the interpreter.
CPU_IMPLS = ["torch"] + (["triton"] if _triton_ok and INTERPRET else [])


def make(B, T, Hqk, Hv, K, V, P, dtype=torch.float32, state_dtype=torch.float32, layout="KV", seed=0,
         device="cpu", l2norm=False, gate="logsigmoid"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hqk, K, generator=gen)
    k = torch.randn(B, T, Hqk, K, generator=gen)
    if not l2norm:
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, Hv, V, generator=gen)
    x = torch.randn(B, T, Hv, generator=gen)
    if gate == "strong":
        g = -torch.linspace(0.0, 3.0, Hv).exp() * torch.nn.functional.softplus(x)
    else:
        g = torch.nn.functional.logsigmoid(x)
    beta = torch.sigmoid(torch.randn(B, T, Hv, generator=gen))
    pool_kv = (torch.randn(P, Hv, K, V, generator=gen) * 0.5).to(state_dtype)
    pool = pool_kv if layout == "KV" else pool_kv.transpose(-1, -2).contiguous()
    t = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta.to(dtype), state=pool)
    return {n: x.to(device) for n, x in t.items()}


def as_kv(state, layout):
    return state if layout == "KV" else state.transpose(-1, -2)


def oracle(x, pool_before_kv, indices, scale=None, l2norm=False):
    """float64 o [B, T, Hv, V] (zeros for padded rows) and {pool row: final state [Hv, K, V]}."""
    B, T, Hv, V = x["v"].shape
    o = torch.zeros(B, T, Hv, V, dtype=torch.float64)
    finals = {}
    for b in range(B):
        i = b if indices is None else int(indices[b])
        if i < 0:
            continue
        sl = lambda t: t[b:b + 1].detach().cpu().double()  # noqa: E731
        ob, hb = recurrent_gated_delta_rule_ref(
            sl(x["q"]), sl(x["k"]), sl(x["v"]), sl(x["g"]), sl(x["beta"]), scale=scale,
            initial_state=pool_before_kv[i:i + 1].detach().cpu().double(), output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm, compute_dtype=torch.float64)
        o[b] = ob[0]
        finals[i] = hb[0]
    return o, finals


def bits(t):
    """Bit pattern of a tensor (NaN-safe equality)."""
    return t.detach().cpu().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def tol(dtype):
    return TOLERANCES[str(dtype).replace("torch.", "")]


def run_and_check(impl, B, T, Hqk, Hv, K, V, P, indices, dtype=torch.float32, state_dtype=torch.float32,
                  layout="KV", l2norm=False, scale=None, device="cpu", gate="logsigmoid", seed=0):
    x = make(B, T, Hqk, Hv, K, V, P, dtype, state_dtype, layout, seed=seed, device=device, l2norm=l2norm,
             gate=gate)
    idx = None if indices is None else torch.tensor(indices, dtype=torch.int32, device=device)
    used = set(range(B)) if indices is None else {i for i in indices if i >= 0}
    unused = [r for r in range(P) if r not in used]
    state = x["state"]
    if unused:  # rows the call must not touch hold NaN: any read-modify-write of them would show
        state[unused] = float("nan")
    before_kv = as_kv(state, layout).clone()
    before_bits = bits(state)
    ptr = state.data_ptr()
    with poisoned_outputs(device):
        o = gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], state, idx, scale=scale,
                                    use_qk_l2norm_in_kernel=l2norm, state_layout=layout, impl=impl)
    assert o.shape == (B, T, Hv, V) and o.dtype == dtype
    assert state.data_ptr() == ptr, "the pool must be updated in place"
    ref_o, ref_h = oracle(x, before_kv, indices, scale, l2norm)
    t_o = tol(dtype)["o"] if dtype != torch.float32 else 1e-5
    err_o = rel_l2(o, ref_o)
    assert err_o <= t_o, f"o: rel err {err_o:.3e} > {t_o}"
    if indices is not None:
        for b, i in enumerate(indices):
            if i < 0:
                assert torch.equal(o[b].cpu(), torch.zeros_like(o[b].cpu())), "padded slot: output must be zeros"
    after_kv = as_kv(state, layout)
    t_h = 1e-5 if state_dtype == torch.float32 else tol(torch.bfloat16)["ht"]
    for i, h in ref_h.items():
        err = rel_l2(after_kv[i], h)
        assert err <= t_h, f"pool row {i}: rel err {err:.3e} > {t_h}"
    after_bits = bits(state)
    for r in unused:
        assert torch.equal(after_bits[r], before_bits[r]), f"pool row {r} is not referenced but changed"
    return err_o


# ---------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("layout", ["KV", "VK"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
def test_decode_matches_oracle(impl, layout, state_dtype):
    # GVA 2 -> 4, a padded slot, a permuted pool, two tokens (verify), non-power-of-2 V.
    run_and_check(impl, B=3, T=2, Hqk=2, Hv=4, K=32, V=48, P=6, indices=[4, -1, 1],
                  state_dtype=state_dtype, layout=layout)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_decode_single_token_l2norm_gva(impl):
    run_and_check(impl, B=2, T=1, Hqk=1, Hv=4, K=16, V=16, P=3, indices=[2, 0], l2norm=True, scale=0.4)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_decode_without_indices_uses_row_b(impl):
    run_and_check(impl, B=2, T=3, Hqk=2, Hv=2, K=16, V=32, P=4, indices=None, layout="VK", gate="strong")


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_decode_all_padded(impl):
    run_and_check(impl, B=2, T=1, Hqk=1, Hv=2, K=8, V=8, P=2, indices=[-1, -1])


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_decode_bf16_inputs(impl):
    run_and_check(impl, B=2, T=2, Hqk=2, Hv=4, K=32, V=32, P=3, indices=[1, 2], dtype=torch.bfloat16,
                  state_dtype=torch.bfloat16, layout="VK")


def test_decode_torch_float64_is_exact():
    err = run_and_check("torch", B=2, T=4, Hqk=1, Hv=2, K=16, V=8, P=2, indices=[1, 0], dtype=torch.float64,
                        state_dtype=torch.float64)
    assert err < 1e-12


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_decode_strided_views(impl):
    """q/k/v as column slices of one fused projection, g/beta as slices too: no copy needed."""
    B, T, H, K, V, P = 2, 2, 2, 16, 16, 3
    gen = torch.Generator().manual_seed(3)
    qn = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    kn = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    fused = torch.cat([qn.flatten(2), kn.flatten(2), torch.randn(B, T, H * V + 2 * H, generator=gen)], -1)
    q = fused[..., :H * K].view(B, T, H, K)
    k = fused[..., H * K:2 * H * K].view(B, T, H, K)
    v = fused[..., 2 * H * K:2 * H * K + H * V].view(B, T, H, V)
    g = torch.nn.functional.logsigmoid(fused[..., -2 * H:-H]).transpose(0, 1).contiguous().transpose(0, 1)
    beta = fused[..., -H:]
    assert not q.is_contiguous() and not v.is_contiguous() and not g.is_contiguous()
    pool = torch.randn(P, H, K, V, generator=gen)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    x = dict(q=q, k=k, v=v, g=g, beta=beta)
    ref_o, ref_h = oracle(x, pool.clone(), [2, 0])
    o = gated_delta_rule_decode(q, k, v, g, beta, pool, idx, impl=impl)
    assert rel_l2(o, ref_o) < 1e-5
    for i, h in ref_h.items():
        assert rel_l2(pool[i], h) < 1e-5


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_decode_unchecked_out_of_range_is_never_written(impl):
    x = make(2, 1, 1, 2, 8, 8, 3)
    before = x["state"].clone()
    idx = torch.tensor([7, 1], dtype=torch.int32)
    o = gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], idx, impl=impl,
                                check_indices=False)
    assert torch.equal(o[0], torch.zeros_like(o[0]))
    assert torch.equal(x["state"][0], before[0]) and torch.equal(x["state"][2], before[2])
    assert not torch.equal(x["state"][1], before[1])


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_prefill_then_decode_equals_one_prefill(impl):
    """chunk op over the prompt -> pool rows; then decode steps of 1 and 2 tokens == chunk op over all."""
    B, Hqk, Hv, K, V, T0, T1 = 2, 1, 2, 16, 16, 37, 3
    x = make(B, T0 + T1, Hqk, Hv, K, V, 1, seed=5)
    h0 = torch.randn(B, Hv, K, V, generator=torch.Generator().manual_seed(9)) * 0.5
    full_o, full_h = flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                                     output_final_state=True, backend="reference")
    pre = {n: x[n][:, :T0] for n in ("q", "k", "v", "g", "beta")}
    o0, h = flashqla.chunk_gated_delta_rule(**pre, initial_state=h0, output_final_state=True, backend="reference")
    pool = torch.full((4, Hv, V, K), float("nan"))           # serving layout, rows 3 and 0 in use
    slots = torch.tensor([3, 0], dtype=torch.int32)
    pool[slots.long()] = h.transpose(-1, -2)
    outs = [o0]
    for a, b in ((T0, T0 + 1), (T0 + 1, T0 + 3)):
        step = {n: x[n][:, a:b] for n in ("q", "k", "v", "g", "beta")}
        outs.append(gated_delta_rule_decode(**step, state=pool, state_indices=slots, state_layout="VK", impl=impl))
    o = torch.cat(outs, 1)
    assert rel_l2(o, full_o) < 1e-5
    assert rel_l2(pool[slots.long()].transpose(-1, -2), full_h) < 1e-5
    ref_o, ref_h = recurrent_gated_delta_rule_ref(*(x[n].double() for n in ("q", "k", "v", "g", "beta")),
                                                  initial_state=h0.double(), output_final_state=True)
    assert rel_l2(o, ref_o) < 1e-5 and rel_l2(pool[slots.long()].transpose(-1, -2), ref_h) < 1e-5


def test_decode_empty_batch_and_zero_tokens():
    x = make(2, 1, 1, 2, 8, 8, 2)
    before = x["state"].clone()
    o = gated_delta_rule_decode(x["q"][:, :0], x["k"][:, :0], x["v"][:, :0], x["g"][:, :0], x["beta"][:, :0],
                                x["state"])
    assert o.shape == (2, 0, 2, 8) and torch.equal(x["state"], before)
    o = gated_delta_rule_decode(x["q"][:0], x["k"][:0], x["v"][:0], x["g"][:0], x["beta"][:0], x["state"],
                                torch.zeros(0, dtype=torch.int32))
    assert o.shape == (0, 1, 2, 8) and torch.equal(x["state"], before)


def test_decode_dispatch_choices():
    x = make(1, 1, 1, 1, 8, 8, 1)
    name, why = choose_decode_impl(x["q"], x["v"], x["g"], x["beta"], x["state"])
    assert name == "torch"                        # CPU: the torch path; triton only when named
    impls = decode_implementations()
    assert set(impls) == {"triton", "tilelang", "torch"}
    with pytest.raises(ValueError, match="decode impl 'tilelang' cannot serve this call"):
        gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], impl="tilelang")
    with pytest.raises(ValueError, match="unknown decode impl"):
        gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], impl="nope")
    x64 = make(1, 1, 1, 1, 8, 8, 1, state_dtype=torch.float64)
    if _triton_ok and INTERPRET:
        with pytest.raises(ValueError, match="state dtype torch.float64 not supported"):
            gated_delta_rule_decode(x64["q"], x64["k"], x64["v"], x64["g"], x64["beta"], x64["state"],
                                    impl="triton")


def _args(**over):
    x = make(2, 1, 2, 4, 8, 16, 3)
    x["state_indices"] = torch.tensor([0, 2], dtype=torch.int32)
    x.update(over)
    return x


@pytest.mark.parametrize("over,exc,match", [
    (dict(state_indices=torch.tensor([0, 3], dtype=torch.int32)), ValueError, r"state_indices\[1\] = 3 is out of range"),
    (dict(state_indices=torch.tensor([-2, 0], dtype=torch.int32)), ValueError, r"state_indices\[0\] = -2"),
    (dict(state_indices=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "both name pool row 1"),
    (dict(state_indices=torch.tensor([0, 1])), TypeError, "state_indices must be int32"),
    (dict(state_indices=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, r"state_indices must have shape \[B\]"),
    (dict(state=torch.zeros(3, 4, 16, 8)), ValueError, r"state must be a pool \[P, Hv, K, V\]"),
    (dict(state=torch.zeros(3, 4, 8, 16, dtype=torch.int32)), TypeError, "state must be float32 or bfloat16"),
    (dict(state=torch.zeros(3, 4, 16, 8).transpose(-1, -2)), ValueError, "inner two dims must be contiguous"),
    (dict(state_layout="kv"), ValueError, "state_layout must be"),
    (dict(k=torch.zeros(2, 1, 2, 8, dtype=torch.bfloat16)), TypeError, "q, k and v must share one dtype"),
    (dict(v=torch.zeros(2, 1, 3, 16)), ValueError, "g must have shape"),
    (dict(g=torch.zeros(2, 1, 3)), ValueError, "g must have shape"),
    (dict(beta=torch.zeros(2, 2, 4)), ValueError, "beta must have shape"),
    (dict(q=torch.zeros(2, 1, 8)), ValueError, "q must be 4-D"),
    (dict(scale="x"), TypeError, "scale must be a Python float"),
    (dict(state=[1]), TypeError, "state must be a torch.Tensor"),
])
def test_decode_validation(over, exc, match):
    with pytest.raises(exc, match=match):
        gated_delta_rule_decode(**_args(**over))


def test_decode_validation_pool_too_small_without_indices():
    x = _args(state_indices=None, state=torch.zeros(1, 4, 8, 16))
    with pytest.raises(ValueError, match="P >= B"):
        gated_delta_rule_decode(**x)


def test_decode_gqa_head_mismatch():
    x = _args(v=torch.zeros(2, 1, 3, 16), g=torch.zeros(2, 1, 3), beta=torch.zeros(2, 1, 3),
              state=torch.zeros(3, 3, 8, 16))
    with pytest.raises(ValueError, match="multiple of the query/key"):
        gated_delta_rule_decode(**x)


# ---------------------------------------------------------------------------------------------- GPU


def _gpu_impls():
    """Decode implementations that can run on this machine's GPU (empty without one)."""
    if not CUDA:
        return []
    out = ["triton"]
    from flashqla.decode import _tilelang_available
    if _tilelang_available()[0] and torch.cuda.get_device_capability() == (9, 0):
        out.append("tilelang")
    return out


GPU_IMPLS = _gpu_impls() or ["triton", "tilelang"]  # ids stay stable; the gpu marker skips without a GPU


def _need(impl):
    if impl not in _gpu_impls():
        pytest.skip(f"decode impl {impl!r} cannot run here")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("layout", ["KV", "VK"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
@pytest.mark.parametrize("T", [1, 4])
def test_decode_cuda_matches_oracle(impl, layout, state_dtype, T):
    _need(impl)
    run_and_check(impl, B=5, T=T, Hqk=4, Hv=8, K=128, V=128, P=9, indices=[7, -1, 0, 3, 8],
                  dtype=torch.bfloat16, state_dtype=state_dtype, layout=layout, device="cuda", l2norm=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_decode_cuda_big_batch_both_block_sizes(impl):
    """Enough rows for the wide V block (B * Hv > 512) and few rows for the narrow one, fp32 io, no norm."""
    _need(impl)
    run_and_check(impl, B=40, T=2, Hqk=4, Hv=16, K=128, V=128, P=48, indices=list(range(47, 7, -1)),
                  dtype=torch.float32, layout="VK", device="cuda")
    run_and_check(impl, B=3, T=3, Hqk=4, Hv=16, K=128, V=128, P=4, indices=None, dtype=torch.float16,
                  layout="KV", device="cuda", gate="strong")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_decode_cuda_gva_head_dims(impl):
    _need(impl)
    run_and_check(impl, B=3, T=2, Hqk=2, Hv=8, K=256, V=64, P=4, indices=[1, 3, 0], dtype=torch.bfloat16,
                  device="cuda", gate="strong")
    run_and_check(impl, B=2, T=1, Hqk=1, Hv=2, K=96, V=80, P=2, indices=None, dtype=torch.float16,
                  device="cuda")
    run_and_check(impl, B=2, T=3, Hqk=1, Hv=2, K=96, V=80, P=3, indices=[2, 0], dtype=torch.float16,
                  layout="VK", device="cuda", l2norm=True)
    if impl == "tilelang":  # head dims the tilelang kernel declines (K not a multiple of 32): a clear error
        x = make(2, 1, 1, 2, 72, 80, 2, dtype=torch.float16, device="cuda")
        with pytest.raises(ValueError, match="head dims"):
            gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], impl=impl)
        assert choose_decode_impl(x["q"], x["v"], x["g"], x["beta"], x["state"])[0] == "triton"


@pytest.mark.gpu
def test_decode_cuda_auto_order():
    x = make(1, 1, 1, 1, 64, 64, 1, dtype=torch.bfloat16, device="cuda")
    name, why = choose_decode_impl(x["q"], x["v"], x["g"], x["beta"], x["state"])
    first = "tilelang" if "tilelang" in _gpu_impls() else "triton"   # sm_90: tilelang, measured faster
    assert name == first and set(why) == {first}
    # a strided pool view goes past tilelang (named: a clear error)
    if "tilelang" in _gpu_impls():
        big = torch.zeros(4, 2, 64, 64, device="cuda")
        view = big[:, :1]
        with pytest.raises(ValueError, match="contiguous"):
            gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], view, impl="tilelang")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_decode_cuda_graph_capture(impl):
    _need(impl)
    B, T, Hqk, Hv, K, V, P = 4, 1, 2, 4, 128, 128, 8
    x = make(B, T, Hqk, Hv, K, V, P, dtype=torch.bfloat16, device="cuda", layout="VK")
    idx = torch.tensor([5, -1, 0, 2], dtype=torch.int32, device="cuda")
    pool = x["state"]
    eager_pool = pool.clone()
    args = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    # warm up (compiles the kernel) on a scratch copy, outside capture
    scratch = pool.clone()
    warm_up_for_capture(lambda: gated_delta_rule_decode(**args, state=scratch, state_indices=idx, state_layout="VK",
                                                        impl=impl))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_delta_rule_decode(**args, state=pool, state_indices=idx, state_layout="VK", impl=impl)
        with pytest.raises(RuntimeError, match="CUDA graph capture"):
            gated_delta_rule_decode(**args, state=scratch, state_indices=idx, state_layout="VK", check_indices=True,
                                    impl=impl)
    for _ in range(2):  # two decode steps: replay reads the state the previous replay wrote
        graph.replay()
        ref = gated_delta_rule_decode(**args, state=eager_pool, state_indices=idx, state_layout="VK", impl="torch")
        torch.cuda.synchronize()
        assert rel_l2(out, ref) < 2e-3        # bf16 outputs: rounding apart from the torch path
        assert rel_l2(pool, eager_pool) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["KV", "VK"])
def test_cuda_graph_prefill_then_decode(layout):
    """One CUDA graph holds a varlen prefill (backend auto, precomputed varlen metadata), the scatter of its
    final states into the pool and a decode step from the pool: replay == eager, and prefill + decode ==
    one prefill over the concatenation (float64 oracle)."""
    dev = "cuda"
    lens = [37, 64, 1, 130]
    N, Hqk, Hv, K, V, P = len(lens), 2, 4, 128, 128, 6
    gen = torch.Generator().manual_seed(3)
    tot = sum(lens)
    full = make(1, tot + N, Hqk, Hv, K, V, 1, dtype=torch.bfloat16, l2norm=True, seed=5)
    # sequence n: prefill tokens, then one decode token (the last N tokens, one per sequence)
    pre = {n: full[n][:, :tot].to(dev) for n in ("q", "k", "v", "g", "beta")}
    dec = {n: full[n][0, tot:].unsqueeze(1).to(dev) for n in ("q", "k", "v", "g", "beta")}  # [N, 1, ...]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    meta = flashqla.prepare_varlen(cu)
    slots = torch.tensor([4, 0, 5, 2], dtype=torch.int32, device=dev)
    inner = (K, V) if layout == "KV" else (V, K)
    pool = torch.zeros(P, Hv, *inner, device=dev)
    h0 = (0.1 * torch.randn(N, Hv, K, V, generator=gen)).to(dev)
    h0_l = h0 if layout == "KV" else h0.transpose(-1, -2).contiguous()

    def step(pool):
        _, ht = flashqla.chunk_gated_delta_rule(**pre, initial_state=h0_l, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, cu_seqlens=cu, varlen_meta=meta,
                                                state_layout=layout)
        pool.index_copy_(0, slots.long(), ht)
        return gated_delta_rule_decode(**dec, state=pool, state_indices=slots, use_qk_l2norm_in_kernel=True,
                                       state_layout=layout, check_indices=False)

    eager_pool = pool.clone()
    warm_up_for_capture(lambda: step(pool.clone()))  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(pool)
    graph.replay()
    ref = step(eager_pool)
    torch.cuda.synchronize()
    assert torch.equal(out, ref) and torch.equal(pool, eager_pool), "replay differs from eager"
    # the oracle: every sequence with its decode token appended, from h0
    for n, L in enumerate(lens):
        b0 = int(cu[n])
        seq = {k: torch.cat([full[k][:, b0:b0 + L], full[k][:, tot + n:tot + n + 1]], 1).double()
               for k in ("q", "k", "v", "g", "beta")}
        o_ref, h_ref = recurrent_gated_delta_rule_ref(
            seq["q"], seq["k"], seq["v"], seq["g"], seq["beta"], initial_state=h0[n:n + 1].cpu().double(),
            output_final_state=True, use_qk_l2norm_in_kernel=True, compute_dtype=torch.float64)
        assert rel_l2(out[n, 0], o_ref[0, -1]) <= tol(torch.bfloat16)["o"], n
        got = pool[int(slots[n])]
        got = got if layout == "KV" else got.transpose(-1, -2)
        assert rel_l2(got, h_ref[0]) <= tol(torch.bfloat16)["ht"], n


# ------------------------------------------------------------------------------------- compile-only

_COMPILE_CHECK = r"""
import sys, torch
from flashqla.backends.triton_decode import compile_for_target
variants = [
    # capability, K, V, io dtype, state dtype, VK layout, l2norm, indices
    ((9, 0), 128, 128, torch.bfloat16, torch.float32, True, True, True),
    ((9, 0), 128, 128, torch.bfloat16, torch.bfloat16, False, False, False),
    ((8, 0), 256, 64, torch.float16, torch.float16, True, False, True),
    ((8, 0), 96, 80, torch.float32, torch.float32, False, True, True),
]
for cap, K, V, io, st, vk, l2, idx in variants:
    ck = compile_for_target(cap, K, V, 2, io, torch.float32, st, vk, l2, idx)
    assert len(ck.asm["cubin"]) > 0 and "gdn_decode_kernel" in ck.asm["ptx"]
    print("compiled", cap, K, V, io, st, vk, l2, idx, flush=True)
print("ALL OK")
"""


@pytest.mark.compile
@pytest.mark.skipif(not _triton_ok, reason=f"triton unavailable: {_triton_why}")
def test_triton_decode_compiles_for_gpu():
    """The GPU code path (which the interpreter does not exercise) compiles to a cubin for SM80/SM90.
    In a subprocess: a process with TRITON_INTERPRET=1 cannot run Triton's compiler."""
    import subprocess
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_CHECK], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "ALL OK" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


# ------------------------------------------------------------------------------------------ example


def test_example_gated_deltanet_runs():
    """examples/gated_deltanet.py: prefill + decode (padded row, verify step) == one prefill over everything."""
    import importlib.util as iu
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "gated_deltanet.py")
    spec = iu.spec_from_file_location("_example_gated_deltanet", path)
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([]) == 0
    assert mod.main(["--bf16-state"]) == 0


# -------------------------------------------------------------------------------- tilelang lowering

_HAVE_TILELANG = __import__("importlib").util.find_spec("tilelang") is not None


@pytest.mark.compile
@pytest.mark.skipif(not _HAVE_TILELANG, reason="tilelang is not installed")
@pytest.mark.parametrize("args", [
    # io, g, beta, state dtype, K, V, BV, VK layout, l2norm, indices
    ("bfloat16", "float32", "bfloat16", "float32", 128, 128, 64, True, True, True),
    ("bfloat16", "float32", "bfloat16", "float32", 128, 128, 16, False, False, False),
    ("bfloat16", "float32", "bfloat16", "float32", 128, 128, 64, False, True, True),
    ("float16", "float32", "float32", "bfloat16", 256, 64, 32, True, False, True),
    ("float32", "bfloat16", "float32", "float16", 64, 128, 64, False, True, True),
], ids=lambda a: "-".join(str(x) for x in a))
def test_tilelang_decode_lowers_for_sm90a(args):
    """The TileLang decode kernel compiles for sm_90a without a GPU: 64-bit pool offsets, vector loads of the
    state, warp-shuffle reductions, no spills."""
    import tilelang
    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.decode_sm90 import build_decode
    from test_backend_tilelang import resource_usage

    kern = tilelang.compile(build_decode(*args), out_idx=None, target=TARGET)
    src = kern.get_kernel_source()
    assert "(int64_t)row" in src, "pool offsets must be 64-bit"
    if args[7]:   # [V, K]: sums over K are warp shuffles, no CTA barrier inside the token loop
        assert "warp_reduce_sum" in src and src.count("__syncthreads()") <= 2
        if args[3] == "float32":
            assert "float4" in src, "the VK pool rows should be read with 16-byte vector loads"
    else:         # [K, V]: per-group partials through shared memory
        assert src.count("__syncthreads()") >= 3
        if args[3] == "float32" and args[6] == 64:
            assert "float2" in src, "each lane should read its two V columns with one 8-byte load"
    usage = resource_usage(kern)
    print(f"decode{args}: {usage}")
    assert "LOCAL:0" in usage or "unavailable" in usage, f"register spills: {usage}"


def test_tilelang_decode_block_choice():
    from flashqla.backends.tilelang.decode_sm90 import block_v, supported_head_dims
    assert block_v(128, 128, 8 * 32) == 16 and block_v(128, 128, 64 * 32) == 64
    assert block_v(256, 64, 10_000) == 32 and block_v(128, 48, 10_000) == 16
    for K, V in ((128, 128), (256, 64), (64, 128), (128, 48)):
        assert supported_head_dims(K, V, block_v(K, V, 10_000))

