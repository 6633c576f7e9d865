"""The whole-V fused tilelang backward (``chunk_bwd_whole_sm90``, ``FLASHQLA_TILELANG_BWD=whole``, or ``auto`` where
its cost model says it pays; session 14, on the H200 since session 15).

* Its mbarrier protocol, read from the kernel's own source and stepped through a model of mbarrier phases under
  many random interleavings of the four roles: no deadlock for walks of 0..6 chunks, every barrier ends on a
  whole phase, and no barrier ever gets two phases ahead of a waiter (the parity would alias); the model fails a
  broken protocol.
* Lowering for sm_90a: wgmma, TMA, 512 threads, setmaxnreg within the register file, no cross-warp AllReduce (its
  bar.sync id 1 would be shared by every warpgroup), no local memory, shared memory within one CTA.
* Its algebra (the w-free chain) is ``bwd_fused_ref(w_free=True)``, checked in ``test_tilelang_bwd_fused_ref``.
* The automatic choice between it and the split backward.
* On an sm_90 GPU: the oracle comparison of the shared backward cases and 20-run bitwise determinism.

(The first fused backward, ``chunk_bwd_fused_sm90`` at BV = 64, and its tests were retired in session 15; the
protocol model and the lowering checks written for it serve this kernel.)
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
SRC = Path(__file__).resolve().parents[1] / "flashqla" / "backends" / "tilelang" / "chunk_bwd_whole_sm90.py"
# (zero: the GVA pair's zeroing warp, built with pair_zero only; the model runs it always, a superset)
ROLES = {"chain": 128, "value": 128, "key": 128, "producer": 32, "zero": 32}


LIGHT_HALO = re.compile(r"# ~~ light halo ~~.*?# ~~ light halo end ~~", re.S)


def _barrier_ops(body: str) -> list:
    return [(m.group(1), m.group(2).strip(), (m.group(3) or "").strip()) for m in re.finditer(
        r"T\.barrier_(wait|arrive)\(([\w\[\]\s%/+()]+?)(?:,\s*(.+?))?\)\s*(?:#.*)?$", body, re.M)]


def _role_bodies(text: str) -> dict:
    marks = [(m.start(), m.group(1)) for m in re.finditer(r"# -{16} (\w+)", text)]
    return {role: text[pos:(marks[n + 1][0] if n + 1 < len(marks) else len(text))]
            for n, (pos, role) in enumerate(marks)}


def _light_protocol(src: Path = SRC) -> dict:
    """Per role, the barrier ops of its light_halo steps (the ``# ~~ light halo ~~`` regions), where it has one."""
    out = {}
    for role, body in _role_bodies(src.read_text()).items():
        regions = LIGHT_HALO.findall(body)
        if regions:
            assert len(regions) == 1, role
            out[role] = _barrier_ops(regions[0])
    return out


def _protocol(src: Path = SRC):
    """(barrier arrive counts, per-role list of (op, barrier expr, parity expr)) from the kernel source: the main
    loops' (the light_halo steps' regions are left out: ``_light_protocol``, which a test holds equal to these)."""
    text = src.read_text()
    counts = {}
    for name, arg in re.findall(r"(\w+) = T\.alloc_barrier\(arrive_count=([^)]*)\)", text):
        val = eval(arg)                                   # noqa: S307 - our own source
        counts[name] = list(val) if isinstance(val, list) else [val]
    ops = {role: _barrier_ops(LIGHT_HALO.sub("", body)) for role, body in _role_bodies(text).items()}
    return counts, ops


def _resolve(expr, i):
    """'full_in[0]' / 'vec_ready[s]' / 'dsb_ready' -> (name, index) at step i."""
    m = re.fullmatch(r"(\w+)(?:\[(.+)\])?", expr)
    idx = eval(m.group(2), {}, {"i": i, "s": i % 2}) if m.group(2) else 0   # noqa: S307
    return m.group(1), idx


def _simulate(counts, ops, nchunks, rng, roles=None):
    """Step the roles' barrier ops for a walk of nchunks chunks, choosing a random runnable role each time.
    Returns the completed-phase counts; raises AssertionError on a deadlock or a parity alias.  ``roles``:
    role -> threads (default: this kernel's)."""
    roles = roles or ROLES
    done = {(b, j): 0 for b, c in counts.items() for j in range(len(c))}
    pending = dict.fromkeys(done, 0)
    pc = {r: 0 for r in roles}                            # program counter over (step, op)
    total = {r: nchunks * len(ops[r]) for r in roles}
    waits_seen = {}
    def current(r):
        """Role r's next op: (op, barrier (name, index), parity or None)."""
        i, k = divmod(pc[r], len(ops[r]))
        op, bexpr, pexpr = ops[r][k]
        parity = eval(pexpr, {}, {"i": i, "s": i % 2}) if op == "wait" else None   # noqa: S307
        return op, _resolve(bexpr, i), parity

    while True:
        runnable = []
        for r in roles:
            if pc[r] < total[r]:
                op, b, parity = current(r)
                if op == "arrive" or done[b] % 2 != parity:
                    runnable.append(r)
        if not runnable:
            stuck = {r: ops[r][pc[r] % len(ops[r])] for r in roles if pc[r] < total[r]}
            assert not stuck, f"deadlock at nchunks={nchunks}: {stuck}"
            break
        r = rng.choice(runnable)
        op, b, _ = current(r)
        if op == "arrive":
            pending[b] += roles[r]
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


def check_ws_kernel(kern, label: str) -> None:
    """What a lowered warp-specialised backward (four 128-thread roles) must show: wgmma and TMA, 512 threads,
    setmaxnreg .inc only above the launch's 128 registers per thread and .dec only below (anything else is an
    illegal instruction on the device) within the 64K-register file, one __syncthreads (after the barrier init;
    the roles sync on named barriers of their own), no cross-warp AllReduce (its bar.sync 1, 128 would be shared
    by the warpgroups), no local memory, at most 112 bytes of stack (136 over segments; spills of the key role,
    which keeps its wgmma pipelined at 160 registers only with them), wgmma not serialised by ptxas, shared memory
    within one CTA."""
    from test_backend_tilelang import _SM90_SMEM, _smem_bytes, assert_wgmma_pipelined, resource_usage

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
    assert_wgmma_pipelined(kern, label)
    assert "LOCAL:0" in usage or "unavailable" in usage, usage
    stack = re.search(r"STACK:(\d+)", usage)
    # (the walk over segments, "halo": 136 bytes in session 18 -- the segment's scalars from its tables, also
    # loop-invariant; an if around the key role's dk stores instead of a row bound had serialised its wgmma)
    limit = 136 if "halo" in label else 112
    assert stack is None or int(stack.group(1)) <= limit, f"spills: {usage}"
    if "unavailable" not in usage:
        assert _smem_bytes(kern, usage) <= _SM90_SMEM, usage


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


def assert_equal_but_compiler_bits(a, b, name: str, other: str) -> None:
    """``a`` equals ``b`` (the same gradient from two builds whose code for it is the same), bitwise or, where ptxas /
    NVVM treated the builds differently, within 1e-5 relative L2 (printed)."""
    if not torch.equal(a, b):
        rel = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
        print(f"{name}: not bitwise equal to {other}, relative L2 {rel:.1e}")
        assert rel < 1e-5, (name, rel)


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


def gpu_switch_bitwise(case, dtype, monkeypatch, switch: str, base: str, other: str, runs: int = 20) -> None:
    """Forward + backward of ``case`` under ``switch=base`` and ``switch=other``, each on memory the caching
    allocator has just held NaN in (so a row no CTA wrote would show): every gradient of ``other`` finite and
    bitwise ``base``'s (a compiler's last-bit difference is allowed within 1e-5 and printed), then ``runs`` runs of
    ``other`` bitwise equal."""
    import flashqla
    from flashqla.testing import make_inputs

    inp = make_inputs(case, dtype, "cuda")
    leaves = [inp[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]

    def grads(mode):
        monkeypatch.setenv(switch, mode)
        junk = torch.full((1 << 28,), float("nan"), dtype=torch.float32, device="cuda")
        del junk
        o, ht = flashqla.chunk_gated_delta_rule(*leaves[:5], scale=case.scale, initial_state=leaves[5],
                                                output_final_state=True, cu_seqlens=inp["cu_seqlens"],
                                                backend="tilelang")
        return torch.autograd.grad((o, ht), leaves, (inp["do"], inp["dht"]))

    ref, got = grads(base), grads(other)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, ref):
        assert torch.isfinite(a).all(), (case.name, name)
        assert_equal_but_compiler_bits(a, b, f"{case.name} {name}", f"{switch}={base}")
    for _ in range(runs):
        for a, b in zip(got, grads(other)):
            assert torch.equal(a, b), case.name


def test_whole_protocol_is_parsed():
    counts, ops = _protocol(SRC)
    assert set(ops) == set(ROLES)
    assert all(ops[r] for r in ROLES)
    used = {re.fullmatch(r"(\w+)(?:\[.*\])?", e).group(1) for seq in ops.values() for _, e, _ in seq}
    assert used == set(counts)
    # each input's readers arrive on its empty barrier as many times as its count says
    per_input = {}
    for role, seq in ops.items():
        for op, e, _ in seq:
            m = re.fullmatch(r"empty_in\[(\d)\]", e)
            if op == "arrive" and m:
                per_input[int(m.group(1))] = per_input.get(int(m.group(1)), 0) + ROLES[role]
    assert [per_input[j] for j in range(7)] == counts["empty_in"]


@pytest.mark.parametrize("nchunks", [0, 1, 2, 3, 4, 6])
def test_whole_protocol_no_deadlock(nchunks):
    counts, ops = _protocol(SRC)
    rng = random.Random(nchunks)
    for _ in range(300):
        done = _simulate(counts, ops, nchunks, rng, ROLES)
    assert all(done[("full_in", j)] == nchunks and done[("empty_in", j)] == nchunks for j in range(7))
    assert done[("vec_ready", 0)] + done[("vec_ready", 1)] == nchunks


def test_whole_light_halo_protocol_is_the_main_loops():
    # light_halo (FLASHQLA_TILELANG_HALO_STEP=light): the chain's and the value role's halo loops and the key role's
    # halo branch run their main loop's barrier operations in the same order, parities included, so a walk of
    # light halo steps and then main steps has the protocol the model checks above; the producer has no region of
    # its own (it skips three loads, not their barrier operations)
    counts, ops = _protocol(SRC)
    light = _light_protocol(SRC)
    assert set(light) == {"chain", "value", "key"}
    for role, seq in light.items():
        assert seq == ops[role], role
    body = _role_bodies(SRC.read_text())["producer"]
    assert body.count("if (i >= nhalo) if light else True:") == 3
    # (a halo branch that forgot an arrival would differ from its main loop; stepped alone it deadlocks)
    broken = dict(ops, key=[o for o in light["key"] if o[1] != "dsb_free"])
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(counts, broken, 3, random.Random(0), ROLES)


def test_whole_protocol_model_catches_a_broken_protocol():
    counts, ops = _protocol(SRC)
    # the key warpgroup never frees dSb: the chain's second publish waits forever
    broken = dict(ops, key=[o for o in ops["key"] if o[1] != "dsb_free"])
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(counts, broken, 3, random.Random(0), ROLES)
    # the key warpgroup never frees S: the producer's second S load waits forever
    broken = dict(ops, key=[o for o in ops["key"] if o[1] != "empty_in[4]"])
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(counts, broken, 2, random.Random(0), ROLES)
    # the chain publishes dSb twice per chunk
    broken = dict(ops, chain=ops["chain"] + [("arrive", "dsb_ready", "")])
    with pytest.raises(AssertionError, match="arrivals in one phase|deadlock|partial|two phases"):
        for seed in range(20):
            _simulate(counts, broken, 3, random.Random(seed), ROLES)


def _variants():
    return [("bfloat16", "bfloat16", 128, 128, False, False), ("bfloat16", "float32", 128, 128, True, True),
            ("float16", "float16", 128, 128, True, False),
            # the walk over segments with a halo (segments.py), as the backend builds it: ex2.approx, dht and dh0
            ("bfloat16", "bfloat16", 128, 128, True, True, False, None, True, True),
            # and with the GVA pair sum in the kernel (FLASHQLA_TILELANG_GVA=pair; its plain walk: the test below)
            ("bfloat16", "bfloat16", 128, 128, True, True, False, None, True, True, True),
            # and the pair's rows zeroed in the kernel (FLASHQLA_TILELANG_GVA_ZERO=kernel), both walks
            ("bfloat16", "bfloat16", 128, 128, True, True, False, None, True, True, True, True),
            ("float16", "float16", 128, 128, False, False, False, None, True, False, True, True),
            # light halo steps (FLASHQLA_TILELANG_HALO_STEP=light): with the GVA pair sum, without, and pair_zero
            ("bfloat16", "bfloat16", 128, 128, True, True, False, None, True, True, True, False, True),
            ("float16", "float16", 128, 128, False, False, False, None, True, True, False, False, True),
            ("bfloat16", "bfloat16", 128, 128, True, True, False, None, True, True, True, True, True)]


@pytest.mark.compile
@pytest.mark.parametrize("args", _variants(), ids=lambda x: str(x).replace(" ", ""))
def test_whole_kernel_lowers_for_sm90a(args):
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang

    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_bwd_whole_sm90 import build_bwd_whole

    # (48 bytes at session 15's code: loop-invariant addresses that each role reloads a few times per chunk step,
    # not values of the passes; one version of that session had 96 and was slower)
    label = f"bwd_whole{args}" + (" halo" if len(args) > 9 and args[9] else "")
    check_ws_kernel(tilelang.compile(build_bwd_whole(*args), out_idx=None, target=TARGET), label)


def _pair_offsets_agree(call: str, loop_var: str, n: int, rng, threads=range(256, 384)) -> bool:
    """Whether a generated ``flq_red_pair_*`` call's offset expression gives the same element offset for local
    registers 2m and 2m + 1 (one pair: same row, the even column), for random values of its other symbols."""
    expr = re.sub(r"\((?:u?int(?:64_t)?|long long)\)", "", call)
    expr = expr.replace("threadIdx.x", "tx").replace("blockIdx.x", "bx").replace("blockIdx.y", "by")
    names = set(re.findall(r"[A-Za-z_]\w*", expr)) - {loop_var}
    for _ in range(20):
        env = {name: rng.randrange(0, 1 << 12) for name in names}
        env["tx"] = rng.choice(threads)             # (the whole-V kernel: its key role's threads)
        for m in range(n // 2):
            a = eval(expr, {}, dict(env, **{loop_var: 2 * m}))      # noqa: S307 - generated by our own build
            b = eval(expr, {}, dict(env, **{loop_var: 2 * m + 1}))  # noqa: S307
            if a != b or a % 2:
                return False
    return True


@pytest.mark.compile
def test_whole_gva_pair_reductions_lower_in_pairs():
    # FLASHQLA_TILELANG_GVA=pair (build_bwd_whole(gva_pair=True)) as the backend builds it (ex2.approx): the key
    # role's dq / dk go out as REDG.E.ADD.BF16x2 (no generic-address ATOM with its shared-memory CAS loop, no
    # scalar 16-bit red, which is a CAS loop too), and the helper's contract holds in the generated source: each
    # call passes register v of a fragment with parity (v & 1), inside an ascending unrolled loop over v, and the
    # offsets of registers 2m and 2m + 1 are one pair's (so the even call parks its value, the odd one adds both).
    # The wgmma stays pipelined and the role's spills within the limits (check_ws_kernel).
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang

    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_bwd_whole_sm90 import build_bwd_whole
    from test_backend_tilelang import kernel_sass

    kern = tilelang.compile(build_bwd_whole("bfloat16", "bfloat16", 128, 128, False, False, hw_ex2=True,
                                            gva_pair=True), out_idx=None, target=TARGET)
    check_ws_kernel(kern, "bwd_whole gva_pair")
    src = kern.get_kernel_source()
    # dq: its two K halves in one loop, full chunk and last chunk; dk: each half, full chunk and last chunk
    _check_pair_calls(src, "flq_red_pair_bf16", {"dq_out", "dk_out"}, 6, range(256, 384), random.Random(0))
    _check_pair_sass(kernel_sass(kern), 128)


def _check_pair_sass(sass, min_reds: int) -> None:
    """At least ``min_reds`` REDG.E.ADD.BF16x2 in a kernel's SASS (where cuobjdump is here), and no ATOM or CAS."""
    if sass is not None:
        assert len(re.findall(r"REDG\.E\.ADD\.BF16x2\.RN", sass)) >= min_reds
        assert not re.search(r"\bATOMS?\.|\bATOMG\.|CAS", sass), "a generic or emulated atomic"


def _check_pair_calls(src: str, fn: str, outs: set, n_calls: int, threads, rng) -> None:
    """The make_red_rows helper's contract in a generated source (see the test above); the dq / dk rows go to the
    pair's row (Hqk of them), not to a value head's."""
    calls = re.findall(rf"{fn}\((d[qk]_out), (.+), (\w+)\[(\w+)\], \((\w+) & 1\), \(&\(pend\[0\]\)\)\);", src)
    assert len(calls) == n_calls and src.count(f"{fn}(d") == n_calls, len(calls)
    assert {c[0] for c in calls} == outs
    for out, offset, frag, reg, parity in calls:
        assert reg == parity, (frag, reg, parity)
        loop = re.findall(rf"for \(int {reg} = 0; {reg} < (\d+); \+\+{reg}\)", src[:src.index(offset)])
        assert loop and int(loop[-1]) % 2 == 0, (reg, loop)
        assert _pair_offsets_agree(offset, reg, int(loop[-1]), rng, threads), (out, offset)
        assert "* ((int64_t)Hqk))" in offset, offset


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["dqk", "wy"])
def test_split_backward_gva_pair_reductions_lower_in_pairs(kind):
    # FLASHQLA_TILELANG_GVA=pair in the split backward (calls with the fused L2 norm take it): dq from the dqk kernel,
    # dk from the wy kernel, as REDG.E.ADD.BF16x2 pairs into the GVA pair's row (the checks of the test above), the
    # L2-norm Jacobian applied per value head before (it is linear, so the sum of the heads' terms is the term of
    # the sum); wgmma pipelined, no local memory
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang

    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_bwd_dqk_v2_sm90 import build_bwd_dqk_v2
    from flashqla.backends.tilelang.chunk_bwd_wy_v2_sm90 import build_bwd_wy_v2
    from test_backend_tilelang import assert_wgmma_pipelined, kernel_sass, resource_usage

    if kind == "dqk":
        func, out = build_bwd_dqk_v2("bfloat16", 128, 128, True, gva_pair=True), "dq_out"
    else:
        func, out = build_bwd_wy_v2("bfloat16", "bfloat16", 128, 128, True, gva_pair=True), "dk_out"
    kern = tilelang.compile(func, out_idx=None, target=TARGET)
    src = kern.get_kernel_source()
    # (one store site: a whole chunk and a sequence's last chunk)
    _check_pair_calls(src, "flq_red_pair_bf16", {out}, 2, range(0, 256), random.Random(1))
    assert_wgmma_pipelined(kern, f"bwd_{kind} gva_pair")
    usage = resource_usage(kern)
    assert "LOCAL:0" in usage or "unavailable" in usage, usage
    _check_pair_sass(kernel_sass(kern), 32)      # 16 pairs a thread, two forms


# ---- GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_whole_backward_matches_oracle(dtype, monkeypatch):
    gpu_backward_matches_oracle("whole", "bwd_whole_sm90", dtype, monkeypatch)


@pytest.mark.gpu
@needs_sm90
def test_gpu_whole_backward_deterministic(monkeypatch):
    gpu_backward_deterministic("whole", monkeypatch)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_fused_training_forward_matches_oracle(dtype, monkeypatch):
    # FLASHQLA_TILELANG_TRAIN_FUSED=1: ahead of the whole-V backward the training forward runs the fused form
    # (stage 1 writes Tb and X, the fused recurrence saves the chunk states and v_new); the gradients against the
    # oracle, and the kernels it built
    from flashqla.backends.tilelang import _compile
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "1")
    monkeypatch.setenv("FLASHQLA_TILELANG_FWD", "fused")
    gpu_backward_matches_oracle("whole", "bwd_whole_sm90", dtype, monkeypatch)
    built = {(n, k) for n, k in _compile.cached_kernels()}
    assert any(n == "fwd_intra_tbx_sm90" for n, _ in built)
    # the fused recurrence with its saves: key entries 7 (save_states) and 14 (fused)
    assert any(n == "fwd_recurrent_ws_sm90" and k[7] and len(k) > 14 and k[14] for n, k in built)


