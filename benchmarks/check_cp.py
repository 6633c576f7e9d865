"""GPU check of exact context parallelism (flashqla.cp): plain vs CP, speed and agreement, in CUDA graphs.

For each backend (tilelang, triton), heads Hqk/Hv (2/8, 4/16) and one sequence of T tokens (32768, 8192),
bf16, K = V = 128, q/k L2 norm in the kernel, gates logsigmoid(x) scaled per head by 1e-4 .. 1 (slow heads
carry state across every segment), a varlen call with ``varlen_meta`` (no host sync): the median of
``--reps`` CUDA-graph replays of the plain op and of CP with 4, 8, 16 segments and the automatic plan,
forward (inference, no grad) and forward + backward.  Agreement: every output of CP against the plain op
(rel-L2 and max|diff| / max|plain|), and both against the fp32 chunked PyTorch reference; a row FAILs when
CP is further from the reference than ``2 x plain + 2e-3`` (rel-L2).  The cost model's predicted speedup is
printed next to the measured one (for calibrating ``CPCostModel``).

    source .gpu/setup.sh && python benchmarks/check_cp.py --out $OUT/cp

Writes ``<out>.md`` (the table) and ``<out>.json`` (raw numbers) when ``--out`` is given.  Stops starting new
rows after ``--deadline-s`` seconds (the table so far is still written).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flashqla  # noqa: E402
from flashqla.cp import CPCostModel, _model_cost, cp_plan, split_even  # noqa: E402
from flashqla.testing import warm_up_for_capture  # noqa: E402

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def make_inputs(Hqk, Hv, T, seed=0, dtype=torch.bfloat16, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    K = V = 128
    q = torch.randn(1, T, Hqk, K, device=device, generator=gen).to(dtype)
    k = torch.randn(1, T, Hqk, K, device=device, generator=gen).to(dtype)
    v = torch.randn(1, T, Hv, V, device=device, generator=gen).to(dtype)
    # decay rates spread over the heads (x 1e-4 .. x 1): slow heads carry state across every segment, so
    # the segment scan matters for the agreement check (with logsigmoid gates alone nothing survives 1000
    # tokens and CP would agree trivially)
    rate = torch.logspace(-4, 0, Hv, device=device)
    g = (torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, device=device, generator=gen)) * rate).float()
    beta = torch.sigmoid(torch.randn(1, T, Hv, device=device, generator=gen)).to(dtype)
    do = torch.randn(1, T, Hv, V, device=device, generator=gen).to(dtype)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    return dict(q=q, k=k, v=v, g=g, beta=beta, do=do, cu=cu, meta=flashqla.prepare_varlen(cu))


def make_fn(x, backend, cp, mode):
    """A closure running one call (forward, or forward + backward) and returning its outputs."""
    names = ("q", "k", "v", "g", "beta")

    def call(leaves):
        return flashqla.chunk_gated_delta_rule(*leaves, cu_seqlens=x["cu"], varlen_meta=x["meta"],
                                               use_qk_l2norm_in_kernel=True, backend=backend,
                                               context_parallel=cp)[0]
    if mode == "fwd":
        leaves = [x[n] for n in names]

        def fwd():
            with torch.no_grad():
                return [call(leaves)]
        return fwd
    leaves = [x[n].detach().clone().requires_grad_() for n in names]

    def fwdbwd():
        with torch.enable_grad():
            o = call(leaves)
            return [o.detach()] + list(torch.autograd.grad(o, leaves, x["do"]))
    return fwdbwd


def fla_fn(x, mode):
    os.environ["FLA_FLASH_QLA"] = "0"
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    params = inspect.signature(fn).parameters
    extra = {}
    if "chunk_indices" in params and "cu_seqlens_cpu" in params:
        from fla.ops.utils.index import prepare_chunk_indices
        cu_cpu = x["cu"].to("cpu", torch.long)
        extra = {"cu_seqlens_cpu": cu_cpu, "chunk_indices": prepare_chunk_indices(x["cu"], 64, cu_seqlens_cpu=cu_cpu)}
    names = ("q", "k", "v", "g", "beta")
    leaves = [x[n] if mode == "fwd" else x[n].detach().clone().requires_grad_() for n in names]

    def run():
        with torch.set_grad_enabled(mode != "fwd"):
            o = fn(q=leaves[0], k=leaves[1], v=leaves[2], g=leaves[3], beta=leaves[4], scale=128 ** -0.5,
                   cu_seqlens=x["cu"], use_qk_l2norm_in_kernel=True, **extra)[0]
            if mode == "fwd":
                return [o]
            return [o.detach()] + list(torch.autograd.grad(o, leaves, x["do"]))
    return run


def time_graph(fn, reps):
    """(median ms, outputs, method, note, graph): CUDA-graph replays (eager when capture fails; wall
    clock on the CPU smoke run)."""
    if not torch.cuda.is_available():
        out = fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), out, "wall", "", None
    torch.cuda.synchronize()
    warm_up_for_capture(fn, reps=2)   # compilation, the CP plan's metadata
    torch.cuda.synchronize()
    graph, note = None, ""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        step = graph.replay
    except Exception as exc:
        graph = None
        torch.cuda.synchronize()
        note = f"graph capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:150] if str(exc) else ''}"
        step = fn
    for _ in range(3):
        res = step()
    if graph is None:
        out = res
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        res = step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    if graph is None:
        out = res
    torch.cuda.synchronize()
    return statistics.median(times), out, ("graph" if graph is not None else "eager"), note, graph


def rel_l2(a, b):
    a, b = a.double(), b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def max_rel(a, b):
    den = b.double().abs().max().item()
    return (a.double() - b.double()).abs().max().item() / den if den > 0 else 0.0


def reference_outputs(x, mode):
    """fp32 chunked PyTorch reference (backend "reference") on fp32 copies of the inputs."""
    xf = dict(x)
    for n in ("q", "k", "v", "beta", "do"):
        xf[n] = x[n].float()
    return make_fn(xf, "reference", False, mode)()


def model_speedup(T, Hv, sm, cp, mode):
    if not isinstance(cp, int):
        return float("nan")
    segs = (split_even(T, cp),)
    plain, c = _model_cost(segs, Hv, 128, 128, sm, mode == "fwdbwd", CPCostModel())
    return plain / c if c > 0 else float("nan")


def one_row(x, backend, hs, Hv, T, mode, segs, ref, use_fla, fla_cell, sm, reps):
    """Time plain and every CP variant of one (backend, shape, mode); returns (row, table line, ok, fla cell)."""
    row = dict(backend=backend, heads=hs, T=T, mode=mode, notes=[], cp={})
    ms, plain_out, method, note, graph = time_graph(make_fn(x, backend, False, mode), reps)
    plain_out = [t.clone() for t in plain_out]
    del graph
    row["plain_ms"], row["plain_method"] = ms, method
    if note:
        row["notes"].append(f"plain: {note}")
    row["plain_vs_ref"] = max(rel_l2(a, r) for a, r in zip(plain_out, ref)) if ref else float("nan")
    cells = []
    worst_plain, worst_max, worst_ref = 0.0, 0.0, (0.0 if ref else float("nan"))
    for s in segs:
        label = str(s)
        if s == "auto":
            plan = cp_plan(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu"], varlen_meta=x["meta"],
                           needs_grad=mode == "fwdbwd")
            label = f"auto={plan.max_segments}"
        try:
            cms, cout, cmethod, cnote, cgraph = time_graph(make_fn(x, backend, s, mode), reps)
        except Exception as exc:
            row["notes"].append(f"cp {label}: {type(exc).__name__}: {str(exc)[:200]}")
            cells.append("error")
            continue
        e_plain = max(rel_l2(a, b) for a, b in zip(cout, plain_out))
        e_max = max(max_rel(a, b) for a, b in zip(cout, plain_out))
        e_ref = max(rel_l2(a, r) for a, r in zip(cout, ref)) if ref else float("nan")
        del cgraph, cout
        worst_plain, worst_max = max(worst_plain, e_plain), max(worst_max, e_max)
        if ref:
            worst_ref = max(worst_ref, e_ref)
        row["cp"][label] = dict(ms=cms, method=cmethod, rel_l2_vs_plain=e_plain, max_vs_plain=e_max,
                                rel_l2_vs_ref=e_ref)
        if cnote:
            row["notes"].append(f"cp {label}: {cnote}")
        star = "*" if cmethod != "graph" else ""
        cells.append(f"{cms:.3f}{star} ({ms / cms:.2f}x{', ' + label if s == 'auto' else ''})")
    if use_fla:
        if fla_cell is None:   # once per shape and mode (the same for every backend row)
            try:
                fms, fout, fmethod, fnote, fgraph = time_graph(fla_fn(x, mode), reps)
                del fgraph, fout
                fla_cell = f"{fms:.3f}{'*' if fmethod != 'graph' else ''}"
                row["fla_ms"] = fms
            except Exception as exc:
                row["notes"].append(f"fla: {type(exc).__name__}: {str(exc)[:150]}")
                fla_cell = "error"
        cells.append(fla_cell)
    model = ",".join(f"{model_speedup(T, Hv, sm, s, mode):.2f}" for s in segs if s != "auto")
    ok = (not ref) or worst_ref <= 2.0 * row["plain_vs_ref"] + 2e-3
    pstar = "*" if method != "graph" else ""
    line = ([backend, hs, str(T), mode, f"{ms:.3f}{pstar}"] + cells
            + [model, f"{worst_plain:.1e} / {worst_max:.1e}", f"{row['plain_vs_ref']:.1e}", f"{worst_ref:.1e}",
               "ok" if ok else "FAIL"])
    return row, "| " + " | ".join(line) + " |", ok, fla_cell


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="tilelang,triton")
    ap.add_argument("--heads", default="2/8,4/16")
    ap.add_argument("--seqlens", default="32768,8192")
    ap.add_argument("--segments", default="4,8,16,auto")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-ref", action="store_true", help="skip the fp32 reference (agreement CP vs plain only)")
    ap.add_argument("--fla", default="auto", choices=("auto", "on", "off"), help="time FLA too when importable")
    ap.add_argument("--deadline-s", type=float, default=480.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="exercise this script on the CPU (e.g. --backends reference --heads 1/2 --seqlens 512)")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu_smoke else "cuda"
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("check_cp.py needs a CUDA GPU (or --cpu-smoke)")
    t_start = time.time()
    if args.cpu_smoke:
        class _Cpu:
            name, multi_processor_count = "cpu", 132
        dev = _Cpu()
    else:
        dev = torch.cuda.get_device_properties(0)
    sm = dev.multi_processor_count
    segs = [("auto" if s == "auto" else int(s)) for s in args.segments.split(",")]
    use_fla = args.fla != "off"
    if use_fla:
        try:
            os.environ["FLA_FLASH_QLA"] = "0"
            import fla.ops.gated_delta_rule  # noqa: F401
        except Exception as exc:
            if args.fla == "on":
                raise
            print(f"FLA not importable ({type(exc).__name__}: {exc}); no FLA column")
            use_fla = False
    rows, failures = [], []
    header = (["backend", "heads", "T", "mode", "plain ms"] + [f"cp {s} ms (x)" for s in segs]
              + (["fla ms"] if use_fla else [])
              + ["model x (" + ",".join(str(s) for s in segs if s != "auto") + ")",
                 "CP vs plain rel-L2 / max", "plain vs ref", "worst CP vs ref", "check"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    print(f"{dev.name}, {sm} SMs, torch {torch.__version__}, flashqla CP check (bf16, K=V=128, l2norm)")
    stop = False
    # order of priority under the deadline: the long sequence first, both backends, forward then fwd+bwd
    for T in (int(t) for t in args.seqlens.split(",")):
        for hs in args.heads.split(","):
            Hqk, Hv = (int(a) for a in hs.split("/"))
            x = make_inputs(Hqk, Hv, T, dtype=torch.float32 if args.cpu_smoke else torch.bfloat16, device=device)
            backends = []
            for backend in args.backends.split(","):
                d = flashqla.explain(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu"],
                                     varlen_meta=x["meta"], use_qk_l2norm_in_kernel=True, backend=backend,
                                     needs_grad=True)
                if d.chosen == backend:
                    backends.append(backend)
                else:
                    print(f"skip {backend} {hs} {T}: {d.reasons().get(backend)}")
            for mode in args.modes.split(","):
                if stop or time.time() - t_start > args.deadline_s:
                    stop = True
                    break
                ref = None if args.no_ref else reference_outputs(x, mode)
                fla_cell = None
                for backend in backends:
                    if time.time() - t_start > args.deadline_s:
                        stop = True
                        break
                    row, line, ok, fla_cell = one_row(x, backend, hs, Hv, T, mode, segs, ref, use_fla, fla_cell,
                                                      sm, args.reps)
                    if not ok:
                        failures.append(f"{backend} {hs} {T} {mode}")
                    lines.append(line)
                    print(line, flush=True)
                    for n in row["notes"]:
                        print(f"    note: {n}", flush=True)
                    rows.append(row)
                    torch.cuda.empty_cache()
                del ref
            if stop:
                break
        if stop:
            break
    if stop:
        lines.append(f"\n(stopped at the {args.deadline_s:.0f} s deadline)")
    notes = [f"- {r['backend']} {r['heads']} {r['T']} {r['mode']}: {n}" for r in rows for n in r["notes"]]
    text = (f"CP check on {dev.name} ({sm} SMs): median of {args.reps} CUDA-graph replays (* = eager), bf16, "
            f"K=V=128, l2norm, one sequence; (x) = plain ms / cp ms; model x = CPCostModel's predicted speedup.\n\n"
            + "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "") + "\n")
    print()
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".md", "w") as f:
            f.write(text)
        with open(args.out + ".json", "w") as f:
            json.dump(dict(device=dev.name, sm=sm, rows=rows), f, indent=1, default=str)
    print(f"total {time.time() - t_start:.0f} s")
    if failures:
        print("FAIL (CP further from the reference than 2x plain + 2e-3):", "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
