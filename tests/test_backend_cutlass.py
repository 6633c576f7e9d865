"""Backend "cutlass" (CuTe DSL, sm_90a): registration, cross-compilation, emulation, GPU checks.

* ``compile``-marked tests cross-compile every kernel for sm_90a on any machine (no GPU, no driver: the
  arch is passed as a compile option) and check that the PTX holds warpgroup MMAs and TMA copies.  They
  skip, with the reason, when nvidia-cutlass-dsl is not installed.
* The emulation tests run :mod:`flashqla.backends.cutlass.emulation` -- the kernels' per-chunk steps with
  their bf16 rounding points, in PyTorch -- against the float64 oracle on a CPU.
* ``gpu``-marked tests run the kernels on an sm_90 GPU against the oracle.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

import flashqla
from flashqla.dispatch import fake_device, get_backend
from flashqla.reference import recurrent_gated_delta_rule_ref
from flashqla.testing import TOLERANCES, Case, make_inputs, oracle, rel_l2, run_case
from flashqla.validation import validate

HAVE_DSL = importlib.util.find_spec("cutlass") is not None
needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl is not installed "
                                                     "(pip install nvidia-cutlass-dsl==4.3.5)")
ON_H100 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not ON_H100, reason="needs an sm_90 GPU")
BF16_TOL = TOLERANCES["bfloat16"]


def _backend():
    return get_backend("cutlass")


# --------------------------------------------------------------------------------------- registration
def test_registered_with_priority_and_cheap_probe():
    be = _backend()
    assert be.name == "cutlass" and dict(be.priorities) == {"sm_90": 20}
    t0 = time.perf_counter()
    ok, why = be.available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    assert time.perf_counter() - t0 < 1.0, "available() must not import the DSL"
    if not torch.cuda.is_available():
        assert not ok


def _spec(dtype=torch.bfloat16, K=128, V=128, capability=(9, 0), g_dtype=torch.float32, h0_dtype=None):
    q = torch.zeros(1, 4, 1, K, dtype=dtype)
    v = torch.zeros(1, 4, 2, V, dtype=dtype)
    g = torch.zeros(1, 4, 2, dtype=g_dtype)
    h0 = None if h0_dtype is None else torch.zeros(1, 2, K, V, dtype=h0_dtype)
    with fake_device("cuda", capability):
        spec, _, _ = validate(q, q, v, g, g.to(dtype), initial_state=h0)
    return spec


def test_forward_plan(monkeypatch):
    # the recurrence's variant (FLASHQLA_CUTLASS_FWD / backend_options["fwd"]: serial by default, ws not yet run on a
    # GPU, auto by the model), its V block, and FLASHQLA_CUTLASS_SEGMENTS: off by default; auto cuts one long
    # sequence at few heads into about a CTA per SM and leaves a walk per SM alone; a number forces segments
    import flashqla.backends.cutlass as cb
    plan = lambda lens, Hv, mode="serial", wg=0, seg="off": cb.fwd_plan(lens, Hv, 128, 132, mode, wg, seg)  # noqa: E731
    for name in ("FLASHQLA_CUTLASS_SEGMENTS", "FLASHQLA_CUTLASS_FWD"):
        monkeypatch.delenv(name, raising=False)
    assert cb.segments_mode() == "auto" and cb.fwd_mode() == "fused" and cb.fwd_mode({"fwd": "ws"}) == "ws"
    with pytest.raises(ValueError, match="backend_options"):
        cb.fwd_mode({"fwd": "fast"})
    monkeypatch.setenv("FLASHQLA_CUTLASS_FWD", "warp")
    with pytest.raises(ValueError, match="FLASHQLA_CUTLASS_FWD"):
        cb.fwd_mode()

    p = plan([8192] * 4, 32)                              # 128 walks < 132 SMs: V block 64
    assert (p.variant, p.num_wg, p.state_wg, p.split) == ("serial", 1, 1, None) and "chunk_fwd_sm90" in p.why
    p = plan([8192] * 16, 32)                             # a walk per SM or more: V block 128
    assert (p.variant, p.num_wg, p.state_wg) == ("serial", 2, 2)
    assert plan([8192] * 16, 32, wg=1).num_wg == 1
    p = plan([8192] * 16, 32, "ws")                       # ws has one V block; the backward keeps its own rule
    assert (p.variant, p.num_wg, p.state_wg) == ("ws", 1, 2) and "chunk_fwd_ws_sm90" in p.why
    assert plan([8192] * 4, 32, "fused").variant == "fused"   # inference forwards only
    p = cb.fwd_plan([8192] * 4, 32, 128, 132, "fused", training=True)
    assert p.variant == "serial" and "inference" in p.why       # (ws trained slower on the H200, session 19)
    assert cb.fwd_plan([32768], 8, 128, 132, "auto", training=False).variant in ("fused", "serial")
    assert cb.fwd_plan([32768], 8, 128, 132, "auto", training=True).variant in ("ws", "serial")
    for lens, Hv in (([32768], 8), ([8192] * 16, 32), ([100, 5000, 64], 16)):
        for training, name, steps in ((True, "ws", cb.CUTLASS_WS_STEP_US), (False, "fused", cb.CUTLASS_FUSED_STEP_US)):
            p = cb.fwd_plan(lens, Hv, 128, 132, "auto", training=training)
            chunks = tuple(-(-n // 64) for n in lens)
            serial_wg = 2 if len(lens) * Hv >= 132 else 1
            ws_us = cb._walk_us(chunks, Hv, 2, steps[64], 132)
            serial_us = cb._walk_us(chunks, Hv, 2 // serial_wg, cb.CUTLASS_STEP_US[64 * serial_wg], 132)
            assert p.variant == (name if ws_us < serial_us else "serial") and "modelled" in p.why

    p = plan([32768], 8, seg="auto")
    assert p.split is not None and p.split.num_segments >= 8 and 8 * p.split.num_segments * (128 // p.split.bv) <= 132
    assert p.num_wg == p.split.bv // 64 and "over segments" in p.why
    p = plan([32768], 8, "ws", seg="auto")
    assert p.split is not None and p.split.bv == 64 and p.num_wg == 1
    assert plan([8192] * 16, 32, seg="auto").split is None   # 512 walks at V block 128: nothing to gain
    assert plan([64], 8, seg="auto").split is None           # one chunk: nothing to cut
    p = plan([64 * 40 + 3, 70], 4, seg="16")
    assert p.split.seg_chunks == 16 and p.split.num_segments == 3 + 1 and p.split.bv in (64, 128)
    monkeypatch.setenv("FLASHQLA_CUTLASS_SEGMENTS", "0")
    with pytest.raises(ValueError, match="FLASHQLA_CUTLASS_SEGMENTS"):
        cb.segments_mode()


def _ws_forward_protocol(halo: int, own: int) -> dict:
    """The barrier ops of chunk_fwd_ws_sm90's four roles over a walk of ``halo`` + ``own`` chunks, as the kernel issues
    them: per role a list of ("wait" | "arrive", (barrier, index), parity, completions the wait is for).  Rings and
    handoff have two slots; a producer's PipelineState starts at phase 1 (its first wait on an empty slot passes), a
    consumer's at 0.  Arrival counts are folded to one per role (each role's threads or warps arrive together)."""
    def wait(name, j, producer):
        # use u of a slot: a producer needs its u-th release (none for u = 0), a consumer its (u+1)-th fill
        u = j // 2
        return ("wait", (name, j % 2), (u + (1 if producer else 0)) % 2, u if producer else u + 1)

    chain_loader, chain, out_loader, output = [], [], [], []
    for j in range(halo + own):
        chain_loader += [wait("chain_empty", j, True), ("arrive", ("chain_full", j % 2), None, None)]
        chain.append(wait("chain_full", j, False))
        if j >= halo:                       # own chunks publish Sb and v_new; halo chunks publish nothing
            k = j - halo
            chain += [wait("hand_empty", k, True), ("arrive", ("hand_full", k % 2), None, None)]
        chain.append(("arrive", ("chain_empty", j % 2), None, None))
    for k in range(own):
        out_loader += [wait("out_empty", k, True), ("arrive", ("out_full", k % 2), None, None)]
        output += [wait("out_full", k, False), wait("hand_full", k, False),
                   ("arrive", ("out_empty", k % 2), None, None), ("arrive", ("hand_empty", k % 2), None, None)]
    return {"chain_loader": chain_loader, "chain": chain, "out_loader": out_loader, "output": output}


@pytest.mark.parametrize("halo,own", [(0, 0), (0, 1), (0, 2), (0, 7), (1, 0), (3, 1), (3, 6), (5, 9)])
def test_ws_forward_barrier_protocol(halo, own):
    """chunk_fwd_ws_sm90's synchronisation, stepped in random interleavings: no deadlock, every slot's phases
    complete in order, no waiter finds a barrier two phases past the one it waits for (a parity alias), and no
    slot is refilled before its readers released it."""
    import random
    roles = _ws_forward_protocol(halo, own)
    for seed in range(40):
        rng = random.Random(seed)
        done, pc = {}, dict.fromkeys(roles, 0)
        while True:
            runnable = [r for r, ops in roles.items() if pc[r] < len(ops) and (
                ops[pc[r]][0] == "arrive" or done.get(ops[pc[r]][1], 0) % 2 != ops[pc[r]][2])]
            if not runnable:
                assert all(pc[r] == len(ops) for r, ops in roles.items()), \
                    f"deadlock (halo {halo}, own {own}, seed {seed}): {[(r, roles[r][pc[r]]) for r in roles if pc[r] < len(roles[r])]}"
                break
            r = rng.choice(runnable)
            op, b, parity, want = roles[r][pc[r]]
            if op == "arrive":
                done[b] = done.get(b, 0) + 1
            else:
                # a parity wait passes on any completion count of the other parity: it must be exactly the one it
                # is for (two more would be an alias: a fill or a release taken for the next one)
                assert done.get(b, 0) == want, (r, b, done.get(b, 0), want, seed)
            pc[r] += 1
        # every slot of a ring / the handoff: fills and releases alternate, as many of each
        for name in ("chain", "out", "hand"):
            for slot in (0, 1):
                assert done.get((f"{name}_full", slot), 0) == done.get((f"{name}_empty", slot), 0)


def test_explain_note_names_the_recurrence(monkeypatch):
    # what explain() prints for a cutlass forward: the recurrence the env switches pick for this call
    from flashqla.api import _cutlass_forward_note
    for name in ("FLASHQLA_CUTLASS_SEGMENTS", "FLASHQLA_CUTLASS_FWD", "FLASHQLA_CUTLASS_NUM_WG"):
        monkeypatch.delenv(name, raising=False)
    spec = _spec()
    q = torch.zeros(1, 4, 1, 128)
    assert "fused warp-specialised recurrence (chunk_fwd_ws_sm90" in _cutlass_forward_note(q, spec, None)
    monkeypatch.setenv("FLASHQLA_CUTLASS_FWD", "serial")
    assert "chunk_fwd_sm90, 1 consumer warpgroup" in _cutlass_forward_note(q, spec, None)
    monkeypatch.setenv("FLASHQLA_CUTLASS_FWD", "ws")
    assert "chunk_fwd_ws_sm90" in _cutlass_forward_note(q, spec, None)
    monkeypatch.setenv("FLASHQLA_CUTLASS_FWD", "auto")
    assert "modelled" in _cutlass_forward_note(q, spec, None)


@pytest.mark.parametrize("kw,needle", [
    (dict(), None),
    (dict(dtype=torch.float16), "bfloat16"),
    (dict(K=64, V=64), "K = V = 128"),
    (dict(V=64), "K = V = 128"),
    (dict(capability=(8, 0)), "sm_90"),
    (dict(capability=(10, 0)), "sm_90"),
    (dict(g_dtype=torch.bfloat16), "g must be float32"),
    (dict(h0_dtype=torch.float64), "float32"),
])
def test_supports_gives_precise_reasons(kw, needle):
    ok, why = _backend().supports(_spec(**kw))
    if needle is None:
        assert ok, why
    else:
        assert not ok and needle in why, why


# --------------------------------------------------------------------------------------- cross-compile
def _compile(kind, key, tmp_path):
    from flashqla.backends.cutlass import compile_kernel
    return compile_kernel(kind, key, keep_dir=tmp_path / f"{kind}-{'-'.join(map(str, key))}")


def _check_ptx(fn, kind, key):
    ptx = fn.__ptx__
    assert isinstance(ptx, str) and ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx, "no warpgroup MMA in the PTX"
    assert "cp.async.bulk.tensor" in ptx, "no TMA copy in the PTX"
    assert "mbarrier" in ptx
    assert fn.__cubin__ and len(fn.__cubin__) > 1000, "ptxas produced no cubin"
    from flashqla.backends.cutlass import artifact_dir
    kept = artifact_dir(kind, key)
    assert kept is not None and list(kept.glob("*.ptx")) and list(kept.glob("*.cubin")), "artifacts not kept"
    return ptx


# (kind, key, wgmma instructions expected in the PTX)
KERNELS = [
    ("prep", (128, 128, "bfloat16", False, False, True), 24),  # k k^T, q k^T (8 k-blocks each), -w and u (4 each)
    ("prep", (128, 128, "float32", True, False, True), 24),    # fp32 beta, training variant (also stores T)
    ("prep", (128, 128, "bfloat16", False, True, True), 16),   # fused inference forward: T diag(beta), no -w / u
    ("fwd", (128, 128, 1, 2, False), 24),          # vn, q-part of o (8 each), Aqk-part of o, state (4 each)
    ("fwd", (128, 128, 2, 2, True), 24),           # two consumer warpgroups, training variant
    ("fwd", (128, 128, 1, 2, False, True), 24),    # the walk over segments with a halo (FLASHQLA_CUTLASS_SEGMENTS)
    ("fwd", (128, 128, 2, 2, True, True), 24),
    ("fwd_ws", (128, 128, False), 24),             # warp-specialised: the chain's vn and state (8 + 4), the output's
    ("fwd_ws", (128, 128, True), 24),              # q-part and Aqk-part (8 + 4), from the shared handoff buffers
    ("fwd_ws", (128, 128, False, True), 24),
    ("fwd_ws", (128, 128, True, True), 24),
    ("fwd_ws", (128, 128, False, False, True), 28),  # fused: + H k^T (8) and (v - ..) Tb^T (4) - the vn of -w (8)
    ("fwd_ws", (128, 128, False, True, True), 28),
    ("bwd_state", (128, 128, 1, 2), 20),
    ("bwd_state", (128, 128, 2, 2), 20),
    ("bwd_dqk", (128, 128), 48),
    ("bwd_wy", (128, 128, "bfloat16"), 48),
]


@pytest.mark.compile
@needs_dsl
@pytest.mark.parametrize("kind,key,n_wgmma", KERNELS, ids=lambda x: str(x))
def test_kernel_cross_compiles_for_sm90a(kind, key, n_wgmma, tmp_path, monkeypatch):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    ptx = _check_ptx(_compile(kind, key, tmp_path), kind, key)
    assert ptx.count("wgmma.mma_async") == n_wgmma
    from flashqla.backends.cutlass import smem_bytes
    assert 0 < smem_bytes(kind, key) <= 227 * 1024, f"{kind}: {smem_bytes(kind, key)} B of shared memory"

    if (kind in ("fwd", "bwd_state") and key[2] == 2) or kind == "fwd_ws":
        assert "setmaxnreg" in ptx
    # every wgmma pipelined (the one-warpgroup backward state kernel was serialised until session 24: C7520,
    # "compiler-inserted WG.AR in divergent path"; two wgmma fences around its dht load / dh0 store mended it)
    from test_backend_tilelang import assert_cubin_pipelined
    assert_cubin_pipelined(_compile(kind, key, tmp_path).__cubin__, f"{kind} {key}")
    import shutil
    if shutil.which("cc") or shutil.which("gcc"):
        # the on-disk cache: the same kernel through TVM-FFI, exported and linked by a detached child process
        # (loading needs a GPU driver)
        from flashqla.backends.cutlass import wait_for_exports
        wait_for_exports()
        lib = tmp_path / f"{kind}-{'-'.join(map(str, key))}" / "kernel.so"
        assert lib.is_file() and lib.stat().st_size > 10_000, "no kernel.so kept for the on-disk cache"


@pytest.mark.compile
@needs_dsl
def test_disk_cache_can_be_turned_off(tmp_path, monkeypatch):
    import flashqla.backends.cutlass as cb
    monkeypatch.setenv("FLASHQLA_CUTLASS_DISK_CACHE", "0")
    monkeypatch.setattr(cb, "_compiled", {})
    _compile("bwd_dqk", (128, 128), tmp_path)
    cb.wait_for_exports()
    out = tmp_path / "bwd_dqk-128-128"
    assert list(out.glob("*.ptx")) and not (out / "kernel.so").exists()
    monkeypatch.delenv("FLASHQLA_CUTLASS_DISK_CACHE")
    monkeypatch.setenv("FLASHQLA_CUTLASS_EXPORT", "off")
    monkeypatch.setattr(cb, "_compiled", {})
    _compile("bwd_dqk", (128, 128), tmp_path / "off")
    cb.wait_for_exports()
    assert not (tmp_path / "off" / "bwd_dqk-128-128" / "kernel.so").exists()


@needs_dsl
def test_cached_library_failing_its_first_call_falls_back_to_compiling(tmp_path):
    # a library whose first call raises (a calling-convention mismatch, say) is set aside and the compiled kernel
    # serves this call and every later one; a library that worked once is trusted
    import cutlass
    import flashqla.backends.cutlass as cb
    lib = tmp_path / "kernel.so"
    lib.write_bytes(b"x")
    seen, compiled = [], []

    def broken(*args):
        raise TypeError("mismatch")

    def fallback():
        compiled.append(1)
        return lambda *args: seen.append(args) or "compiled"

    k = cb._LoadedKernel(broken, lib, fallback)
    assert k(cutlass.Int32(3), 1.5) == "compiled" and k(cutlass.Int32(4)) == "compiled"
    assert len(compiled) == 1 and not lib.exists() and (tmp_path / "kernel.so.bad").exists()
    assert isinstance(seen[0][0], cutlass.Int32)          # the compiled kernel gets the original arguments
    ok = cb._LoadedKernel(lambda *a: a, tmp_path / "other.so", fallback)
    assert ok(cutlass.Int32(7), cutlass.Float32(0.5)) == (7, 0.5)   # plain values for the TVM-FFI function
    assert len(compiled) == 1


def test_disk_cache_key_follows_the_sources(tmp_path, monkeypatch):
    # an edited kernel source changes the directory a kernel is cached in, so a stale library never loads
    import flashqla.backends.cutlass as cb
    a = cb._source_digest()
    monkeypatch.setattr(cb, "_source_digest_memo", [])
    assert cb._source_digest() == a
    monkeypatch.setattr(cb, "_source_digest_memo", ["0" * 16])
    assert cb._source_digest() != a


@pytest.mark.compile
@needs_dsl
def test_compile_cache_hits_in_memory(tmp_path):
    from flashqla.backends.cutlass import compile_count
    a = _compile("fwd", (128, 128, 1, 2, False), tmp_path)
    n = compile_count()
    b = _compile("fwd", (128, 128, 1, 2, False), tmp_path)
    assert a is b and compile_count() == n


# --------------------------------------------------------------------------------------- emulation (CPU)
def test_blocked_inverse_is_exact():
    from flashqla.backends.cutlass.emulation import invert_unit_lower
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(3, 64, 64, generator=gen, dtype=torch.float64).tril(-1) * 0.3
    T = invert_unit_lower(A)
    eye = torch.eye(64, dtype=torch.float64).expand(3, 64, 64)
    ref = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
    assert torch.allclose(T, ref, rtol=1e-10, atol=1e-10)


EMU_CASES = [
    Case("varlen_tail", 1, 2, 128, 128, seqlens=(1, 63, 130, 0, 64)),
    Case("strong_decay", 1, 2, 128, 128, seqlens=(150, 7), gate="strong"),
    Case("gva_no_h0", 2, 4, 128, 128, seqlens=(70, 40), h0=False, scale=0.2),
]


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: c.name)
def test_emulation_of_kernel_steps_matches_oracle(case, fused):
    # fused: the fused inference forward's algebra and rounding points (Tb = T diag(beta) from the prep, v_new
    # formed in the recurrence from v and the bf16 bracket v - (Hb k^T) Gamma)
    from flashqla.backends.cutlass import emulation
    x = make_inputs(case, torch.bfloat16)
    scale = case.scale if case.scale is not None else case.K ** -0.5
    o, ht = emulation.forward(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"],
                              x["cu_seqlens"], fused=fused)
    ref = oracle(case, x, grads=False)
    assert rel_l2(o, ref["o"]) <= BF16_TOL["o"]
    assert rel_l2(ht, ref["ht"]) <= BF16_TOL["ht"]


BWD_EMU_CASES = [
    Case("varlen_tail", 1, 2, 128, 128, seqlens=(1, 63, 130, 0)),
    Case("gva_strong", 2, 4, 128, 128, seqlens=(70, 40), gate="strong", h0=False, scale=0.2),
]


@pytest.mark.parametrize("case", BWD_EMU_CASES, ids=lambda c: c.name)
def test_emulation_of_backward_kernel_steps_matches_oracle(case):
    """The backward kernels' steps (state-gradient recurrence, bwd_dqk, bwd_wy) give the oracle's grads."""
    from flashqla.backends.cutlass import emulation
    x = make_inputs(case, torch.bfloat16)
    scale = case.scale if case.scale is not None else case.K ** -0.5
    grads = emulation.backward(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"],
                               x["cu_seqlens"], x["do"], x["dht"])
    ref = oracle(case, x, grads=True)
    for name, gr in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
        if gr is None:
            assert name == "dh0" and not case.h0
            continue
        assert rel_l2(gr, ref[name]) <= BF16_TOL[name], name


def test_emulation_is_not_trivially_close():
    """The comparison above can fail: dropping the strictly-lower UT correction breaks it."""
    from flashqla.backends.cutlass import emulation
    case = EMU_CASES[0]
    x = make_inputs(case, torch.bfloat16)
    orig = emulation.invert_unit_lower
    try:
        emulation.invert_unit_lower = lambda A: torch.eye(64).expand_as(A).clone()
        o, _ = emulation.forward(x["q"], x["k"], x["v"], x["g"], x["beta"], case.K ** -0.5,
                                 x["initial_state"], x["cu_seqlens"])
    finally:
        emulation.invert_unit_lower = orig
    assert rel_l2(o, oracle(case, x, grads=False)["o"]) > 3 * BF16_TOL["o"]


# --------------------------------------------------------------------------------------- GPU
GPU_CASES = [
    Case("varlen_odd", 1, 2, 128, 128, seqlens=(0, 1, 63, 64, 65, 130)),
    Case("dense_h0_ht", 2, 4, 128, 128, B=2, T=300),
    Case("dense_no_state", 2, 4, 128, 128, B=2, T=200, h0=False, ht=False),
    Case("strong_decay", 1, 2, 128, 128, seqlens=(520, 7), gate="strong"),
    Case("no_decay", 1, 2, 128, 128, B=1, T=260, gate="zero"),
    Case("l2norm", 2, 4, 128, 128, seqlens=(33, 0, 390), l2norm=True),
    Case("gva_16_64", 16, 64, 128, 128, B=1, T=70, h0=False),
    Case("single_token", 1, 2, 128, 128, B=3, T=1),
]


@pytest.mark.gpu
@needs_dsl
@needs_sm90
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_matches_oracle(case):
    be = _backend()
    res = run_case(flashqla.chunk_gated_delta_rule, case, "cutlass", torch.bfloat16, "cuda",
                   grads=be.has_backward, exact_fp32=False)
    assert res.ok, f"errors over tolerance {res.failures} (all: {res.errors})"


@pytest.mark.gpu
@needs_dsl
@needs_sm90
@pytest.mark.parametrize("num_wg", [1, 2, "ws"])
@pytest.mark.parametrize("case", GPU_CASES[:6], ids=lambda c: c.name)
def test_gpu_forward_over_segments(case, num_wg, monkeypatch):
    # FLASHQLA_CUTLASS_SEGMENTS=2: the recurrence walks segments of 2 chunks, each starting in a halo before it
    # (or at its sequence start, from h0, where the gates' decay bound allows none: g = 0); the gradients run
    # through the chunk states the split forward saved.  Against the oracle, and the unsplit forward
    import flashqla.backends.cutlass as cb
    monkeypatch.setenv("FLASHQLA_CUTLASS_SEGMENTS", "2")
    # (num_wg 1 / 2: the one-warpgroup walk, which the fused default leaves to training forwards)
    opts = {"fwd": "ws"} if num_wg == "ws" else {"num_wg": num_wg, "fwd": "serial"}
    res = run_case(lambda *a, **kw: flashqla.chunk_gated_delta_rule(*a, **kw, backend_options=opts),
                   case, "cutlass", torch.bfloat16, "cuda", grads=True, exact_fp32=False)
    assert res.ok, f"errors over tolerance {res.failures} (all: {res.errors})"
    x = make_inputs(case, torch.bfloat16, "cuda")
    with torch.no_grad():
        o1, h1 = _call(x, case, **opts)
        monkeypatch.setenv("FLASHQLA_CUTLASS_SEGMENTS", "off")
        o0, h0 = _call(x, case, **opts)
    assert rel_l2(o1.float(), o0.float()) <= 2e-3 and rel_l2(h1, h0) <= 2e-3
    # the halo variant served the split calls, training and inference
    want = ({("fwd_ws", "sm_90a", 128, 128, save, True) for save in (False, True)} if num_wg == "ws" else
            {("fwd", "sm_90a", 128, 128, num_wg, 2, save, True) for save in (False, True)})
    assert want <= set(cb._compiled)


def _call(x, case, **opts):
    return flashqla.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=case.scale, initial_state=x["initial_state"],
        output_final_state=True, use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=x["cu_seqlens"],
        backend="cutlass", backend_options=opts or None)


@pytest.mark.gpu
@needs_dsl
@needs_sm90
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_ws_forward_matches_oracle_and_serial(case):
    # the warp-specialised recurrence (backend_options fwd=ws): the shared suite's cases, gradients through the
    # chunk states and v_new it saves; and o / ht against the one-warpgroup recurrence (same bf16 rounding points)
    import flashqla.backends.cutlass as cb
    ws = {"fwd": "ws"}
    res = run_case(lambda *a, **kw: flashqla.chunk_gated_delta_rule(*a, **kw, backend_options=ws),
                   case, "cutlass", torch.bfloat16, "cuda", grads=True, exact_fp32=False)
    assert res.ok, f"errors over tolerance {res.failures} (all: {res.errors})"
    x = make_inputs(case, torch.bfloat16, "cuda")
    with torch.no_grad():
        o1, h1 = _call(x, case, fwd="ws")
        o0, h0 = _call(x, case, fwd="serial", num_wg=1)
    assert rel_l2(o1.float(), o0.float()) <= 1e-3 and rel_l2(h1, h0) <= 1e-3
    assert {("fwd_ws", "sm_90a", 128, 128, save) for save in (False, True)} <= set(cb._compiled)


@pytest.mark.gpu
@needs_dsl
@needs_sm90
@pytest.mark.parametrize("segments", ["off", "2"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_fused_forward_matches_oracle_and_serial(case, segments, monkeypatch):
    # the fused inference forward (fwd=fused: the prep's T diag(beta), v_new formed in the recurrence), alone and
    # over 2-chunk segments: o / ht against the oracle and against the one-warpgroup walk
    import flashqla.backends.cutlass as cb
    monkeypatch.setenv("FLASHQLA_CUTLASS_SEGMENTS", segments)
    x = make_inputs(case, torch.bfloat16, "cuda")
    with torch.no_grad():
        o1, h1 = _call(x, case, fwd="fused")
        monkeypatch.setenv("FLASHQLA_CUTLASS_SEGMENTS", "off")
        o0, h0 = _call(x, case, fwd="serial", num_wg=1)
    ref = oracle(case, x, grads=False)
    assert rel_l2(o1, ref["o"]) <= BF16_TOL["o"]
    if ref.get("ht") is not None:           # (the oracle leaves ht out where the case has none)
        assert rel_l2(h1, ref["ht"]) <= BF16_TOL["ht"]
    assert rel_l2(o1.float(), o0.float()) <= 1e-2 and rel_l2(h1, h0) <= 1e-2
    # (the walk over segments runs where a sequence is cut: at least three chunks here)
    cut = segments != "off" and max(case.seqlens or (case.T,)) > 2 * 64
    assert ("fwd_ws", "sm_90a", 128, 128, False, cut, True) in cb._compiled
    # (the prep's key as prep_key spells it)
    assert ("prep", "sm_90a") + cb.prep_key(128, 128, str(x["beta"].dtype).split(".")[-1], False, True) in cb._compiled


@pytest.mark.gpu
@needs_dsl
@needs_sm90
@pytest.mark.parametrize("num_wg", [1, 2])
def test_gpu_both_recurrence_variants(num_wg):
    case = Case("variant", 2, 4, 128, 128, seqlens=(200, 65, 1))
    x = make_inputs(case, torch.bfloat16, "cuda")
    o, ht = _call(x, case, num_wg=num_wg)
    ref = oracle(case, x, grads=False)
    assert rel_l2(o, ref["o"]) <= BF16_TOL["o"] and rel_l2(ht, ref["ht"]) <= BF16_TOL["ht"]


@pytest.mark.gpu
@needs_dsl
@needs_sm90
def test_gpu_new_lengths_do_not_recompile():
    from flashqla.backends.cutlass import compile_count
    case = Case("len1", 1, 2, 128, 128, seqlens=(100, 37))
    x = make_inputs(case, torch.bfloat16, "cuda")
    _call(x, case)
    n = compile_count()
    for seqlens in ((333,), (5, 64, 700, 1), (64,)):
        c2 = Case("len2", 1, 2, 128, 128, seqlens=seqlens)
        x2 = make_inputs(c2, torch.bfloat16, "cuda")
        o, ht = _call(x2, c2)
        ref = oracle(c2, x2, grads=False)
        assert rel_l2(o, ref["o"]) <= BF16_TOL["o"]
    assert compile_count() == n, "a new sequence length recompiled a kernel"


_DISK_CACHE_SCRIPT = r"""
import json, sys, time
import torch
import flashqla
from flashqla.backends import cutlass as cb
from flashqla.testing import Case, make_inputs
case = Case("disk", 2, 4, 128, 128, seqlens=(300, 1, 129))
x = make_inputs(case, torch.bfloat16, "cuda")
leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
t = time.perf_counter()
o, ht = flashqla.chunk_gated_delta_rule(*leaves, output_final_state=True, cu_seqlens=x["cu_seqlens"],
                                        backend="cutlass")
