"""Host time of a CP call (flashqla.cp) against the plain op, with the backend's kernels stubbed out.

A windowed CP call reads its window lengths on the host, so whatever the host does after that read is time
the GPU waits through.  This measures the Python / torch-op side alone: the ``reference`` backend's forward is
replaced by one that allocates its outputs and computes nothing, on small CPU tensors, and every torch
function the call runs is counted.

    python benchmarks/cp_host_time.py [--segments 8] [--reps 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flashqla  # noqa: E402
from flashqla.dispatch.registry import get_backend  # noqa: E402

# attribute reads and views do not launch anything on a GPU
_NO_LAUNCH = {"__get__", "__getitem__", "dim", "device", "reshape", "contiguous", "data_ptr", "stride",
              "size", "numel", "view", "tolist"}


class _Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    be = get_backend("reference")

    def stub_forward(self, spec, x):
        n = x.varlen.num_seqs if x.varlen is not None else x.q.shape[0]
        ht = torch.zeros(n, x.v.shape[2], x.k.shape[3], x.v.shape[3]) if x.output_final_state else None
        return torch.empty_like(x.v), ht, (), None

    type(be).forward = stub_forward
    T, Hqk, Hv, K = 2048, 1, 2, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, generator=gen), dim=-1).bfloat16()
    k = q.clone()
    v = torch.randn(1, T, Hv, K, generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen))
    beta = torch.rand(1, T, Hv, generator=gen).bfloat16()
    cu = torch.tensor([0, T], dtype=torch.int32)
    meta = flashqla.prepare_varlen(cu)

    def run(cp):
        return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                               varlen_meta=meta, backend="reference", context_parallel=cp)

    print(f"T={T}, Hqk/Hv={Hqk}/{Hv}, K=V={K}, logsigmoid gates (every window negligible), stub backend")
    import flashqla.cp as cpmod
    real_counts = cpmod.window_counts
    cached = {}

    def one_launch_counts(k, g, beta, idx, n, l2, thr):
        # on a GPU the window counts are one Triton launch; here: its result, computed once
        key = (idx.data_ptr(), n, l2, thr)
        if key not in cached:
            cached[key] = real_counts(k, g, beta, idx, n, l2, thr)
        return cached[key].clone()

    with torch.no_grad():
        for cp in (False, args.segments, "stub"):
            cpmod.window_counts = one_launch_counts if cp == "stub" else real_counts
            if cp == "stub":
                cp = args.segments
            for _ in range(3):
                run(cp)
            t0 = time.perf_counter()
            for _ in range(args.reps):
                run(cp)
            us = (time.perf_counter() - t0) / args.reps * 1e6
            with _Count() as c:
                run(cp)
            launches = sum(n for f, n in c.calls.items() if f not in _NO_LAUNCH)
            what = "plain" if cp is False else (f"CP, {cp} segments, windows" +
                                                ("; bound as one launch" if cpmod.window_counts is
                                                 one_launch_counts else "; bound by torch ops"))
            print(f"{what:52s} {us:8.1f} us per call on the host, {sum(c.calls.values())} torch calls, "
                  f"~{launches} that would launch work on a GPU (plus the backend's kernels)")
    cpmod.window_counts = real_counts
    return 0


if __name__ == "__main__":
    sys.exit(main())
