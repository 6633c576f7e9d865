"""Variant sweep of one backend: per-kernel GPU time under environment settings, in one process.

The backends read their tuning knobs from the environment at call time: the triton kernels' warps / stages /
V-block from ``FLASHQLA_TRITON_TUNE`` ("state.bv=64,state.warps=4,..."; see ``backends/triton/ops.py``), the
tilelang forward's V-block and options from ``FLASHQLA_TILELANG_BV`` / ``FLASHQLA_TILELANG_WS_OPTS``.  A
variant is ``-`` (the defaults) or space-separated ``NAME=VALUE`` settings (split at the first ``=``);
``;`` separates variants.  Per row and variant this prints the sum of kernel times, the eager wall time per call
(calls back to back: the sum cannot show kernels that overlap on two streams), the per-kernel split and
the outputs' largest relative L2 difference from the first variant (a variant that changes the numbers
beyond rounding is a bug, not a speedup).

usage (device machine):
    python benchmarks/sweep_variants.py --backend triton --rows 16/32:1x32768 --mode fwd \
        --variants "-;FLASHQLA_TRITON_TUNE=state.bv=64,state.warps=2" --out $OUT/sweep.json
    python benchmarks/sweep_variants.py --backend tilelang --rows 16/32:1x32768 --variants \
        "-;FLASHQLA_TILELANG_BV=64;FLASHQLA_TILELANG_BV=64 FLASHQLA_TILELANG_WS_OPTS=fastexp,psplit,tchain"
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from profile_kernels import profile_one, row_inputs  # noqa: E402


_SAVED_ENV: dict = {}


def set_variant(spec: str) -> None:
    """Restore the environment of the start, then apply ``spec``'s settings."""
    for name, val in _SAVED_ENV.items():
        if val is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = val
    _SAVED_ENV.clear()
    if spec not in ("", "-", "default"):
        for item in spec.split():
            name, _, val = item.partition("=")
            _SAVED_ENV.setdefault(name, os.environ.get(name))
            os.environ[name] = val
    try:
        from flashqla.backends.triton import ops
        ops._tune_cache.clear()
    except ImportError:        # no triton here: nothing cached
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--rows", default="16/32:1x32768,16/32:4x8192")
    ap.add_argument("--mode", default="fwd", choices=("fwd", "fwdbwd"))
    ap.add_argument("--variants", default="-")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--graph", action="store_true",
                    help="also the CUDA-graph median per call (flashqla bench's timing), what an overlap shows in")
    args = ap.parse_args(argv)

    from flashqla.cli.bench import _flashqla_op, agreement, make_call, time_cuda

    op = _flashqla_op(args.backend)
    results = []
    for row in args.rows.split(","):
        x = row_inputs(row, torch.device("cuda"))
        base = None
        for spec in args.variants.split(";"):
            spec = spec.strip()
            set_variant(spec)
            fn = make_call(op, x, args.mode)
            try:
                outs = [t.clone() if t is not None else None for t in fn()]
                if base is None:
                    base = outs
                err = agreement(outs, base)
                r = profile_one(fn, args.iters)
                if args.graph:
                    r["graph_ms"] = time_cuda([fn], 0.2, 200, use_graph=True)["ms"]
            except Exception as exc:  # one bad variant (too much shared memory, ...) must not end the sweep
                r, err = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}, float("nan")
            r.update(backend=args.backend, row=row, mode=args.mode, variant=spec, diff_vs_first=err)
            results.append(r)
            if "error" in r:
                print(f"{args.backend} {row} {args.mode} [{spec}]: {r['error']}")
            else:
                split = ", ".join(f"{k['name'][:28]} {k['ms']:.3f}" for k in r["kernels"][:6])
                # (kernel-time sum; wall: eager calls back to back, what shows an overlap of two streams)
                graph = f", graph {r['graph_ms']:.3f}" if "graph_ms" in r else ""
                print(f"{args.backend} {row} {args.mode} [{spec}]: {r['total_ms']:.3f} ms, wall {r['wall_ms']:.3f}"
                      f"{graph} (diff {err:.1e}) | {split}")
            sys.stdout.flush()
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    set_variant("-")
    return 0


if __name__ == "__main__":
    sys.exit(main())
