#!/usr/bin/env python
"""Fill a TileLang disk cache with FlashQLA's kernels on a machine without a GPU.

FlashQLA (the ``flash_qla`` package, a TileLang library) builds its kernels with ``@tilelang.jit`` on first
use; on a fresh H200 that costs minutes per head configuration, because the head counts (``H``, ``Hg``),
the V tile (``block_DV``, picked from ``batch * H`` against 70 % of the SM count) and the CP switches
(``is_cp``, chosen by FlashQLA's calibrated auto-CP model from the sequence lengths and the SM count) are
Python parameters of the kernel builders, i.e. part of each kernel; token counts are ``T.dynamic``.
So the set of kernels depends on the head configuration *and* on the rows of the bench.

This script does not copy or re-derive FlashQLA's dispatch logic.  It imports FlashQLA, makes it believe it
runs on an H200 (compute capability 9.0, ``--sm-count`` SMs), and runs its real host code, the same call
the bench makes (``flashqla/cli/bench.py``: ``chunk_gated_delta_rule(q, k, v, g, beta, scale=K**-0.5,
initial_state=None, output_final_state=True, cu_seqlens=<int32>, use_qk_l2norm_in_kernel=False)`` under
``no_grad`` for forward rows; ``output_final_state=False`` plus ``autograd.grad`` for forward+backward rows)
on ``meta`` tensors, with ``tilelang.jit``'s call replaced by a recorder.  Every (kernel builder, arguments)
pair FlashQLA would jit is recorded, de-duplicated, and then compiled through the very same
``JITImpl`` objects (``get_tir`` + ``tilelang.compile`` with the decorator's options, as
``JITImpl.compile`` does), with TileLang's target left at ``"auto"`` and its CUDA target detector
answering what it answers on an H200: ``Target({"kind": "cuda", "arch": "sm_90a"})``
(``tilelang.cuda.target._cuda_target_from_arch("sm_" + nvcc.get_target_arch((9, 0)))``).

TileLang 0.1.15's disk-cache key (``tilelang/cache/kernel_cache.py``, ``KernelCache._generate_key``) is
sha256 over: the PrimFunc's TIR script (``func.script(show_meta=True)``), out_idx, ``str(target)``,
``str(target_host)``, the execution backend name ("tvm_ffi": the first CUDA backend, always available),
the normalised pass configs, compile flags, ``tilelang.__version__`` and ``platform.machine()`` (plus a
hash of libtilelang.so only when ``TILELANG_KERNEL_CACHE_USE_LIB_STAMP=1``, off by default).  Nothing in
it reads the GPU, the driver or the Python version, so a key computed here equals the key the H200
computes for the same call.  The entries go to ``$TILELANG_CACHE_DIR/0.1.15/linux-x86_64/kernels/<key>``
(and the nvcc outputs to ``.../0.1.15/cuda-binaries``).

A manifest (``flash_qla_warm.json``) with every key, its kernel, parameters and the rows that use it is
written at the top of ``--cache-dir``; ``benchmarks/check_flashqla_warm.py`` reads it on the device.

Usage (CPU machine, repository root; flash_qla from the peers bundle unpacked at /tmp/peers):

    python benchmarks/warm_flashqla_cache.py --cache-dir /tmp/kc/tilelang            # qwen35-fwd rows
    python benchmarks/warm_flashqla_cache.py --cache-dir /tmp/kc/tilelang --with-backward
    python benchmarks/warm_flashqla_cache.py --list                                   # the kernel set only

``--cache-dir`` is the directory the device run uses as ``TILELANG_CACHE_DIR`` (``/tmp/kcache/tilelang``
there, packed into ``.gpu/kcache.tar.xz``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MANIFEST = "flash_qla_warm.json"
DEFAULT_HEADS = "2/8,4/16,8/32,16/32,16/64"
# Rows of the bench presets (flashqla/cli/cases.py), repeated here only as a fallback when the flashqla
# package is not importable.
_FWD_SEQS = [(32768,), (8192,), (28672, 4096), (8192,) * 4, (1024,) * 8]
_BWD_SEQS = [(8192,), (2048,) * 4, (32768,), (8192,) * 4]
# Environment variables that change TileLang's key or target resolution; the device run sets none.
_KEY_ENV = ("TILELANG_DEFAULT_TARGET", "TILELANG_DEFAULT_EXECUTION_BACKEND", "TILELANG_KERNEL_CACHE_USE_LIB_STAMP",
            "TILELANG_LAYOUT_COST_MODEL", "TILELANG_DISABLE_CACHE")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", default=None,
                   help="TileLang cache dir to fill (default $TILELANG_CACHE_DIR, else ~/.tilelang/cache)")
    p.add_argument("--heads", default=DEFAULT_HEADS, help=f"Hqk/Hv pairs (default {DEFAULT_HEADS})")
    p.add_argument("--seqs", default=None,
                   help="forward rows as packed sequence lengths, ';'-separated, e.g. '32768;28672+4096;8192x4' "
                        "(default: the qwen35-fwd preset rows)")
    p.add_argument("--with-backward", action="store_true",
                   help="also the forward+backward rows of the qwen35-bwd preset (training-mode kernels)")
    p.add_argument("--bwd-seqs", default=None, help="forward+backward rows, same syntax as --seqs "
                                                    "(default: the qwen35-bwd preset rows)")
    p.add_argument("--bwd-preset", default=None,
                   help="forward+backward rows from this bench preset instead (e.g. flashqla-bwd, whose random "
                        "splits choose other FlashQLA variants than the qwen35-bwd rows)")
    p.add_argument("--max-walks", type=int, default=None,
                   help="only (heads, row) pairs with Hv x sequences at most this, as `flashqla bench --max-walks` "
                        "keeps (e.g. 40: issue #8's rows)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="q/k/v and beta dtype")
    p.add_argument("--sm-count", type=int, default=132, help="SM count FlashQLA sees (H200: 132)")
    p.add_argument("--flash-qla-path", default=None,
                   help="directory holding the flash_qla package when it is not installed (default: try the "
                        "import, then /tmp/peers, then .gpu/peers.tar.xz unpacked to /tmp/flashqla_peers)")
    p.add_argument("--jobs", type=int, default=max(1, min(16, os.cpu_count() or 1)),
                   help="compile threads (default min(16, CPUs))")
    p.add_argument("--list", action="store_true", help="print the kernel set and keys, compile nothing")
    p.add_argument("--native", action="store_true",
                   help="on a GPU machine: use the real device (no H200 pretence); compiles with the keys that "
                        "machine computes (default when a CUDA device is present)")
    p.add_argument("--no-xz", action="store_true", help="skip measuring the xz size of the cache dir")
    return p.parse_args(argv)


def parse_heads(s):
    out = []
    for item in (x.strip() for x in s.split(",") if x.strip()):
        a, _, b = item.partition("/")
        hqk, hv = int(a), int(b)
        if hqk <= 0 or hv % hqk:
            raise SystemExit(f"--heads: Hv must be a positive multiple of Hqk, got {item!r}")
        out.append((hqk, hv))
    return out


def parse_seqs(s):
    rows = []
    for item in (x.strip() for x in s.split(";") if x.strip()):
        lens = []
        for part in item.split("+"):
            n, _, rep = part.partition("x")
            lens += [int(n)] * (int(rep) if rep else 1)
        rows.append(tuple(lens))
    return rows


def preset_rows(name):
    """The distinct packed sequence lengths of one bench preset (flashqla.cli.cases)."""
    sys.path.insert(0, ROOT)
    from flashqla.cli.cases import presets
    ps = presets("cuda")
    if name not in ps:
        raise SystemExit(f"--bwd-preset: unknown preset {name!r} (one of {sorted(ps)})")
    return sorted({tuple(r.seqlens) for r in ps[name].rows})


def preset_seqs():
    """(fwd rows, fwdbwd rows) of the qwen35 presets, from flashqla.cli.cases when importable."""
    try:
        sys.path.insert(0, ROOT)
        from flashqla.cli.cases import QWEN35_FWD_SEQS, presets
        bwd = []
        for row in presets("cuda")["qwen35-bwd"].rows:
            if tuple(row.seqlens) not in bwd:
                bwd.append(tuple(row.seqlens))
        return [tuple(s) for s in QWEN35_FWD_SEQS], bwd
    except Exception:
        return list(_FWD_SEQS), list(_BWD_SEQS)


def row_label(seqlens):
    s = list(seqlens)
    if len(set(s)) == 1:
        return f"{len(s)}x{s[0]}"
    return "+".join(map(str, s))


# ----------------------------------------------------------------------------------------------------
# Making FlashQLA and TileLang see an H200
# ----------------------------------------------------------------------------------------------------

class _FakeProps:
    """What FlashQLA reads from torch.cuda.get_device_properties() at import (multi_processor_count)."""

    def __init__(self, sm_count):
        self.multi_processor_count = sm_count
        self.name = "NVIDIA H200"
        self.major, self.minor = 9, 0
        self.total_memory = 143771140096


def h200_target():
    """The object TileLang's CUDA detector returns on an H200 (capability (9, 0)), built by its own code."""
    from tilelang.contrib import nvcc
    import tilelang.cuda.target as cuda_target
    return cuda_target._cuda_target_from_arch("sm_" + nvcc.get_target_arch((9, 0)))


