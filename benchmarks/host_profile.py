"""Where the host time of an eager call goes (cProfile), beside its GPU time.

An eager call is host-bound when the Python between its kernel launches takes longer than the kernels;
a CUDA graph hides that, an eager caller (most prefill paths) does not.  For each implementation and row
this prints the eager wall time per call, the host time per call with the GPU kept ahead (no sync inside
the loop), and cProfile's top functions by own time over those calls.

usage (device machine):
    python benchmarks/host_profile.py --impls tilelang,tilelang@cpw16 --rows 2/8:1x32768,8/32:1x8192
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from profile_kernels import load_impl, row_inputs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="tilelang")
    ap.add_argument("--rows", default="2/8:1x32768")
    ap.add_argument("--mode", default="fwd")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    args = ap.parse_args(argv)
    from flashqla.cli.bench import make_call

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()
    for row in args.rows.split(","):
        x = row_inputs(row, torch.device(args.device))
        for name in args.impls.split(","):
            fn = make_call(load_impl(name), x, args.mode)
            for _ in range(5):
                fn()
            sync()
            # wall per call, the GPU drained after each call (what one isolated eager call costs)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
                sync()
            iso = (time.perf_counter() - t0) / args.calls * 1e3
            # host per call, calls back to back (the host runs ahead unless the call syncs)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            host = (time.perf_counter() - t0) / args.calls * 1e3
            sync()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.calls):
                fn()
            pr.disable()
            sync()
            s = io.StringIO()
            st = pstats.Stats(pr, stream=s)
            st.sort_stats("tottime").print_stats(args.top)
            print(f"\n## {row} {args.mode} {name}: isolated call {iso:.3f} ms, back-to-back host {host:.3f} ms "
                  f"per call")
            lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
            start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
            for ln in lines[start:start + args.top + 1]:
                print("   " + ln[:160])
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
