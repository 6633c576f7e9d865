"""``python -m flashqla bench``: time flashqla's backends against the FLA and FlashQLA baselines.

Timing.  On a GPU each (row, implementation) is called once to compile (timed separately, shown
by the progress bar), warmed up on a side stream, then captured into a CUDA graph (``varlen_meta``
built by ``flashqla.prepare_varlen`` outside the capture, so the op makes no host sync) and replayed;
the time is the median over many replays, each timed by a pair of CUDA events.  An implementation
that cannot be captured (a host sync inside, e.g. FlashQLA's automatic CP planning) is timed the same
way without the graph, and the row says ``eager``.  When one call's data fits in L2 (under 3x its
size) the graph holds calls on several input copies in turn, so every call reads from HBM; the time
is per call.  On the CPU: wall-clock medians.  ``--eager-too`` also times every graph-timed implementation
without the graph (its host time included, as an eager caller sees it) and compares that with the baselines
that are timed eagerly anyway.

Baselines: ``fla`` (flash-linear-attention's Triton ``chunk_gated_delta_rule``, imported with
``FLA_FLASH_QLA=0`` so it does not route to FlashQLA) and ``flashqla`` (the ``flash_qla`` package,
its automatic CP on, as shipped).  Any flashqla backend name may also serve as a baseline
(``--baselines reference`` on the CPU).  A baseline that cannot be imported is skipped, with a note.
Speedup = baseline ms / backend ms (above 1: the backend is faster).

Outputs: a table on stdout; with ``--out DIR`` also ``bench_<preset>_<mode>.json`` / ``.csv`` / ``.md``
(rewritten after every row, so an interrupted run keeps what it measured) and ``.png`` (matplotlib).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from . import roofline
from .cases import make_inputs, presets
from .progress import Progress
from .table import markdown_table, text_table

# --------------------------------------------------------------------------------------------------
# implementations


@dataclass
class Impl:
    name: str
    kind: str                      # "backend" or "baseline"
    op: Optional[Callable] = None  # op(q, k, v, g, beta, cu, meta, output_final_state) -> (o, ht)
    version: str = ""
    skip_reason: str = ""          # set when it cannot run at all (not importable)
    eager_reason: str = ""         # set when it is known not to be capturable: timed eagerly, no capture tried

    @property
    def is_flashqla_backend(self) -> bool:
        return self.op is None and not self.skip_reason


# Windowed CP (flashqla.cp: an inference forward reads the gates' decay bound on the host, one sync) cannot
# run inside a CUDA graph: under capture the op takes the fixed pass structure.  "NAME@cpw" times the
# windowed call eagerly, as FlashQLA's host-planned CP is timed; "NAME@cp" is captured (fixed structure).
CP_WINDOWED_NOTE = "windowed CP reads the gates' decay bound on the host (one sync), which a CUDA graph cannot hold"


def filter_rows(rows, filt: Optional[str]) -> list:
    """The rows whose label contains one of ``filt``'s ``|``-separated alternatives (all rows without one)."""
    alts = [a for a in (filt or "").split("|") if a]
    return [r for r in rows if not alts or any(a in r.name() for a in alts)]


def split_cp_name(name: str) -> tuple:
    """``"cutlass@cp4"`` -> ``("cutlass", 4)`` (CP forced to 4 segments per sequence), ``"tilelang@cp"``
    and ``"tilelang@cpw"`` -> ``("tilelang", "auto")`` (the cost model decides; ``cpw``, and ``cpwN`` with N
    segments, are timed eagerly so that the calls take windows), ``"triton"`` -> ``("triton", False)``."""
    base, sep, tail = name.partition("@")
    if not sep:
        return name, False
    if tail in ("cp", "cpw"):
        return base, "auto"
    n = tail[3:] if tail.startswith("cpw") else tail[2:]
    if tail.startswith("cp") and n.isdigit() and int(n) >= 1:
        return base, int(n)
    raise SystemExit(f"bad backend variant {name!r}: use NAME@cp (automatic CP), NAME@cpw (automatic, timed "
                     f"eagerly with windows), NAME@cpN (N segments) or NAME@cpwN")


def _flashqla_op(name: str):
    import flashqla
    backend, cp = split_cp_name(name)

    def op(q, k, v, g, beta, cu, meta, output_final_state, h0=None):
        return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                               output_final_state=output_final_state, cu_seqlens=cu,
                                               backend=backend, varlen_meta=meta, context_parallel=cp)
    return op