def pretend_h200(sm_count):
    """Patch (for this process) TileLang's target auto-detection and compute-version query, then import
    flash_qla with torch.cuda.get_device_properties answering ``sm_count`` SMs.  Returns the target."""
    import tilelang  # noqa: F401  (puts its bundled tvm on the path)
    from tvm.target import Target
    from tilelang.contrib import nvcc
    from tilelang.backend.target import determine_target, register_target_detector

    target = h200_target()
    register_target_detector("cuda", lambda: target, override=True)
    orig = nvcc.get_target_compute_version

    def get_target_compute_version(target=None):
        if target is None and Target.current(allow_none=True) is None:
            return "9.0"  # flash_qla picks its Hopper kernels and auto-CP coefficients (sm90) from this
        return orig(target)

    nvcc.get_target_compute_version = get_target_compute_version
    got = determine_target("auto", return_object=True)
    if str(got) != str(target):
        raise SystemExit(f"warm: TileLang's 'auto' target resolves to {got}, not {target}; another detector "
                         f"answered first")
    return target


def import_flash_qla(path, sm_count=None):
    """Import flash_qla (installed, or from ``path`` / /tmp/peers / the peers bundle); with ``sm_count``
    torch.cuda.get_device_properties answers that many SMs while it imports (no GPU here)."""
    import torch
    props = torch.cuda.get_device_properties
    if sm_count is not None:
        torch.cuda.get_device_properties = lambda *a, **k: _FakeProps(sm_count)
    try:
        candidates = [path] if path else [None, "/tmp/peers", "/tmp/flashqla_peers"]
        last = None
        for cand in candidates:
            if cand is None:
                try:
                    import flash_qla
                    return flash_qla
                except ImportError as exc:
                    last = exc
                    continue
            if cand == "/tmp/flashqla_peers" and not os.path.isdir(os.path.join(cand, "flash_qla")):
                bundle = os.path.join(ROOT, ".gpu", "peers.tar.xz")
                if not os.path.exists(bundle):
                    continue
                os.makedirs(cand, exist_ok=True)
                subprocess.run(["tar", "xJf", bundle, "-C", cand], check=True)
            if os.path.isdir(os.path.join(cand, "flash_qla")):
                sys.path.insert(0, cand)
                import flash_qla
                return flash_qla
        raise SystemExit(f"warm: flash_qla is not importable ({last}); pass --flash-qla-path DIR")
    finally:
        torch.cuda.get_device_properties = props


