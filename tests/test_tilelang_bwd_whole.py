"""The whole-V fused tilelang backward (``chunk_bwd_whole_sm90``, ``FLASHQLA_TILELANG_BWD=whole``; session 14).

* Its mbarrier protocol, read from the kernel's source and stepped through the mbarrier-phase model of
  ``test_tilelang_bwd_fused`` under random interleavings of the four roles: no deadlock for walks of 0..6
  chunks, no barrier two phases ahead of a waiter, every phase whole; the model fails a broken protocol.
* Lowering for sm_90a: wgmma, TMA, 512 threads, setmaxnreg within the register file, no cross-warp
  AllReduce, no local memory, shared memory within one CTA.
* Its algebra (the w-free chain) is ``bwd_fused_ref(w_free=True)``, checked in ``test_tilelang_bwd_fused_ref``.
* On an sm_90 GPU: the oracle comparison of the shared backward cases and 20-run bitwise determinism.
"""

from __future__ import annotations

import importlib.util
import random
import re
from pathlib import Path

import pytest
import torch

from test_backend_tilelang import needs_sm90
from test_tilelang_bwd_fused import _protocol, _simulate, gpu_backward_deterministic, gpu_backward_matches_oracle

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None
SRC = Path(__file__).resolve().parents[1] / "flashqla" / "backends" / "tilelang" / "chunk_bwd_whole_sm90.py"
ROLES = {"chain": 128, "value": 128, "key": 128, "producer": 32}


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
            ("float16", "float16", 128, 128, True, False)]


@pytest.mark.compile
@pytest.mark.parametrize("args", _variants(), ids=lambda x: str(x).replace(" ", ""))
def test_whole_kernel_lowers_for_sm90a(args):
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang

    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_bwd_whole_sm90 import build_bwd_whole
    from test_tilelang_bwd_fused import check_ws_kernel

    # (72 bytes since session 15's register-staged passes: ptxas spills loop-invariant addresses, which each role
    # reloads a few times per chunk step (the SASS has ~10 LDL per role and step), not values of the passes)
    check_ws_kernel(tilelang.compile(build_bwd_whole(*args), out_idx=None, target=TARGET), f"bwd_whole{args}",
                    max_stack=96)


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


# ---- the automatic choice between the split and the whole backward ---------------------------------------------

def _chunk_meta(lengths):
    from flashqla.backends.tilelang.ops import ChunkMeta
    nc = sum((n + 63) // 64 for n in lengths)
    busy = sum(lengths) / max(lengths) if lengths and max(lengths) else 0.0
    return ChunkMeta(None, None, None, len(lengths), nc, busy)


@pytest.mark.parametrize("lengths,Hv,whole", [
    ([8192] * 4, 32, True),       # 128 walks: 2.2 ms whole against 3.5 split (session 15, H200)
    ([4096] * 8, 16, True),       # 128 shorter walks: 1.2 against 1.8
    ([8192] * 4, 16, False),      # 64 walks: 2.1 against 1.8
    ([32768], 32, False),         # 32 walks of 512 chunks: 8.1 against 4.2
    ([32768], 8, False),          # 8 walks: 7.7 against 2.3
    ([28672, 4096], 64, False),   # one long walk per head dominates
    ([], 32, False),
])
def test_auto_backward_choice(lengths, Hv, whole):
    """``FLASHQLA_TILELANG_BWD=auto`` (the default) takes the whole backward where its cost model says it beats
    the split one: the rows measured on the H200 fall on the side they were measured on."""
    from flashqla.backends.tilelang.ops import bwd_whole_pays
    assert bwd_whole_pays(_chunk_meta(lengths), Hv, torch.device("cpu")) is whole


def test_auto_is_the_default(monkeypatch):
    from flashqla.backends.tilelang.ops import bwd_variant
    monkeypatch.delenv("FLASHQLA_TILELANG_BWD", raising=False)
    assert bwd_variant() == "auto"
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "split")
    with pytest.raises(ValueError, match="FLASHQLA_TILELANG_BWD"):
        bwd_variant()