def _load_fla():
    # FLA routes its GDN to FlashQLA when that is installed unless told not to; the baseline must be
    # FLA's own Triton kernels, so the switch is set before the first import of fla.
    os.environ["FLA_FLASH_QLA"] = "0"
    import inspect

    import fla  # noqa: F401
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    version = getattr(fla, "__version__", "")
    params = inspect.signature(fn).parameters
    # Newer FLA takes the host copy of cu_seqlens and the chunk indices, which keeps its call free of
    # host syncs (so it can be captured in a CUDA graph); built once per cu_seqlens object, on the
    # first (eager) call.
    extra_ok = "chunk_indices" in params and "cu_seqlens_cpu" in params
    prepared = {}

    def extras(cu):
        if cu is None or not extra_ok:
            return {}
        hit = prepared.get(id(cu))
        if hit is None or hit[0] is not cu:
            try:
                from fla.ops.utils.index import prepare_chunk_indices
                cu_cpu = cu.detach().to("cpu", torch.long)
                hit = (cu, {"cu_seqlens_cpu": cu_cpu,
                            "chunk_indices": prepare_chunk_indices(cu, 64, cu_seqlens_cpu=cu_cpu)})
            except Exception:  # another FLA layout: let FLA build them itself
                hit = (cu, {})
            prepared.clear()
            prepared[id(cu)] = hit
        return hit[1]

    def op(q, k, v, g, beta, cu, meta, output_final_state, h0=None):
        return fn(q=q, k=k, v=v, g=g, beta=beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
                  output_final_state=output_final_state, cu_seqlens=cu, use_qk_l2norm_in_kernel=False,
                  **extras(cu))
    return op, version


def _load_flash_qla():
    import flash_qla
    from flash_qla import chunk_gated_delta_rule as fn
    version = getattr(flash_qla, "__version__", "")

    def op(q, k, v, g, beta, cu, meta, output_final_state, h0=None):
        return fn(q=q, k=k, v=v, g=g, beta=beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
                  output_final_state=output_final_state, cu_seqlens=cu, use_qk_l2norm_in_kernel=False)
    return op, version


EXTERNAL_BASELINES = {"fla": _load_fla, "flashqla": _load_flash_qla}
_DEFAULT_LOADERS = dict(EXTERNAL_BASELINES)
# Known host syncs: a capture attempt would fail, and a failed capture can leave a library's caches
# holding tensors of the discarded graph pool, so these are timed eagerly from the start.
EAGER_ONLY = {"flashqla": "FlashQLA's automatic CP plans on the host (reads g), which a CUDA graph cannot hold"}


_PROBE = {"fla": "import os; os.environ['FLA_FLASH_QLA'] = '0'; import fla.ops.gated_delta_rule",
          "flashqla": "import flash_qla"}


def probe_import(name: str, timeout_s: float = 180.0) -> str:
    """Import a baseline in a child process first: a native library that aborts on import (a wheel
    built for another Python, a missing driver) must cost a skipped baseline, not this process.
    Returns '' when the import works, else the reason."""
    import subprocess
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE[name]], capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"importing it took over {timeout_s:.0f}s"
    if r.returncode == 0:
        return ""
    lines = [ln for ln in (r.stderr or "").strip().splitlines() if ln.strip()]
    return f"import failed (exit {r.returncode}): {lines[-1][:200] if lines else 'no message'}"


def build_impls(backends, baselines) -> list:
    import flashqla
    names = flashqla.list_backends()
    impls, seen = [], set()
    for b in baselines:
        if b in seen:
            continue
        seen.add(b)
        if b in EXTERNAL_BASELINES:
            why = probe_import(b) if b in _PROBE and EXTERNAL_BASELINES[b] is _DEFAULT_LOADERS.get(b) else ""
            if why:
                impls.append(Impl(b, "baseline", None, "", f"not importable: {why}"))
                continue
            try:
                op, ver = EXTERNAL_BASELINES[b]()
                impls.append(Impl(b, "baseline", op, ver, eager_reason=EAGER_ONLY.get(b, "")))
            except Exception as exc:
                impls.append(Impl(b, "baseline", None, "", f"not importable: {type(exc).__name__}: "
                                                            f"{str(exc).splitlines()[0] if str(exc) else ''}"))
        elif b in names:
            be = flashqla.get_backend(b)
            impls.append(Impl(b, "baseline", _flashqla_op(b), _safe_version(be)))
        else:
            raise SystemExit(f"unknown baseline {b!r}: use fla, flashqla, a flashqla backend "
                             f"({', '.join(names)}) or none")
    for b in backends:
        if b in seen:
            for im in impls:
                if im.name == b:
                    im.kind = "backend+baseline"
            continue
        seen.add(b)
        if split_cp_name(b)[0] not in names:
            raise SystemExit(f"unknown backend {b!r}; registered: {', '.join(names)}")
        impls.append(Impl(b, "backend", _flashqla_op(b), _safe_version(flashqla.get_backend(split_cp_name(b)[0])),
                          eager_reason=CP_WINDOWED_NOTE if "@cpw" in b else ""))
    # backends first in the table, then baselines
    return sorted(impls, key=lambda im: 0 if im.kind.startswith("backend") else 1)


def _safe_version(be) -> str:
    try:
        return be.version() or ""
    except Exception:
        return ""


