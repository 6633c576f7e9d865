"""The fused tilelang backward (``chunk_bwd_fused_sm90``, ``FLASHQLA_TILELANG_BWD=fused``).

* Its mbarrier protocol, read from the kernel's own source and stepped through a model of mbarrier phases
  under many random interleavings of the four roles: no deadlock for walks of 0..6 chunks, every barrier
  ends on a whole phase, and no barrier ever gets two phases ahead of a waiter (the parity would alias).
* Lowering for sm_90a (wgmma, TMA, setmaxnreg, 512 threads, shared memory within one CTA, no cross-warp
  AllReduce: its bar.sync id 1 is shared by every warpgroup).
* The V-block split on the CPU: the CPU model's gradients over the V blocks, summed as the host sums them,
  equal the whole-V gradients (the K-side gradients are linear in the V-contracted partials).
* On an sm_90 GPU: the oracle comparison of the shared backward cases and 20-run bitwise determinism.
"""

from __future__ import annotations

import importlib.util
import random
import re
from pathlib import Path

import pytest
import torch

from flashqla.testing import Case
from test_backend_tilelang import needs_sm90

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None
SRC = Path(__file__).resolve().parents[1] / "flashqla" / "backends" / "tilelang" / "chunk_bwd_fused_sm90.py"
ROLES = {"chain": 128, "prep": 128, "grad": 128, "producer": 32}


def _protocol(src: Path = SRC):
    """(barrier arrive counts, per-role list of (op, barrier expr, parity expr)) from the kernel source."""
    text = src.read_text()
    counts = {}
    for name, arg in re.findall(r"(\w+) = T\.alloc_barrier\(arrive_count=([^)]*)\)", text):
        val = eval(arg)                                   # noqa: S307 - our own source
        counts[name] = list(val) if isinstance(val, list) else [val]
    ops = {}
    marks = [(m.start(), m.group(1)) for m in re.finditer(r"# -{16} (\w+)", text)]
    for n, (pos, role) in enumerate(marks):
        end = marks[n + 1][0] if n + 1 < len(marks) else len(text)
        body = text[pos:end]
        seq = []
        for m in re.finditer(r"T\.barrier_(wait|arrive)\(([\w\[\]\s%/+()]+?)(?:,\s*(.+?))?\)\s*(?:#.*)?$", body, re.M):
            seq.append((m.group(1), m.group(2).strip(), (m.group(3) or "").strip()))
        ops[role] = seq
    return counts, ops


def _resolve(expr, i):
    """'full_in[0]' / 'empty_kg[s]' / 'pc_ready' -> (name, index) at step i."""
    m = re.fullmatch(r"(\w+)(?:\[(.+)\])?", expr)
    idx = eval(m.group(2), {}, {"i": i, "s": i % 2}) if m.group(2) else 0   # noqa: S307
    return m.group(1), idx


def _simulate(counts, ops, nchunks, rng, roles=None):
    """Step the roles' barrier ops for a walk of nchunks chunks, choosing a random runnable role each time.
    Returns the completed-phase counts; raises AssertionError on a deadlock or a parity alias.  ``roles``:
    role -> threads (default: this kernel's)."""
    ROLES = roles or globals()["ROLES"]
    done = {(b, j): 0 for b, c in counts.items() for j in range(len(c))}
    pending = dict.fromkeys(done, 0)
    pc = {r: 0 for r in ROLES}                            # program counter over (step, op)
    total = {r: nchunks * len(ops[r]) for r in ROLES}
    waits_seen = {}
    def current(r):
        """Role r's next op: (op, barrier (name, index), parity or None)."""
        i, k = divmod(pc[r], len(ops[r]))
        op, bexpr, pexpr = ops[r][k]
        parity = eval(pexpr, {}, {"i": i, "s": i % 2}) if op == "wait" else None   # noqa: S307
        return op, _resolve(bexpr, i), parity

    while True:
        runnable = []
        for r in ROLES:
            if pc[r] < total[r]:
                op, b, parity = current(r)
                if op == "arrive" or done[b] % 2 != parity:
                    runnable.append(r)
        if not runnable:
            stuck = {r: ops[r][pc[r] % len(ops[r])] for r in ROLES if pc[r] < total[r]}
            assert not stuck, f"deadlock at nchunks={nchunks}: {stuck}"
            break
        r = rng.choice(runnable)
        op, b, _ = current(r)
        if op == "arrive":
            pending[b] += ROLES[r]
            need = counts[b[0]][b[1]]
            assert pending[b] <= need, f"{b}: {pending[b]} arrivals in one phase, expected {need}"
            if pending[b] == need:
                pending[b] = 0
                done[b] += 1
                # a waiter that has not yet seen phase p must not find p + 2 complete (parity alias)
                for (r2, b2), seen in waits_seen.items():
                    assert b2 != b or done[b] - seen <= 2, f"{b} ran two phases ahead of {r2}"
        else:
            waits_seen[(r, b)] = done[b]
        pc[r] += 1
    assert all(v == 0 for v in pending.values()), f"partial phases left: {pending}"
    return done