@pytest.mark.gpu
@needs_sm90
def test_gpu_fused_training_forward_deterministic(monkeypatch):
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "1")
    monkeypatch.setenv("FLASHQLA_TILELANG_FWD", "fused")
    gpu_backward_deterministic("whole", monkeypatch)


# ---- the automatic choice between the split and the whole backward ---------------------------------------------

@pytest.mark.parametrize("lengths,Hv,whole", [
    ([8192] * 4, 32, True),       # 128 walks: 2.0 ms whole against 3.5 split (session 16 run 2, H200)
    ([4096] * 8, 16, True),       # 128 shorter walks: 1.0 against 1.8
    ([8192] * 4, 16, False),      # 64 walks: 1.93 against 1.86
    ([32768], 32, False),         # 32 walks of 512 chunks: 7.1 against 4.1
    ([32768], 8, False),          # 8 walks: 7.7 against 2.3
    ([28672, 4096], 64, True),    # modelled, not measured: 6.0 ms whole (448 chunks x 13.3 us) against 6.4 split
    ([28672, 4096], 32, False),   # one long walk per head dominates: 6.0 against 3.9
    ([], 32, False),
])
def test_auto_backward_choice(lengths, Hv, whole, monkeypatch):
    """``FLASHQLA_TILELANG_BWD=auto`` (the default) takes the whole backward where its cost model says it beats
    the split one: the rows measured on the H200 fall on the side they were measured on (backward kernels only:
    without the fused training forward's credit)."""
    from flashqla.backends.tilelang.ops import ChunkMeta, bwd_whole_pays
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "0")
    assert bwd_whole_pays(ChunkMeta.of_lengths(lengths), Hv, torch.device("cpu")) is whole


