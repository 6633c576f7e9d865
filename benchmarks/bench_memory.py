"""Peak extra device memory of the forward and of forward + backward: flashqla's backends beside FLA and FlashQLA.

    python benchmarks/bench_memory.py --out benchmarks/results/memory_h200            # the whole grid, CUDA
    python benchmarks/bench_memory.py --modes fwd --filter 16/32 --backends triton     # a part of it
    python benchmarks/bench_memory.py --device cpu --backends reference --baselines none --filter 1/2  # smoke test

Grid (the Step 2 grid of ``python -m flashqla bench``): forward = preset ``qwen35-fwd`` (Hqk/Hv in {2/8, 4/16,
8/32, 16/32, 16/64} x {1x32768, 1x8192, 28672+4096, 4x8192, 8x1024}, output_final_state=True, no grad);
forward + backward = preset ``qwen35-bwd`` (the same heads x {8k, 32k} tokens x {1, 4} sequences; grads of q, k,
v, g, beta from ``torch.autograd.grad`` of o with a random ``do``).  Inputs are those of ``bench`` (K = V = 128,
bf16 q/k/v/beta, fp32 g, packed with int32 ``cu_seqlens``); the calls are ``bench.make_call``'s.

Measure.  Peak extra memory of one call = ``torch.cuda.max_memory_allocated()`` during the call minus
``torch.cuda.memory_allocated()`` just before it, with everything the call reads already allocated (inputs,
``cu_seqlens`` and its metadata, for fwdbwd the leaf copies of q, k, v, g, beta and ``do``).  It therefore
includes the call's own outputs (o and the final state; or the five gradients) and every workspace the
implementation allocates through PyTorch's allocator.  Each (row, implementation) is called once first
(compilation, lazily built caches), and the second call is measured.  Memory allocated outside PyTorch's
allocator (a library's own cudaMalloc) is not seen; flashqla, FLA and FlashQLA allocate through PyTorch.

Columns: ``peak MB`` per implementation; ``<= FlashQLA`` per flashqla backend (yes when its peak is at most
FlashQLA's on the row); reference sizes: ``in MB`` (what the call reads), ``out MB`` (o + final state, or the
gradients in the input dtypes) and ``states MB`` (one 16-bit copy of the per-chunk states [chunks, Hv, K, V],
what a training forward of the chunked form keeps).

``--device cpu`` runs the same rows on the CPU with a simple accounting (a TorchDispatchMode that adds the bytes
of every new storage an op returns and subtracts them when its last tracked tensor dies): a smoke test of the
harness, not a measurement of the CPU backends (memory a kernel allocates internally is not seen).

Outputs with ``--out DIR``: ``bench_memory.json`` (everything) and ``bench_memory.md`` (one table per mode),
rewritten after every row.  A failing (row, implementation) is an error cell (OOM included), never a crash.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(HERE.parent))

from flashqla.cli.bench import (_inputs_for, build_impls, filter_rows, make_call,  # noqa: E402
                                split_cp_name)
from flashqla.cli.cases import presets  # noqa: E402
from flashqla.cli.table import markdown_table, text_table  # noqa: E402

MB = 1e6
PRESET_OF_MODE = {"fwd": "qwen35-fwd", "fwdbwd": "qwen35-bwd"}
DEFAULT_GPU_BACKENDS = ("triton", "tilelang", "cutlass")
FLASHQLA_BASELINE = "flashqla"   # the FlashQLA package (flash_qla), as ``bench`` names it


# --------------------------------------------------------------------------------------------------
# meters


class CudaMeter:
    """Peak extra memory of a block on the current CUDA device (PyTorch's allocator)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        self.held = torch.cuda.memory_allocated(self.device) - self.base
        return False


class CpuMeter(TorchDispatchMode):
    """Bytes of the storages that ops return while active: +nbytes when a storage is first seen, -nbytes
    when the last tracked tensor on it is freed.  Tensors made before entering are not counted."""

    def __init__(self):
        super().__init__()
        self.cur = self.peak = 0
        self._refs = {}       # storage key -> [tracked tensors alive, nbytes]
        # tensors already counted, by id (a WeakSet would compare two tensors with == on a hash match, which
        # is elementwise: in-place ops such as copy_ return a tensor already seen)
        self._seen = {}

    def _release(self, key):
        ent = self._refs.get(key)
        if ent is None:
            return
        ent[0] -= 1
        if ent[0] == 0:
            self.cur -= ent[1]
            del self._refs[key]

    def _track(self, t):
        ref = self._seen.get(id(t))
        if (ref is not None and ref() is t) or t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
        except Exception:  # tensors without storage (sparse, functional wrappers): not counted
            return
        if nbytes == 0:
            return
        tid = id(t)
        self._seen[tid] = weakref.ref(t, lambda _r, tid=tid, seen=self._seen: seen.pop(tid, None))
        ent = self._refs.get(key)
        if ent is None:
            self._refs[key] = [1, nbytes]
            self.cur += nbytes
            self.peak = max(self.peak, self.cur)
        else:
            ent[0] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def __enter__(self):
        gc.collect()
        super().__enter__()
        return self

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.held = self.cur
        return False


def meter_for(device):
    return CudaMeter(device) if device.type == "cuda" else CpuMeter()


# --------------------------------------------------------------------------------------------------
# one row


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def reference_sizes(row, x, mode: str) -> dict:
    """Sizes (bytes) that put a peak in context: inputs read, outputs, one 16-bit copy of the chunk states."""
    K = V = x["v"].shape[-1]
    chunks = sum((n + 63) // 64 for n in row.seqlens)
    inputs = [x[k] for k in ("q", "k", "v", "g", "beta")] + ([x["do"]] if mode == "fwdbwd" else [])
    if mode == "fwd":
        out = x["v"].numel() * x["v"].element_size() + len(row.seqlens) * row.Hv * K * V * 4
    else:
        out = _nbytes([x[k] for k in ("q", "k", "v", "g", "beta")])
    return {"in_bytes": _nbytes(inputs), "out_bytes": out, "states_bytes": chunks * row.Hv * K * V * 2,
            "chunks": chunks}


def _serves(im, x, mode: str):
    """None when flashqla backend ``im`` serves the row, else why not (``bench`` marks such cells n/a)."""
    import flashqla
    base = split_cp_name(im.name)[0]
    if base not in flashqla.list_backends() or (im.kind == "baseline" and im.name not in flashqla.list_backends()):
        return None   # FLA, FlashQLA, or any other op: nothing to ask
    d = flashqla.explain(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=(mode == "fwd"),
                         cu_seqlens=x["cu_seqlens"], varlen_meta=x["meta"], backend=base,
                         needs_grad=(mode == "fwdbwd"))
    if d.chosen == base:
        return None
    return next((c.reason for c in d.candidates if c.name == base), "cannot serve")


def _short(exc) -> str:
    msg = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else ""
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in msg.lower():
        return f"OOM: {msg}"
    return f"{type(exc).__name__}: {msg}"


def measure_one(im, x, mode: str, device) -> dict:
    """Peak / held extra bytes of the second call of ``im`` on inputs ``x``."""
    fn = make_call(im.op, x, mode)          # fwdbwd: the leaf copies exist from here on, before the base
    t0 = time.perf_counter()
    out = fn()                              # first call: compilation and lazily built caches
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_s = time.perf_counter() - t0
    del out
    with meter_for(device) as m:
        out = fn()
    res = {"status": "ok", "peak_bytes": int(m.peak), "held_bytes": int(m.held),
           "first_call_s": round(first_s, 3)}
    del out, fn
    return res


def measure_row(row, impls, mode: str, dtype, device, verbose: bool = False) -> dict:
    """Every implementation on one row; failures become error cells."""
    rec = {"label": row.name(), "mode": mode, "Hqk": row.Hqk, "Hv": row.Hv, "seqlens": list(row.seqlens),
           "tokens": row.tokens, "results": {}}
    try:
        x = _inputs_for(row, dtype, device, mode, seed=1)
    except Exception as exc:
        for im in impls:
            rec["results"][im.name] = {"status": "error", "error": f"inputs: {_short(exc)}"}
        return rec
    rec.update(reference_sizes(row, x, mode))
    for im in impls:
        if im.skip_reason:
            rec["results"][im.name] = {"status": "skipped", "error": im.skip_reason}
            continue
        try:
            why = _serves(im, x, mode)
            if why is not None:
                rec["results"][im.name] = {"status": "n/a", "error": why}
                continue
            rec["results"][im.name] = measure_one(im, x, mode, device)
        except Exception as exc:
            rec["results"][im.name] = {"status": "error", "error": _short(exc)}
            if verbose:
                traceback.print_exc()
        finally:
            gc.collect()
            if device.type == "cuda":
                try:
                    torch.cuda.synchronize(device)
                    torch.cuda.empty_cache()
                except Exception as exc2:  # a failed kernel can poison the context: say so, go on
                    rec["results"][im.name]["error"] = (rec["results"][im.name].get("error", "") +
                                                        f" (then the device failed: {type(exc2).__name__})")
    del x
    compare_to_flashqla(rec, impls)
    return rec


def compare_to_flashqla(rec: dict, impls) -> None:
    """rec['le_flashqla'][backend] = True / False when both peaks exist (backend <= FlashQLA's peak)."""
    ref = rec["results"].get(FLASHQLA_BASELINE, {})
    rec["le_flashqla"] = {}
    for im in impls:
        if not im.kind.startswith("backend"):
            continue
        r = rec["results"].get(im.name, {})
        if r.get("status") == "ok" and ref.get("status") == "ok":
            rec["le_flashqla"][im.name] = r["peak_bytes"] <= ref["peak_bytes"]


# --------------------------------------------------------------------------------------------------
# tables


def _cell(r) -> str:
    if not r:
        return "-"
    if r.get("status") == "ok":
        return f"{r['peak_bytes'] / MB:.1f}"
    return {"n/a": "n/a", "skipped": "skip"}.get(r.get("status"), "ERR")


def table(results: list, impls, mode: str):
    shown = [im for im in impls if not im.skip_reason]
    backends = [im for im in shown if im.kind.startswith("backend")]
    headers = (["heads", "seqlens", "tokens"] + [f"{im.name} peak MB" for im in shown] +
               [f"{im.name} <= FlashQLA" for im in backends] + ["in MB", "out MB", "states MB"])
    body = []
    for rec in results:
        if rec["mode"] != mode:
            continue
        row = [f"{rec['Hqk']}/{rec['Hv']}", rec["label"].split(" ", 1)[1], rec["tokens"]]
        row += [_cell(rec["results"].get(im.name)) for im in shown]
        for im in backends:
            v = rec.get("le_flashqla", {}).get(im.name)
            row.append("-" if v is None else ("yes" if v else "NO"))
        row += [f"{rec.get(k, 0) / MB:.1f}" for k in ("in_bytes", "out_bytes", "states_bytes")]
        body.append(row)
    return headers, body


def notes(results) -> list:
    out, seen = [], set()
    for rec in results:
        for name, r in rec["results"].items():
            if r.get("status") in ("error", "n/a", "skipped"):
                key = (name, r["status"], r.get("error", ""))
                if key not in seen:
                    seen.add(key)
                    out.append(f"{name} {r['status']} on {rec['mode']} {rec['label']}: {r.get('error', '')}")
    return out


def render_markdown(meta: dict, results: list, impls) -> str:
    lines = [f"# Peak extra device memory ({meta['device']['name']}, {meta['dtype']}, K = V = 128)", "",
             meta["method"], "", "Implementations: " + ", ".join(
                 f"{i['name']} {i['version']}".strip() + (f" (skipped: {i['skipped']})" if i["skipped"] else "")
                 for i in meta["impls"]), ""]
    for mode in meta["modes"]:
        h, b = table(results, impls, mode)
        title = "forward (no grad, output_final_state=True)" if mode == "fwd" else "forward + backward"
        lines += [f"## {title}", "", markdown_table(h, b) if b else "(no rows)", ""]
    n = notes(results)
    if n:
        lines += ["Notes:", ""] + [f"- {x}" for x in n] + [""]
    return "\n".join(lines)


def write_outputs(out_dir: Path, meta: dict, results: list, impls) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "bench_memory.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": results}, indent=1, default=str))
    tmp.replace(out_dir / "bench_memory.json")
    (out_dir / "bench_memory.md").write_text(render_markdown(meta, results, impls))


