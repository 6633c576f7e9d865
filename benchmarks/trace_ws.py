"""Role timeline of the tilelang warp-specialised forward recurrence, from in-kernel clock64 stamps.

The recurrence runs four roles per CTA (state chain, output, scores, TMA producer; see
``backends/tilelang/chunk_fwd_ws_sm90.py``).  Built with ``trace=True``, the first thread of each role in CTA
(0, 0, 0) stamps ``clock64()`` at the points of ``TRACE_EVENTS`` for the first ``TRACE_CHUNKS`` chunks.  This
script runs one traced forward per row and prints, per event, the median over chunks 8..63 of its cycle
offset from the chain's "slot ready" stamp of the same chunk, and the median chunk period: which role
waits for which, and how long each step takes, in SM cycles (the H200 runs ~1.98 GHz under load).

usage (device machine, after `source .gpu/setup.sh`):
    python benchmarks/trace_ws.py --rows 16/32:1x32768,16/32:4x8192 [--env FLASHQLA_TILELANG_BV=64] --out $OUT/trace.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from profile_kernels import row_inputs  # noqa: E402


def traced_run(call, ops, attr: str, n_events: int, n_steps: int) -> torch.Tensor:
    """Run ``call`` twice with the trace buffer ``ops.<attr>`` set (the first run builds the traced kernel and
    warms the caches) and return the second run's stamps on the CPU."""
    buf = torch.zeros(n_events, n_steps, dtype=torch.int64, device="cuda")
    setattr(ops, attr, buf)
    try:
        call()
        buf.zero_()
        call()
        torch.cuda.synchronize()
    finally:
        setattr(ops, attr, None)
    return buf.cpu()


def summarize(t, events, steps, label: str, unit: str) -> dict:
    """Print and return, per event of ``events`` ((name, role) pairs; rows of the stamp tensor ``t``), the median
    cycle offset over ``steps`` from event 0 of the same step, and the median step period.  Events never
    stamped (a role the variant does not have) are left out."""
    base = t[0]
    period = statistics.median(int(base[i + 1] - base[i]) for i in steps) if len(steps) else float("nan")
    rec = {"period_cycles": period, "events": []}
    print(f"\n## {label}: {unit} period {period:.0f} cycles (median, {unit}s {steps.start}..{steps.stop})")
    for e, (name, role) in enumerate(events):
        offs = [int(t[e][i] - base[i]) for i in steps if t[e][i] != 0]
        if not offs:
            continue
        med = statistics.median(offs)
        rec["events"].append({"event": name, "role": role, "offset_median": med,
                              "offset_min": min(offs), "offset_max": max(offs)})
        print(f"  {name:<32} {med:>8.0f}  (min {min(offs):>7}, max {max(offs):>7})")
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16/32:1x32768,16/32:4x8192")
    ap.add_argument("--env", default="", help="NAME=VALUE settings (space separated) applied before the calls")
    ap.add_argument("--first", type=int, default=8, help="first chunk of the steady-state window")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    for item in args.env.split():
        name, _, val = item.partition("=")
        os.environ[name] = val

    import flashqla
    from flashqla.backends.tilelang import ops
    from flashqla.backends.tilelang.chunk_fwd_ws_sm90 import TRACE_CHUNKS, TRACE_EVENTS

    out = []
    for row in args.rows.split(","):
        x = row_inputs(row, torch.device("cuda"))

        def call():
            with torch.no_grad():
                flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True,
                                                cu_seqlens=x["cu_seqlens"], backend="tilelang")

        t = traced_run(call, ops, "TRACE_BUFFER", len(TRACE_EVENTS), TRACE_CHUNKS)
        rec = summarize(t, TRACE_EVENTS, range(args.first, TRACE_CHUNKS - 1), f"{row} {args.env}", "chunk")
        rec.update(row=row, env=args.env)
        out.append(rec)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