def test_fused_training_forward_credit_moves_the_choice(monkeypatch):
    """Under FLASHQLA_TILELANG_TRAIN_FUSED=1 the whole-V backward also saves the training forward its unfused stage 1
    (``TRAIN_FUSED_PAIR_CREDIT_US`` per (chunk, head)): 16/32's 4x8192 at 16 value heads, split by the model without
    it (1.70 against 1.66 ms), goes to whole-V with it; the explanation says so."""
    from flashqla.backends.tilelang.ops import ChunkMeta, bwd_choice, bwd_whole_pays
    cpu = torch.device("cpu")
    meta = ChunkMeta.of_lengths([8192] * 4)
    for name in ("FLASHQLA_TILELANG_FWD", "FLASHQLA_TILELANG_BWD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "0")
    assert not bwd_whole_pays(meta, 16, cpu)
    monkeypatch.delenv("FLASHQLA_TILELANG_TRAIN_FUSED")          # on by default
    assert bwd_whole_pays(meta, 16, cpu)
    assert "net of the fused training forward" in bwd_choice(meta, 16, 128, 128, False, cpu, explain=True)[1]
    monkeypatch.setenv("FLASHQLA_TILELANG_FWD", "ws")          # no fused forward to save: no credit
    assert not bwd_whole_pays(meta, 16, cpu)


def test_auto_is_the_default(monkeypatch):
    from flashqla.backends.tilelang.ops import bwd_variant
    monkeypatch.delenv("FLASHQLA_TILELANG_BWD", raising=False)
    assert bwd_variant() == "auto"
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "split")
    with pytest.raises(ValueError, match="FLASHQLA_TILELANG_BWD"):
        bwd_variant()


