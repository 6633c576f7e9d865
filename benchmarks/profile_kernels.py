"""Per-kernel GPU time of each implementation on a few rows (torch.profiler, CUDA activity).

Where a backend's time goes is the first question of every speed change: this prints, per (row, mode,
implementation), each kernel's mean device time per call and its share, so a serial recurrence that
dominates (or a stray copy) shows at once.  Implementations are flashqla backends and the bench
baselines (``fla`` = FLA's own Triton with FLA_FLASH_QLA=0, ``flashqla`` = FlashQLA 0.1.3).

usage (device machine):
    python benchmarks/profile_kernels.py --impls triton,tilelang,fla,flashqla --rows 16/32:1x32768,16/32:4x8192 \
        --modes fwd,fwdbwd --out $OUT/profile.json
Rows are ``Hqk/Hv:seqlens`` with seqlens like ``1x32768`` or ``28672+4096``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections import defaultdict

import torch


def parse_seqlens(s: str) -> list:
    out = []
    for part in s.split("+"):
        if "x" in part:
            n, L = part.split("x")
            out += [int(L)] * int(n)
        else:
            out.append(int(part))
    return out


def row_inputs(row: str, device) -> dict:
    """Inputs of a ``Hqk/Hv:seqlens`` row (``flashqla.cli.cases.make_inputs``) with their varlen metadata
    (``meta``) and a random output gradient (``do``), as ``bench.make_call`` takes them."""
    import flashqla
    from flashqla.cli.cases import make_inputs
    heads, sl = row.split(":")
    Hqk, Hv = (int(x) for x in heads.split("/"))
    x = make_inputs(parse_seqlens(sl), Hqk, Hv, device=device)
    x["meta"] = flashqla.prepare_varlen(x["cu_seqlens"])
    x["do"] = torch.randn_like(x["v"])
    return x


def load_impl(name: str):
    from flashqla.cli import bench
    if name in bench.EXTERNAL_BASELINES:
        op, _ = bench.EXTERNAL_BASELINES[name]()
        return op
    return bench._flashqla_op(name)


def profile_one(fn, iters: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    # eager wall time per call: beside the sum of kernel times it says whether the call is host-bound
    t0 = time.perf_counter()
    for _ in range(max(iters, 20)):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / max(iters, 20) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    count = defaultdict(int)
    t_lo, t_hi = float("inf"), 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            count[ev.name] += 1
            t_lo, t_hi = min(t_lo, ev.time_range.start), max(t_hi, ev.time_range.end)
    total = sum(per.values())
    rows = sorted(((k, v / iters / 1e3, count[k] / iters) for k, v in per.items()), key=lambda r: -r[1])
    return {"total_ms": total / iters / 1e3, "wall_ms": wall_ms,
            "gpu_span_ms": (t_hi - t_lo) / iters / 1e3 if t_hi > t_lo else 0.0,
            "kernels": [{"name": k, "ms": ms, "calls": c} for k, ms, c in rows]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default="triton,tilelang,fla,flashqla")
    ap.add_argument("--rows", default="16/32:1x32768,16/32:4x8192")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    from flashqla.cli.bench import make_call

    results = []
    for row in args.rows.split(","):
        x = row_inputs(row, torch.device("cuda"))
        for mode in args.modes.split(","):
            for name in args.impls.split(","):
                try:
                    op = load_impl(name)
                    fn = make_call(op, x, mode)
                    r = profile_one(fn, args.iters)
                except Exception as exc:
                    traceback.print_exc()
                    r = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                r.update(row=row, mode=mode, impl=name)
                results.append(r)
                print(f"\n## {row} {mode} {name}: " + (f"{r['total_ms']:.3f} ms (sum of kernels), eager wall {r['wall_ms']:.3f} ms, "
                                                        f"GPU span {r['gpu_span_ms']:.3f} ms" if "total_ms" in r
                                                       else r["error"]))
                for kk in r.get("kernels", [])[:int(os.environ.get("PROFILE_TOP", "14"))]:
                    share = 100 * kk["ms"] / r["total_ms"] if r["total_ms"] else 0
                    print(f"   {kk['ms']:8.3f} ms {share:5.1f}%  x{kk['calls']:.0f}  {kk['name'][:110]}")
                sys.stdout.flush()
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
