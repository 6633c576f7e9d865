"""Role timeline of the fused tilelang backward (``chunk_bwd_whole_sm90``, ``FLASHQLA_TILELANG_BWD=whole``), from
in-kernel clock64 stamps.

The kernel runs four roles per CTA (chain, value, key, TMA producer).  Built with ``trace=True``,
the first thread of each role in CTA (0, 0, 0) stamps ``clock64()`` at the points of ``TRACE_EVENTS`` for the
first ``TRACE_CHUNKS`` steps of its walk.  This script runs one traced fwd+bwd per row and prints, per event, the
median over steps ``--first``..62 of its cycle offset from the chain's "k, G ready" stamp of the same step, and
the median step period: which role waits for which, and how long each part of a step takes (SM cycles; the
H200 runs ~1.98 GHz under load).

usage (device machine, after `source .gpu/setup.sh`):
    python benchmarks/trace_bwd_fused.py --rows 16/32:4x8192,16/32:1x32768 --out $OUT/trace_bwd_fused.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from profile_kernels import row_inputs  # noqa: E402
from trace_ws import summarize, traced_run  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16/32:4x8192,16/32:1x32768")
    ap.add_argument("--first", type=int, default=4, help="first step of the steady-state window")
    ap.add_argument("--out", default="")
    ap.add_argument("--kernel", default="whole", choices=("whole",),
                    help="(the BV-64 fused kernel this also traced was retired in session 15)")
    args = ap.parse_args(argv)
    os.environ["FLASHQLA_TILELANG_BWD"] = args.kernel

    import flashqla
    from flashqla.backends.tilelang import ops
    from flashqla.backends.tilelang.chunk_bwd_whole_sm90 import TRACE_CHUNKS, TRACE_EVENTS

    out = []
    for row in args.rows.split(","):
        x = row_inputs(row, torch.device("cuda"))
        leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]

        def call():
            o, _ = flashqla.chunk_gated_delta_rule(*leaves, cu_seqlens=x["cu_seqlens"], backend="tilelang")
            torch.autograd.grad(o, leaves, torch.ones_like(o))

        t = traced_run(call, ops, "BWD_TRACE_BUFFER", len(TRACE_EVENTS), TRACE_CHUNKS)
        last = int((t[0] != 0).sum()) - 1
        rec = summarize(t, TRACE_EVENTS, range(args.first, max(args.first, last)), row, "step")
        rec["row"] = row
        out.append(rec)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