def test_backward_choice_is_explained(monkeypatch):
    """``ops.bwd_choice`` gives the backward ``backward`` runs and why; ``flashqla.explain`` prints it for
    tilelang (filled by ``api._tilelang_backward_note`` from the call's lengths).  (Backward kernels only: without
    the fused training forward's credit, and without the gradient walk's split.)"""
    from types import SimpleNamespace
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "0")
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "off")

    import flashqla
    from flashqla.api import _tilelang_backward_note
    from flashqla.backends.tilelang.ops import ChunkMeta, bwd_choice
    cpu = torch.device("cpu")

    def choice(lengths, Hv, V=128, l2norm=False):
        return bwd_choice(ChunkMeta.of_lengths(lengths), Hv, 128, V, l2norm, cpu, explain=True)

    monkeypatch.delenv("FLASHQLA_TILELANG_BWD", raising=False)
    v, why = choice([8192] * 4, 32)
    assert v == "whole" and "128 (value head, sequence) walks" in why and "ms whole-V against" in why
    v, why = choice([32768], 32)
    assert v == "ws" and why.startswith("split backward: 32 ")
    assert choice([8192] * 4, 32, l2norm=True)[0] == "ws"                    # the fused L2 norm: split only
    assert choice([0, 0], 8) == ("ws", "split backward: no chunks")
    # the call path asks for the variant only, and gets the same one
    assert bwd_choice(ChunkMeta.of_lengths([8192] * 4), 32, 128, 128, False, cpu) == ("whole", "")
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "whole")
    assert choice([32768], 32) == ("whole", "FLASHQLA_TILELANG_BWD=whole")
    assert choice([32768], 32, V=64)[0] == "ws"                              # forced, but V = 64 is not served
    monkeypatch.delenv("FLASHQLA_TILELANG_BWD")
    # the lengths explain() passes: varlen from the metadata validate() built of cu_seqlens, else B sequences of T
    spec = SimpleNamespace(Hv=32, Hqk=16, K=128, V=128, use_qk_l2norm=False)
    q = torch.empty(1, 32768, 16, 128)
    cu = torch.tensor([0, 8192, 16384, 24576, 32768], dtype=torch.int32)
    monkeypatch.setenv("FLASHQLA_TILELANG_GVA", "host")
    note = _tilelang_backward_note(q, spec, flashqla.prepare_varlen(cu))
    assert note.startswith("whole-V fused backward: 128 ") and note.endswith("group by a separate kernel "
                                                                             "(FLASHQLA_TILELANG_GVA)"), note
    # (the GVA pair sum in the kernel, the default since session 23: ratio 2 only)
    monkeypatch.delenv("FLASHQLA_TILELANG_GVA")
    assert _tilelang_backward_note(q, spec, flashqla.prepare_varlen(cu)).endswith(
        "summed over each GVA pair in the kernels (FLASHQLA_TILELANG_GVA=pair)")
    note = _tilelang_backward_note(q, SimpleNamespace(**dict(spec.__dict__, Hqk=8)), flashqla.prepare_varlen(cu))
    assert "GVA ratio 4 (the in-kernel sum" in note, note
    assert _tilelang_backward_note(q, spec, None).startswith("split backward: 32 ")
    d = flashqla.explain(*(torch.randn(1, 64, 2, 128) for _ in range(2)), torch.randn(1, 64, 2, 128),
                         torch.zeros(1, 64, 2), torch.ones(1, 64, 2))
    d.backward = "split backward: why"
    assert "backward: split backward: why" in str(d)