def default_backends(device: torch.device) -> list:
    """Registered backends that are available and declare a priority for this device's architecture;
    the slow reference only on the CPU."""
    import flashqla
    from flashqla.dispatch import detect, priority_of
    info = detect(device)
    out = []
    for name in flashqla.list_backends():
        if name == "reference" and device.type != "cpu":
            continue
        be = flashqla.get_backend(name)
        try:
            ok = be.available()[0] and priority_of(be, info.arch, info.capability) is not None
        except Exception:
            ok = False
        if ok:
            out.append(name)
    return out


# --------------------------------------------------------------------------------------------------
# calls and timing


def make_call(op, x: dict, mode: str):
    """A zero-argument callable that runs the op once on inputs ``x`` (fwd, or fwd + bwd).  With ``x["h0"]``
    (``--initial-state``) the call starts from that state, and fwd + bwd also takes its gradient."""
    q, k, v, g, beta, cu, meta = x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"], x["meta"]
    # (h0 goes by keyword, and only when there is one: an op written before --initial-state still serves)
    state = {} if x.get("h0") is None else {"h0": x["h0"]}
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                o, ht = op(q, k, v, g, beta, cu, meta, True, **state)
            return [o, ht]
        return fwd
    state = {name: t.detach().clone().requires_grad_() for name, t in state.items()}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta)] + list(state.values())
    do = x["do"]

    def fwdbwd():
        with torch.enable_grad():
            o, _ = op(*leaves[:5], cu, meta, False, **state)
            return list(torch.autograd.grad(o, leaves, do, allow_unused=True))
    return fwdbwd


def _rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def agreement(outs, ref_outs) -> float:
    errs = [_rel_l2(a, b) for a, b in zip(outs, ref_outs) if a is not None and b is not None
            and a.shape == b.shape]
    return max(errs) if errs else float("nan")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cuda(fns, min_time_s: float, max_reps: int, use_graph: bool) -> dict:
    from ..testing import warm_up_for_capture
    torch.cuda.synchronize()
    warm_up_for_capture(*fns, reps=2)
    torch.cuda.synchronize()
    graph, note, held = None, "", []
    if use_graph:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                held.append([f() for f in fns])  # the outputs live in the graph's pool
            graph.replay()
            torch.cuda.synchronize()
        except Exception as exc:
            graph = None
            held.clear()
            note = f"graph capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
            torch.cuda.synchronize()

    def step():
        if graph is not None:
            graph.replay()
        else:
            for f in fns:
                f()

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    step()
    b.record()
    b.synchronize()
    one = max(a.elapsed_time(b), 1e-3) * 1e-3
    reps = int(min(max_reps, max(10, min_time_s / one)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        step()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) / len(fns) for s, e in zip(starts, ends))
    method = "graph" if graph is not None else "eager"
    graph = None  # frees the graph's memory pool before the next implementation runs
    held.clear()
    return {"ms": statistics.median(times), "min_ms": times[0], "reps": reps, "method": method, "note": note}


def time_cpu(fns, min_time_s: float, max_reps: int) -> dict:
    for f in fns:
        f()
    times, t_start, i = [], time.perf_counter(), 0
    while True:
        f = fns[i % len(fns)]
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e3)
        i += 1
        if i >= max_reps or (i >= 3 and time.perf_counter() - t_start > min_time_s):
            break
    times.sort()
    return {"ms": statistics.median(times), "min_ms": times[0], "reps": len(times), "method": "wall",
            "note": ""}


def rotation_count(nbytes: float, device) -> int:
    """Input copies cycled through so that each call reads from HBM, not from L2."""
    if device.type != "cuda":
        return 1
    try:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
    except Exception:
        l2 = 50 << 20
    return int(min(16, max(1, math.ceil(3 * l2 / max(nbytes, 1.0)))))


# --------------------------------------------------------------------------------------------------
# the run


def _fmt_ms(r):
    if r is None:
        return "-"
    if r.get("status") != "ok":
        return {"n/a": "n/a", "error": "ERR", "skipped": "skip"}.get(r.get("status"), "?")
    return f"{r['ms']:.3f}" + ("*" if r.get("method") == "eager" else "")