grads = torch.autograd.grad([o, ht], leaves, [x["do"], x["dht"]])
torch.cuda.synchronize()
dt = time.perf_counter() - t
torch.save([o.detach().cpu(), ht.detach().cpu()] + [g.cpu() for g in grads], sys.argv[1])
cb.wait_for_exports()   # the libraries are built by detached children: let them finish before the next process
print(json.dumps(dict(compiles=cb.compile_count(), loads=cb.load_count(), seconds=dt)))
"""


@pytest.mark.gpu
@needs_dsl
@needs_sm90
def test_gpu_disk_cache_serves_a_new_process(tmp_path):
    # #5 item 2: a second process loads every kernel of a forward + backward from the on-disk cache (no
    # compilation) and computes bit for bit what the compiling process computed
    import json
    import subprocess
    import sys
    env = dict(os.environ, FLASHQLA_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("FLASHQLA_CUTLASS_DISK_CACHE", None)
    runs = []
    for i in range(2):
        proc = subprocess.run([sys.executable, "-c", _DISK_CACHE_SCRIPT, str(tmp_path / f"out{i}.pt")], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"process {i}: {runs[-1]}  {proc.stderr[-600:]}")
    first, second = runs
    assert first["compiles"] >= 5 and first["loads"] == 0, first
    assert second["compiles"] == 0 and second["loads"] == first["compiles"], second
    a, b = torch.load(tmp_path / "out0.pt"), torch.load(tmp_path / "out1.pt")
    for name, x, y in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta"), a, b):
        assert torch.equal(x, y), name


@pytest.mark.gpu
@needs_dsl
@needs_sm90
def test_gpu_strong_decay_stays_finite():
    case = Case("g_-1e4", 1, 2, 128, 128, seqlens=(150, 1, 70))
    x = make_inputs(case, torch.bfloat16, "cuda")
    x["g"][:, ::3] = -1e4
    o, ht = _call(x, case)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    ref = oracle(case, x, grads=False)
    assert rel_l2(o, ref["o"]) <= 2e-2 and rel_l2(ht, ref["ht"]) <= 2e-2


@pytest.mark.gpu
@needs_dsl
@needs_sm90
def test_gpu_nonfinite_input_stays_in_its_sequence():
    case = Case("nan", 1, 2, 128, 128, seqlens=(50, 80, 20))
    x = make_inputs(case, torch.bfloat16, "cuda")
    clean_o, clean_ht = _call(x, case)
    x["k"][0, 60, 0, 3] = float("nan")   # inside sequence 1 (tokens 50..129); also in the tail tile of seq 0
    x["v"][0, 61, 1, 3] = float("nan")
    o, ht = _call(x, case)
    torch.testing.assert_close(o[:, :50], clean_o[:, :50])
    torch.testing.assert_close(o[:, 130:], clean_o[:, 130:])
    torch.testing.assert_close(ht[[0, 2]], clean_ht[[0, 2]])
    assert not torch.isfinite(ht[1]).all()


@pytest.mark.gpu
@needs_dsl
@needs_sm90
@pytest.mark.parametrize("opts", [{"num_wg": 1}, {"num_wg": 2}, {"fwd": "ws"}], ids=lambda o: str(o))
def test_gpu_kernels_match_emulation_one_by_one(opts):
    """Each kernel's workspace against the emulation: localises a failure to one kernel."""
    import flashqla.backends.cutlass as cb
    from flashqla.backends.cutlass import emulation
    from flashqla.dispatch.registry import FwdInputs
    case = Case("ws", 1, 2, 128, 128, seqlens=(1, 150, 64, 37))
    x = make_inputs(case, torch.bfloat16, "cuda")
    scale = case.K ** -0.5
    spec, _, meta = validate(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True,
                             False, x["cu_seqlens"], needs_grad=True)
    inp = FwdInputs(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=scale,
                    initial_state=x["initial_state"], cu_seqlens=meta.cu_seqlens, varlen=meta,
                    output_final_state=True, use_qk_l2norm=False, options=opts)
    be = _backend()
    o, ht, saved, aux = be.forward(spec, inp)
    cb.debug_capture = cap = {}
    try:
        be.backward(spec, saved, aux, x["do"], x["dht"])
    finally:
        cb.debug_capture = None
    ref = {}
    cpu = {n: (None if t is None else t.cpu()) for n, t in x.items()}
    emulation.backward(cpu["q"], cpu["k"], cpu["v"], cpu["g"], cpu["beta"], scale, cpu["initial_state"],
                       cpu["cu_seqlens"], cpu["do"], cpu["dht"], intermediates=ref)
    ws = dict(zip(("w_neg", "aqk", "G", "T", "S", "vn"), saved[7:13]))
    ws.update(cap)
    # kernel order: prep (w_neg, aqk, G, T) -> fwd (S, vn) -> bwd_state (dS, dvn) -> bwd_dqk (dw, dG1)
    errs = {}
    for name in ("G", "w_neg", "aqk", "T", "S", "vn", "dS", "dvn", "dw", "dG1"):
        got = ws[name].float().cpu()
        want = ref[name].float()
        errs[name] = rel_l2(got.reshape(want.shape), want)
    bad = {n: e for n, e in errs.items() if not e <= 1e-2}
    assert not bad, f"first kernel off: {next(iter(bad))} (all errors: {errs})"