# ----------------------------------------------------------------------------------------------------
# Recording the kernels FlashQLA's host code asks for
# ----------------------------------------------------------------------------------------------------

def _noop(*args, **kwargs):
    return None


@contextlib.contextmanager
def recording(flash_qla):
    """Within the block every ``tilelang.jit`` kernel request is appended to the yielded list as
    (JITImpl, args, sorted kwargs) and answered by a launcher that does nothing; FlashQLA's CUDA-only
    helpers (tensor_cache's CUDA-graph checks, input_guard's device switch, the dense-input cu_seqlens
    factory) are made CPU-safe."""
    import torch
    from tilelang.jit import JITImpl
    import importlib
    chunk = importlib.import_module("flash_qla.ops.gated_delta_rule.chunk")

    rec = []

    def fake_call(self, *args, **kwargs):
        rec.append((self, args, tuple(sorted(kwargs.items()))))
        return _noop

    def create_cu_seqlens(batch_size, num_tokens, device_idx):
        return torch.arange(batch_size + 1, dtype=torch.int32) * num_tokens

    saved = [(JITImpl, "__call__", JITImpl.__call__),
             (torch.cuda, "is_available", torch.cuda.is_available),
             (torch.cuda, "is_current_stream_capturing", torch.cuda.is_current_stream_capturing),
             (torch.cuda, "device", torch.cuda.device),
             (chunk, "_create_cu_seqlens", chunk._create_cu_seqlens)]
    JITImpl.__call__ = fake_call
    torch.cuda.is_available = lambda: True
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.device = lambda idx=None: contextlib.nullcontext()
    chunk._create_cu_seqlens = create_cu_seqlens
    try:
        yield rec
    finally:
        for obj, name, val in saved:
            setattr(obj, name, val)