def run_bench(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.preset == "decode" and not args.list:
        from .bench_decode import run_decode_bench
        return run_decode_bench(args)
    all_presets = presets(device.type)
    if args.list:
        for p in all_presets.values():
            print(f"{p.name:<14} {p.mode:<7} {len(p.rows):>4} rows  {p.about}")
        return 0
    preset = all_presets[args.preset]
    mode = args.mode or preset.mode
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    rows = preset.rows
    if args.filter:
        names = [r.name() for r in rows]
        rows = filter_rows(rows, args.filter)
        if not rows:
            raise SystemExit(f"--filter {args.filter!r} matches no row of preset {args.preset!r} "
                             f"(rows: {', '.join(names)})")
    if args.max_walks is not None:
        names = [r.name() for r in rows]
        rows = [r for r in rows if r.Hv * len(r.seqlens) <= args.max_walks]
        if not rows:
            raise SystemExit(f"--max-walks {args.max_walks} leaves no row of preset {args.preset!r} "
                             f"(rows: {', '.join(names)})")
    if args.max_rows:
        rows = rows[: args.max_rows]

    backends = ([b for b in args.backends.split(",") if b] if args.backends is not None
                else default_backends(device))
    if args.baselines is None:
        baselines = ["fla", "flashqla"] if device.type == "cuda" else ["reference"]
    else:
        baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    impls = build_impls(backends, baselines)
    for im in impls:
        if im.skip_reason:
            print(f"bench: baseline {im.name} skipped ({im.skip_reason})", file=sys.stderr)
    runnable = [im for im in impls if not im.skip_reason]
    if not runnable:
        print("bench: nothing to time (no backend or baseline can run)", file=sys.stderr)
        return 2

    ceil = roofline.ceilings(device, refresh=args.refresh_ceilings)
    min_time = args.min_time if args.min_time is not None else (0.2 if device.type == "cuda" else 0.3)
    max_reps = args.max_reps or (200 if device.type == "cuda" else 20)
    meta = _metadata(args, device, dtype, preset, mode, impls, ceil)
    results = []
    out_dir = Path(args.out) if args.out else None
    stem = f"bench_{preset.name}_{mode}"
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)

    prog = Progress(len(rows) * len(runnable), desc=f"{preset.name} {mode}", enabled=not args.no_progress)
    interrupted = False
    try:
        for row in rows:
            results.append(_run_row(row, runnable, impls, mode, dtype, device, ceil, min_time, max_reps,
                                    args, prog))
            if out_dir:
                write_outputs(out_dir, stem, meta, results, impls, plot=False)
    except KeyboardInterrupt:  # SIGINT (e.g. `timeout -s INT`): keep and report what was measured
        interrupted = True
        meta["interrupted"] = f"after {len(results)} of {len(rows)} rows"
    finally:
        prog.close()
    meta["rows_done"], meta["rows_total"] = len(results), len(rows)

    print(render_text(meta, results, impls))
    if out_dir:
        note = write_outputs(out_dir, stem, meta, results, impls, plot=not args.no_plot)
        print(f"\nwrote {out_dir / stem}.json, .csv, .md" + (", .png" if note is None else f" ({note})"))
    errors = sum(1 for r in results for v in r["results"].values() if v.get("status") == "error")
    if errors:
        print(f"bench: {errors} (row, implementation) pairs failed; their errors are in the JSON",
              file=sys.stderr)
    if interrupted:
        print(f"bench: interrupted after {len(results)} of {len(rows)} rows", file=sys.stderr)
        return 130
    return 1 if args.strict and errors else 0