def test_whole_nregs_override(monkeypatch):
    """``FLASHQLA_TILELANG_WHOLE_NREGS`` (a tuning experiment) reaches the compile key only when set, and a count
    setmaxnreg cannot take is refused with the variable's name."""
    from flashqla.backends.tilelang import ops
    monkeypatch.delenv("FLASHQLA_TILELANG_WHOLE_NREGS", raising=False)
    assert ops.whole_nregs() is None
    monkeypatch.setenv("FLASHQLA_TILELANG_WHOLE_NREGS", "168,160,160,24")
    assert ops.whole_nregs() == (168, 160, 160, 24)
    for bad in ("168,160,160", "168,160,168,24", "170,160,160,24", "a,b,c,d", "16,240,232,24", "120,200,168,24",
                "128,128,120,136"):
        monkeypatch.setenv("FLASHQLA_TILELANG_WHOLE_NREGS", bad)
        with pytest.raises(ValueError, match="FLASHQLA_TILELANG_WHOLE_NREGS"):
            ops.whole_nregs()


@pytest.mark.compile
def test_whole_kernel_hw_ex2_lowers():
    """``hw_ex2`` (``FLASHQLA_TILELANG_EX2=approx``): every exponential is one MUFU.EX2 with no subnormal-range
    test around it (exp2f's FSETP and predicated multiplies are the only FSETP in this kernel), the wgmma stay
    pipelined and the kernel has fewer instructions than with exp2f."""
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang

    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_bwd_whole_sm90 import build_bwd_whole
    from test_backend_tilelang import kernel_sass

    def sass(hw_ex2):
        kern = tilelang.compile(build_bwd_whole("bfloat16", "bfloat16", 128, 128, False, False, hw_ex2=hw_ex2),
                                out_idx=None, target=TARGET)
        if hw_ex2:
            check_ws_kernel(kern, "bwd_whole hw_ex2")
        text = kernel_sass(kern)
        if text is None:
            pytest.skip("no cuobjdump / embedded cubin here")
        return text

    fast, accurate = sass(True), sass(False)
    assert fast.count("MUFU.EX2") == accurate.count("MUFU.EX2") > 100
    assert fast.count("FSETP") == 0 < accurate.count("FSETP")
    count = lambda text: len(re.findall(r"/\*[0-9a-f]{4,}\*/", text))   # noqa: E731
    assert count(fast) < count(accurate) - 400, (count(fast), count(accurate))


def test_hw_ex2_switch_and_keys(monkeypatch):
    """``FLASHQLA_TILELANG_EX2``: ``auto`` (default) takes ex2.approx in the whole backward only (its GPU tests pass
    with it, session 17), ``exp2f`` nowhere (the keys as before session 16), ``approx`` also in stage 1 and the ws
    recurrence, the flag at its builder position in each key."""
    from flashqla.backends.tilelang import _compile, ops
    monkeypatch.delenv("FLASHQLA_TILELANG_EX2", raising=False)
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_INV", "fma")     # (stage 1's keys end at the flag here)
    assert ops.hw_ex2("bwd_whole") is True and ops.hw_ex2() is False

    def keys():
        with _compile.record_keys() as rec:
            ops.bwd_whole_kernel(torch.bfloat16, torch.bfloat16, 128, 128, False, False)
            ops.intra_tb_kernel(torch.bfloat16, torch.bfloat16, 128, False)
            ops.fwd_ws_kernel(torch.bfloat16, 128, 128, False, False, True, False, 128, fused=True)
        return {name: key for name, _, key in rec}

    auto = keys()
    monkeypatch.setenv("FLASHQLA_TILELANG_EX2", "exp2f")
    assert ops.hw_ex2("bwd_whole") is False and ops.hw_ex2() is False
    plain = keys()
    assert plain["bwd_whole_sm90"] == ("bfloat16", "bfloat16", 128, 128, False, False)
    assert auto["bwd_whole_sm90"] == plain["bwd_whole_sm90"] + (False, None, True)
    assert auto["fwd_intra_tb_sm90"] == plain["fwd_intra_tb_sm90"]
    assert auto["fwd_recurrent_ws_sm90"] == plain["fwd_recurrent_ws_sm90"]
    monkeypatch.setenv("FLASHQLA_TILELANG_EX2", "approx")
    assert ops.hw_ex2() is True
    fast = keys()
    assert fast["bwd_whole_sm90"] == auto["bwd_whole_sm90"]
    assert fast["fwd_intra_tb_sm90"] == plain["fwd_intra_tb_sm90"] + (False, False, 128, True)
    assert fast["fwd_recurrent_ws_sm90"][-1] is True and len(fast["fwd_recurrent_ws_sm90"]) == 18
    monkeypatch.setenv("FLASHQLA_TILELANG_EX2", "fast")
    with pytest.raises(ValueError, match="FLASHQLA_TILELANG_EX2"):
        ops.hw_ex2()


