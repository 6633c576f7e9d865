"""The forward with and without an initial state, on rows whose walks the plan splits into segments.

A split walk that starts at its sequence's first chunk loads h0; the others start from zero.  Until session 24 the
BV-128 kernel chose between the two with an if / else, and ptxas then serialised all 40 of its wgmma (a 512-byte
stack; ``_common.make_start_state``).  ``flashqla bench`` never passes h0, so this times it: per row, the
inference forward (and with ``--mode fwdbwd`` the forward + backward) without h0 and with a random one, CUDA-graph
medians (``flashqla.cli.bench.time_cuda``), and the plan ``explain()`` reports.

usage (device machine):
    python benchmarks/h0_split.py --rows 16/32:1x32768,8/32:1x32768,2/8:1x32768 --out $OUT/h0_split.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from profile_kernels import row_inputs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16/32:1x32768,8/32:1x32768,2/8:1x32768")
    ap.add_argument("--backend", default="tilelang")
    ap.add_argument("--mode", default="fwd", choices=("fwd", "fwdbwd"))
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--max-reps", type=int, default=200)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    import flashqla
    from flashqla.cli.bench import time_cuda

    dev = torch.device("cuda")
    results = []
    for row in args.rows.split(","):
        x = row_inputs(row, dev)
        N, Hv, K, V = len(x["cu_seqlens"]) - 1, x["v"].shape[2], x["q"].shape[3], x["v"].shape[3]
        h0 = torch.randn(N, Hv, K, V, device=dev, dtype=torch.float32) * 0.1
        rec = {"row": row, "mode": args.mode}
        for label, state in (("no_h0", None), ("h0", h0)):
            leaves = [x[n].detach().clone().requires_grad_(args.mode == "fwdbwd") for n in ("q", "k", "v")]

            def call(state=state, leaves=leaves):
                kw = dict(initial_state=state, output_final_state=True, cu_seqlens=x["cu_seqlens"],
                          varlen_meta=x["meta"], backend=args.backend)
                if args.mode == "fwd":
                    with torch.no_grad():
                        return list(flashqla.chunk_gated_delta_rule(*leaves, x["g"], x["beta"], **kw))
                with torch.enable_grad():
                    o, _ = flashqla.chunk_gated_delta_rule(*leaves, x["g"], x["beta"], **kw)
                    return list(torch.autograd.grad(o, leaves, x["do"]))

            t = time_cuda([call], args.min_time, args.max_reps, use_graph=True)
            rec[label] = t
            if label == "h0":
                d = flashqla.explain(*leaves, x["g"], x["beta"], initial_state=state, output_final_state=True,
                                     cu_seqlens=x["cu_seqlens"], varlen_meta=x["meta"], backend=args.backend,
                                     needs_grad=args.mode == "fwdbwd")
                rec["plan"] = [ln.strip() for ln in str(d).splitlines() if "segment" in ln or "split" in ln][:3]
        rec["h0_over_no_h0"] = rec["h0"]["ms"] / rec["no_h0"]["ms"]
        print(f"{row:16s} {args.mode}: no h0 {rec['no_h0']['ms']:.3f} ms, h0 {rec['h0']['ms']:.3f} ms "
              f"({rec['h0_over_no_h0']:.2f}x; {rec['h0']['method']})", flush=True)
        results.append(rec)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