def _metadata(args, device, dtype, preset, mode, impls, ceil) -> dict:
    import flashqla
    dev = {"type": device.type}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        dev.update(name=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                   l2_bytes=getattr(p, "L2_cache_size", None))
    else:
        dev.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return {
        "preset": preset.name, "mode": mode, "about": preset.about, "dtype": str(dtype).replace("torch.", ""),
        "K": 128, "V": 128, "g_dtype": "float32", "beta_dtype": str(dtype).replace("torch.", ""),
        "g": f"logsigmoid(randn) x {getattr(args, 'g_scale', 1.0)}",
        "device": dev, "torch": torch.__version__, "flashqla": flashqla.__version__,
        "python": platform.python_version(),
        "impls": [{"name": im.name, "kind": im.kind, "version": im.version, "skipped": im.skip_reason}
                  for im in impls],
        "ceilings": ceil,
        "flops": f"per token per value head 10*C*d + 6*d^2 + (2/3)*C^2 (C=64, d=128); fwdbwd = "
                 f"{1 + roofline.BWD_FLOP_FACTOR} x fwd",
        "bytes": "q,k,v,o (dtype) + g fp32 + beta, + ht fp32 (fwd); fwdbwd adds do,dq,dk,dv,dg,dbeta"
                 + ("; + h0 fp32 (and dh0 in fwdbwd)" if getattr(args, "initial_state", False) else ""),
        "initial_state": bool(getattr(args, "initial_state", False)),
        "timing": "CUDA graph replay, median of CUDA-event-timed replays (eager* when capture fails); "
                  "cpu: wall-clock median",
        "speedup": "baseline_ms / backend_ms",
        "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _inputs_for(row, dtype, device, mode, seed, shared=None, g_scale: float = 1.0, h0: bool = False):
    """One input copy.  Copies of a row share one cu_seqlens tensor and one VarlenMeta: caches keyed on
    the cu_seqlens object (FLA's chunk-index cache) then hit on every copy, also during graph capture.
    ``h0``: a random fp32 initial state ``[N, Hv, K, V]`` (``x["h0"]``) as well."""
    import flashqla
    x = make_inputs(row.seqlens, row.Hqk, row.Hv, dtype=dtype, device=device, seed=seed, g_scale=g_scale)
    if h0:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + 4242)
        K, V = x["q"].shape[-1], x["v"].shape[-1]
        x["h0"] = 0.1 * torch.randn(len(row.seqlens), row.Hv, K, V, generator=gen, device=device,
                                    dtype=torch.float32)
    if shared is not None:
        x["cu_seqlens"], x["meta"] = shared["cu_seqlens"], shared["meta"]
    else:
        x["meta"] = flashqla.prepare_varlen(x["cu_seqlens"]) if x["cu_seqlens"] is not None else None
    if mode == "fwdbwd":
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + 7777)
        x["do"] = torch.randn(x["v"].shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return x


def _run_row(row, runnable, impls, mode, dtype, device, ceil, min_time, max_reps, args, prog) -> dict:
    import flashqla
    tokens, nseq = row.tokens, len(row.seqlens)
    flops = roofline.gdn_flops(tokens, row.Hv, mode=mode)
    with_h0 = bool(getattr(args, "initial_state", False))
    nbytes = roofline.gdn_bytes(tokens, row.Hqk, row.Hv, num_seqs=nseq, dtype=dtype, mode=mode,
                                h0=with_h0, ht=(mode == "fwd"))
    floor = roofline.floor_ms(flops, nbytes, ceil)
    n_rot = 1 if args.no_rotate else rotation_count(nbytes, device)
    rec = {"label": row.name(), "Hqk": row.Hqk, "Hv": row.Hv, "seqlens": list(row.seqlens), "tokens": tokens,
           "num_seqs": nseq, "flops": flops, "bytes": nbytes, "floor_ms": floor, "rotate": n_rot,
           "results": {}, "speedup": {}}
    try:
        gs = getattr(args, "g_scale", 1.0)
        xs = [_inputs_for(row, dtype, device, mode, seed=1, g_scale=gs, h0=with_h0)]
        xs += [_inputs_for(row, dtype, device, mode, seed=1 + i, shared=xs[0], g_scale=gs, h0=with_h0)
               for i in range(1, n_rot)]
    except Exception as exc:  # e.g. out of memory: the whole row fails, the run goes on
        for im in runnable:
            rec["results"][im.name] = {"status": "error", "error": f"inputs: {type(exc).__name__}: {exc}"}
            prog.update()
        return rec
    ref_outs, ref_name = None, None
    for im in impls:
        if im.skip_reason:
            rec["results"][im.name] = {"status": "skipped", "error": im.skip_reason}
            continue
        r = {"status": "ok"}
        try:
            base = split_cp_name(im.name)[0] if im.kind != "baseline" else im.name
            if im.kind != "baseline" or im.name in flashqla.list_backends():
                x = xs[0]
                d = flashqla.explain(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("h0"),
                                     output_final_state=(mode == "fwd"), cu_seqlens=x["cu_seqlens"],
                                     varlen_meta=x["meta"], backend=base, needs_grad=(mode == "fwdbwd"))
                if d.chosen != base:
                    why = next((c.reason for c in d.candidates if c.name == base), "cannot serve")
                    rec["results"][im.name] = {"status": "n/a", "error": why}
                    prog.update()
                    continue
            fns = [make_call(im.op, x, mode) for x in xs]
            prog.status(f"compile {im.name} | {row.name()}")
            t0 = time.perf_counter()
            outs = fns[0]()
            _sync(device)
            r["first_call_s"] = round(time.perf_counter() - t0, 3)
            if ref_outs is None:
                ref_outs, ref_name = [None if t is None else t.detach() for t in outs], im.name
                r["agree"] = 0.0
            else:
                r["agree"] = agreement(outs, ref_outs)
            r["agree_with"] = ref_name
            del outs
            prog.status(f"time {im.name} | {row.name()}")
            if device.type == "cuda":
                r.update(time_cuda(fns, min_time, max_reps, use_graph=not args.no_graph and not im.eager_reason))
                if im.eager_reason and not args.no_graph:
                    r["method"], r["note"] = "eager", im.eager_reason
                if args.eager_too and r["method"] == "graph":
                    # the same calls back to back without the graph: what an eager caller gets, host included
                    r["eager_ms"] = time_cuda(fns, min_time, max_reps, use_graph=False)["ms"]
            else:
                r.update(time_cpu(fns, min_time, max_reps))
            r["pct_roofline"] = 100.0 * floor / r["ms"] if r["ms"] > 0 else float("nan")
            r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
            r["gbps"] = nbytes / (r["ms"] * 1e-3) / 1e9
            del fns
        except Exception as exc:
            msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            r = {"status": "error", "error": msg}
            if args.verbose:
                prog.write(f"{im.name} on {row.name()} failed:\n{traceback.format_exc()}")
            try:
                _sync(device)
            except Exception as exc2:
                r["error"] += f" (then the device failed: {type(exc2).__name__})"
        rec["results"][im.name] = r
        prog.update()
    del xs, ref_outs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for im in impls:
        ri = rec["results"].get(im.name, {})
        if not im.kind.startswith("backend") or ri.get("status") != "ok":
            continue
        for bl in impls:
            rb = rec["results"].get(bl.name, {})
            if "baseline" in bl.kind and bl.name != im.name and rb.get("status") == "ok":
                rec["speedup"].setdefault(im.name, {})[bl.name] = rb["ms"] / ri["ms"]
                if "eager_ms" in ri and rb.get("method") == "eager":
                    # eager against eager (the baseline was timed eagerly: it cannot be captured)
                    rec.setdefault("speedup_eager", {}).setdefault(im.name, {})[bl.name] = rb["ms"] / ri["eager_ms"]
    prog.write(_row_line(rec, impls))
    return rec


def _row_line(rec, impls) -> str:
    parts = [f"{rec['label']:<28}"]
    for im in impls:
        parts.append(f"{im.name} {_fmt_ms(rec['results'].get(im.name))}")
    return "  ".join(parts)


# --------------------------------------------------------------------------------------------------
# rendering


def _pairs(impls):
    return [(a.name, b.name) for a in impls if a.kind.startswith("backend") for b in impls
            if "baseline" in b.kind and b.name != a.name and not b.skip_reason]


def table_rows(results, impls):
    shown = [im for im in impls if not im.skip_reason]
    pairs = _pairs(impls)
    # (--eager-too) the graph-timed implementations timed eagerly as well, and eager against eager baselines
    eager = [im for im in shown if any("eager_ms" in rec["results"].get(im.name, {}) for rec in results)]
    epairs = [(a, b) for a, b in pairs if any(b in rec.get("speedup_eager", {}).get(a, {}) for rec in results)]
    headers = ["heads", "seqlens", "tokens"] + [f"{im.name} ms" for im in shown] + \
              [f"{im.name} eager ms" for im in eager] + [f"{a} vs {b} x" for a, b in pairs] + \
              [f"{a} eager vs {b} x" for a, b in epairs] + ["GFLOP", "MB", "floor ms"] + \
              [f"{im.name} %roof" for im in shown]
    body = []
    for rec in results:
        row = [f"{rec['Hqk']}/{rec['Hv']}", rec["label"].split(" ", 1)[1], rec["tokens"]]
        row += [_fmt_ms(rec["results"].get(im.name)) for im in shown]
        for im in eager:
            e = rec["results"].get(im.name, {}).get("eager_ms")
            row.append("-" if e is None else f"{e:.3f}")
        for a, b in pairs:
            s = rec["speedup"].get(a, {}).get(b)
            row.append("-" if s is None else f"{s:.2f}")
        for a, b in epairs:
            s = rec.get("speedup_eager", {}).get(a, {}).get(b)
            row.append("-" if s is None else f"{s:.2f}")
        row += [f"{rec['flops'] / 1e9:.1f}", f"{rec['bytes'] / 1e6:.1f}", f"{rec['floor_ms']:.3f}"]
        for im in shown:
            r = rec["results"].get(im.name, {})
            row.append(f"{r['pct_roofline']:.0f}%" if r.get("status") == "ok" else "-")
        body.append(row)
    return headers, body


def _notes(results, impls, mode: str = "fwd") -> list:
    notes = []
    # two correct bf16 implementations differ by a few 1e-3 in o, by up to ~3e-2 in dg / dbeta
    agree_tol = 2e-2 if mode == "fwd" else 6e-2
    for im in impls:
        if im.skip_reason:
            notes.append(f"{im.name}: skipped ({im.skip_reason})")
    seen = set()
    for rec in results:
        for name, r in rec["results"].items():
            if r.get("status") in ("error", "n/a"):
                key = (name, r["status"], r.get("error", ""))
                if key not in seen:
                    seen.add(key)
                    notes.append(f"{name} {r['status']} on {rec['label']}"
                                 f"{' (and others)' if _count(results, key) > 1 else ''}: {r.get('error', '')}")
            if r.get("note"):
                key = (name, "note", r["note"])
                if key not in seen:
                    seen.add(key)
                    notes.append(f"{name} timed eager (*): {r['note']}")
            if r.get("status") == "ok" and isinstance(r.get("agree"), float) and r["agree"] > agree_tol:
                notes.append(f"{name} on {rec['label']}: output differs from {r['agree_with']} by rel-L2 "
                             f"{r['agree']:.2e}")
    return notes


def _count(results, key):
    name, status, err = key
    return sum(1 for rec in results if rec["results"].get(name, {}).get("status") == status
               and rec["results"][name].get("error", "") == err)


def _header(meta) -> str:
    c = meta["ceilings"]
    d = meta["device"]
    impl = ", ".join(f"{i['name']} {i['version']}".strip() for i in meta["impls"] if not i["skipped"])
    return (f"flashqla bench --preset {meta['preset']} ({meta['mode']}, {meta['dtype']}, K=V=128) on "
            f"{d.get('name', d['type'])}: {impl}\n"
            f"ceilings: copy {c['copy_gbps']:.0f} GB/s, matmul {c['matmul_tflops']:.3g} TFLOP/s "
            f"({c['matmul_dtype']}); floor = max(FLOPs/peak, bytes/bw); 'A vs B x' = speedup of A over B = B ms / A ms; "
            f"* = timed eager")


# FlashQLA runs its context parallelism where value heads x sequences is at most this (issue #8's rows)
CP_WALKS = 40
# the speedup issue #8 asks for on those rows
TARGET_SPEEDUP = 1.1


def summarize(results) -> list:
    """Per (implementation A, baseline B) pair that has speedups: over all rows and over the rows with value heads
    x sequences <= ``CP_WALKS``, the row count, geometric mean of B ms / A ms, the lowest (and its row) and how
    many rows are under ``TARGET_SPEEDUP``.  A list of dicts, in the pairs' first-seen order."""
    pairs = []
    for rec in results:
        for a, per in rec["speedup"].items():
            for b in per:
                if (a, b) not in pairs:
                    pairs.append((a, b))
    out = []
    for a, b in pairs:
        for subset, keep in (("all rows", lambda rec: True),
                             (f"Hv x sequences <= {CP_WALKS}", lambda rec: rec["Hv"] * rec["num_seqs"] <= CP_WALKS)):
            vals = [(rec["speedup"][a][b], rec["label"]) for rec in results
                    if keep(rec) and rec["speedup"].get(a, {}).get(b) is not None]
            if not vals:
                continue
            low = min(vals)
            out.append({"impl": a, "baseline": b, "rows": subset, "count": len(vals),
                        "geomean": math.exp(sum(math.log(v) for v, _ in vals) / len(vals)),
                        "lowest": low[0], "lowest_row": low[1],
                        "below_target": sum(1 for v, _ in vals if v < TARGET_SPEEDUP)})
    return out


def summary_lines(results) -> list:
    return [f"{s['impl']} vs {s['baseline']}, {s['rows']} ({s['count']}): geometric mean {s['geomean']:.3f}x, "
            f"lowest {s['lowest']:.3f}x ({s['lowest_row']}), {s['below_target']} under {TARGET_SPEEDUP}x"
            for s in summarize(results)]


def render_text(meta, results, impls) -> str:
    headers, body = table_rows(results, impls)
    out = [_header(meta), text_table(headers, body)]
    summary = summary_lines(results)
    if summary:
        out.append("summary:\n" + "\n".join(f"  - {line}" for line in summary))
    notes = _notes(results, impls, meta["mode"])
    if notes:
        out.append("notes:\n" + "\n".join(f"  - {n}" for n in notes))
    return "\n".join(out)


def render_markdown(meta, results, impls) -> str:
    headers, body = table_rows(results, impls)
    out = [f"### {meta['preset']} ({meta['mode']})", "", _header(meta).replace("\n", "  \n"), "",
           markdown_table(headers, body)]
    summary = summary_lines(results)
    if summary:
        out += ["", *[f"- {line}" for line in summary]]
    notes = _notes(results, impls, meta["mode"])
    if notes:
        out += ["", *[f"- {n}" for n in notes]]
    return "\n".join(out) + "\n"


CSV_FIELDS = ["preset", "mode", "label", "Hqk", "Hv", "seqlens", "tokens", "num_seqs", "impl", "kind", "version",
              "status", "ms", "min_ms", "reps", "method", "eager_ms", "first_call_s", "flops", "bytes", "floor_ms",
              "pct_roofline", "tflops", "gbps", "agree", "agree_with", "speedups", "error"]


def write_outputs(out_dir: Path, stem: str, meta, results, impls, plot: bool) -> Optional[str]:
    doc = {"meta": meta, "rows": results, "summary": summarize(results)}
    tmp = out_dir / f"{stem}.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(out_dir / f"{stem}.json")
    kinds = {im.name: (im.kind, im.version) for im in impls}
    with open(out_dir / f"{stem}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        for rec in results:
            for name, r in rec["results"].items():
                sp = rec["speedup"].get(name, {})
                w.writerow({
                    "preset": meta["preset"], "mode": meta["mode"], "label": rec["label"], "Hqk": rec["Hqk"],
                    "Hv": rec["Hv"], "seqlens": " ".join(map(str, rec["seqlens"])), "tokens": rec["tokens"],
                    "num_seqs": rec["num_seqs"], "impl": name, "kind": kinds.get(name, ("", ""))[0],
                    "version": kinds.get(name, ("", ""))[1], "status": r.get("status"), "ms": r.get("ms"),
                    "min_ms": r.get("min_ms"), "reps": r.get("reps"), "method": r.get("method"),
                    "eager_ms": r.get("eager_ms"),
                    "first_call_s": r.get("first_call_s"), "flops": rec["flops"], "bytes": rec["bytes"],
                    "floor_ms": rec["floor_ms"], "pct_roofline": r.get("pct_roofline"), "tflops": r.get("tflops"),
                    "gbps": r.get("gbps"), "agree": r.get("agree"), "agree_with": r.get("agree_with"),
                    "speedups": ";".join(f"{b}={x:.4f}" for b, x in sp.items()),
                    "error": r.get("error", "") or r.get("note", "")})
    (out_dir / f"{stem}.md").write_text(render_markdown(meta, results, impls))
    if not plot:
        return "no plot yet"
    return write_plot(out_dir / f"{stem}.png", meta, results, impls)


def write_plot(path: Path, meta, results, impls) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        note = f"no plot: matplotlib not importable ({type(exc).__name__})"
        print(f"bench: {note}", file=sys.stderr)
        return note
    shown = [im for im in impls if not im.skip_reason]
    labels = [rec["label"] for rec in results]
    n = max(len(labels), 1)
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.45 * n * max(1, len(shown)) / 2 + 3), 8), sharex=True)
    width = 0.8 / max(len(shown), 1)
    for j, im in enumerate(shown):
        xs, ms, pct = [], [], []
        for i, rec in enumerate(results):
            r = rec["results"].get(im.name, {})
            if r.get("status") == "ok":
                xs.append(i + (j - (len(shown) - 1) / 2) * width)
                ms.append(r["ms"])
                pct.append(r["pct_roofline"])
        axes[0].bar(xs, ms, width, label=f"{im.name} ({im.kind})")
        axes[1].bar(xs, pct, width, label=im.name)
    axes[0].plot(range(len(results)), [rec["floor_ms"] for rec in results], "k_", markersize=12,
                 label="roofline floor")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms (log)")
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"flashqla bench {meta['preset']} ({meta['mode']}, {meta['dtype']}) on "
                      f"{meta['device'].get('name', meta['device']['type'])}")
    axes[1].set_ylabel("% of roofline floor")
    axes[1].set_xticks(range(len(labels)))
    axes[1].set_xticklabels(labels, rotation=70, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time backends against FLA / FlashQLA baselines",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="quick",
                   choices=["quick", "qwen35-fwd", "qwen35-bwd", "flashqla-fwd", "flashqla-bwd", "decode"],
                   help="decode: the decode step on a state pool vs FLA's fused_recurrent (flashqla.cli.bench_decode; "
                        "--backends then names decode implementations, e.g. triton,triton[bv=16,warps=2])")
    p.add_argument("--backends", default=None,
                   help="comma list of flashqla backends (default: every available one; reference only on cpu); "
                        "NAME@cpN runs a backend with context parallelism forced to N segments per sequence, "
                        "NAME@cp with the automatic CP plan")
    p.add_argument("--baselines", default=None,
                   help="comma list from fla, flashqla or a flashqla backend name, or 'none' "
                        "(default: fla,flashqla on cuda, reference on cpu)")
    p.add_argument("--out", default=None, help="directory for JSON, CSV, markdown and PNG")
    p.add_argument("--mode", choices=["fwd", "fwdbwd"], default=None, help="default: the preset's")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="q/k/v dtype (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--filter", default=None,
                   help="only rows whose label contains this ('|' separates alternatives: '2/8 1x|28672')")
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--max-walks", type=int, default=None,
                   help="only rows with value heads x sequences <= this (e.g. 40: the rows where FlashQLA runs its "
                        "context parallelism, issue #8's acceptance rows)")
    p.add_argument("--min-time", type=float, default=None, help="seconds of timing per (row, impl)")
    p.add_argument("--max-reps", type=int, default=None)
    p.add_argument("--no-graph", action="store_true", help="time eager calls, no CUDA graph")
    p.add_argument("--eager-too", action="store_true",
                   help="also time every graph-timed implementation eagerly (columns 'NAME eager ms' and "
                        "'A eager vs B x' against eagerly timed baselines): what a caller without graphs gets")
    p.add_argument("--initial-state", action="store_true",
                   help="every call starts from a random fp32 initial state [N, Hv, K, V] (a continued prefill); "
                        "fwd+bwd also takes its gradient")
    p.add_argument("--g-scale", type=float, default=1.0,
                   help="gates g = logsigmoid(randn) x this (default 1; e.g. 0.01 for slowly decaying heads, "
                        "where windowed CP finds no negligible map and runs its fixed structure)")
    p.add_argument("--no-rotate", action="store_true", help="do not rotate input copies through L2")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--refresh-ceilings", action="store_true", help="measure bandwidth / matmul rate again")
    p.add_argument("--strict", action="store_true", help="exit 1 when any (row, impl) failed")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failures")
    p.set_defaults(func=run_bench)
