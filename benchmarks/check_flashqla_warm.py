#!/usr/bin/env python
"""Device-side check (and, with --rekey, repair) of FlashQLA's kernels in the TileLang cache.

Check: runs the bench's FlashQLA call (``flashqla/cli/bench.py`` baseline ``flashqla``: packed int32
``cu_seqlens``, bf16 q/k/v/beta, fp32 g, ``scale=K**-0.5``, ``output_final_state=True`` under ``no_grad``;
``--with-backward`` adds the forward+backward rows) once per row and head configuration, and prints per head
configuration the first-call seconds, how many kernels TileLang loaded or built and how many *new* cache
entries appeared (a compile: the cache did not hold that key).  Exit status 0 when none appeared.

--rekey (before the check; compiles nothing): shadow-runs the same calls on meta tensors to list FlashQLA's
kernel requests (as ``warm_flashqla_cache.py`` does on the CPU), computes the key TileLang computes *here*
for each, and when that key is absent but the warm-up manifest (``flash_qla_warm.json`` at the top of
``$TILELANG_CACHE_DIR``) holds an entry built from a TIR script with the same sha256, copies that entry
under the key computed here.  Same TIR script = same kernel; only key inputs outside the TIR can differ
then (target string, pass configs, ...), and the line ``key inputs that differ`` says which, with both
values.  A request whose TIR differs from every warmed one is left alone (it compiles on first use).

Usage on the device (after ``source .gpu/setup.sh``, which points TILELANG_CACHE_DIR at /tmp/kcache/tilelang):

    python benchmarks/check_flashqla_warm.py --rekey                  # repair, then check every qwen35-fwd row
    python benchmarks/check_flashqla_warm.py --rekey --no-calls        # repair only (a few seconds)
    python benchmarks/check_flashqla_warm.py --heads 16/32 --seqs '8192x4' --dump-keys $OUT/keys
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from warm_flashqla_cache import (DEFAULT_HEADS, MANIFEST, capturing_keys, key_of,  # noqa: E402
                                 parse_heads, parse_seqs, preset_seqs, record_requests, row_label)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default=DEFAULT_HEADS)
    p.add_argument("--seqs", default=None, help="forward rows, e.g. '32768;28672+4096;8192x4' (default qwen35-fwd)")
    p.add_argument("--with-backward", action="store_true", help="also the qwen35-bwd forward+backward rows")
    p.add_argument("--bwd-seqs", default=None)
    p.add_argument("--manifest", default=None, help="warm-up manifest (default $TILELANG_CACHE_DIR/" + MANIFEST + ")")
    p.add_argument("--rekey", action="store_true",
                   help="copy warmed entries whose TIR matches under the key computed here (no compile)")
    p.add_argument("--no-calls", action="store_true", help="skip the FlashQLA calls (with --rekey: repair only)")
    p.add_argument("--dump-keys", default=None,
                   help="directory for the key inputs and TIR script of every request (--rekey) / key (calls)")
    return p.parse_args(argv)


def _roundtrip(x):
    return json.loads(json.dumps(x))


def rekey(flash_qla, heads, rows, manifest, root, dump_dir=None):
    """Alias warmed entries to the keys computed here; returns Counter of outcomes."""
    import torch
    t0 = time.perf_counter()
    uniq, _, _ = record_requests(flash_qla, heads, rows, torch.bfloat16)
    by_sha = {}
    for k in (manifest or {}).get("kernels", []):
        if k.get("func_sha256") and k.get("key"):
            by_sha.setdefault(k["func_sha256"], k)
    present = set(os.listdir(root)) if os.path.isdir(root) else set()
    out, differ, examples = Counter(), Counter(), {}
    for it in uniq.values():
        key, inputs = key_of(it["impl"], it["args"], it["kwargs"])
        inputs = _roundtrip(inputs)
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            with open(os.path.join(dump_dir, f"{key}.json"), "w") as f:
                json.dump(dict(inputs, key=key, desc=it["desc"]), f, indent=1)
        src = by_sha.get(inputs["func_sha256"])
        if src is not None:
            for field, val in inputs.items():
                if src.get("key_inputs") and src["key_inputs"].get(field) != val:
                    differ[field] += 1
                    examples.setdefault(field, (val, src["key_inputs"].get(field)))
        if key in present:
            out["hit"] += 1
            continue
        if src is None or src["key"] not in present:
            out["missing"] += 1
            why = "no warmed entry with this TIR" if src is None else f"warmed entry {src['key'][:16]} absent"
            print(f"  rekey: missing {it['desc']} key={key[:16]} ({why})")
            continue
        tmp = os.path.join(root, f".rekey-{key}-{os.getpid()}")
        shutil.copytree(os.path.join(root, src["key"]), tmp)
        try:
            os.rename(tmp, os.path.join(root, key))
            present.add(key)
            out["aliased"] += 1
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            out["hit"] += 1  # appeared meanwhile
    print(f"rekey: {len(uniq)} FlashQLA kernels over {len(heads)} head configs x {len(rows)} rows: "
          f"{out['hit']} already under the key computed here, {out['aliased']} aliased from the warm-up "
          f"(same TIR sha256), {out['missing']} missing; {time.perf_counter() - t0:.1f} s")
    if differ:
        print("rekey: key inputs that differ from the warm-up (here vs warm-up): "
              + "; ".join(f"{f} x{n}: {examples[f][0]!r} vs {examples[f][1]!r}" for f, n in differ.items()))
    return out


class CallLog:
    """Wraps KernelCache.cached to record each kernel TileLang loads or builds and whether a new entry appeared."""

    def __init__(self):
        self.events = []

    def install(self):
        from tilelang.cache.kernel_cache import KernelCache
        from tilelang.utils.language import get_prim_func_name
        orig, log = KernelCache.cached, self

        def cached(self, func=None, out_idx=None, *args, **kwargs):
            root = KernelCache._get_cache_root()
            before = set(os.listdir(root)) if os.path.isdir(root) else set()
            t = time.perf_counter()
            kern = orig(self, func, out_idx, *args, **kwargs)
            key = getattr(kern, "_tilelang_cache_key", None)
            log.events.append(dict(key=key, kernel=get_prim_func_name(func, "?"), secs=time.perf_counter() - t,
                                   new=bool(key) and key not in before))
            return kern

        KernelCache.cached = cached


def run_calls(flash_qla, heads, rows, manifest_keys, dump_dir=None):
    import torch
    log = CallLog()
    log.install()
    dev = torch.device("cuda")
    K = V = 128
    fn = flash_qla.chunk_gated_delta_rule
    total_new = 0
    ctx = capturing_keys() if dump_dir else None
    seen = ctx.__enter__() if ctx else {}
    try:
        for hqk, hv in heads:
            ev0 = len(log.events)
            first = []
            for mode, seqlens in rows:
                T = int(sum(seqlens))
                gen = torch.Generator(device=dev).manual_seed(0)
                cu = torch.tensor([0] + list(itertools.accumulate(seqlens)), dtype=torch.int32, device=dev)
                q = torch.nn.functional.normalize(torch.randn(1, T, hqk, K, device=dev, generator=gen), dim=-1)
                k = torch.nn.functional.normalize(torch.randn(1, T, hqk, K, device=dev, generator=gen), dim=-1)
                q, k = q.bfloat16(), k.bfloat16()
                v = torch.randn(1, T, hv, V, device=dev, generator=gen).bfloat16()
                g = torch.nn.functional.logsigmoid(torch.randn(1, T, hv, device=dev, generator=gen)).float()
                beta = torch.sigmoid(torch.randn(1, T, hv, device=dev, generator=gen)).bfloat16()
                torch.cuda.synchronize()
                t = time.perf_counter()
                if mode == "fwd":
                    with torch.no_grad():
                        fn(q=q, k=k, v=v, g=g, beta=beta, scale=K ** -0.5, initial_state=None,
                           output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=False)
                else:
                    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
                    o, _ = fn(q=leaves[0], k=leaves[1], v=leaves[2], g=leaves[3], beta=leaves[4],
                              scale=K ** -0.5, initial_state=None, output_final_state=False, cu_seqlens=cu,
                              use_qk_l2norm_in_kernel=False)
                    torch.autograd.grad(o, leaves, torch.randn_like(o), allow_unused=True)
                torch.cuda.synchronize()
                first.append((mode, seqlens, time.perf_counter() - t))
            evs = log.events[ev0:]
            new = [e for e in evs if e["new"]]
            total_new += len(new)
            unknown = [e for e in evs if manifest_keys is not None and e["key"] not in manifest_keys]
            rows_txt = ", ".join(f"{'' if m == 'fwd' else 'fwdbwd '}{row_label(s)} {sec:.2f}s" for m, s, sec in first)
            print(f"{hqk}/{hv}: first calls {sum(x[2] for x in first):.2f} s ({rows_txt}); kernels loaded/built "
                  f"{len(evs)} in {sum(e['secs'] for e in evs):.2f} s; NEW cache entries {len(new)}"
                  + (f"; keys not in the manifest {len(unknown)}" if manifest_keys is not None else ""), flush=True)
            for e in new:
                print(f"    new: {e['kernel']} {e['key']} ({e['secs']:.1f} s)")
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
            os.makedirs(dump_dir, exist_ok=True)
            for key, inputs in seen.items():
                with open(os.path.join(dump_dir, f"call-{key}.json"), "w") as f:
                    json.dump(dict(inputs, key=key), f, indent=1)
    return total_new


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("check: no CUDA device", file=sys.stderr)
        return 2
    cache_dir = os.environ.get("TILELANG_CACHE_DIR") or os.path.expanduser("~/.tilelang/cache")
    mpath = args.manifest or os.path.join(cache_dir, MANIFEST)
    manifest = json.load(open(mpath)) if os.path.exists(mpath) else None
    manifest_keys = {k["key"] for k in manifest.get("kernels", []) if k.get("key")} if manifest else None
    keyenv = {k: v for k, v in os.environ.items() if k.startswith(("TILELANG", "TVM"))}
    t0 = time.perf_counter()
    import tilelang
    from tilelang.backend.target import determine_target
    import flash_qla
    t_imp = time.perf_counter() - t0
    from tilelang.cache.kernel_cache import KernelCache
    root = KernelCache._get_cache_root()
    n_before = len(os.listdir(root)) if os.path.isdir(root) else 0
    print(f"check: {torch.cuda.get_device_name()} (SMs {torch.cuda.get_device_properties(0).multi_processor_count}), "
          f"tilelang {tilelang.__version__}, flash_qla {getattr(flash_qla, '__version__', '?')}, "
          f"auto target {determine_target('auto', return_object=True)}; cache {root} ({n_before} entries); "
          f"manifest {mpath if manifest else 'none'}"
          f"{' (%d keys)' % len(manifest_keys) if manifest else ''}; TILELANG*/TVM* env {keyenv or 'none'}; "
          f"imports {t_imp:.1f} s", flush=True)

    heads = parse_heads(args.heads)
    fwd_default, bwd_default = preset_seqs()
    rows = [("fwd", s) for s in (parse_seqs(args.seqs) if args.seqs else fwd_default)]
    if args.with_backward:
        rows += [("fwdbwd", s) for s in (parse_seqs(args.bwd_seqs) if args.bwd_seqs else bwd_default)]

    if args.rekey:
        if manifest is None:
            print(f"rekey: no manifest at {mpath}; nothing to alias", file=sys.stderr)
        else:
            rekey(flash_qla, heads, rows, manifest, root, args.dump_keys)
    if args.no_calls:
        return 0
    total_new = run_calls(flash_qla, heads, rows, manifest_keys, args.dump_keys)
    n_after = len(os.listdir(root)) if os.path.isdir(root) else 0
    verdict = "PASS (every FlashQLA kernel came from the cache)" if total_new == 0 else \
        f"FAIL ({total_new} kernels compiled here)"
    print(f"check: cache entries {n_before} -> {n_after}; {verdict}")
    return 0 if total_new == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
