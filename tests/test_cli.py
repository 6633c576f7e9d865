"""The command line: ``python -m flashqla info | check | bench`` on the CPU (small shapes, in-process)."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import pytest
import torch

import flashqla
from flashqla.__main__ import main
from flashqla.cli import bench as bench_mod
from flashqla.cli import roofline
from flashqla.cli.cases import make_inputs, presets, random_split
from flashqla.cli.tolerances import TOLERANCES, tolerance
from flashqla.dispatch.registry import Backend, register_backend, unregister_backend


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHQLA_CACHE_DIR", str(tmp_path / "cache"))


# --------------------------------------------------------------------------------------------------
# toy backends registered in-process


class _WrongOutput(Backend):
    """Deliberately broken: returns v as the output and a zero state."""

    name = "toy_wrong"
    priorities = {}
    has_backward = False

    def forward(self, spec, x):
        N = x.varlen.num_seqs if x.varlen is not None else x.q.shape[0]
        ht = torch.zeros(N, spec.Hv, spec.K, spec.V, dtype=torch.float32) if x.output_final_state else None
        return x.v.clone(), ht, (), None


class _Raises(Backend):
    name = "toy_raises"
    priorities = {}
    has_backward = False

    def forward(self, spec, x):
        raise RuntimeError("toy kernel exploded")


class _Refuses(Backend):
    name = "toy_refuses"
    priorities = {}

    def supports(self, spec):
        return False, "toy backend refuses every call"


@pytest.fixture
def toys():
    made = [register_backend(b(), replace=True) for b in (_WrongOutput, _Raises, _Refuses)]
    yield made
    for b in made:
        unregister_backend(b.name)


# --------------------------------------------------------------------------------------------------
# info


def test_info_names_the_chosen_backend(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    x = flashqla.cli.info.dummy_call(torch.device("cpu"))
    expected = flashqla.explain(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu_seqlens"],
                                output_final_state=True, needs_grad=False).chosen
    assert expected is not None
    assert f"chosen: {expected}" in out
    for name in flashqla.list_backends():
        assert name in out
    assert "torch " + torch.__version__ in out
    assert "native cpu module" in out


def test_info_json_and_fake_arch(capsys):
    assert main(["info", "--json", "--fake-arch", "sm_90"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["torch"] == torch.__version__
    names = {b["name"] for b in doc["backends"]}
    assert {"reference", "cpu", "triton", "tilelang", "cutlass"} <= names
    for d in doc["decisions"]:
        assert "sm_90" in d["spec"] and "bfloat16" in d["spec"]
        assert d["chosen"] in names
        # every rejection carries its reason
        assert all(c["reason"] for c in d["order"])
    # the decode op's choice for a typical serving step, with every implementation's verdict
    dec = doc["decode"]
    assert dec["chosen"] == ("tilelang" if torch.cuda.is_available() and
                             torch.cuda.get_device_capability() == (9, 0) else
                             "triton" if torch.cuda.is_available() else "torch")
    assert {r["name"] for r in dec["order"]} == {"tilelang", "triton", "torch"} and all(r["verdict"] for r in dec["order"])


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "flashqla", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "chosen:" in r.stdout


# --------------------------------------------------------------------------------------------------
# check


def test_check_reference_passes(capsys):
    rc = main(["check", "--backend", "reference", "--head-dim", "32", "--cases", "varlen_odd,gva_2_8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "2 passed, 0 failed" in out
    assert "FAIL" not in out


def test_check_fails_on_a_broken_backend(toys, capsys, tmp_path):
    path = tmp_path / "check.json"
    rc = main(["check", "--backend", "toy_wrong", "--head-dim", "32", "--cases", "exact_chunk,gva_2_8",
               "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "FAIL" in out and "!" in out
    doc = json.loads(path.read_text())
    assert [r["status"] for r in doc["results"]] == ["fail", "fail"]
    assert all(r["errors"]["o"] > TOLERANCES["float32"]["o"] for r in doc["results"])


def test_check_fails_on_a_raising_backend_and_skips_a_refusing_one(toys, capsys):
    assert main(["check", "--backend", "toy_raises", "--cases", "single_token"]) == 1
    assert "toy kernel exploded" in capsys.readouterr().out
    # a backend that refuses everything checks nothing: exit 2, with its reason shown
    assert main(["check", "--backend", "toy_refuses", "--cases", "single_token"]) == 2
    assert "toy backend refuses every call" in capsys.readouterr().out


def test_check_mixed_run_reports_the_failure(toys, capsys):
    rc = main(["check", "--backend", "reference", "toy_wrong", "--cases", "single_token"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "1 passed, 1 failed" in out


def test_tolerance_table_is_the_shared_one():
    from flashqla import testing
    assert TOLERANCES is testing.TOLERANCES
    assert tolerance(torch.float32, "o") == 1e-5
    assert tolerance("bfloat16", "state") == 5e-3
    assert tolerance(torch.bfloat16, "dq") == 1e-2 and tolerance(torch.bfloat16, "dh0") == 1e-2
    assert tolerance(torch.bfloat16, "dg") == 2e-2 and tolerance(torch.bfloat16, "dbeta") == 2e-2
    with pytest.raises(KeyError):
        tolerance(torch.int8, "o")


# --------------------------------------------------------------------------------------------------
# bench


def _bench(tmp_path, *extra):
    out = tmp_path / "bench"
    rc = main(["bench", "--preset", "quick", "--out", str(out), "--min-time", "0.02", "--max-reps", "3",
               "--no-progress", *extra])
    return rc, out


def test_bench_quick_writes_well_formed_outputs(tmp_path, capsys):
    rc, out = _bench(tmp_path, "--backends", "reference")
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads((out / "bench_quick_fwd.json").read_text())
    meta, rows = doc["meta"], doc["rows"]
    assert meta["preset"] == "quick" and meta["mode"] == "fwd"
    assert meta["ceilings"]["copy_gbps"] > 0 and meta["ceilings"]["matmul_tflops"] > 0
    assert len(rows) == len(presets("cpu")["quick"].rows) == meta["rows_done"]
    for r in rows:
        res = r["results"]["reference"]
        assert res["status"] == "ok", res
        assert res["ms"] > 0 and math.isfinite(res["ms"])
        assert r["flops"] > 0 and r["bytes"] > 0 and r["floor_ms"] > 0
        assert 0 < res["pct_roofline"] == pytest.approx(100 * r["floor_ms"] / res["ms"])
        assert r["tokens"] == sum(r["seqlens"])
    with open(out / "bench_quick_fwd.csv") as fh:
        recs = list(csv.DictReader(fh))
    assert recs and set(recs[0]) == set(bench_mod.CSV_FIELDS)
    assert len(recs) == len(rows)
    assert all(float(x["ms"]) > 0 and x["status"] == "ok" for x in recs)
    md = (out / "bench_quick_fwd.md").read_text()
    assert md.count("\n|") >= len(rows) + 1
    # the stdout table has one line per row
    for r in rows:
        assert r["label"].split(" ", 1)[1] in text
    # ceilings were cached for the next run
    assert (tmp_path / "cache" / "ceilings.json").exists()


def test_bench_fwdbwd_speedups_and_baseline(tmp_path, capsys, monkeypatch):
    def missing():
        raise ImportError("no module named fla (test)")
    monkeypatch.setitem(bench_mod.EXTERNAL_BASELINES, "fla", missing)
    rc, out = _bench(tmp_path, "--backends", "reference", "--baselines", "reference,fla", "--mode", "fwdbwd",
                     "--max-rows", "1")
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    assert "baseline fla skipped" in captured.err
    doc = json.loads((out / "bench_quick_fwdbwd.json").read_text())
    row = doc["rows"][0]
    assert row["results"]["fla"]["status"] == "skipped"
    assert row["results"]["reference"]["status"] == "ok"
    fwd_flops = roofline.gdn_flops(row["tokens"], row["Hv"], mode="fwd")
    assert row["flops"] == pytest.approx(3.5 * fwd_flops)


def test_bench_max_walks_keeps_the_few_walk_rows_and_summarises(tmp_path, capsys):
    # --max-walks 2 keeps the CPU quick preset's 1/2 one-sequence row (2 walks) and drops its 2/4 three-sequence one
    # (12); the summary (stdout, markdown, JSON) gives the geometric mean and the lowest ratio over the kept rows
    rc, out = _bench(tmp_path, "--backends", "cpu", "--baselines", "reference", "--max-walks", "2")
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads((out / "bench_quick_fwd.json").read_text())
    assert [(r["Hv"], r["num_seqs"]) for r in doc["rows"]] == [(2, 1)]
    ratio = doc["rows"][0]["speedup"]["cpu"]["reference"]
    assert [(s["rows"], s["count"]) for s in doc["summary"]] == [("all rows", 1), ("Hv x sequences <= 40", 1)]
    for s in doc["summary"]:
        assert s["impl"] == "cpu" and s["baseline"] == "reference"
        assert s["geomean"] == pytest.approx(ratio) and s["lowest"] == pytest.approx(ratio)
    assert "summary:" in text and "cpu vs reference, all rows (1)" in text
    assert "- cpu vs reference, Hv x sequences <= 40 (1)" in (out / "bench_quick_fwd.md").read_text()
    with pytest.raises(SystemExit, match="--max-walks 1 leaves no row"):
        _bench(tmp_path, "--backends", "cpu", "--max-walks", "1")


def test_bench_summary_over_all_rows_and_the_cp_rows():
    def rec(label, Hv, seqs, **ratios):
        return {"label": label, "Hv": Hv, "num_seqs": seqs, "speedup": {"a": dict(ratios)}}
    results = [rec("8/32 1x32768", 32, 1, flashqla=1.05, fla=3.0), rec("16/32 4x8192", 32, 4, flashqla=1.2),
               rec("2/8 4x8192", 8, 4, flashqla=1.6, fla=None)]
    got = {(s["baseline"], s["rows"]): s for s in bench_mod.summarize(results)}
    everything = got[("flashqla", "all rows")]
    assert everything["count"] == 3 and everything["geomean"] == pytest.approx((1.05 * 1.2 * 1.6) ** (1 / 3))
    assert (everything["lowest"], everything["lowest_row"], everything["below_target"]) == (1.05, "8/32 1x32768", 1)
    cp = got[("flashqla", "Hv x sequences <= 40")]
    assert cp["count"] == 2 and cp["geomean"] == pytest.approx((1.05 * 1.6) ** 0.5)
    # a missing ratio (None) is not a row of the summary
    assert got[("fla", "all rows")]["count"] == 1 and got[("fla", "Hv x sequences <= 40")]["count"] == 1


def test_bench_initial_state_reaches_every_implementation(tmp_path, capsys, monkeypatch):
    # --initial-state: each call starts from the row's random h0 (a baseline that dropped it would disagree with
    # the backend, which the agree column shows), the bytes count h0 (and dh0 in fwd+bwd), and the state changes o
    calls = []
    real = bench_mod._flashqla_op

    def spying(name):
        op = real(name)

        def wrapped(*a, h0=None, **kw):
            calls.append(h0 is not None)
            return op(*a, h0=h0, **kw)
        return wrapped
    monkeypatch.setattr(bench_mod, "_flashqla_op", spying)
    for mode in ("fwd", "fwdbwd"):
        rc, out = _bench(tmp_path, "--backends", "cpu", "--baselines", "reference", "--mode", mode, "--max-rows",
                         "2", "--initial-state")
        assert rc == 0, capsys.readouterr().out
        doc = json.loads((out / f"bench_quick_{mode}.json").read_text())
        assert doc["meta"]["initial_state"] is True
        for r in doc["rows"]:
            assert r["results"]["cpu"]["status"] == "ok" and r["results"]["reference"]["agree"] < 1e-4
            state = r["num_seqs"] * r["Hv"] * 128 * 128 * 4
            plain = roofline.gdn_bytes(r["tokens"], r["Hqk"], r["Hv"], num_seqs=r["num_seqs"], mode=mode,
                                       dtype=torch.float32, ht=(mode == "fwd"))
            assert r["bytes"] == pytest.approx(plain + state * (1 if mode == "fwd" else 2))
    assert calls and all(calls)
    # the state is used: o differs from the call without it
    row = bench_mod.presets("cpu")["quick"].rows[0]
    x = bench_mod._inputs_for(row, torch.float32, torch.device("cpu"), "fwd", seed=1, h0=True)
    op = real("reference")
    with_h0 = bench_mod.make_call(op, x, "fwd")()[0]
    x.pop("h0")
    assert not torch.allclose(with_h0, bench_mod.make_call(op, x, "fwd")()[0])


def test_bench_records_a_failing_backend_and_goes_on(toys, tmp_path, capsys):
    rc, out = _bench(tmp_path, "--backends", "toy_raises,reference,toy_refuses", "--baselines", "none")
    assert rc == 0
    doc = json.loads((out / "bench_quick_fwd.json").read_text())
    for r in doc["rows"]:
        assert r["results"]["toy_raises"]["status"] == "error"
        assert "toy kernel exploded" in r["results"]["toy_raises"]["error"]
        assert r["results"]["toy_refuses"]["status"] == "n/a"
        assert r["results"]["reference"]["status"] == "ok"
    assert "toy kernel exploded" in capsys.readouterr().out  # in the notes under the table
    rc, _ = _bench(tmp_path, "--backends", "toy_raises", "--baselines", "none", "--strict")
    assert rc == 1


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("quick", "qwen35-fwd", "qwen35-bwd", "flashqla-fwd", "flashqla-bwd"):
        assert name in out


# --------------------------------------------------------------------------------------------------
# presets, inputs and the roofline model


def test_presets_match_the_published_grids():
    p = presets("cuda")
    assert len(p["qwen35-fwd"].rows) == 5 * 5 and p["qwen35-fwd"].mode == "fwd"
    assert len(p["qwen35-bwd"].rows) == 5 * 2 * 2 and p["qwen35-bwd"].mode == "fwdbwd"
    assert len(p["flashqla-fwd"].rows) == 9 * 12
    assert len(p["flashqla-bwd"].rows) == 4 * 2 * 4
    assert {r.tokens for r in p["flashqla-bwd"].rows} == {8192, 32768}
    assert {r.tokens for r in p["qwen35-bwd"].rows} == {8192, 32768}
    for r in p["flashqla-fwd"].rows + p["qwen35-fwd"].rows:
        assert r.Hv % r.Hqk == 0
    for n in (1, 2, 4, 8):
        s = random_split(32768, n, seed=n)
        assert len(s) == n and sum(s) == 32768 and min(s) >= 64
        assert s == random_split(32768, n, seed=n)  # deterministic


def test_bench_inputs_follow_the_recipe():
    x = make_inputs([5, 0, 7], 2, 4, dtype=torch.bfloat16, seed=3)
    assert x["q"].dtype == torch.bfloat16 and x["g"].dtype == torch.float32 and x["beta"].dtype == torch.bfloat16
    assert x["cu_seqlens"].tolist() == [0, 5, 5, 12] and x["cu_seqlens"].dtype == torch.int32
    norms = x["q"].float().norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
    assert (x["g"] < 0).all() and ((x["beta"] > 0) & (x["beta"] < 1)).all()


def test_roofline_counts():
    assert roofline.flops_per_token_head(128) == pytest.approx(10 * 64 * 128 + 6 * 128 ** 2 + (2 / 3) * 64 ** 2)
    assert roofline.gdn_flops(1000, 32, mode="fwdbwd") == pytest.approx(3.5 * roofline.gdn_flops(1000, 32))
    # q, k: 2 x 16 heads x 128 x 2 B; v, o: 2 x 32 x 128 x 2 B; g: 32 x 4 B; beta: 32 x 2 B (per token)
    per_tok = 2 * 16 * 128 * 2 + 2 * 32 * 128 * 2 + 32 * 4 + 32 * 2
    assert roofline.gdn_bytes(100, 16, 32) == 100 * per_tok
    assert roofline.gdn_bytes(100, 16, 32, num_seqs=2, ht=True) == 100 * per_tok + 2 * 32 * 128 * 128 * 4
    bwd = roofline.gdn_bytes(100, 16, 32, mode="fwdbwd")
    assert bwd == 100 * (per_tok + 32 * 128 * 2 * 2 + 2 * 16 * 128 * 2 + 32 * 4 + 32 * 2)
    ceil = {"copy_gbps": 1000.0, "matmul_tflops": 100.0}
    assert roofline.floor_ms(1e12, 1e9, ceil) == pytest.approx(10.0)   # compute-bound: 1e12 / 1e14 s
    assert roofline.floor_ms(1e6, 1e10, ceil) == pytest.approx(10.0)   # memory-bound: 1e10 / 1e12 s


def test_bench_plot_when_matplotlib_is_there(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    rc = main(["bench", "--preset", "quick", "--out", str(out), "--min-time", "0.01", "--max-reps", "2",
               "--no-progress", "--backends", "reference", "--max-rows", "1"])
    assert rc == 0
    png = (out / "bench_quick_fwd.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_bench_decode_on_cpu_both_layouts(tmp_path, capsys):
    """The decode preset on the CPU: the torch path in both pool layouts, checked against itself (same
    math), with JSON + markdown written."""
    import json
    out = tmp_path / "dec"
    rc = main(["bench", "--preset", "decode", "--backends", "torch,torch[layout=VK]", "--baselines", "none",
               "--filter", "16/32 b1", "--min-time", "0.01", "--max-reps", "2", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "bench_decode.json").read_text())
    assert len(data["rows"]) == 1
    res = data["rows"][0]["results"]
    for name in ("torch", "torch[layout=VK]"):
        assert res[name]["status"] == "ok" and res[name]["err"] < 1e-6 and res[name]["ms"] > 0, res[name]
    md = (out / "bench_decode.md").read_text()
    assert "| 16/32 | 1 |" in md and "torch[layout=VK] us" in md


def test_bench_cp_names_and_filter_alternatives(tmp_path, capsys):
    """NAME@cp / @cpN are captured; @cpw / @cpwN (windowed CP reads the gates on the host) are timed
    eagerly from the start; --filter takes '|'-separated alternatives."""
    from flashqla.cli.bench import CP_WINDOWED_NOTE, build_impls, split_cp_name
    assert split_cp_name("tilelang@cp") == ("tilelang", "auto") == split_cp_name("tilelang@cpw")
    assert split_cp_name("triton@cpw8") == ("triton", 8) == split_cp_name("triton@cp8")
    assert split_cp_name("reference") == ("reference", False)
    for bad in ("tilelang@cpw0", "tilelang@cpx", "tilelang@cp-2"):
        with pytest.raises(SystemExit):
            split_cp_name(bad)
    impls = {im.name: im for im in build_impls(["reference@cpw4", "reference@cp4"], [])}
    assert impls["reference@cpw4"].eager_reason == CP_WINDOWED_NOTE and not impls["reference@cp4"].eager_reason
    with pytest.raises(SystemExit, match="matches no row"):
        main(["bench", "--preset", "quick", "--device", "cpu", "--backends", "reference", "--baselines", "none",
              "--filter", "nomatch|alsonot", "--no-plot"])
    labels = [r.name() for r in presets("cpu")["quick"].rows]
    assert main(["bench", "--preset", "quick", "--device", "cpu", "--backends", "reference", "--baselines", "none",
                 "--filter", f"{labels[0]}|{labels[-1]}", "--no-plot", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_quick_fwd.json").read_text())["rows"]
    assert [r["label"] for r in rows] == [labels[0], labels[-1]]


def test_bench_eager_too_columns():
    """--eager-too (timing on CUDA only): the table shows each graph-timed implementation's eager time and its
    eager-vs-eager speedup over eagerly timed baselines, besides the graph numbers."""
    impls = [bench_mod.Impl("tilelang", "backend"), bench_mod.Impl("flashqla", "baseline", op=lambda *a: None)]
    rec = {"Hqk": 2, "Hv": 8, "label": "2/8 1x32768", "tokens": 32768, "flops": 4.8e10, "bytes": 1.7e8,
           "floor_ms": 0.06,
           "results": {"tilelang": {"status": "ok", "ms": 0.5, "method": "graph", "eager_ms": 0.8,
                                    "pct_roofline": 12.0},
                       "flashqla": {"status": "ok", "ms": 0.6, "method": "eager", "pct_roofline": 10.0,
                                    "note": "host planning"}},
           "speedup": {"tilelang": {"flashqla": 1.2}}, "speedup_eager": {"tilelang": {"flashqla": 0.75}}}
    headers, body = bench_mod.table_rows([rec], impls)
    row = dict(zip(headers, body[0]))
    assert row["tilelang eager ms"] == "0.800" and row["tilelang eager vs flashqla x"] == "0.75"
    assert row["tilelang vs flashqla x"] == "1.20" and "flashqla eager ms" not in row
    # without --eager-too nothing changes
    for r in rec["results"].values():
        r.pop("eager_ms", None)
    rec.pop("speedup_eager")
    headers, _ = bench_mod.table_rows([rec], impls)
    assert not any("eager" in h for h in headers)
