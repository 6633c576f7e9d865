"""Launch-configuration sweep of the triton backend: per-kernel GPU time under FLASHQLA_TRITON_TUNE variants.

The triton kernels take their warps / stages / V-block from ``backends/triton/ops.py::_DEFAULTS``, overridable
by ``FLASHQLA_TRITON_TUNE`` ("state.bv=64,state.warps=4,...").  This runs every variant listed (``;``
separates variants, ``-`` is the defaults) on each row, in one process, and prints per variant the sum of
kernel times and the per-kernel split, plus the output's agreement with the defaults (a variant that
changes the numbers beyond rounding is a bug, not a speedup).

usage (device machine):
    python benchmarks/sweep_triton.py --rows 16/32:1x32768,16/32:4x8192 --mode fwd \\
        --variants "-;state.bv=64;state.stages=3;fwd.fuse=1" --out $OUT/sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from profile_kernels import parse_seqlens, profile_one  # noqa: E402


def set_tune(spec: str) -> None:
    from flashqla.backends.triton import ops
    os.environ["FLASHQLA_TRITON_TUNE"] = "" if spec in ("", "-") else spec
    ops._tune_cache.clear()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16/32:1x32768,16/32:4x8192")
    ap.add_argument("--mode", default="fwd", choices=("fwd", "fwdbwd"))
    ap.add_argument("--variants", default="-")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import flashqla
    from flashqla.cli.bench import _flashqla_op, agreement, make_call
    from flashqla.cli.cases import make_inputs

    op = _flashqla_op("triton")
    results = []
    for row in args.rows.split(","):
        heads, sl = row.split(":")
        Hqk, Hv = (int(x) for x in heads.split("/"))
        seqlens = parse_seqlens(sl)
        x = make_inputs(seqlens, Hqk, Hv, device=torch.device("cuda"))
        x["meta"] = flashqla.prepare_varlen(x["cu_seqlens"])
        x["do"] = torch.randn(1, sum(seqlens), Hv, 128, device="cuda", dtype=torch.bfloat16)
        base = None
        for spec in args.variants.split(";"):
            spec = spec.strip()
            set_tune(spec)
            fn = make_call(op, x, args.mode)
            try:
                outs = [t.clone() if t is not None else None for t in fn()]
                if base is None:
                    base = outs
                err = agreement(outs, base)
                r = profile_one(fn, args.iters)
            except Exception as exc:  # one bad variant (too much shared memory, ...) must not end the sweep
                r, err = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}, float("nan")
            r.update(row=row, mode=args.mode, variant=spec, diff_vs_first=err)
            results.append(r)
            if "error" in r:
                print(f"{row} {args.mode} [{spec}]: {r['error']}")
            else:
                split = ", ".join(f"{k['name'][:28]} {k['ms']:.3f}" for k in r["kernels"][:6])
                print(f"{row} {args.mode} [{spec}]: {r['total_ms']:.3f} ms (diff {err:.1e}) | {split}")
            sys.stdout.flush()
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    set_tune("-")
    return 0


if __name__ == "__main__":
    sys.exit(main())
