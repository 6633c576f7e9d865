"""Run one row's forward + backward a few times with nothing else on the GPU: the target for an external
profiler (Nsight Compute / Systems), which torch.profiler's CUPTI subscription would collide with.

usage (device machine): FLASHQLA_TILELANG_BWD=whole ncu -k regex:gdn_bwd_whole ... \\
    python benchmarks/run_fwdbwd.py --row 16/32:4x8192 --backend tilelang --iters 2
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from profile_kernels import row_inputs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="16/32:4x8192")
    ap.add_argument("--backend", default="tilelang")
    ap.add_argument("--iters", type=int, default=2)
    args = ap.parse_args(argv)

    import flashqla
    x = row_inputs(args.row, torch.device("cuda"))
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    for _ in range(args.iters):
        o, _ = flashqla.chunk_gated_delta_rule(*leaves, cu_seqlens=x["cu_seqlens"], backend=args.backend)
        torch.autograd.grad(o, leaves, torch.ones_like(o))
    torch.cuda.synchronize()
    print(f"{args.row} {args.backend}: {args.iters} forward + backward runs done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