# --------------------------------------------------------------------------------------------------
# main


def grid(modes, filt=None) -> list:
    """[(mode, BenchRow)] of the Step 2 grid (the CPU gets the same rows: use --filter / --max-rows)."""
    ps = presets("cuda")
    return [(mode, row) for mode in modes for row in filter_rows(ps[PRESET_OF_MODE[mode]].rows, filt)]


def tiny_grid(modes, filt=None) -> list:
    """Small rows for --device cpu --tiny (the harness check of the tests)."""
    from flashqla.cli.cases import BenchRow
    rows = [BenchRow(1, 2, (64,)), BenchRow(1, 2, (40, 70))]
    return [(m, r) for m in modes for r in filter_rows(rows, filt)]


def available_backends(names) -> list:
    import flashqla
    out = []
    for n in names:
        try:
            if flashqla.get_backend(split_cp_name(n)[0]).available()[0]:
                out.append(n)
        except Exception:
            pass
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--backends", default=None,
                    help="comma list of flashqla backends (default: triton,tilelang,cutlass where available; "
                         "on the cpu: reference)")
    ap.add_argument("--baselines", default=None,
                    help="comma list from fla, flashqla, a flashqla backend, or 'none' (default: fla,flashqla on "
                         "cuda, none on the cpu)")
    ap.add_argument("--modes", default="fwd,fwdbwd", help="comma list of fwd, fwdbwd")
    ap.add_argument("--filter", default=None,
                    help="only rows whose label (e.g. '16/32 1x32768') contains this ('|' separates alternatives)")
    ap.add_argument("--max-rows", type=int, default=None, help="at most this many rows (after --filter)")
    ap.add_argument("--out", default=None, help="directory for bench_memory.json and bench_memory.md")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                    help="q/k/v dtype (default bfloat16 on cuda, float32 on the cpu)")
    ap.add_argument("--tiny", action="store_true", help="two tiny rows instead of the grid (harness check)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="measure nothing: combine earlier bench_memory.json files (e.g. a fwd and a fwdbwd run) "
                         "into one JSON + markdown under --out")
    ap.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failures")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in PRESET_OF_MODE]
    if bad or not args.modes:
        ap.error(f"--modes takes fwd and/or fwdbwd, got {args.modes}")
    return args


