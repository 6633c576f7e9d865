"""The device-run shell helpers (benchmarks/device_lib.sh, next_device_run.sh) on this machine: syntax, and the
compile cache's round trip, which must come back in parts when it is larger than one returned file may be."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / "benchmarks" / "device_lib.sh"

pytestmark = pytest.mark.skipif(not (shutil.which("bash") and shutil.which("xz") and shutil.which("split")
                                     and shutil.which("numfmt")), reason="needs bash, xz, split and numfmt")


def test_scripts_parse():
    for name in ("device_lib.sh", "next_device_run.sh"):
        r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / name)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def _bash(script: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=cwd, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("split", ["64K", "16M"])
def test_kcache_round_trip_whole_or_in_parts(tmp_path, split):
    """save_kcache packs the cache (whole, or in parts past KCACHE_SPLIT); sourcing device_lib.sh in a fresh
    checkout with those files in .gpu/ restores the same bytes."""
    cache, out, repo = tmp_path / "kcache", tmp_path / "out", tmp_path / "repo"
    (cache / "tilelang").mkdir(parents=True)
    blob = os.urandom(300_000)                  # incompressible: 300 kB > 64K, so that case splits
    (cache / "tilelang" / "kernel.bin").write_bytes(blob)
    # TileLang's nvcc-output cache stays behind (the kernel-cache entries embed their cubins)
    (cache / "tilelang" / "0.1.15" / "cuda-binaries" / "k1").mkdir(parents=True)
    (cache / "tilelang" / "0.1.15" / "cuda-binaries" / "k1" / "kernel.cubin").write_bytes(b"cubin")
    (repo / ".gpu").mkdir(parents=True)
    env = {"OUT": str(out), "KCACHE": str(cache), "KCACHE_SPLIT": split, "BUDGET_S": "60"}
    r = _bash(f"source {LIB} && save_kcache", repo, env)
    assert r.returncode == 0, r.stdout + r.stderr
    parts = sorted(p.name for p in out.iterdir() if p.name.startswith("kcache"))
    assert parts == (["kcache.tar.xz"] if split == "16M" else
                     [f"kcache.tar.xz.part-a{c}" for c in "abcdefghij"[:len(parts)]]), parts
    assert split == "16M" or len(parts) >= 2
    for p in parts:
        shutil.copy(out / p, repo / ".gpu" / p)
    # a second save in the same call replaces the first one's files (no stale part beside fewer new ones)
    (out / "kcache.tar.xz.part-zz").write_bytes(b"stale")
    r = _bash(f"source {LIB} && save_kcache", repo, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("kcache")) == parts
    fresh = tmp_path / "fresh"
    r = _bash(f"source {LIB}", repo, {**env, "KCACHE": str(fresh)})
    assert r.returncode == 0, r.stdout + r.stderr
    got = (fresh / "tilelang" / "kernel.bin").read_bytes()
    assert hashlib.sha1(got).digest() == hashlib.sha1(blob).digest() and (fresh / ".restored").exists()
    assert not (fresh / "tilelang" / "0.1.15" / "cuda-binaries").exists()


def test_pack_results_keeps_the_cache_and_packs_the_rest(tmp_path):
    out, repo = tmp_path / "out", tmp_path / "repo"
    (out / "cpw").mkdir(parents=True)
    repo.mkdir()
    for name in ("cpw/bench.json", "cpw/bench.md", "probe.json"):
        (out / name).write_text(name)
    (out / "kcache.tar.xz.part-aa").write_bytes(b"x")
    env = {"OUT": str(out), "KCACHE": str(tmp_path / "kcache"), "BUDGET_S": "60"}
    r = _bash(f"source {LIB} && pack_results", repo, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["kcache.tar.xz.part-aa", "results.tar.xz"]
    listing = subprocess.run(["tar", "tJf", str(out / "results.tar.xz")], capture_output=True, text=True).stdout
    assert {"./cpw/bench.json", "./cpw/bench.md", "./probe.json", "./logs/"} <= set(listing.split()), listing


def test_ncu_lines_summarises_a_source_page(tmp_path, capsys):
    """benchmarks/ncu_lines.py on a source page shaped as ncu writes it (a "Kernel Name" row before the header):
    samples per setmaxnreg segment, the wgmma-serialisation count, the hottest instruction first."""
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ncu_lines

    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
            "stall_barrier", "stall_long_sb (Not Issued)"]
    rows = [["0x0", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa0", "1", "128", "0", "1", "0"],
            ["0x10", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0", "5", "512", "0", "0", "0"],
            ["0x20", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "30", "512", "0", "30", "0"],
            ["0x30", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa8", "2", "128", "0", "0", "0"],
            ["0x40", "@!P0 BRA 0x100", "62", "4096", "60", "0", "55"]]
    quote = lambda r: ",".join(f'"{x}"' for x in r)                      # noqa: E731
    path = tmp_path / "page.csv"
    path.write_text('"Kernel Name","gdn_bwd_whole_kernel",\n' + "\n".join(quote(r) for r in [cols] + rows) + "\n")
    ncu_lines.summarize(str(path), top=2)
    out = capsys.readouterr().out
    assert "1 HGMMA, 1 WARPGROUP.DEPBAR  (serialised by ptxas" in out
    assert "1:  36.0%" in out and "barrier 86%" in out           # 36 of 100 samples, 31 of them on the barrier
    assert "2:  64.0%" in out and "long_sb 94%" in out           # the Not-Issued column is not a stall reason
    assert "barrier 0%" not in out
    hottest = [ln for ln in out.splitlines() if ln.strip().startswith("62.0%")]
    assert hottest and "BRA" in hottest[0]