def shadow_row(flash_qla, hqk, hv, seqlens, mode, dtype):
    """Run the bench's FlashQLA call for one row on meta tensors; returns the recorded kernel requests."""
    import torch
    dev = torch.device("meta")
    T = int(sum(seqlens))
    K = V = 128
    cu = torch.tensor([0] + list(itertools.accumulate(seqlens)), dtype=torch.int32)  # host values drive CP
    q = torch.empty(1, T, hqk, K, dtype=dtype, device=dev)
    k = torch.empty(1, T, hqk, K, dtype=dtype, device=dev)
    v = torch.empty(1, T, hv, V, dtype=dtype, device=dev)
    g = torch.empty(1, T, hv, dtype=torch.float32, device=dev)
    beta = torch.empty(1, T, hv, dtype=dtype, device=dev)
    fn = flash_qla.chunk_gated_delta_rule
    with recording(flash_qla) as rec:
        if mode == "fwd":
            with torch.no_grad():
                fn(q=q, k=k, v=v, g=g, beta=beta, scale=K ** -0.5, initial_state=None, output_final_state=True,
                   cu_seqlens=cu, use_qk_l2norm_in_kernel=False)
        else:
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta)]
            with torch.enable_grad():
                o, _ = fn(q=leaves[0], k=leaves[1], v=leaves[2], g=leaves[3], beta=leaves[4], scale=K ** -0.5,
                          initial_state=None, output_final_state=False, cu_seqlens=cu,
                          use_qk_l2norm_in_kernel=False)
                torch.autograd.grad(o, leaves, torch.empty_like(o), allow_unused=True)
    return rec


def kernel_name(impl):
    f = getattr(impl.func, "orig_func", None) or impl.func
    return getattr(f, "__name__", repr(f))


_SHOWN = ("H", "Hg", "num_heads", "block_DV", "is_varlen", "is_cp", "use_initial_state", "store_final_state",
          "store_h", "use_dht", "reverse", "zero_last_chunk", "use_raw_h0", "transpose_m", "seqlen_dtype")


def describe(impl, args, kwargs):
    """Short 'name(H=.., Hg=.., ...)' from the builder signature (positional args bound by name)."""
    try:
        bound = impl.signature.bind_partial(*args, **dict(kwargs)).arguments
    except TypeError:
        bound = dict(kwargs)
    parts = [f"{k}={bound[k]}".replace("torch.", "") for k in _SHOWN if k in bound]
    return f"{kernel_name(impl)}({', '.join(parts)})"


def jsonable(x):
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    return str(x).replace("torch.", "")


# ----------------------------------------------------------------------------------------------------
# TileLang cache keys and their inputs
# ----------------------------------------------------------------------------------------------------

class KeyOnly(Exception):
    """Raised from inside TileLang's key computation by ``capturing_keys(key_only=True)``."""

    def __init__(self, key, inputs):
        super().__init__(key)
        self.key, self.inputs = key, inputs