def _tiled_inverse_replay(A):
    """``ChunkPrepSm90``'s inverse (on register tiles) replayed task by task on the CPU: the same
    thread -> (block, row, column group) maps, the same 4-wide slices, the same phases and summation order, in
    float64.  ``A`` [64, 64] strictly lower; returns the 64 x 64 T the kernel leaves in shared memory, NaN where it
    would leave an entry unwritten (the scratch is not cleared first)."""
    import numpy as np
    T = np.full((64, 64), np.nan)
    P = np.full((3, 16, 16), np.nan)
    nthr = 128
    # _clear_upper_blocks
    for tidx in range(nthr):
        half, w = tidx // 64, tidx % 64
        for e in range(3):
            bi, bj = [(0, 1 + half), (half, 3 - half), (1 + half, 3)][e]
            r, c4 = 16 * bi + w // 4, 4 * (4 * bj + w % 4)
            T[r, c4:c4 + 4] = 0.0
    # P1: the diagonal blocks by forward substitution (threads 0..63: block b, column c)
    for tidx in range(64):
        b, c = tidx // 16, tidx % 16
        x = np.zeros(16)
        for r in range(16):
            acc = sum(A[16 * b + r, 16 * b + j] * x[j] for j in range(r))
            x[r] = 1.0 if r == c else (0.0 if r < c else -acc)
        T[16 * b:16 * b + 16, 16 * b + c] = x
    # _off_diagonal_tiled
    for d in range(1, 4):
        ntasks = (4 - d) * 64
        for phase in ("a", "b"):
            for rd in range(-(-ntasks // nthr)):
                for tidx in range(nthr):
                    task = rd * nthr + tidx
                    if task >= ntasks:
                        continue
                    p, r, q = task // 64, (task % 64) // 4, task % 4
                    acc = np.zeros(4)
                    if phase == "a":
                        for kk in range(0, 16 * d, 4):
                            a4 = A[16 * (p + d) + r, 4 * (4 * p + kk // 4):][:4]
                            for u in range(4):
                                acc = acc + a4[u] * T[16 * p + kk + u, 4 * (4 * p + q):][:4]
                        P[p, r, 4 * q:4 * q + 4] = acc
                    else:
                        for y in range(0, 16, 4):
                            d4 = T[16 * (p + d) + r, 4 * (4 * (p + d) + y // 4):][:4]
                            for u in range(4):
                                acc = acc + d4[u] * P[p, y + u, 4 * q:4 * q + 4]
                        T[16 * (p + d) + r, 4 * (4 * p + q):][:4] = -acc
    return T


@pytest.mark.parametrize("seed", [0, 1])
def test_tiled_prep_inverse_replay_matches_inverse(seed):
    """The tiled inverse's index maps write every entry of T exactly once per phase and form (I + A)^-1 (float64
    replay of the kernel's tasks; the kernel itself needs the H200: test_gpu_kernels_match_emulation_one_by_one)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    A = np.tril(rng.standard_normal((64, 64)) * 0.3, -1)
    T = _tiled_inverse_replay(A)
    assert not np.isnan(T).any(), "an entry of T is never written"
    np.testing.assert_allclose(T, np.linalg.inv(np.eye(64) + A), rtol=1e-9, atol=1e-9)


def test_prep_key_marks_the_tiled_inverse():
    # every prep key ends in the register-tile inverse's marker, so no scalar-inverse kernel (removed in session 23)
    # kept in an on-disk cache can match one
    from flashqla.backends.cutlass import _make_kernel, prep_key
    assert prep_key(128, 128, "bfloat16", False, True) == (128, 128, "bfloat16", False, True, True)
    assert prep_key(128, 128, "float32", True, False) == (128, 128, "float32", True, False, True)
    with pytest.raises(KeyError, match="scalar inverse"):
        _make_kernel("prep", (128, 128, "bfloat16", False, True, False))