def test_fused_protocol_is_parsed():
    counts, ops = _protocol()
    assert set(ops) == set(ROLES)
    assert all(ops[r] for r in ROLES)
    # every barrier the roles use is allocated, and every allocated one is used
    used = {re.fullmatch(r"(\w+)(?:\[.*\])?", e).group(1) for seq in ops.values() for _, e, _ in seq}
    assert used == set(counts)


@pytest.mark.parametrize("nchunks", [0, 1, 2, 3, 4, 6])
def test_fused_protocol_no_deadlock(nchunks):
    counts, ops = _protocol()
    rng = random.Random(nchunks)
    for _ in range(300):
        done = _simulate(counts, ops, nchunks, rng)
    # the input ring and the single-buffered tiles complete one phase per chunk (the ring: per two slots)
    assert done[("full_in", 0)] == nchunks and done[("empty_in", 0)] == nchunks
    assert done[("full_kg", 0)] + done[("full_kg", 1)] == nchunks


def test_fused_protocol_model_catches_a_broken_protocol():
    counts, ops = _protocol()
    # grad never frees dSb: the chain's second c1 waits forever
    broken = dict(ops, grad=[o for o in ops["grad"] if o[1] != "dsb_free"])
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(counts, broken, 3, random.Random(0))
    # one role too many arrives on q's empty barrier
    broken = dict(ops, producer=ops["producer"] + [("arrive", "empty_in[0]", "")])
    with pytest.raises(AssertionError, match="arrivals in one phase|deadlock|partial"):
        for seed in range(20):
            _simulate(counts, broken, 3, random.Random(seed))


def _variants():
    return [("bfloat16", "bfloat16", 128, 128, False, False), ("bfloat16", "float32", 128, 128, True, True),
            ("float16", "float16", 128, 128, True, False)]


@pytest.mark.compile
@pytest.mark.parametrize("args", _variants(), ids=lambda x: str(x).replace(" ", ""))
def test_fused_kernel_lowers_for_sm90a(args):
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang

    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_bwd_fused_sm90 import build_bwd_fused

    kern = tilelang.compile(build_bwd_fused(*args), out_idx=None, target=TARGET)
    check_ws_kernel(kern, f"bwd_fused{args}")


def check_ws_kernel(kern, label: str, max_stack: int = 64) -> None:
    """What a lowered warp-specialised backward (four 128-thread roles) must show: wgmma and TMA, 512 threads,
    setmaxnreg .inc only above the launch's 128 registers per thread and .dec only below (anything else is an
    illegal instruction on the device) within the 64K-register file, one __syncthreads (after the barrier init;
    the roles sync on named barriers of their own), no cross-warp AllReduce (its bar.sync 1, 128 would be shared
    by the warpgroups), no local memory, at most ``max_stack`` bytes of stack, shared memory within one CTA."""
    from test_backend_tilelang import _SM90_SMEM, _smem_bytes, resource_usage

    src = kern.get_kernel_source()
    assert "wgmma" in src and "tma_load" in src
    assert "__launch_bounds__(512, 1)" in src
    inc = [int(x) for x in re.findall(r"warpgroup_reg_alloc<(\d+)>", src)]
    dec = [int(x) for x in re.findall(r"warpgroup_reg_dealloc<(\d+)>", src)]
    assert len(inc) + len(dec) == 4, (inc, dec)
    assert all(n >= 128 for n in inc) and all(n <= 128 for n in dec), (inc, dec)
    assert sum(inc) + sum(dec) <= 512, (inc, dec)
    assert src.count("__syncthreads()") == 1
    assert not re.search(r"AllReduce<tl::SumOp, (64|128), ", src)
    usage = resource_usage(kern)
    print(f"{label}: {usage}")
    assert "LOCAL:0" in usage or "unavailable" in usage, usage
    stack = re.search(r"STACK:(\d+)", usage)
    assert stack is None or int(stack.group(1)) <= max_stack, f"spills: {usage}"
    if "unavailable" not in usage:
        assert _smem_bytes(kern, usage) <= _SM90_SMEM, usage