def _jsonable_tree(x):
    if isinstance(x, dict):
        return {str(k): _jsonable_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable_tree(v) for v in x]
    return jsonable(x)


@contextlib.contextmanager
def capturing_keys(key_only=False):
    """Wrap ``KernelCache._generate_key`` (the disk-cache key of TileLang 0.1.15): yields a dict
    key -> the key's inputs (sha256 of the TIR script, target and host strings, execution backend, pass
    configs, compile flags, out_idx, base key).  With ``key_only`` the wrapper raises ``KeyOnly`` right
    after computing the key, so ``tilelang.compile`` neither compiles nor loads anything."""
    import hashlib
    from tilelang.cache.kernel_cache import KernelCache
    orig = KernelCache._generate_key
    seen = {}

    def _generate_key(self, func, out_idx, execution_backend="tvm_ffi", args=None, target="auto",
                      target_host=None, pass_configs=None, compile_flags=None):
        key = orig(self, func, out_idx, execution_backend=execution_backend, args=args, target=target,
                   target_host=target_host, pass_configs=pass_configs, compile_flags=compile_flags)
        inputs = {"func_sha256": hashlib.sha256(func.script(show_meta=True).encode()).hexdigest(),
                  "target": str(target), "target_host": str(target_host) if target_host else None,
                  "execution_backend": execution_backend, "pass_configs": _jsonable_tree(pass_configs),
                  "compile_flags": _jsonable_tree(compile_flags), "out_idx": repr(out_idx),
                  "args_repr": [repr(a) for a in (args or ())], "base_key": self._get_base_key()}
        seen[key] = inputs
        if key_only:
            raise KeyOnly(key, inputs)
        return key

    KernelCache._generate_key = _generate_key
    try:
        yield seen
    finally:
        KernelCache._generate_key = orig


def compile_like_jit(impl, func):
    """``tilelang.compile`` with the options of a ``tilelang.jit`` object, as ``JITImpl.compile`` does."""
    import tilelang
    return tilelang.compile(func, out_idx=impl.out_idx, execution_backend=impl.execution_backend,
                            target=impl.target, target_host=impl.target_host, verbose=impl.verbose,
                            pass_configs=impl.pass_configs, compile_flags=impl.compile_flags)


def key_of(impl, args, kwargs):
    """(key, inputs) TileLang computes for this jit request here, compiling and loading nothing."""
    func = impl.get_tir(*args, **dict(kwargs))
    with capturing_keys(key_only=True):
        try:
            compile_like_jit(impl, func)
        except KeyOnly as k:
            return k.key, k.inputs
    raise RuntimeError("TileLang compiled without computing a cache key (cache disabled?)")


def record_requests(flash_qla, heads, rows, dtype, max_walks=None):
    """Shadow-run every (heads, row) (with ``max_walks``, only those with Hv x sequences at most that); returns
    (uniq: dedup key -> request dict, per_head, per_row)."""
    import warnings
    uniq, per_head, per_row = {}, {}, []
    for hqk, hv in heads:
        mine = []
        for mode, seqlens in rows:
            if max_walks is not None and hv * len(seqlens) > max_walks:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rec = shadow_row(flash_qla, hqk, hv, seqlens, mode, dtype)
            ks = []
            for impl, a, kw in rec:
                dk = (id(impl), a, kw)
                if dk not in uniq:
                    uniq[dk] = dict(impl=impl, args=a, kwargs=kw, desc=describe(impl, a, kw), users=[])
                uniq[dk]["users"].append(f"{hqk}/{hv} {mode} {row_label(seqlens)}")
                if dk not in ks:
                    ks.append(dk)
                if dk not in mine:
                    mine.append(dk)
            per_row.append(((hqk, hv), mode, seqlens, ks))
        per_head[(hqk, hv)] = mine
    return uniq, per_head, per_row


# ----------------------------------------------------------------------------------------------------
# Cache dir helpers
# ----------------------------------------------------------------------------------------------------

def kernels_root():
    from tilelang.cache.kernel_cache import KernelCache
    return KernelCache._get_cache_root()


def list_entries(root):
    try:
        return {e for e in os.listdir(root) if not e.startswith(".")}
    except FileNotFoundError:
        return set()