def test_train_fused_credit_only_where_the_fused_training_forward_runs(monkeypatch):
    """The whole-V backward is credited with the fused training forward's saving only where that forward runs: not
    ahead of a split forward under FLASHQLA_TILELANG_TRAIN_FUSED=1 (it stays unfused there), yes under ``all``."""
    from flashqla.backends.tilelang import ops
    monkeypatch.delenv("FLASHQLA_TILELANG_FWD", raising=False)
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "1")
    dev = torch.device("cpu")
    assert ops._train_fused_credit(512, 32, dev) > 0
    assert ops._train_fused_credit(512, 32, dev, fwd_split=True) == 0
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "all")
    assert ops._train_fused_credit(512, 32, dev, fwd_split=True) == ops._train_fused_credit(512, 32, dev) > 0
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "0")
    assert ops._train_fused_credit(512, 32, dev) == 0


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", ["whole", "ws"])
def test_gpu_backward_gva_pair(variant, dtype, monkeypatch):
    # FLASHQLA_TILELANG_GVA=pair, the GVA pair sum in the kernels (the whole-V one; the split backward's dqk and wy
    # kernels under "ws"): the shared backward cases against the oracle; then against the separate sum
    # (FLASHQLA_TILELANG_GVA=host) on GVA pairs whose long sequence the backward walks in segments of 8 chunks (with
    # the fused L2 norm under "ws"): dv, dg, dbeta, dh0 equal (their code is the same: bitwise expected, a
    # compiler's last-bit difference within 1e-5 relative L2 allowed and printed), dq / dk equal but
    # where the host's fp32 sum rounded before its last rounding (one unit in the last place at most, rarely); and
    # 20 runs of the pair form bitwise equal (two adds onto +0 commute, whichever head's CTA comes first)
    import flashqla
    from flashqla.backends.tilelang import _compile
    from flashqla.testing import make_inputs

    monkeypatch.setenv("FLASHQLA_TILELANG_GVA", "pair")
    # (the pair flag's place in each key: ops.bwd_whole_kernel / ops.bwd_dqk_kernel)
    kernel, flag = ("bwd_whole_sm90", 10) if variant == "whole" else ("bwd_dqk_v2_sm90", 5)
    gpu_backward_matches_oracle(variant, kernel, dtype, monkeypatch)
    assert any(n == kernel and k[flag:flag + 1] == (True,) for n, k in _compile.cached_kernels()), \
        "the pair kernels did not run"

    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", "auto")
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "8")
    case = Case("gva_pair_vs_host", 2, 4, 128, 128, seqlens=(64 * 40 + 9, 1, 300), l2norm=variant == "ws")
    inp = make_inputs(case, dtype, "cuda")
    leaves = [inp[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]

    def grads(mode):
        monkeypatch.setenv("FLASHQLA_TILELANG_GVA", mode)
        o, ht = flashqla.chunk_gated_delta_rule(*leaves[:5], scale=case.scale, initial_state=leaves[5],
                                                output_final_state=True, cu_seqlens=inp["cu_seqlens"],
                                                use_qk_l2norm_in_kernel=case.l2norm, backend="tilelang")
        return torch.autograd.grad((o, ht), leaves, (inp["do"], inp["dht"]))

    host, pair = grads("host"), grads("pair")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), pair, host):
        assert torch.isfinite(a).all(), name
        if name not in ("dq", "dk"):
            # (the same code in both builds: bitwise equal is expected; a last-bit difference would come from
            # ptxas / NVVM treating the two builds differently, not from the sum, so it is allowed, and shown)
            assert_equal_but_compiler_bits(a, b, name, "the host-sum build")
            continue
        same = a == b
        ulps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
        assert bool((same | (ulps <= 1)).all()), (name, int(ulps[~same].max()))
        assert float((~same).float().mean()) <= 1e-3, (name, float((~same).float().mean()))
    for _ in range(20):
        for a, b in zip(pair, grads("pair")):
            assert torch.equal(a, b)


@pytest.mark.compile
def test_whole_pair_zero_lowers():
    # FLASHQLA_TILELANG_GVA_ZERO=kernel (build_bwd_whole(pair_zero=True)), as the backend builds it: one ticket per
    # CTA, the zeroing step before the walk (ZERO_AHEAD steps) and in it, the other CTA's wait; the zeroes go out as
    # 16-byte stores of RZ, the ticket as one 64-bit global atomic; the key role's reductions stay pairs and the
    # wgmma pipelined (check_ws_kernel: also no local memory, the stack within its limit)
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang

    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_bwd_whole_sm90 import build_bwd_whole
    from test_backend_tilelang import kernel_sass

    kern = tilelang.compile(build_bwd_whole("bfloat16", "bfloat16", 128, 128, False, False, hw_ex2=True,
                                            gva_pair=True, pair_zero=True), out_idx=None, target=TARGET)
    check_ws_kernel(kern, "bwd_whole gva_pair pair_zero")
    src = kern.get_kernel_source()
    body = src[src.index("__global__"):]
    assert body.count("flq_pair_ticket(") == 1
    assert body.count("flq_pair_zero_step(") == 2
    assert body.count("flq_pair_wait(") == 1
    _check_pair_calls(src, "flq_red_pair_bf16", {"dq_out", "dk_out"}, 6, range(256, 384), random.Random(2))
    sass = kernel_sass(kern)
    if sass is not None:
        assert len(re.findall(r"STG\.E\.128 desc\[\w+\]\[R\d+\.64\], RZ", sass)) >= 2
        assert len(re.findall(r"ATOMG\.E\.ADD\.64", sass)) == 1
        assert len(re.findall(r"REDG\.E\.ADD\.BF16x2\.RN", sass)) >= 128
    with pytest.raises(AssertionError, match="pair_zero"):
        build_bwd_whole("bfloat16", "bfloat16", 128, 128, False, False, gva_pair=False, pair_zero=True)


