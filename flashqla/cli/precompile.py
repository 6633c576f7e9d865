"""``python -m flashqla precompile``: build the tilelang backend's kernels into the disk cache, no GPU needed.

The variants are not a hand-kept list: the host code of the backend (``backends/tilelang/ops.py``
``forward`` / ``backward``) runs on ``meta`` tensors under ``_compile.record_keys()``, which makes
``_compile.get_kernel`` record the ``(kernel name, builder, key)`` it would compile instead of compiling.
Every call option the backend serves is swept (q/k/v dtype, beta dtype, initial state, final state,
fused L2 norm, varlen, gradients saved; in the backward also a final-state gradient), the recorded
keys are de-duplicated and then compiled through the same ``_compile.get_kernel`` for
``_compile.TARGET`` (sm_90a), which goes through TileLang's disk cache ``TILELANG_CACHE_DIR``.
That variable is set to ``--cache-dir`` (default ``$FLASHQLA_CACHE_DIR/tilelang``,
``FLASHQLA_CACHE_DIR`` defaulting to ``~/.cache/flashqla``) before tilelang is imported; point the
deployment / device run at the same directory to start warm.

Head counts are symbolic in the kernels (not part of any key); ``--list`` checks that every ``--heads``
configuration gives the same keys and says so.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

SUPPORTED_ARCHS = ("sm_90a",)
# Flags swept by default (each over {0, 1}); --flags fixes some of them.
FLAGS = ("h0", "ht", "l2norm", "varlen", "grad", "dht")
FLAG_HELP = {"h0": "initial state given", "ht": "final state returned", "l2norm": "fused q/k L2 norm",
             "varlen": "packed sequences (cu_seqlens)", "grad": "forward saves tensors for a backward",
             "dht": "backward gets a final-state gradient"}


def default_cache_dir() -> str:
    root = os.environ.get("FLASHQLA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flashqla")
    return os.path.join(root, "tilelang")


def add_parser(sub) -> None:
    p = sub.add_parser("precompile", help="compile the tilelang kernels into the disk cache (no GPU needed)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="sm_90a", help=f"target architecture (supported: {', '.join(SUPPORTED_ARCHS)})")
    p.add_argument("--heads", default="16/32", help="Hqk/Hv pairs, comma separated (default 16/32)")
    p.add_argument("--dtypes", default="bfloat16,float16", help="q/k/v dtypes (default bfloat16,float16)")
    p.add_argument("--beta-dtypes", default=None,
                   help="beta dtypes (default: every float dtype the backend accepts)")
    p.add_argument("--modes", default="fwd,bwd",
                   help="fwd: the forward kernels (with and without saving for a backward); "
                        "bwd: the backward kernels; decode: the decode kernels of gated_delta_rule_decode "
                        "(fp32 and bf16 pools, both layouts, both V blocks, beta in the q/k/v dtype, "
                        "state_indices given) (default fwd,bwd)")
    p.add_argument("--flags", default="",
                   help="fix some flags instead of sweeping both values, e.g. h0=0,ht=1,l2norm=0; flags: "
                        + ", ".join(f"{k} ({v})" for k, v in FLAG_HELP.items()))
    p.add_argument("--kernels", default="", help="only kernels whose name contains one of these (comma separated)")
    p.add_argument("--cache-dir", default=None,
                   help="TileLang disk cache (default $FLASHQLA_CACHE_DIR/tilelang, ~/.cache/flashqla/tilelang)")
    p.add_argument("--list", action="store_true", help="print the variants, compile nothing")
    p.add_argument("--jobs", type=int, default=1, help="compile in N processes (default 1)")
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------------------------------
# Enumeration from the backend's own code paths
# ----------------------------------------------------------------------------------------------------

def _csv(s):
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def _parse_heads(s):
    out = []
    for item in _csv(s):
        try:
            a, b = item.split("/")
            hqk, hv = int(a), int(b)
        except ValueError:
            raise ValueError(f"--heads: expected Hqk/Hv like 16/32, got {item!r}")
        if hqk <= 0 or hv <= 0 or hv % hqk:
            raise ValueError(f"--heads: Hv must be a positive multiple of Hqk, got {item!r}")
        out.append((hqk, hv))
    if not out:
        raise ValueError("--heads: nothing given")
    return out


def _parse_flags(s):
    fixed = {}
    for item in _csv(s):
        k, _, v = item.partition("=")
        k = k.strip()
        if k not in FLAGS or v.strip() not in ("0", "1"):
            raise ValueError(f"--flags: expected NAME=0|1 with NAME in {', '.join(FLAGS)}, got {item!r}")
        fixed[k] = v.strip() == "1"
    return fixed


def _sweep(fixed, names):
    axes = [[fixed[n]] if n in fixed else [False, True] for n in names]
    for vals in itertools.product(*axes):
        yield dict(zip(names, vals))


def enumerate_variants(heads, dtypes, beta_dtypes, modes, fixed):
    """[(mode, name, builder, key)] in first-seen order, de-duplicated, recorded from ``ops`` on meta
    tensors; plus {(Hqk, Hv): set of (name, key)} and {varlen: set of (name, key)} to show whether
    heads / varlen change any key."""
    import torch

    from ..backends.tilelang import _compile, ops

    dev = torch.device("meta")
    B, T, K, V = 1, 2 * ops.CHUNK, 128, 128
    seen, out, per_heads, per_varlen = set(), [], {}, {False: set(), True: set()}
    for hqk, hv in heads:
        keys_here = set()
        for dt_name, bdt_name in itertools.product(dtypes, beta_dtypes):
            dt, bdt = getattr(torch, dt_name), getattr(torch, bdt_name)
            for f in _sweep(fixed, ("h0", "ht", "l2norm", "varlen", "grad")):
                q = torch.empty(B, T, hqk, K, dtype=dt, device=dev)
                k = torch.empty(B, T, hqk, K, dtype=dt, device=dev)
                v = torch.empty(B, T, hv, V, dtype=dt, device=dev)
                g = torch.empty(B, T, hv, dtype=torch.float32, device=dev)
                beta = torch.empty(B, T, hv, dtype=bdt, device=dev)
                n = 2 if f["varlen"] else B
                h0 = torch.empty(n, hv, K, V, dtype=torch.float32, device=dev) if f["h0"] else None
                varlen = None
                if f["varlen"]:
                    from types import SimpleNamespace
                    i32 = torch.int32
                    varlen = SimpleNamespace(cu_seqlens=torch.empty(3, dtype=i32, device=dev),
                                             chunk_offsets=torch.empty(3, dtype=i32, device=dev),
                                             chunk_indices=torch.empty(2, 2, dtype=i32, device=dev),
                                             num_seqs=2, total_chunks=2, busy_seqs=2.0)
                with _compile.record_keys() as rec_fwd:
                    res = ops.forward(q, k, v, g, beta, 1.0, h0, varlen, f["ht"], f["l2norm"], f["grad"])
                recs = [("fwd", r) for r in rec_fwd] if "fwd" in modes else []
                if "bwd" in modes and f["grad"]:
                    for fb in _sweep(fixed, ("dht",)):
                        do = torch.empty(B, T, hv, V, dtype=dt, device=dev)
                        dht = torch.empty(res.meta.num_seqs, hv, K, V, dtype=torch.float32, device=dev) \
                            if fb["dht"] else None
                        with _compile.record_keys() as rec_bwd:
                            ops.backward(res.q, res.k, res.v, res.beta, res.w, res.G, res.X, res.h,
                                         res.v_new, res.meta, (B, T, hqk, hv, K, V), 1.0, f["l2norm"],
                                         f["h0"], do, dht)
                        recs += [("bwd", r) for r in rec_bwd]
                for mode, (name, builder, key) in recs:
                    keys_here.add((name, key))
                    per_varlen[f["varlen"]].add((name, key))
                    if (name, key) not in seen:
                        seen.add((name, key))
                        out.append((mode, name, builder, key))
        per_heads[(hqk, hv)] = keys_here
    if "decode" in modes:
        for rec in decode_variants(dtypes, fixed):
            if (rec[0], rec[2]) not in seen:
                seen.add((rec[0], rec[2]))
                out.append(("decode",) + rec)
    order = {"fwd": 0, "bwd": 1, "decode": 2}
    out.sort(key=lambda r: (order[r[0]], r[1], repr(r[3])))
    return out, per_heads, per_varlen


def decode_variants(dtypes, fixed):
    """[(name, builder, key)] of the decode kernel: K = V = 128, fp32 g, beta in the q/k/v dtype, indices
    given; both pool dtypes (fp32, bf16), both layouts, the two V blocks the call-time choice makes, and
    the L2 norm both ways unless fixed with --flags l2norm=0|1.  Head counts are in no key."""
    import torch

    from ..backends.tilelang import _compile, decode_sm90

    l2s = [fixed["l2norm"]] if "l2norm" in fixed else [False, True]
    with _compile.record_keys() as rec:
        for dt_name in dtypes:
            dt = getattr(torch, dt_name)
            for st, vk, l2, rows in itertools.product((torch.float32, torch.bfloat16), (False, True), l2s,
                                                      (1, 1 << 20)):
                bv = decode_sm90.block_v(128, 128, rows)
                decode_sm90.decode_kernel(dt, torch.float32, dt, st, 128, 128, bv, vk, l2, True)
    return rec   # enumerate_variants drops repeats (its ``seen`` set)


# ----------------------------------------------------------------------------------------------------
# Compiling
# ----------------------------------------------------------------------------------------------------

def _dir_stats(path):
    n = size = 0
    for root, _, files in os.walk(path):
        for fn in files:
            try:
                size += os.path.getsize(os.path.join(root, fn))
                n += 1
            except OSError:
                pass
    return n, size


def _compile_one(name, builder, key):
    """Compile one variant (in this or a worker process); its seconds."""
    from .._build_notice import quiet
    from ..backends.tilelang import _compile
    t0 = time.perf_counter()
    with quiet():       # this command prints a line per kernel itself
        _compile.get_kernel(name, builder, key)
    return time.perf_counter() - t0


def _fmt_size(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def _bar(total):
    if not sys.stderr.isatty():  # a log file: one plain line per kernel, no redraws
        return None
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc="precompile", file=sys.stderr, dynamic_ncols=True)
    except Exception:
        return None


def run(args) -> int:
    if args.arch not in SUPPORTED_ARCHS:
        print(f"precompile: --arch {args.arch} is not supported; supported: {', '.join(SUPPORTED_ARCHS)} "
              f"(the tilelang kernels are built for Hopper with wgmma/TMA)", file=sys.stderr)
        return 2
    try:
        heads = _parse_heads(args.heads)
        fixed = _parse_flags(args.flags)
        dtypes = _csv(args.dtypes)
        modes = _csv(args.modes)
        from ..backends.tilelang import _FLOATS, _SUPPORTED_DTYPES
        beta_dtypes = _csv(args.beta_dtypes) if args.beta_dtypes else list(_FLOATS)
        for d in dtypes:
            if d not in _SUPPORTED_DTYPES:
                raise ValueError(f"--dtypes: {d!r} not served by the tilelang backend "
                                 f"(supported: {', '.join(_SUPPORTED_DTYPES)})")
        for d in beta_dtypes:
            if d not in _FLOATS:
                raise ValueError(f"--beta-dtypes: {d!r} not a float dtype the backend accepts "
                                 f"({', '.join(_FLOATS)})")
        for m in modes:
            if m not in ("fwd", "bwd", "decode"):
                raise ValueError(f"--modes: expected some of fwd, bwd, decode, got {m!r}")
        if not dtypes or not modes:
            raise ValueError("--dtypes and --modes must not be empty")
        if args.jobs < 1:
            raise ValueError("--jobs must be >= 1")
    except ValueError as exc:
        print(f"precompile: {exc}", file=sys.stderr)
        return 2

    cache_dir = os.path.abspath(os.path.expanduser(args.cache_dir or default_cache_dir()))
    if "tilelang" in sys.modules and os.environ.get("TILELANG_CACHE_DIR") != cache_dir:
        print(f"precompile: warning: tilelang was imported before the cache dir could be set; it may "
              f"use {os.environ.get('TILELANG_CACHE_DIR') or 'its default'} instead of {cache_dir}",
              file=sys.stderr)
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    try:
        import tilelang  # noqa: F401
        tl_ver = getattr(tilelang, "__version__", "?")
    except Exception as exc:
        print(f"precompile: tilelang is not importable ({type(exc).__name__}: {exc}); "
              f"install it with: pip install tilelang==0.1.15", file=sys.stderr)
        return 2

    variants, per_heads, per_varlen = enumerate_variants(heads, dtypes, beta_dtypes, modes, fixed)
    sel = _csv(args.kernels)
    if sel:
        variants = [v for v in variants if any(s in v[1] for s in sel)]
        keep = {(v[1], v[3]) for v in variants}
        per_heads = {h: s & keep for h, s in per_heads.items()}
        per_varlen = {f: s & keep for f, s in per_varlen.items()}
    head_sets = list(per_heads.values())
    heads_in_key = any(s != head_sets[0] for s in head_sets[1:])
    heads_txt = ", ".join(f"{a}/{b}" for a, b in heads)
    heads_note = (f"heads ({heads_txt}): part of a key (different --heads give different variants)"
                  if heads_in_key else
                  f"heads ({heads_txt}): not part of any key (head counts are symbolic); every --heads "
                  f"configuration gives the same {len(head_sets[0])} variants")
    swept = [f for f in FLAGS if f not in fixed]
    flags_note = ("flags swept: " + (", ".join(swept) or "none")
                  + ("; fixed: " + ", ".join(f"{k}={int(v)}" for k, v in fixed.items()) if fixed else ""))

    from ..backends.tilelang import _compile
    if args.list:
        print(f"tilelang {tl_ver}, target {_compile.TARGET}, cache dir {cache_dir}")
        print(heads_note)
        if "varlen" not in fixed:
            flags_note += ("; varlen: " + ("part of a key" if per_varlen[False] != per_varlen[True]
                                           else "not part of any key (same kernels with and without)"))
        print(flags_note + "; g is always cast to float32 and lengths are symbolic")
        for i, (mode, name, _, key) in enumerate(variants, 1):
            print(f"{i:4d}  {mode}  {name}  key={key!r}")
        print(f"{len(variants)} variants")
        return 0

    os.makedirs(cache_dir, exist_ok=True)
    print(f"precompile: {len(variants)} tilelang variants for {args.arch} into {cache_dir} "
          f"(tilelang {tl_ver}, jobs {args.jobs}); {heads_note}", file=sys.stderr)
    bar = _bar(len(variants))

    def line(i, mode, name, key, secs, extra=""):
        text = f"[{i}/{len(variants)}] {mode} {name} {key!r}: {secs:.2f} s{extra}"
        if bar is not None:
            bar.write(text, file=sys.stderr)
            bar.update(1)
        else:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    times, failed = [], []
    t_all = time.perf_counter()
    if args.jobs == 1:
        for i, (mode, name, builder, key) in enumerate(variants, 1):
            n0 = _dir_stats(cache_dir)[0]
            try:
                secs = _compile_one(name, builder, key)
            except Exception as exc:
                failed.append((name, key, f"{type(exc).__name__}: {exc}"))
                line(i, mode, name, key, 0.0, f"  FAILED ({type(exc).__name__}: {str(exc)[:200]})")
                continue
            times.append(secs)
            line(i, mode, name, key, secs, "  (new)" if _dir_stats(cache_dir)[0] > n0 else "  (cached)")
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed
        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futs = {pool.submit(_compile_one, name, builder, key): (mode, name, key)
                    for mode, name, builder, key in variants}
            for i, fut in enumerate(as_completed(futs), 1):
                mode, name, key = futs[fut]
                try:
                    secs = fut.result()
                except Exception as exc:
                    failed.append((name, key, f"{type(exc).__name__}: {exc}"))
                    line(i, mode, name, key, 0.0, f"  FAILED ({type(exc).__name__}: {str(exc)[:200]})")
                    continue
                times.append(secs)
                line(i, mode, name, key, secs)
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t_all
    nfiles, size = _dir_stats(cache_dir)
    print(f"precompiled {len(times)}/{len(variants)} variants: compile {sum(times):.2f} s total "
          f"({wall:.2f} s wall); cache dir {cache_dir}: {nfiles} files, {_fmt_size(size)}")
    for name, key, why in failed:
        print(f"FAILED {name} {key!r}: {why}", file=sys.stderr)
    return 1 if failed else 0