def dir_stats(path):
    n = size = 0
    for r, _, files in os.walk(path):
        for fn in files:
            try:
                size += os.path.getsize(os.path.join(r, fn))
                n += 1
            except OSError:
                pass
    return n, size


def xz_size(path):
    tar = subprocess.Popen(["tar", "cf", "-", "-C", path, "."], stdout=subprocess.PIPE)
    xz = subprocess.Popen(["xz", "-6", "-T2"], stdin=tar.stdout, stdout=subprocess.PIPE)
    tar.stdout.close()
    n = 0
    while True:
        chunk = xz.stdout.read(1 << 20)
        if not chunk:
            break
        n += len(chunk)
    xz.wait()
    tar.wait()
    return n


def mib(n):
    return f"{n / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    cache_dir = os.path.abspath(os.path.expanduser(
        args.cache_dir or os.environ.get("TILELANG_CACHE_DIR") or "~/.tilelang/cache"))
    if "tilelang" in sys.modules:
        raise SystemExit("warm: tilelang was imported before the cache dir could be set")
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    import torch
    native = args.native or torch.cuda.is_available()
    if not native:
        for var in _KEY_ENV:
            if os.environ.pop(var, None) is not None:
                print(f"warm: ignoring {var} (the device run does not set it; it would change the keys)",
                      file=sys.stderr)

    heads = parse_heads(args.heads)
    fwd_default, bwd_default = preset_seqs()
    # --seqs none: no forward rows (a backward-only warm-up)
    rows = [] if args.seqs == "none" else \
        [("fwd", s) for s in (parse_seqs(args.seqs) if args.seqs else fwd_default)]
    if args.bwd_preset:
        bwd_default = preset_rows(args.bwd_preset)
    if args.with_backward or args.bwd_preset:
        rows += [("fwdbwd", s) for s in (parse_seqs(args.bwd_seqs) if args.bwd_seqs else bwd_default)]

    t0 = time.perf_counter()
    import tilelang
    if native:
        from tilelang.backend.target import determine_target
        target = determine_target("auto", return_object=True)
        flash_qla = import_flash_qla(args.flash_qla_path)
        args.sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    else:
        target = pretend_h200(args.sm_count)
        flash_qla = import_flash_qla(args.flash_qla_path, args.sm_count)
    dtype = getattr(torch, args.dtype)
    fq_ver = getattr(flash_qla, "__version__", "?")
    print(f"warm: tilelang {tilelang.__version__} ({os.path.dirname(tilelang.__file__)}), flash_qla {fq_ver} "
          f"({os.path.dirname(flash_qla.__file__)}), target {target}{' (native)' if native else ''}, "
          f"SMs {args.sm_count}, "
          f"cache {cache_dir}; setup {time.perf_counter() - t0:.1f} s")
    if fq_ver != "0.1.3":
        print(f"warm: warning: flash_qla {fq_ver}; the device bundle has 0.1.3 (keys follow the kernel code)",
              file=sys.stderr)

    # 1. record
    t1 = time.perf_counter()
    uniq, per_head, per_row = record_requests(flash_qla, heads, rows, dtype, args.max_walks)
    print(f"warm: recorded {sum(len(r[3]) for r in per_row)} kernel requests over {len(per_row)} rows, "
          f"{len(uniq)} distinct kernels ({time.perf_counter() - t1:.1f} s)")
    for (hqk, hv), ks in per_head.items():
        print(f"  {hqk}/{hv}: {len(ks)} kernels")
    if args.list:
        for it in uniq.values():
            it["key"] = key_of(it["impl"], it["args"], it["kwargs"])[0]
        for (h, mode, seqlens, ks) in per_row:
            print(f"{h[0]}/{h[1]} {mode} {row_label(seqlens)}:")
            for dk in ks:
                print(f"    {uniq[dk]['key'][:16]}  {uniq[dk]['desc']}")
        return 0

    # 2. compile
    from concurrent.futures import ThreadPoolExecutor
    os.makedirs(cache_dir, exist_ok=True)
    root = kernels_root()
    before = list_entries(root)
    items = list(uniq.values())
    n = len(items)

    for it in items:  # elaboration in this thread (TileLang's par_compile does the same); lowering + nvcc in threads
        t = time.perf_counter()
        it["func"] = it["impl"].get_tir(*it["args"], **dict(it["kwargs"]))
        it["elab"] = time.perf_counter() - t

    def build(i, it):
        t = time.perf_counter()
        kern = compile_like_jit(it["impl"], it["func"])
        secs = time.perf_counter() - t
        key = getattr(kern, "_tilelang_cache_key", None)
        it.update(key=key, secs=secs, status="cached" if key in before else "new", key_inputs=captured.get(key))
        print(f"[{i}/{n}] {it['desc']}: {secs:.1f} s {it['status']} key={key}", flush=True)
        return it

    t2 = time.perf_counter()
    failed = []
    with capturing_keys() as captured, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futs = [pool.submit(build, i, it) for i, it in enumerate(items, 1)]
        for f, it in zip(futs, items):
            try:
                f.result()
            except Exception as exc:
                failed.append((it["desc"], f"{type(exc).__name__}: {exc}"))
    wall = time.perf_counter() - t2
    after = list_entries(root)

    # 3. manifest + report
    manifest = {
        "tilelang": tilelang.__version__, "flash_qla": fq_ver, "target": str(target), "sm_count": args.sm_count,
        "dtype": args.dtype, "heads": [f"{a}/{b}" for a, b in heads],
        "rows": [f"{m} {row_label(s)}" for m, s in rows], "kernels_dir": os.path.relpath(root, cache_dir),
        "kernels": [dict(key=it.get("key"), kernel=kernel_name(it["impl"]), desc=it["desc"],
                         params={k: jsonable(v) for k, v in it["impl"].signature.bind_partial(
                             *it["args"], **dict(it["kwargs"])).arguments.items()},
                         func_sha256=(it.get("key_inputs") or {}).get("func_sha256"),
                         key_inputs=it.get("key_inputs"),
                         compile_s=round(it.get("secs", 0.0), 2), status=it.get("status", "failed"),
                         used_by=it["users"]) for it in items],
        "per_head": {f"{a}/{b}": sorted({uniq[dk].get("key") for dk in ks if uniq[dk].get("key")})
                     for (a, b), ks in per_head.items()},
    }
    mpath = os.path.join(cache_dir, MANIFEST)
    old = {}
    if os.path.exists(mpath):  # keep the keys of earlier runs with other heads / rows
        try:
            old = json.load(open(mpath))
        except Exception:
            old = {}
    if old.get("kernels"):
        have = {k["key"] for k in manifest["kernels"]}
        manifest["kernels"] += [k for k in old["kernels"] if k.get("key") not in have]
        for h, ks in old.get("per_head", {}).items():
            manifest["per_head"][h] = sorted(set(manifest["per_head"].get(h, [])) | set(ks))
    with open(mpath, "w") as f:
        json.dump(manifest, f, indent=1)

    new = [it for it in items if it.get("status") == "new"]
    secs = [it["secs"] for it in items if "secs" in it]
    print(f"warm: {len(items) - len(failed)}/{len(items)} kernels ready in {wall:.1f} s wall "
          f"({len(new)} compiled, {len(items) - len(new) - len(failed)} already cached; "
          f"{len(after - before)} new cache entries)")
    if new:
        ts = [it["secs"] for it in new]
        print(f"warm: compile seconds per new kernel: min {min(ts):.1f}, mean {sum(ts) / len(ts):.1f}, "
              f"max {max(ts):.1f} (jobs {args.jobs} on {os.cpu_count()} CPUs)")
    elif secs:
        print(f"warm: seconds per kernel (disk hits): mean {sum(secs) / len(secs):.2f}")
    nfiles, size = dir_stats(cache_dir)
    line = f"warm: cache dir {cache_dir}: {len(after)} kernel entries, {nfiles} files, {mib(size)}"
    if not args.no_xz:
        line += f"; tar | xz -6: {mib(xz_size(cache_dir))}"
    print(line)
    print(f"warm: manifest {mpath}")
    for desc, why in failed:
        print(f"FAILED {desc}: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