def test_pair_zero_switch(monkeypatch):
    from flashqla.backends.tilelang import ops

    monkeypatch.delenv("FLASHQLA_TILELANG_GVA_ZERO", raising=False)
    assert ops.pair_rows_mode() == "host"
    monkeypatch.setenv("FLASHQLA_TILELANG_GVA_ZERO", "kernel")
    assert ops.pair_rows_mode() == "kernel"
    # (store, session 31, removed in session 33: wrong gradients on an H100)
    for bad in ("sometimes", "store"):
        monkeypatch.setenv("FLASHQLA_TILELANG_GVA_ZERO", bad)
        with pytest.raises(ValueError, match="FLASHQLA_TILELANG_GVA_ZERO"):
            ops.pair_rows_mode()
    # the key: unchanged where the kernel does not zero (carried caches keep matching), one flag more where it does
    monkeypatch.setattr(ops, "get_kernel", lambda name, builder, key: key)
    base = ops.bwd_whole_kernel(torch.bfloat16, torch.bfloat16, 128, 128, False, False, True, True)
    assert ops.bwd_whole_kernel(torch.bfloat16, torch.bfloat16, 128, 128, False, False, True, True, False) == base
    assert ops.bwd_whole_kernel(torch.bfloat16, torch.bfloat16, 128, 128, False, False, True, True, True) == \
        base + (True,)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_whole_pair_zero(dtype, monkeypatch):
    # FLASHQLA_TILELANG_GVA_ZERO=kernel: the whole-V backward zeroes the GVA pair rows itself.  The shared backward
    # cases against the oracle; then, on memory the caching allocator has just held NaN in (so a row no CTA zeroed
    # would show), against the host memset build: every gradient bitwise equal (the same two adds onto +0; a
    # compiler's last-bit difference in the other roles is allowed within 1e-5 and printed), over the plain walk
    # with more CTAs than SMs (so some pairs are not resident together: the ticket decides who zeroes) and the walk
    # in segments with halos of different lengths per head; and 20 runs bitwise equal
    from flashqla.backends.tilelang import _compile

    monkeypatch.setenv("FLASHQLA_TILELANG_GVA", "pair")
    monkeypatch.setenv("FLASHQLA_TILELANG_GVA_ZERO", "kernel")
    gpu_backward_matches_oracle("whole", "bwd_whole_sm90", dtype, monkeypatch)
    # (the key's pair_zero flag: ops.bwd_whole_kernel)
    assert any(n == "bwd_whole_sm90" and k[11:13] == (True,) for n, k in _compile.cached_kernels()), \
        "the pair-zero kernel did not run"

    cases = [
        (Case("pair_zero_many_ctas", 48, 96, 128, 128, seqlens=(700, 64, 1, 333, 0, 129)), {}),
        (Case("pair_zero_segments", 2, 4, 128, 128, seqlens=(64 * 40 + 9, 1, 300)),
         {"FLASHQLA_TILELANG_SEGMENTS": "auto", "FLASHQLA_TILELANG_BWD_SEGMENTS": "8"}),
    ]
    for case, env in cases:
        for name, val in env.items():
            monkeypatch.setenv(name, val)
        gpu_switch_bitwise(case, dtype, monkeypatch, "FLASHQLA_TILELANG_GVA_ZERO", "host", "kernel")
        for name in env:
            monkeypatch.delenv(name)


def test_halo_step_switch_and_key(monkeypatch):
    """``FLASHQLA_TILELANG_HALO_STEP``: ``whole`` (default until measured) or ``light``, anything else a ValueError
    naming the variable; the light_halo flag goes last in the whole-V kernel's key, only for a walk over segments
    (the plain walk's key is the same either way) and never for a traced build."""
    from flashqla.backends.tilelang import _compile, ops
    monkeypatch.delenv("FLASHQLA_TILELANG_HALO_STEP", raising=False)
    assert ops.halo_step_mode() == "whole"

    def keys():
        with _compile.record_keys() as rec:
            ops.bwd_whole_kernel(torch.bfloat16, torch.bfloat16, 128, 128, True, True)
            ops.bwd_whole_kernel(torch.bfloat16, torch.bfloat16, 128, 128, True, True, True, True)
        return [key for name, _, key in rec if name == "bwd_whole_sm90"]

    plain, halo = keys()
    monkeypatch.setenv("FLASHQLA_TILELANG_HALO_STEP", "light")
    assert ops.halo_step_mode() == "light"
    plain_l, halo_l = keys()
    assert plain_l == plain
    assert halo_l == halo + (False, True)
    for bad in ("on", "1", "chain"):
        monkeypatch.setenv("FLASHQLA_TILELANG_HALO_STEP", bad)
        with pytest.raises(ValueError, match="FLASHQLA_TILELANG_HALO_STEP"):
            ops.halo_step_mode()
    from flashqla.backends.tilelang.chunk_bwd_whole_sm90 import build_bwd_whole
    with pytest.raises(AssertionError, match="light_halo"):
        build_bwd_whole("bfloat16", "bfloat16", 128, 128, False, False, light_halo=True)


@pytest.mark.compile
def test_whole_light_halo_lowers():
    # light_halo as the backend builds it (ex2.approx, halo, the GVA pair sum): beside check_ws_kernel's (wgmma
    # pipelined: a halo loop of the key role's own had serialised it), the halo loops are there and lean -- the
    # wgmma count grows by the chain's two products and the value role's four per halo loop body only, and the
    # vn / S / v loads are predicated on the halo
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang

    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_bwd_whole_sm90 import build_bwd_whole

    def build(light):
        return tilelang.compile(build_bwd_whole("bfloat16", "bfloat16", 128, 128, True, True, hw_ex2=True, halo=True,
                                                gva_pair=True, light_halo=light), out_idx=None, target=TARGET)

    kern = build(True)
    check_ws_kernel(kern, "bwd_whole light_halo halo")
    light, whole = kern.get_kernel_source(), build(False).get_kernel_source()
    gemms = lambda src: src.count("tl::warpgroup_commit_batch()")   # noqa: E731
    assert gemms(light) == gemms(whole) + 6, (gemms(light), gemms(whole))
    assert light.count("< nhalo; ++") == 2          # the chain's and the value role's halo loops
    assert len(re.findall(r"if \(nhalo <= i_\d+\)", light)) == 3     # the producer's three loads
    assert len(re.findall(r"if \(i_\d+ < nhalo\)", light)) == 1        # the key role's halo branch


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_whole_light_halo(dtype, monkeypatch):
    # FLASHQLA_TILELANG_HALO_STEP=light: the whole-V backward over segments with halos of different lengths per
    # head (logsigmoid gates ~3-4 chunks, strong decay ~1, no decay: the halo runs to the sequence end), GVA pairs
    # and ratio 1, on memory the caching allocator has just held NaN in: every gradient bitwise the whole-step
    # build's (the halo's dS comes from the same operations; a compiler's last-bit difference elsewhere is allowed
    # within 1e-5 and printed), then 20 runs bitwise equal; and the segment suite's non-L2-norm cases against the
    # oracle with light steps
    from flashqla.backends.tilelang import _compile
    from test_tilelang_segments import _GPU_SEG_CASES, _oracle_run

    monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "whole")
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", "auto")
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "8")

    cases = [Case("light_pair", 2, 4, 128, 128, seqlens=(64 * 40 + 9, 1, 300)),
             Case("light_ratio1", 2, 2, 128, 128, seqlens=(64 * 30 + 5, 640, 0)),
             Case("light_strong", 2, 4, 128, 128, seqlens=(64 * 33,), gate="strong"),
             Case("light_no_decay", 2, 4, 128, 128, seqlens=(64 * 17 + 3, 64), gate="zero")]
    for case in cases:
        gpu_switch_bitwise(case, dtype, monkeypatch, "FLASHQLA_TILELANG_HALO_STEP", "whole", "light")
    # (the key's light_halo flag, the last of 13: ops.bwd_whole_kernel)
    assert any(n == "bwd_whole_sm90" and len(k) == 13 and k[12] is True for n, k in _compile.cached_kernels()), \
        "the light-halo kernel did not run"
    if dtype == torch.bfloat16:
        monkeypatch.setenv("FLASHQLA_TILELANG_HALO_STEP", "light")
        for case in _GPU_SEG_CASES:
            if case.l2norm:
                continue
            res = _oracle_run(case, True, "2", monkeypatch, "whole")
            print(case.name, {k: f"{v:.2e}" for k, v in res.errors.items()})
            assert res.ok, f"{case.name}: {res.failures} (all {res.errors})"


