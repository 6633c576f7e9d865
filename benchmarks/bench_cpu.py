"""Benchmark: the native cpu backend vs the PyTorch chunked reference (fp32), forward and forward+backward.

    python benchmarks/bench_cpu.py [--reps 5] [--quick] [--threads N]

Shapes: T in {1024, 8192} (B = 1), Hqk/Hv in {2/8, 16/32}, K = V = 128, fp32 inputs, logsigmoid gates,
L2-normalised q/k, no initial/final state.  Each timing is the median of ``--reps`` runs after one
warm-up (3 for the reference's slow T=8192 forward+backward), cpu and reference runs interleaved so
both see the same load; both sides use torch.get_num_threads() threads.  Prints a table and writes
benchmarks/results/cpu_bench.json and cpu_bench.md (speedups and their geometric means).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch

import flashqla
from flashqla.dispatch import get_backend
from flashqla.reference import chunk_gated_delta_rule_ref

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def make(T, Hqk, Hv, K, V, grad, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, generator=gen), dim=-1)
    v = torch.randn(1, T, Hv, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen))
    beta = torch.sigmoid(torch.randn(1, T, Hv, generator=gen))
    do = torch.randn(1, T, Hv, V, generator=gen)
    xs = [t.requires_grad_(grad) for t in (q, k, v, g, beta)]
    return xs, do


def timeit_pair(fa, fb, reps_a, reps_b):
    """Medians of fa and fb, runs interleaved (a, b, a, b, ...) after one warm-up each, so both see the
    same machine conditions (other processes on a shared box)."""
    fa()
    fb()
    ta, tb = [], []
    for i in range(max(reps_a, reps_b)):
        for fn, ts, reps in ((fa, ta, reps_a), (fb, tb, reps_b)):
            if i < reps:
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def run_fwd(op, xs):
    with torch.no_grad():
        op(*xs)


def run_fwdbwd(op, xs, do):
    o, _ = op(*xs)
    torch.autograd.grad(o, xs, do)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="T=1024 only (smoke run)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads(N) for both sides; results go to cpu_bench_t<N>.*")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    stem = f"cpu_bench_t{args.threads}" if args.threads else "cpu_bench"

    be = get_backend("cpu")
    ok, why = be.available()
    if not ok:
        raise SystemExit(f"cpu backend unavailable: {why}")
    cpu_op = lambda *a: flashqla.chunk_gated_delta_rule(*a, backend="cpu")  # noqa: E731
    ref_op = lambda *a: chunk_gated_delta_rule_ref(*a)  # noqa: E731
    load0 = list(os.getloadavg())
    K = V = 128
    Ts = [1024] if args.quick else [1024, 8192]
    rows = []
    for T in Ts:
        for Hqk, Hv in ((2, 8), (16, 32)):
            row = dict(T=T, Hqk=Hqk, Hv=Hv, K=K, V=V)
            for mode in ("fwd", "fwdbwd"):
                xs, do = make(T, Hqk, Hv, K, V, grad=(mode == "fwdbwd"))
                # the reference's fwd+bwd at T=8192 takes seconds: fewer reps there
                reps_ref = args.reps if T <= 1024 or mode == "fwd" else max(1, min(args.reps, 3))
                if mode == "fwd":
                    t_cpu, t_ref = timeit_pair(lambda: run_fwd(cpu_op, xs), lambda: run_fwd(ref_op, xs),
                                               args.reps, reps_ref)
                else:
                    t_cpu, t_ref = timeit_pair(lambda: run_fwdbwd(cpu_op, xs, do),
                                               lambda: run_fwdbwd(ref_op, xs, do), args.reps, reps_ref)
                row[f"{mode}_cpu_ms"] = t_cpu * 1e3
                row[f"{mode}_ref_ms"] = t_ref * 1e3
                row[f"{mode}_speedup"] = t_ref / t_cpu
            rows.append(row)
            print(f"T={T:5d} Hqk/Hv={Hqk:2d}/{Hv:2d}  fwd {row['fwd_cpu_ms']:8.2f} ms vs ref "
                  f"{row['fwd_ref_ms']:8.2f} ms ({row['fwd_speedup']:5.2f}x)   fwd+bwd {row['fwdbwd_cpu_ms']:8.2f} ms"
                  f" vs ref {row['fwdbwd_ref_ms']:9.2f} ms ({row['fwdbwd_speedup']:5.2f}x)", flush=True)
    gm = {m: math.exp(sum(math.log(r[f"{m}_speedup"]) for r in rows) / len(rows)) for m in ("fwd", "fwdbwd")}
    print(f"geometric mean speedup: forward {gm['fwd']:.2f}x, forward+backward {gm['fwdbwd']:.2f}x")

    env = dict(machine=platform.machine(), processor=platform.processor() or platform.machine(),
               cpus=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
               isa=be.version(), reps=args.reps, loadavg_at_end=list(os.getloadavg()),
               loadavg_at_start=load0)
    if args.no_write:
        return
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, stem + ".json"), "w") as f:
        json.dump(dict(env=env, rows=rows, geomean_speedup=gm), f, indent=2)
    lines = ["# cpu backend vs PyTorch chunked reference (fp32, K = V = 128, B = 1)", "",
             f"Command: `python benchmarks/bench_cpu.py --reps {args.reps}"
             + (f" --threads {args.threads}" if args.threads else "") + "`; median of reps after a warm-up; "
             f"{env['torch_threads']} threads, {env['cpus']} CPUs, kernels: {env['isa']}, torch {env['torch']}; "
             f"cpu and reference runs interleaved; load average {load0[0]:.1f} at start, "
             f"{env['loadavg_at_end'][0]:.1f} at end (other processes share the machine).", "",
             "| T | Hqk/Hv | fwd cpu (ms) | fwd ref (ms) | fwd speedup | fwd+bwd cpu (ms) | fwd+bwd ref (ms) "
             "| fwd+bwd speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['Hqk']}/{r['Hv']} | {r['fwd_cpu_ms']:.2f} | {r['fwd_ref_ms']:.2f} | "
                     f"{r['fwd_speedup']:.2f}x | {r['fwdbwd_cpu_ms']:.2f} | {r['fwdbwd_ref_ms']:.2f} | "
                     f"{r['fwdbwd_speedup']:.2f}x |")
    lines += ["", f"Geometric mean speedup: forward **{gm['fwd']:.2f}x**, forward+backward **{gm['fwdbwd']:.2f}x**.",
              ""]
    with open(os.path.join(RESULTS, stem + ".md"), "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