class _SavedImpl:
    """An implementation as recorded in a result file's meta (what the tables need)."""

    def __init__(self, d: dict):
        self.name, self.kind, self.version, self.skip_reason = d["name"], d["kind"], d.get("version", ""), \
            d.get("skipped", "")


def merge(paths, out_dir: Path) -> int:
    """One JSON + markdown from several result files (rows in file order, implementations in first-seen
    order, meta of the first file with the union of the modes)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    meta = dict(docs[0]["meta"])
    meta["modes"] = [m for m in ("fwd", "fwdbwd") if any(m in d["meta"]["modes"] for d in docs)]
    meta["merged_from"] = [str(p) for p in paths]
    seen, impls = set(), []
    for d in docs:
        for i in d["meta"]["impls"]:
            if i["name"] not in seen:
                seen.add(i["name"])
                impls.append(i)
    meta["impls"] = impls
    rows = [r for d in docs for r in d["rows"]]
    write_outputs(out_dir, meta, rows, [_SavedImpl(i) for i in impls])
    print(f"merged {len(rows)} rows into {out_dir / 'bench_memory.json'} and {out_dir / 'bench_memory.md'}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        if not args.out:
            print("bench_memory: --merge needs --out", file=sys.stderr)
            return 2
        return merge(args.merge, Path(args.out))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_memory: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.backends is not None:
        backends = [b for b in args.backends.split(",") if b]
    else:
        backends = available_backends(DEFAULT_GPU_BACKENDS) if device.type == "cuda" else ["reference"]
    if args.baselines is None:
        baselines = ["fla", FLASHQLA_BASELINE] if device.type == "cuda" else []
    else:
        baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    impls = build_impls(backends, baselines)
    for im in impls:
        if im.skip_reason:
            print(f"bench_memory: {im.name} skipped ({im.skip_reason})", file=sys.stderr)
    rows = tiny_grid(args.modes, args.filter) if args.tiny else grid(args.modes, args.filter)
    if args.max_rows:
        rows = rows[: args.max_rows]
    import flashqla
    dev = {"type": device.type, "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    meta = {"device": dev, "dtype": str(dtype).replace("torch.", ""), "modes": args.modes,
            "torch": torch.__version__, "flashqla": flashqla.__version__, "argv": sys.argv[1:],
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "impls": [{"name": im.name, "kind": im.kind, "version": im.version, "skipped": im.skip_reason}
                      for im in impls],
            "method": ("peak MB = max_memory_allocated during the second call - memory_allocated before it "
                       "(inputs, leaves and do allocated beforehand; outputs included); MB = 1e6 bytes"
                       if device.type == "cuda" else
                       "cpu accounting: bytes of storages returned by ops during the second call (a harness "
                       "check, not a measurement)")}
    out_dir = Path(args.out) if args.out else None
    results = []
    t_start = time.perf_counter()
    for i, (mode, row) in enumerate(rows):
        rec = measure_row(row, impls, mode, dtype, device, args.verbose)
        results.append(rec)
        cells = "  ".join(f"{n} {_cell(r)}" for n, r in rec["results"].items())
        print(f"[{i + 1}/{len(rows)} {time.perf_counter() - t_start:.0f}s] {mode} {rec['label']}: {cells}",
              file=sys.stderr, flush=True)
        if out_dir:
            write_outputs(out_dir, meta, results, impls)
    for mode in args.modes:
        h, b = table(results, impls, mode)
        if b:
            print(f"\n{mode}:\n" + text_table(h, b))
    for n in notes(results):
        print(f"  - {n}")
    if out_dir:
        write_outputs(out_dir, meta, results, impls)
        print(f"\nwrote {out_dir / 'bench_memory.json'} and {out_dir / 'bench_memory.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