# ---- FLASHQLA_TILELANG_TRAIN_XBETA: the fused training forward on X and beta (session 37) -------------------------

def test_train_xbeta_switch_and_keys(monkeypatch):
    """``FLASHQLA_TILELANG_TRAIN_XBETA``: ``0`` (default until measured) or ``1``, anything else a ValueError naming
    the variable; its flag goes last in stage 1's and the walk's keys, only where it changes the code (the training
    Tb form with X; the fused walk with its saves), so every other key, and the carried caches, stay as they were."""
    from flashqla.backends.tilelang import ops

    monkeypatch.delenv("FLASHQLA_TILELANG_TRAIN_XBETA", raising=False)
    assert ops.train_xbeta() is False
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_XBETA", "1")
    assert ops.train_xbeta() is True
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_XBETA", "yes")
    with pytest.raises(ValueError, match="FLASHQLA_TILELANG_TRAIN_XBETA"):
        ops.train_xbeta()
    monkeypatch.setattr(ops, "get_kernel", lambda name, builder, key: key)
    bf = torch.bfloat16
    base = ops.intra_tb_kernel(bf, bf, 128, False, save_x=True, uniform=True, persist=True)
    assert ops.intra_tb_kernel(bf, bf, 128, False, save_x=True, uniform=True, persist=True, x_beta=True) == \
        base + (True,)
    # (no X, no beta form: the inference Tb form's key is unchanged)
    assert ops.intra_tb_kernel(bf, bf, 128, False, uniform=True, persist=True, x_beta=True) == \
        ops.intra_tb_kernel(bf, bf, 128, False, uniform=True, persist=True)
    walk = ops.fwd_ws_kernel(bf, 128, 128, False, False, False, True, 128, True, False, True)
    assert ops.fwd_ws_kernel(bf, 128, 128, False, False, False, True, 128, True, False, True, True)[:len(walk)] == walk
    assert ops.fwd_ws_kernel(bf, 128, 128, False, False, False, True, 128, True, False, True, True)[-1] is True
    # (the inference walk, no saves: unchanged)
    inf = ops.fwd_ws_kernel(bf, 128, 128, False, False, False, False, 128, True, False, True)
    assert ops.fwd_ws_kernel(bf, 128, 128, False, False, False, False, 128, True, False, True, True) == inf


@pytest.mark.compile
@pytest.mark.parametrize("halo", [False, True], ids=["walk", "segments"])
def test_train_xbeta_lowers(halo):
    # the x_beta builds as the backend makes them: stage 1's persistent training form writes beta (a [NC, Hv, 64]
    # fp32 row per chunk) where it wrote Tb, and X; the fused training walk (BV 128, saves) loads beta's tile on the
    # slot's barrier and stays pipelined, without local memory
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang

    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_fwd_ws_sm90 import build_fwd_ws
    from flashqla.backends.tilelang.chunk_intra_sm90 import build_intra
    from test_backend_tilelang import assert_wgmma_pipelined, resource_usage

    if not halo:
        intra = tilelang.compile(build_intra("bfloat16", "bfloat16", 128, 128, False, True, tb_only=True, hw_ex2=True,
                                             inv_mma=True, uniform=True, persist=True, x_beta=True),
                                 out_idx=None, target=TARGET)
        src = intra.get_kernel_source()
        body = src[src.index("__global__"):]
        # (beta in Tb's place: an fp32 output; both written in the body)
        assert "float* __restrict__ Tb_out" in body
        assert body.count("Tb_out") >= 2 and body.count("X_out") >= 2
        with pytest.raises(AssertionError, match="x_beta"):
            build_intra("bfloat16", "bfloat16", 128, 128, False, False, tb_only=True, x_beta=True)
    walk = tilelang.compile(build_fwd_ws("bfloat16", 128, 128, 128, False, False, False, True, fast_exp=True,
                                         psplit=True, fused=True, ostage=True, hw_ex2=True, halo=halo, x_beta=True),
                            out_idx=None, target=TARGET)
    assert_wgmma_pipelined(walk, f"fwd_ws x_beta halo={halo}")
    usage = resource_usage(walk)
    if "LOCAL:" in usage:
        assert "LOCAL:0 " in usage, usage
    src = walk.get_kernel_source()
    assert "scores_in" in src[src.index("__global__"):]
    with pytest.raises(AssertionError, match="x_beta"):
        build_fwd_ws("bfloat16", 128, 128, 128, False, False, False, False, fused=True, x_beta=True)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_train_xbeta_matches_oracle(dtype, monkeypatch):
    # FLASHQLA_TILELANG_TRAIN_XBETA=1: the fused training forward on X and beta, then the whole-V backward; the
    # shared backward cases against the oracle, unsplit and with every walk forced into 2-chunk segments (halos),
    # and the kernels it built (the x_beta flag last in both keys)
    from flashqla.backends.tilelang import _compile

    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_XBETA", "1")
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "all")
    monkeypatch.setenv("FLASHQLA_TILELANG_FWD", "fused")
    gpu_backward_matches_oracle("whole", "bwd_whole_sm90", dtype, monkeypatch)
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", "2")
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "2")
    gpu_backward_matches_oracle("whole", "bwd_whole_sm90", dtype, monkeypatch)
    built = list(_compile.cached_kernels())
    assert any(n == "fwd_intra_tbx_sm90" and len(k) > 15 and k[15] for n, k in built), "no x_beta stage 1 ran"
    assert any(n == "fwd_recurrent_ws_sm90" and len(k) > 20 and k[20] for n, k in built), "no x_beta walk ran"
