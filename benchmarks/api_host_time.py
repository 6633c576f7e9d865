"""Host time of the op's Python layers on a call so small that the kernel is negligible (any machine).

    python benchmarks/api_host_time.py                 # cpu backend (reference where the native one is absent)
    python benchmarks/api_host_time.py --calls 20000

Prints microseconds per call for: argument validation, the dispatch decision, the whole op without
gradients, and the whole op with inputs that require grad (forward only).  The device machine's CPU is about
4-5x slower than the development machine's (session 8), so these numbers scale, they do not transfer.
Session 9 (development machine): the no-grad call went from 92 to 70 us when it stopped building an
autograd node.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def per_call_us(fn, calls: int) -> float:
    for _ in range(min(200, calls)):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--backend", default=None, help="default: cpu if its native module is built, else reference")
    args = ap.parse_args(argv)

    import flashqla
    from flashqla.dispatch import get_backend
    from flashqla.dispatch.registry import select
    from flashqla.testing import Case, make_inputs
    from flashqla.validation import validate

    torch.set_num_threads(1)
    backend = args.backend or ("cpu" if get_backend("cpu").available()[0] else "reference")
    x = make_inputs(Case("host", 1, 2, 16, 16, B=1, T=1), torch.float32)
    ins = [x[n] for n in ("q", "k", "v", "g", "beta")]
    leaves = [t.clone().requires_grad_() for t in ins]
    with torch.no_grad():
        spec = validate(*ins, output_final_state=True)[0]
        rows = [
            ("validate", lambda: validate(*ins, output_final_state=True)),
            ("dispatch select", lambda: select(spec, backend)),
            ("op, no grad", lambda: flashqla.chunk_gated_delta_rule(*ins, output_final_state=True, backend=backend)),
        ]
        times = [(name, per_call_us(fn, args.calls)) for name, fn in rows]
    times.append(("op, inputs requiring grad", per_call_us(
        lambda: flashqla.chunk_gated_delta_rule(*leaves, output_final_state=True, backend=backend), args.calls)))
    print(f"backend {backend}, one token, Hqk/Hv 1/2, K = V = 16, {args.calls} calls each")
    for name, us in times:
        print(f"  {name:28s} {us:8.1f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