@pytest.mark.parametrize("case", [
    Case("vsplit_varlen", 1, 1, 128, 128, seqlens=(1, 70, 0, 129, 9), h0=False, ht=False),
    Case("vsplit_gva_state", 1, 2, 128, 128, seqlens=(65, 0, 130)),
    Case("vsplit_strong", 2, 2, 128, 128, B=1, T=100, gate="strong"),
], ids=lambda c: c.name)
def test_v_block_partials_sum_to_the_whole(case):
    """The CPU model over each 64-column V block, summed as the host sums the kernel's partials, equals the
    model over the whole V (float64): the split is exact up to rounding."""
    from flashqla.backends.tilelang.chunk_bwd_fused_ref import bwd_fused_ref
    from test_tilelang_bwd_fused_ref import _saved

    inp, st, scale = _saved(case, torch.float64, None)
    B, T = inp["q"].shape[:2]
    cu = inp["cu_seqlens"] if inp["cu_seqlens"] is not None else [b * T for b in range(B + 1)]

    def run(cols):
        return bwd_fused_ref(inp["q"], inp["k"], inp["v"][..., cols], inp["beta"], st["G"], st["X"],
                             st["h"][..., cols], st["v_new"][..., cols], st["w"], inp["do"][..., cols],
                             inp["dht"][..., cols] if case.ht else None, scale=scale, cu_seqlens=cu)

    whole = run(slice(None))
    parts = [run(slice(0, 64)), run(slice(64, 128))]
    for n, name in enumerate(("dq", "dk", "dv", "dg", "db", "dh0")):
        got = torch.cat([p[n] for p in parts], -1) if name in ("dv", "dh0") else parts[0][n] + parts[1][n]
        err = (got - whole[n]).abs().max().item() / max(whole[n].abs().max().item(), 1e-30)
        assert err < 1e-12, (name, err)


# ---- GPU ------------------------------------------------------------------------------------------------

def gpu_backward_matches_oracle(variant: str, kernel: str, dtype, monkeypatch) -> None:
    """The shared backward GPU cases without the L2 norm through ``FLASHQLA_TILELANG_BWD=variant``, at the
    Step 2 tolerances; ``kernel`` must have been built."""
    import test_backend_tilelang as tb
    from flashqla.backends.tilelang import _compile

    monkeypatch.setenv("FLASHQLA_TILELANG_BWD", variant)
    ran = 0
    for case in tb._GPU_BWD_CASES:
        if case.l2norm:
            continue
        tb._gpu_case(case, dtype, grads=True)
        ran += 1
    assert ran >= 3
    assert any(n == kernel for n, _ in _compile.cached_kernels())


def gpu_backward_deterministic(variant: str, monkeypatch, runs: int = 20) -> None:
    """``runs`` forward+backward calls through ``FLASHQLA_TILELANG_BWD=variant`` give bitwise equal gradients."""
    import flashqla
    from flashqla.testing import make_inputs

    monkeypatch.setenv("FLASHQLA_TILELANG_BWD", variant)
    case = Case(f"{variant}_det", 2, 4, 128, 128, seqlens=(300, 1, 700, 64), l2norm=False)
    inp = make_inputs(case, torch.bfloat16, "cuda")
    leaves = [inp[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]

    def grads():
        o, _ = flashqla.chunk_gated_delta_rule(*leaves, scale=case.scale, cu_seqlens=inp["cu_seqlens"],
                                               backend="tilelang")
        return torch.autograd.grad(o, leaves, inp["do"])

    first = grads()
    for _ in range(runs):
        for a, b in zip(first, grads()):
            assert torch.equal(a, b)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_fused_backward_matches_oracle(dtype, monkeypatch):
    gpu_backward_matches_oracle("fused", "bwd_fused_sm90", dtype, monkeypatch)


@pytest.mark.gpu
@needs_sm90
def test_gpu_fused_backward_deterministic(monkeypatch):
    gpu_backward_deterministic("fused", monkeypatch)
