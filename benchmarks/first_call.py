"""First-call latency of the op on the GPU (issue: JIT cold start), in a fresh process.

    python benchmarks/first_call.py [--backend tilelang] [--heads 8/32]

Prints the wall time of: importing flashqla, importing the backend's framework (tilelang / cutlass, which a
process's first call would otherwise pay), the first call (kernel load from the disk cache, or JIT when
the cache is cold), a second call with the same shapes, and a call with a new sequence length (must not
compile: the compile counter of the tilelang backend is printed).  Point TILELANG_CACHE_DIR at a cache
filled by ``python -m flashqla precompile`` to measure the precompiled case.
"""

from __future__ import annotations

import argparse
import time

t_start = time.perf_counter()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="tilelang")
    ap.add_argument("--heads", default="8/32")
    args = ap.parse_args()
    import torch

    import flashqla
    from flashqla.cli.cases import make_inputs
    t_import = time.perf_counter() - t_start
    hqk, hv = (int(x) for x in args.heads.split("/"))

    def call(seqlens):
        x = make_inputs(seqlens, hqk, hv, device="cuda")
        t = time.perf_counter()
        o, _ = flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu_seqlens"],
                                               output_final_state=True, backend=args.backend)
        torch.cuda.synchronize()
        assert torch.isfinite(o).all()
        return time.perf_counter() - t

    compiles = None
    if args.backend == "tilelang":
        from flashqla.backends.tilelang import _compile as c
        compiles = lambda: (c.COMPILE_COUNT, round(c.COMPILE_SECONDS, 2))  # noqa: E731
    torch.cuda.init()
    t = time.perf_counter()
    if args.backend in ("tilelang", "cutlass"):
        # the framework import is part of a process's first call; timed apart so the table can say
        # how much of that call is the import and how much is loading (or building) kernels
        __import__("tilelang" if args.backend == "tilelang" else "cutlass")
    t_framework = time.perf_counter() - t
    first = call([4096])
    c1 = compiles() if compiles else None
    second = call([4096])
    newlen = call([3000, 777])
    c2 = compiles() if compiles else None
    print(f"first_call backend={args.backend} heads={args.heads}: import {t_import:.2f} s, first call {first:.2f} s, "
          f"(+ framework import {t_framework:.2f} s before it), second call {second * 1e3:.1f} ms, new length {newlen * 1e3:.1f} ms; "
          f"(kernel builds, seconds) after first: {c1}, after new length: {c2}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
