#!/usr/bin/env python
"""The backwards' GVA group sum on the GPU: the Triton kernel of ``flashqla/backends/gva.py`` against the
PyTorch forms it replaces (``view(...).sum(2)`` + cast, session 9; ``torch.add(a, b, out=...)``, session 10
run 4), bitwise, and their times (``triton.testing.do_bench``, median).

    python benchmarks/check_gva_sum.py [--rows 32768x32:2,32768x32:4,8192x8:2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from flashqla.backends.gva import _torch_sum, gva_sum


def timed(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32768x32:2,32768x32:4,8192x8:2,1000x6:3")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    res = []
    bad = 0
    for item in args.rows.split(","):
        shape, r = item.split(":")
        NT, Hv = (int(x) for x in shape.split("x"))
        r = int(r)
        for dt in (torch.bfloat16, torch.float16):
            x = torch.randn(NT, Hv, 128, device="cuda")
            new = gva_sum(x, r, dt, use_triton=True)
            old = x.view(NT, Hv // r, r, 128).sum(2).to(dt)
            add = _torch_sum(x, r, dt)
            same_old = torch.equal(new, old)
            same_add = torch.equal(new, add)
            # at ratio > 2 the summation order may differ by one fp32 ulp before the rounding
            ok = (same_old and same_add) if r <= 2 else torch.allclose(new.float(), old.float(), rtol=1e-2, atol=0)
            bad += not ok
            rec = dict(NT=NT, Hv=Hv, ratio=r, dtype=str(dt).replace("torch.", ""), equal_sum_cast=same_old,
                       equal_add=same_add, ok=ok,
                       ms_sum_cast=timed(lambda: x.view(NT, Hv // r, r, 128).sum(2).to(dt)),
                       ms_add=timed(lambda: _torch_sum(x, r, dt)), ms_triton=timed(lambda: gva_sum(x, r, dt, use_triton=True)),
                       MB=(x.numel() * 4 + new.numel() * new.element_size()) / 1e6)
            rec["GBps_triton"] = rec["MB"] / rec["ms_triton"]
            res.append(rec)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print("ALL OK" if not bad else f"{bad} MISMATCHES")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
