"""``python -m flashqla precompile``: enumerate / compile the tilelang kernels without a GPU."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from flashqla.__main__ import main

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None
needs_tilelang = pytest.mark.skipif(not HAVE_TILELANG, reason="tilelang is not installed")

# The cheapest selection: one forward flag set, one dtype -> the two forward kernels.
CHEAP = ["--modes", "fwd", "--dtypes", "bfloat16", "--beta-dtypes", "bfloat16",
         "--flags", "h0=0,ht=0,l2norm=0,varlen=0,grad=0"]


# one V-block of the warp-specialised forward, so the cheap selection is three kernels (stage 1, the
# recurrence over sequences and over segments)
CHEAP_ENV = {"FLASHQLA_TILELANG_BV": "64"}


def _run(args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "flashqla", "precompile", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_bad_arch_exits_2(capsys):
    assert main(["precompile", "--arch", "sm_80", "--list"]) == 2
    assert "sm_90a" in capsys.readouterr().err


def test_no_tilelang_exits_2(tmp_path):
    code = ("import sys; sys.modules['tilelang'] = None\n"
            "from flashqla.__main__ import main\n"
            f"sys.exit(main(['precompile', '--list', '--cache-dir', {str(tmp_path)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "tilelang is not importable" in r.stderr


@needs_tilelang
def test_list_shows_every_variant(tmp_path, capsys):
    from flashqla.backends.tilelang import _compile, ops

    assert main(["precompile", "--list", "--heads", "16/32,8/32,4/4", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "16/32, 8/32, 4/4" in out
    # (dense calls' stage 1 takes the uniform row lookup, session 25: varlen changes stage 1's keys)
    assert "varlen: part of a key" in out
    listed = re.findall(r"^\s*\d+\s+(fwd|bwd)\s+(\S+)\s+key=(.*)$", out, re.M)
    assert int(re.search(r"^(\d+) variants$", out, re.M).group(1)) == len(listed)
    keys = {(n, k) for _, n, k in listed}
    assert len(keys) == len(listed), "duplicates in --list"
    # Independent of the enumeration: every key the kernel helpers of ops build, over all flags.
    import itertools

    import torch
    want = set()
    with _compile.record_keys() as rec:
        for dt in (torch.bfloat16, torch.float16):
            for bdt in (torch.bfloat16, torch.float16, torch.float32):
                for a in (False, True):
                    # (stage 1 with the uniform row lookup for dense calls, the table for varlen ones)
                    for uni in (False, True):
                        ops.intra_kernel(dt, bdt, 128, 128, a, True, uniform=uni)     # training forwards (X saved)
                        # inference forwards (fused); equal-length calls' stage 1 as persistent CTAs (the
                        # default FLASHQLA_TILELANG_INTRA_PERSIST=auto, session 26)
                        ops.intra_tb_kernel(dt, bdt, 128, a, uniform=uni, persist=uni)
                        ops.intra_tb_kernel(dt, bdt, 128, a, scores=True, uniform=uni)  # few walks at BV 32 (pscores)
                    # (each backward kernel also as the GVA pair sum in the kernel, FLASHQLA_TILELANG_GVA=pair,
                    # the default since session 23, for the ratio-2 heads 16/32)
                    for pair in (False, True):
                        ops.bwd_wy_kernel(dt, bdt, 128, 128, a, pair)
                        # the whole-V fused backward (FLASHQLA_TILELANG_BWD=auto takes it where it pays), with a
                        # final-state gradient or not (a), dh0 or not
                        # (and walking segments with a halo: in-kernel CP of the backward)
                        for halo in (False, True):
                            ops.bwd_whole_kernel(dt, bdt, 128, 128, a, True, halo, pair)
                            ops.bwd_whole_kernel(dt, bdt, 128, 128, a, False, halo, pair)
            # the default recurrences: warp-specialised, every V-block the call-time rule can pick; fused
            # when nothing is saved for a backward
            # (and each walking whole sequences or segments with a halo: in-kernel CP)
            for fl in itertools.product((False, True), repeat=4):
                for bv in ops.FWD_WS_BVS:
                    for halo in (False, True):
                        ops.fwd_ws_kernel(dt, 128, 128, *fl, bv, fused=not fl[3], halo=halo)
                        if bv == 32 and not fl[3]:
                            ops.fwd_ws_kernel(dt, 128, 128, *fl, bv, fused=True, pscores=True, halo=halo)
            # the fused training forward ahead of the whole-V backward (FLASHQLA_TILELANG_TRAIN_FUSED, on by default;
            # no fused L2 norm there): stage 1 with X, the fused recurrence with its saves
            for bdt in (torch.bfloat16, torch.float16, torch.float32):
                for uni in (False, True):
                    ops.intra_tb_kernel(dt, bdt, 128, False, save_x=True, uniform=uni, persist=uni)
            for h0, ht in itertools.product((False, True), repeat=2):
                for bv in ops.FWD_WS_BVS:
                    for halo in (False, True):
                        ops.fwd_ws_kernel(dt, 128, 128, False, h0, ht, True, bv, fused=True, halo=halo)
            for fl in itertools.product((False, True), repeat=3):
                for bv in ops.BWD_WS_BVS:
                    for halo in (False, True):
                        ops.bwd_state_ws_kernel(dt, 128, 128, *fl, bv, halo)
            for a, pair in itertools.product((False, True), repeat=2):
                ops.bwd_dqk_kernel(dt, 128, 128, a, pair)
    want = {(n, repr(k)) for n, _, k in rec}
    assert keys == want
    assert {n for n, _ in keys} == {"fwd_intra_sm90", "fwd_intra_tb_sm90", "fwd_intra_tbs_sm90", "fwd_intra_tbx_sm90",
                                    "fwd_recurrent_ws_sm90", "bwd_state_ws_sm90",
                                    "bwd_dqk_v2_sm90", "bwd_wy_v2_sm90", "bwd_whole_sm90"}


@needs_tilelang
def test_list_selection():
    r = _run(["--list", *CHEAP], CHEAP_ENV)
    assert r.returncode == 0, r.stderr
    assert "3 variants" in r.stdout
    assert "fwd_intra_tb_sm90" in r.stdout and "fwd_recurrent_ws_sm90" in r.stdout   # inference: fused
    r = _run(["--list", *CHEAP])
    assert r.returncode == 0, r.stderr
    # every V-block of the ws forward when none is forced, and at BV 32 its pscores form with the stage 1
    # that writes the scores (chosen per call for few walks); each walking sequences or segments (halo)
    assert f"{2 + 2 * 4} variants" in r.stdout


@needs_tilelang
@pytest.mark.compile
def test_compile_cold_then_warm(tmp_path):
    cache = tmp_path / "cache"
    r1 = _run([*CHEAP, "--cache-dir", str(cache)], CHEAP_ENV)
    assert r1.returncode == 0, r1.stderr[-3000:]
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert files, "nothing written to the cache dir"
    assert str(cache) in r1.stdout and "precompiled 3/3" in r1.stdout
    assert r1.stderr.count("(new)") == 3
    r2 = _run([*CHEAP, "--cache-dir", str(cache)], CHEAP_ENV)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert r2.stderr.count("(cached)") == 3
    t1 = float(re.search(r"compile ([\d.]+) s total", r1.stdout).group(1))
    t2 = float(re.search(r"compile ([\d.]+) s total", r2.stdout).group(1))
    print(f"cold {t1:.2f} s, warm {t2:.2f} s")
    assert t2 < t1 / 5, (t1, t2)


@needs_tilelang
def test_default_cache_dir_from_env(tmp_path):
    r = _run(["--list", *CHEAP], {"FLASHQLA_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert f"cache dir {tmp_path / 'tilelang'}" in r.stdout
