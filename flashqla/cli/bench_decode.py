"""``python -m flashqla bench --preset decode``: the decode step on a state pool against FLA's fused_recurrent.

One row is (Hqk/Hv, batch, tokens per row): every batch row reads and updates its own pool row
(``state_indices`` a permutation of the pool, fp32 ``[P, Hv, K, V]`` state, bf16 q/k/v, fp32 g, q/k L2 norm
fused: what a serving engine's decode step calls).  FLA 0.6.0's ``fused_recurrent_gated_delta_rule`` is the
baseline (``FLA_FLASH_QLA=0`` is irrelevant there; it has no FlashQLA route): it reads the same pool as its
``initial_state`` and writes a new final state, the same bytes as our in-place update.

Implementations are the decode op's (``decode_implementations()``: triton, tilelang, torch) plus variants
``triton[bv=16,warps=2]`` that set ``FLASHQLA_DECODE_TUNE`` while the call is built (sweeps), and
``NAME[layout=VK]``: the pool in the serving layout ``[P, Hv, V, K]`` (FLA keeps its own ``[N, H, K, V]``).  Each result
is checked against the op's torch implementation in float32 on a copy of the pool (max relative L2 error
of o and of the updated pool rows).  Timing: CUDA graphs, medians (``bench.time_cuda``); every replay
updates the pool again, which keeps the traffic real (the decay keeps the values bounded).

Floor: bytes / copy bandwidth; bytes = the state read and written once per row and head, plus q, k, v, o,
g and beta (decode moves ~64 KiB of state per (row, head) and computes almost nothing).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import torch

HEADS = ((16, 32), (16, 64))
BATCHES = (1, 8, 64, 256)


def _parse_impl(name: str) -> tuple:
    base, sep, rest = name.partition("[")
    if not sep:
        return base, ""
    if not rest.endswith("]"):
        raise SystemExit(f"bad decode implementation {name!r}: use NAME or NAME[bv=..,warps=..,layout=VK]")
    return base, rest[:-1]


def _make_inputs(Hqk, Hv, B, T, device, dtype, K=128, V=128, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)
    q = rnd(B, T, Hqk, K).to(device, dtype)
    k = rnd(B, T, Hqk, K).to(device, dtype)
    v = rnd(B, T, Hv, V).to(device, dtype)
    g = torch.nn.functional.logsigmoid(rnd(B, T, Hv)).to(device, torch.float32)
    beta = torch.sigmoid(rnd(B, T, Hv)).to(device, dtype)
    pool = (0.05 * rnd(B, Hv, K, V)).to(device, torch.float32)
    idx = torch.randperm(B, generator=gen).to(device, torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, pool=pool, idx=idx)


def _row_bytes(Hqk, Hv, B, T, io_bytes=2, K=128, V=128) -> float:
    state = 2 * B * Hv * K * V * 4
    io = B * T * (2 * Hqk * K + 2 * Hv * V) * io_bytes + B * T * Hv * (4 + io_bytes)
    return float(state + io)


def _split_layout(tune: str) -> tuple:
    """``"bv=16,layout=VK"`` -> (``"bv=16"``, ``"VK"``): the pool layout is a bench option, the rest goes to
    FLASHQLA_DECODE_TUNE."""
    parts, layout = [], "KV"
    for p in (x.strip() for x in tune.split(",") if x.strip()):
        if p.lower().startswith("layout="):
            layout = p.split("=", 1)[1].upper()
            if layout not in ("KV", "VK"):
                raise SystemExit(f"decode bench: layout=KV or layout=VK, got {p!r}")
        else:
            parts.append(p)
    return ",".join(parts), layout


def _flashqla_call(impl: str, tune: str, layout: str, x: dict):
    from flashqla.decode import gated_delta_rule_decode

    if layout == "VK":
        # the serving layout [P, Hv, V, K]: a transposed copy of the pool, turned back for the check
        x["pool"] = x["pool"].transpose(-1, -2).contiguous()

    def call():
        old = os.environ.get("FLASHQLA_DECODE_TUNE")
        if tune:
            os.environ["FLASHQLA_DECODE_TUNE"] = tune
        try:
            return [gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["pool"], x["idx"],
                                            use_qk_l2norm_in_kernel=True, state_layout=layout, impl=impl,
                                            check_indices=False)]
        finally:
            if tune:
                if old is None:
                    os.environ.pop("FLASHQLA_DECODE_TUNE", None)
                else:
                    os.environ["FLASHQLA_DECODE_TUNE"] = old
    return call


def _load_fla_recurrent():
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    import fla
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn
    return fn, getattr(fla, "__version__", "")


def _fla_call(fn, x: dict):
    # FLA reads the pool rows in batch order: gather them once outside the timed call, like an engine
    # that keeps its pool in batch order for FLA.
    h0 = x["pool"].index_select(0, x["idx"].long()).contiguous()
    scale = x["q"].shape[-1] ** -0.5

    def call():
        o, ht = fn(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=scale, initial_state=h0,
                   output_final_state=True, use_qk_l2norm_in_kernel=True)
        return [o, ht]
    return call


def _check(outs, x_ref, o_ref, pool_ref, is_fla: bool) -> float:
    o = outs[0].float()
    err_o = ((o - o_ref).norm() / o_ref.norm().clamp_min(1e-30)).item()
    if is_fla:
        rows = pool_ref.index_select(0, x_ref["idx"].long())
        st = outs[1].float()
    else:
        rows, st = pool_ref, x_ref["pool_after"]
    err_s = ((st - rows).norm() / rows.norm().clamp_min(1e-30)).item()
    return max(err_o, err_s)


def run_decode_bench(args) -> int:
    from flashqla.cli import bench, roofline
    from flashqla.decode import decode_implementations, gated_delta_rule_decode

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    T = 1
    avail = decode_implementations()
    if args.backends:
        names = [b for b in re.split(r",(?![^\[]*\])", args.backends) if b]
    else:
        # what can serve this device: the GPU kernels on CUDA, the torch path on the CPU
        names = [n for n, (ok, _) in avail.items() if ok and (n != "torch") == (device.type == "cuda")]
    baselines = ["fla"] if args.baselines is None else [b for b in args.baselines.split(",") if b and b != "none"]
    impls = []
    for n in names:
        base, tune = _parse_impl(n)
        tune, layout = _split_layout(tune)
        if base not in avail:
            raise SystemExit(f"unknown decode implementation {base!r}; known: {', '.join(avail)}")
        ok, why = avail[base]
        impls.append({"name": n, "kind": "flashqla", "impl": base, "tune": tune, "layout": layout,
                      "skip": "" if ok else why})
    fla_fn, fla_ver = None, ""
    for b in baselines:
        if b != "fla":
            raise SystemExit(f"decode bench baselines: fla or none, got {b!r}")
        why = bench.probe_import("fla") if device.type == "cuda" else "FLA's kernels need a GPU"
        if not why:
            try:
                fla_fn, fla_ver = _load_fla_recurrent()
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
        impls.append({"name": "fla", "kind": "baseline", "version": fla_ver, "skip": why})
    for im in impls:
        if im["skip"]:
            print(f"bench decode: {im['name']} skipped ({im['skip']})", file=sys.stderr)

    ceil = roofline.ceilings(device, refresh=args.refresh_ceilings)
    bw = ceil["copy_gbps"] * 1e9 if "copy_gbps" in ceil else None
    rows = [(hq, hv, B) for hq, hv in HEADS for B in BATCHES]
    if args.filter:
        rows = [r for r in rows if args.filter in f"{r[0]}/{r[1]} b{r[2]}"]
    min_time = args.min_time if args.min_time is not None else (0.2 if device.type == "cuda" else 0.3)
    max_reps = args.max_reps or (500 if device.type == "cuda" else 20)
    results = []
    for hq, hv, B in rows:
        x = _make_inputs(hq, hv, B, T, device, dtype)
        # The oracle: the torch implementation in float32 on a copy of the pool.
        ref = {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in x.items()}
        ref["pool_after"] = None
        pool_ref = x["pool"].clone()
        o_ref = gated_delta_rule_decode(x["q"].float(), x["k"].float(), x["v"].float(), x["g"], x["beta"].float(),
                                        pool_ref, x["idx"], use_qk_l2norm_in_kernel=True, impl="torch",
                                        check_indices=False).float()
        nbytes = _row_bytes(hq, hv, B, T, dtype.itemsize)
        rec = {"label": f"{hq}/{hv} b{B}", "Hqk": hq, "Hv": hv, "batch": B, "tokens": T, "bytes": nbytes,
               "floor_ms": (nbytes / bw * 1e3) if bw else None, "results": {}}
        for im in impls:
            if im["skip"]:
                rec["results"][im["name"]] = {"status": "skipped", "error": im["skip"]}
                continue
            try:
                xi = dict(x, pool=x["pool"].clone())
                if im["kind"] == "baseline":
                    fn = _fla_call(fla_fn, xi)
                else:
                    fn = _flashqla_call(im["impl"], im["tune"], im["layout"], xi)
                outs = fn()
                if im["kind"] != "baseline":
                    after = xi["pool"].float()
                    ref["pool_after"] = after.transpose(-1, -2) if im["layout"] == "VK" else after
                err = _check(outs, ref, o_ref, pool_ref, im["kind"] == "baseline")
                if device.type == "cuda":
                    r = bench.time_cuda([fn], min_time, max_reps, use_graph=not args.no_graph)
                else:
                    r = bench.time_cpu([fn], min_time, max_reps)
                r.update(status="ok", err=err)
                if rec["floor_ms"]:
                    r["pct_floor"] = 100.0 * rec["floor_ms"] / r["ms"]
            except Exception as exc:
                r = {"status": "error", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            rec["results"][im["name"]] = r
        base = rec["results"].get("fla", {})
        if base.get("status") == "ok":
            rec["speedup_vs_fla"] = {n: base["ms"] / r["ms"] for n, r in rec["results"].items()
                                     if r.get("status") == "ok" and n != "fla"}
        results.append(rec)
        print(_row_line(rec, impls), flush=True)

    gm = {}
    for im in impls:
        if im["kind"] == "baseline":
            continue
        sp = [rec.get("speedup_vs_fla", {}).get(im["name"]) for rec in results]
        sp = [s for s in sp if s]
        if sp and len(sp) == len(results):
            gm[im["name"]] = math.exp(sum(math.log(s) for s in sp) / len(sp))
    table = _table(results, impls, gm, device, ceil)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"preset": "decode", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "dtype": str(dtype), "tokens": T, "state": "float32 [P, Hv, K, V], K = V = 128",
                "l2norm": True, "ceilings": ceil, "fla_version": fla_ver, "geomean_vs_fla": gm,
                "command": " ".join(sys.argv)}
        (out / "bench_decode.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
        (out / "bench_decode.md").write_text(table + "\n")
    bad = [(rec["label"], n) for rec in results for n, r in rec["results"].items() if r.get("status") == "error"]
    return 1 if bad else 0


def _row_line(rec, impls) -> str:
    parts = []
    for im in impls:
        r = rec["results"].get(im["name"], {})
        parts.append(f"{im['name']} {r['ms'] * 1e3:.1f}us" if r.get("status") == "ok" else f"{im['name']} {r.get('status')}")
    return f"{rec['label']:<12} " + "  ".join(parts)


def _table(results, impls, gm, device, ceil) -> str:
    names = [im["name"] for im in impls]
    vs = [n for n in names if n != "fla"] if "fla" in names else []   # no ratio columns without the baseline
    head = ["heads", "batch"] + [f"{n} us" for n in names] + [f"{n} vs fla" for n in vs] + \
        [f"{n} %floor" for n in names] + ["max err"]
    lines = [f"decode step (1 token, fp32 pool, bf16 io, q/k L2 norm) on {device}; copy ceiling "
             f"{ceil.get('copy_gbps', float('nan')):.0f} GB/s; CUDA-graph medians",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rec in results:
        rs = rec["results"]
        cells = [f"{rec['Hqk']}/{rec['Hv']}", str(rec["batch"])]
        cells += [f"{rs[n]['ms'] * 1e3:.1f}" if rs.get(n, {}).get("status") == "ok" else rs.get(n, {}).get("status", "-")
                  for n in names]
        cells += [f"{rec.get('speedup_vs_fla', {}).get(n, float('nan')):.2f}" for n in vs]
        cells += [f"{rs[n]['pct_floor']:.0f}%" if "pct_floor" in rs.get(n, {}) else "-" for n in names]
        errs = [rs[n]["err"] for n in names if rs.get(n, {}).get("status") == "ok"]
        cells.append(f"{max(errs):.1e}" if errs else "-")
        lines.append("| " + " | ".join(cells) + " |")
    if gm:
        lines.append("")
        lines.append("geometric mean vs FLA fused_recurrent: " + ", ".join(f"{n} {v:.2f}x" for n, v in gm.items()))
    return "\n".join(lines)
