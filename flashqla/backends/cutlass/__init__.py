"""Backend "cutlass": CuTe DSL (nvidia-cutlass-dsl 4.3.x) kernels for Hopper (sm_90a).

Forward = two kernels per call:

1. :mod:`.chunk_prep_sm90` -- per (64-token chunk, value head): cumulative gate, ``A = beta (k k^T) decay``,
   ``T = (I + A)^-1`` (fp32 blocked forward substitution), ``-w = -T beta Gamma k``, ``u = T beta v``,
   the causal decayed ``Aqk = scale q k^T``.  TMA loads + warpgroup MMA.
2. :mod:`.chunk_fwd_sm90` -- per (sequence, value head, V block): the serial recurrence over chunks, the
   state in registers (transposed, as the A operand of wgmma), a TMA producer warp feeding a two-stage
   mbarrier pipeline.  Or :mod:`.chunk_fwd_ws_sm90` (``FLASHQLA_CUTLASS_FWD=ws``): the same walk
   warp-specialised, the state's own chain in one warpgroup and the output in another, each with its own TMA
   ring; the output's products and stores leave the serial path.

With gradients needed the same kernels also store the bf16 ``T``, the bf16 state at every chunk start
and the bf16 ``v_new``; the backward is three more kernels:

3. :mod:`.chunk_bwd_state_sm90` -- the state-gradient recurrence, serial over chunks in reverse (same
   pipeline structure as 2.): stores ``dS'`` per chunk, ``dv_new``, and ``dh0``.
4. :mod:`.chunk_bwd_dqk_sm90` -- per chunk: dq, the output/state part of dk, ``dw``, part of dg.
5. :mod:`.chunk_bwd_wy_sm90` -- per chunk: dv, dbeta, the WY part of dk (through ``dA = -T^T dT T^T``), dg.

Inputs are bf16 q/k/v, fp32 g, bf16 or fp32 beta, K = V = 128, fp32 states; varlen via the device
``cu_seqlens`` / ``chunk_offsets`` / ``chunk_indices`` of :class:`flashqla.varlen.VarlenMeta` (a dense batch
gets the same metadata built on the device; no host sync either way).  ``use_qk_l2norm`` normalises q
and k with a PyTorch pre-pass (fp32 math, bf16 result) and chains dq/dk through it with autograd; GVA
gradients of q/k are summed over the value heads of a group with one PyTorch reduction.

Compiled kernels are cached in memory by (kernel, arch, head dims, dtypes, variant) -- sequence lengths,
batch and head counts are runtime ``Int32`` arguments of the compiled function, so a new length never
recompiles.  Each compilation also leaves its PTX and cubin under ``$FLASHQLA_CACHE_DIR`` (default
``~/.cache/flashqla/cutlass``) next to a ``key.json``, and, as the on-disk cache, ``kernel.so``: the same
kernel compiled through CuTe DSL's TVM-FFI path, exported with ``export_to_c`` and linked with the C compiler
(``cc``), in a detached child process by default (``FLASHQLA_CUTLASS_EXPORT=async|sync|off``).  A new process
on a GPU loads that library instead of compiling (milliseconds against 2-5 s per kernel).  The directory name
holds a digest of the key, the DSL version and this package's cutlass sources, so an edited kernel never loads
a stale library.  A library that fails to load, or whose first call raises,
is set aside (logged) and the kernel compiled as before; ``FLASHQLA_CUTLASS_DISK_CACHE=0`` turns the disk cache
off.  :func:`compile_count` says how many compilations this process did, :func:`load_count` how many kernels
came from the disk.

``backend_options``: ``{"num_wg": 1 | 2}`` forces the recurrence kernels' V block (64 or 128 value
columns per CTA); by default 2 when there are at least as many (sequence, head) pairs as SMs
(``FLASHQLA_CUTLASS_NUM_WG=1|2`` forces it for every call: tuning sweeps).

``FLASHQLA_CUTLASS_FWD=fused|serial|ws|auto`` (or ``backend_options={"fwd": ...}``): the forward's recurrence,
default ``fused`` (session 19, H200): the warp-specialised walk's fused inference form (the prep stores
``T diag(beta)`` instead of -w and u, the recurrence forms v_new from v); training forwards take ``serial``
(``chunk_fwd_sm90``); ``auto`` takes the least modelled time (``CUTLASS_STEP_US`` / ``CUTLASS_WS_STEP_US`` /
``CUTLASS_FUSED_STEP_US``).  :func:`fwd_plan` is the choice; ``explain()`` prints it.

``FLASHQLA_CUTLASS_SEGMENTS=auto|off|<chunks>`` (default ``auto`` since session 19): the forward recurrence
over chunk-aligned segments of the long sequences, each walk starting in a halo before its segment (the tilelang
forward's in-kernel CP, ``backends/tilelang/segments.py``: its tables, halo search and plan, with
``CUTLASS_STEP_US``).  ``auto`` splits where that model says it pays; a number forces segments of that many
chunks.  The backward is unchanged: the split forward saves the same chunk states.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..._env import env_choice
from ...dispatch.registry import Backend, register_backend
from ..._build_notice import build_notice

log = logging.getLogger("flashqla")

ARCH = "sm_90a"
BT = 64
_INT32_MAX = 2 ** 31 - 1

_lock = threading.Lock()
_compiled: dict = {}
_artifacts: dict = {}
_smem: dict = {}
_compile_counter = [0]
_load_counter = [0]
_meta_cache: dict = {}
# Tests set this to a dict to receive the backward's workspaces (kernel-by-kernel checks); None otherwise.
debug_capture = None


def compile_count() -> int:
    """Number of kernel compilations done by this process (tests read it to prove caching)."""
    return _compile_counter[0]


def load_count() -> int:
    """Number of kernels this process loaded from the on-disk cache instead of compiling them."""
    return _load_counter[0]


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHQLA_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "flashqla",
                                                                    "cutlass")))


def dsl_version():
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------- compile
def _cute():
    import cutlass  # noqa: F401
    import cutlass.cute as cute
    return cute


def _ptr(dtype_name: str, address: int, align: int):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr
    dt = {"bfloat16": cutlass.BFloat16, "float32": cutlass.Float32, "int32": cutlass.Int32}[dtype_name]
    return make_ptr(dt, address, cute.AddressSpace.gmem, assumed_align=align)


def _example_args(kind: str, key: tuple):
    """Arguments with the right types (addresses and sizes are placeholders) for ``cute.compile``."""
    import cutlass
    import cuda.bindings.driver as cuda
    i32, f32 = cutlass.Int32, cutlass.Float32
    bf = lambda: _ptr("bfloat16", 1 << 12, 16)  # noqa: E731
    fp = lambda: _ptr("float32", 1 << 12, 16)  # noqa: E731
    ip = lambda: _ptr("int32", 1 << 12, 4)  # noqa: E731
    if kind == "prep":
        beta = _ptr(key[2], 1 << 12, 4 if key[2] == "float32" else 2)
        return (bf(), bf(), bf(), _ptr("float32", 1 << 12, 4), beta, bf(), bf(), bf(), fp(), bf(), ip(), ip(),
                i32(128), i32(2), i32(1), i32(1), i32(1), f32(0.1), cuda.CUstream(0))
    if kind in ("fwd", "fwd_ws"):
        return (bf(), bf(), bf(), bf(), bf(), fp(), fp(), fp(), bf(), bf(), bf(), ip(), ip(), ip(), ip(),
                i32(128), i32(2), i32(1), i32(1), i32(1), f32(0.1), i32(0), i32(0), cuda.CUstream(0))
    if kind == "bwd_state":
        return (bf(), bf(), bf(), bf(), bf(), fp(), fp(), fp(), bf(), bf(), ip(), ip(),
                i32(128), i32(2), i32(1), i32(1), i32(1), f32(0.1), i32(0), i32(0), cuda.CUstream(0))
    if kind == "bwd_dqk":
        return (bf(), bf(), bf(), bf(), bf(), bf(), bf(), bf(), fp(), fp(), fp(), bf(), fp(), ip(), ip(),
                i32(128), i32(2), i32(1), i32(1), i32(1), f32(0.1), cuda.CUstream(0))
    if kind == "bwd_wy":
        beta = _ptr(key[2], 1 << 12, 4 if key[2] == "float32" else 2)
        return (bf(), bf(), beta, bf(), bf(), bf(), fp(), fp(), fp(), fp(), fp(), fp(), ip(), ip(),
                i32(128), i32(2), i32(1), i32(1), i32(1), cuda.CUstream(0))
    raise KeyError(kind)


def _make_kernel(kind: str, key: tuple):
    if kind == "prep":
        from .chunk_prep_sm90 import ChunkPrepSm90
        K, V, beta, save, tb, tiled = key           # (tb: the fused inference forward's variant; see prep_key)
        if not tiled:
            raise KeyError(f"prep key {key}: the scalar inverse was removed in session 23 (see prep_key)")
        return ChunkPrepSm90(K, V, beta_fp32=(beta == "float32"), save=save, tb=bool(tb))
    if kind == "fwd":
        from .chunk_fwd_sm90 import ChunkFwdSm90
        K, V, num_wg, stages, save, *halo = key     # (halo: the walk over segments; absent = off)
        return ChunkFwdSm90(K, V, num_wg=num_wg, stages=stages, save=save, halo=bool(halo and halo[0]))
    if kind == "fwd_ws":
        from .chunk_fwd_ws_sm90 import ChunkFwdWsSm90
        K, V, save, *flags = key                    # (flags: halo, fused; absent = off)
        return ChunkFwdWsSm90(K, V, save=save, halo=bool(flags and flags[0]),
                              fused=bool(len(flags) > 1 and flags[1]))
    if kind == "bwd_state":
        from .chunk_bwd_state_sm90 import ChunkBwdStateSm90
        K, V, num_wg, stages = key
        return ChunkBwdStateSm90(K, V, num_wg=num_wg, stages=stages)
    if kind == "bwd_dqk":
        from .chunk_bwd_dqk_sm90 import ChunkBwdDqkSm90
        K, V = key
        return ChunkBwdDqkSm90(K, V)
    if kind == "bwd_wy":
        from .chunk_bwd_wy_sm90 import ChunkBwdWySm90
        K, V, _beta = key
        return ChunkBwdWySm90(K, V)
    raise KeyError(kind)


def _disk_cache_on() -> bool:
    return env_choice("FLASHQLA_CUTLASS_DISK_CACHE", ("0", "1"), "1") == "1"


_source_digest_memo: list = []


def _source_digest() -> str:
    """Digest of this package's cutlass kernel sources: part of every cache key, so that an edited kernel
    compiles again instead of loading a library built from the old source."""
    if not _source_digest_memo:
        h = hashlib.sha1()
        for f in sorted(Path(__file__).parent.glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
        _source_digest_memo.append(h.hexdigest()[:16])
    return _source_digest_memo[0]


def _library_name(kind: str) -> str:
    return f"flashqla_cutlass_{kind}"


class _LoadedKernel:
    """A kernel from the on-disk cache: the TVM-FFI function of ``kernel.so``, called with the JIT function's
    arguments (cute pointers pass as opaque pointers; Int32 / Float32 / CUstream as plain values).  Until its
    first call has returned, an exception falls back to compiling the kernel (``fallback``) and the library is
    set aside; after that, exceptions propagate."""

    def __init__(self, fn, path: Path, fallback):
        self.fn, self.path, self._fallback, self._checked = fn, path, fallback, False
        self._compiled = None        # the compiled kernel, once the library failed its first call
        self.__ptx__ = self.__cubin__ = None

    @staticmethod
    def _plain(a):
        if hasattr(a, "__tvm_ffi_opaque_ptr__"):
            return a
        name = type(a).__name__
        if name in ("Int32", "Int64", "Boolean", "Float32"):
            return a.value
        if name == "CUstream":
            return int(a)
        return a

    def __call__(self, *args):
        if self._compiled is not None:
            return self._compiled(*args)
        if self._checked:
            return self.fn(*(self._plain(a) for a in args))
        try:
            out = self.fn(*(self._plain(a) for a in args))
        except Exception as exc:
            log.warning("flashqla cutlass: the cached library %s failed at its first call (%s: %s); compiling "
                        "the kernel instead", self.path, type(exc).__name__, str(exc)[:300])
            _set_aside(self.path)
            self._compiled = self._fallback()
            return self._compiled(*args)
        self._checked = True
        return out


def _set_aside(path: Path) -> None:
    try:
        path.rename(path.with_suffix(".so.bad"))
    except OSError:
        pass


def _load_library(out: Path, kind: str, full_key: tuple, fallback):
    """The kernel from ``out/kernel.so``, or None (absent, no GPU driver, or it fails to load: logged)."""
    lib = out / "kernel.so"
    if not (_disk_cache_on() and lib.is_file() and torch.cuda.is_available()):
        return None
    try:
        from cutlass.cute.runtime import load_module
        mod = load_module(str(lib))
        name = _library_name(kind)
        fn = mod[name] if hasattr(mod, "__getitem__") else getattr(mod, name)
    except Exception as exc:
        log.warning("flashqla cutlass: cannot load the cached %s (%s: %s); compiling instead", lib,
                    type(exc).__name__, str(exc)[:300])
        _set_aside(lib)
        return None
    log.info("flashqla cutlass: %s %s loaded from %s", full_key[0], full_key[2:], lib)
    return _LoadedKernel(fn, lib, fallback)


def _export_mode() -> str:
    """``FLASHQLA_CUTLASS_EXPORT``: ``async`` (default) builds the library in a detached child process, so the
    first call waits only for the JIT compile it needs (session 14: an in-line export took the cold first call of
    a forward from 7.1 to 17.1 s); ``sync`` builds it before returning (tests); ``off`` keeps no library."""
    return env_choice("FLASHQLA_CUTLASS_EXPORT", ("async", "sync", "off"), "async")


_export_children: list = []


def _start_export(kind: str, key: tuple, arch: str, out: Path) -> None:
    """Build ``out/kernel.so`` as :func:`_export_mode` says (a failed build is logged, never raised; a bad
    ``FLASHQLA_CUTLASS_EXPORT`` value is a ValueError)."""
    import subprocess
    import sys
    mode = _export_mode() if _disk_cache_on() else "off"
    if mode == "off":
        return
    if mode == "sync":
        _export_library(_cute(), _make_kernel(kind, key), kind, key, arch, out)
        return
    try:
        spec = json.dumps([kind, list(key), arch, str(out)])
        _export_children.append(subprocess.Popen(
            [sys.executable, "-m", "flashqla.backends.cutlass", spec], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env=dict(os.environ, FLASHQLA_CUTLASS_EXPORT="sync")))
    except OSError as exc:
        log.info("flashqla cutlass: %s %s not kept on disk (%s)", kind, key, exc)


def wait_for_exports(timeout: float = 600.0) -> None:
    """Wait until the libraries this process started building in the background are written (tests, tools)."""
    while _export_children:
        try:
            _export_children.pop().wait(timeout=timeout)
        except Exception:
            pass


def _export_library(cute, kernel, kind: str, key: tuple, arch: str, out: Path) -> None:
    """Compile ``kernel`` again through TVM-FFI, export it and link ``out/kernel.so`` (written under a temporary
    name, then renamed, so a concurrent reader never sees half a file).  Never raises: the disk cache is an
    optimisation."""
    import shutil
    import subprocess
    import tempfile
    if (out / "kernel.so").is_file():
        return
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        log.info("flashqla cutlass: no C compiler (cc): %s is not kept on disk", kind)
        return
    try:
        from cutlass.cute.runtime import find_runtime_libraries
        fn = cute.compile(kernel, *_example_args(kind, tuple(key)), options=f"--gpu-arch {arch} --enable-tvm-ffi")
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            obj, so = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.so")
            fn.export_to_c(obj, _library_name(kind))
            libs = [p for p in find_runtime_libraries(enable_tvm_ffi=True) if os.path.exists(p)]
            rpath = ":".join(sorted({os.path.dirname(p) for p in libs}))
            r = subprocess.run([cc, "-shared", "-o", so, obj, *libs, f"-Wl,-rpath,{rpath}"], capture_output=True,
                               text=True, timeout=120)
            if r.returncode:
                raise RuntimeError(f"{cc} failed: {r.stderr[-800:]}")
            os.replace(so, out / "kernel.so")
    except Exception as exc:
        log.info("flashqla cutlass: %s %s not kept on disk (%s: %s)", kind, key, type(exc).__name__, str(exc)[:300])


def compile_kernel(kind: str, key: tuple, arch: str = ARCH, keep_dir=None):
    """Compile (or fetch from the in-memory or on-disk cache) kernel ``kind`` for ``key`` and ``arch``.

    Passing the arch as a compile option (never through ``CUTE_DSL_ARCH``) makes this work without a GPU
    driver when the option differs from the detected arch: that is how the CPU tests cross-compile.
    Returns the compiled function (``__ptx__`` / ``__cubin__`` hold the artifacts; None for a kernel loaded
    from the disk, whose directory keeps them from its compilation).
    """
    full_key = (kind, arch) + tuple(key)
    fn = _compiled.get(full_key)
    if fn is not None:
        return fn
    with _lock:
        fn = _compiled.get(full_key)
        if fn is not None:
            return fn
        digest = hashlib.sha1(repr((full_key, dsl_version(), _source_digest())).encode()).hexdigest()[:16]
        out = Path(keep_dir) if keep_dir is not None else cache_dir() / f"{kind}-{arch}-{digest}"

        def recompile():
            # the fallback of a library whose first call failed: compile, and serve this key from now on
            with _lock:
                fn = _compile(kind, key, arch, out, full_key, export=False)
                _compiled[full_key] = fn
                return fn

        fn = _load_library(out, kind, full_key, recompile)
        if fn is not None:
            _load_counter[0] += 1
            _compiled[full_key] = fn
            _artifacts[full_key] = out
            return fn
        fn = _compile(kind, key, arch, out, full_key, export=True)
        _compiled[full_key] = fn
        return fn


def _compile(kind: str, key: tuple, arch: str, out: Path, full_key: tuple, export: bool):
    cute = _cute()
    opts = f"--gpu-arch {arch}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "key.json").write_text(json.dumps({"key": [str(x) for x in full_key],
                                                  "nvidia-cutlass-dsl": dsl_version(),
                                                  "sources": _source_digest()}))
        opts += f" --keep-ptx --keep-cubin --dump-dir {out}"
    except OSError as exc:  # an unwritable cache dir must not stop the kernels
        log.warning("flashqla cutlass: cannot keep artifacts in %s (%s)", out, exc)
        export = False
    log.info("flashqla cutlass: compiling %s %s for %s", kind, key, arch)
    try:
        with build_notice("cutlass", kind, key):
            kernel = _make_kernel(kind, key)
            fn = cute.compile(kernel, *_example_args(kind, tuple(key)), options=opts)
    except Exception as exc:
        from ...dispatch.registry import KernelBuildError
        raise KernelBuildError("cutlass", kind, (arch,) + tuple(key), exc) from exc
    _compile_counter[0] += 1
    _artifacts[full_key] = out
    _smem[full_key] = getattr(kernel, "smem_bytes", None)
    if export:
        _start_export(kind, tuple(key), arch, out)
    return fn


def _export_main(argv) -> int:
    """``python -m flashqla.backends.cutlass '[kind, key, arch, out]'``: the background library build."""
    kind, key, arch, out = json.loads(argv[0])
    _export_library(_cute(), _make_kernel(kind, tuple(key)), kind, tuple(key), arch, Path(out))
    return 0


def smem_bytes(kind: str, key: tuple, arch: str = ARCH):
    """Dynamic shared memory of a compiled kernel, in bytes (None if not compiled in this process)."""
    return _smem.get((kind, arch) + tuple(key))


def artifact_dir(kind: str, key: tuple, arch: str = ARCH):
    """Where the PTX / cubin of a compiled kernel were kept (None if not compiled in this process)."""
    return _artifacts.get((kind, arch) + tuple(key))


# ---------------------------------------------------------------------------------------------- runtime
def _dense_meta(B: int, T: int, device):
    """cu_seqlens / chunk_offsets / chunk_indices of B equal sequences of length T, built on the device."""
    key = (B, T, str(device))
    m = _meta_cache.get(key)
    if m is None:
        nc = (T + BT - 1) // BT
        ar = torch.arange(B + 1, device=device, dtype=torch.int32)
        cu = ar * T
        co = ar * nc
        seq = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(nc)
        cid = torch.arange(nc, device=device, dtype=torch.int32).repeat(B)
        ci = torch.stack([seq, cid], 1).contiguous()
        m = (cu, co, ci, B, B * nc)
        if len(_meta_cache) > 64:
            _meta_cache.clear()
        _meta_cache[key] = m
    return m


# Chunk step of the forward recurrences per V block, microseconds, H200 session 19 run 7 (16/32 1x32768, the
# recurrence kernel's time / 512 chunks; h200_2026-12-05_s19run7_sweep_cutlass_fwd.json): one-warpgroup 0.624 ms at
# V block 64 (64 CTAs), 1.016 ms at 128 (two consumer warpgroups, 32 CTAs); warp-specialised 0.628 ms; its fused form
# 0.722 ms (one more wgmma on the chain), whose prep is ~0.12 ms faster per 16384 (chunk, head) pairs instead
CUTLASS_STEP_US = {128: 1.98, 64: 1.22}
CUTLASS_WS_STEP_US = {64: 1.23}
CUTLASS_FUSED_STEP_US = {64: 1.41}

FWD_VARIANTS = ("serial", "ws", "fused", "auto")


def prep_key(K: int, V: int, beta_dtype: str, save: bool, fused: bool) -> tuple:
    """The prep's compile key ``(K, V, beta dtype, save, fused, True)``.  The last entry marks the inverse on
    register tiles (the only form since session 23; ``FLASHQLA_CUTLASS_PREP=tiled`` then), so that no key of the
    former scalar-inverse kernels, ``(K, V, beta, save)`` or ``(..., True)`` for the fused form, can match one
    kept in an on-disk cache."""
    return (K, V, beta_dtype, save, bool(fused), True)


def fwd_mode(options=None) -> str:
    """The forward recurrence: ``backend_options["fwd"]``, else ``FLASHQLA_CUTLASS_FWD``: ``fused`` (the default since
    session 19: ``chunk_fwd_ws_sm90``'s fused form for inference forwards, ``chunk_fwd_sm90`` for training ones),
    ``serial`` (``chunk_fwd_sm90``), ``ws`` (``chunk_fwd_ws_sm90``) or ``auto`` (the model of :func:`fwd_plan`).
    H200 session 20 run 3: fused 0.747 ms at 16/32 4x8192 once the prep staged Aqk and ran the tb form three CTAs to
    an SM (prep 0.604 -> 0.388 ms).  Session 19 run 7, inference: fused 0.983 against serial 1.080 ms at 16/32 4x8192, 0.995 / 1.085 at 32/32
    8x4096, 0.253 / 0.270 at 16/32 8x1024; with segments (the default) 0.268 against 0.799 at 2/8 1x32768.  Training
    forwards keep the one-warpgroup walk: with ws, fwd+bwd took 7.48 against 7.25 ms at 16/32 4x8192 (its saves
    read the swizzled handoff element-wise)."""
    mode = (options or {}).get("fwd")
    if mode is not None:
        if mode not in FWD_VARIANTS:
            raise ValueError(f"backend_options['fwd'] must be one of {FWD_VARIANTS}, got {mode!r}")
        return mode
    return env_choice("FLASHQLA_CUTLASS_FWD", FWD_VARIANTS, "fused")


def forced_num_wg(options=None) -> int:
    """The V block a call forces on the one-warpgroup recurrence: ``backend_options["num_wg"]`` (1 or 2), else
    ``FLASHQLA_CUTLASS_NUM_WG`` (tuning sweeps); 0 leaves it to :func:`fwd_plan`."""
    num_wg = int((options or {}).get("num_wg", 0))
    return num_wg if num_wg in (1, 2) else int(env_choice("FLASHQLA_CUTLASS_NUM_WG", ("0", "1", "2"), "0"))


def segments_mode() -> str:
    """``FLASHQLA_CUTLASS_SEGMENTS``: ``auto`` (default since its GPU tests passed, session 19), ``off`` or a segment
    length in chunks."""
    from ..tilelang import segments
    return segments.read_mode("FLASHQLA_CUTLASS_SEGMENTS", "auto")


@dataclass
class FwdPlan:
    variant: str            # "serial" (chunk_fwd_sm90), "ws" (chunk_fwd_ws_sm90) or "fused" (its fused form)
    num_wg: int             # V block / 64 (ws: 1)
    state_wg: int           # the backward's state-gradient kernel's V block / 64 (the one-warpgroup rule)
    split: Optional[object]  # segments.SegmentPlan of the walk over segments, or None
    why: str

    def describe(self) -> str:
        return self.why


_FWD_PLANS: dict = {}


def _walk_us(chunks: tuple, Hv: int, nvb: int, step: float, sms: int) -> float:
    """Modelled time of one recurrence launch: a CTA per (sequence, head, V block), each SM one at a time."""
    from ..tilelang import segments
    return segments._makespan([c * step for c in chunks for _ in range(Hv * nvb)], sms)


def fwd_plan(lengths, Hv: int, V: int, sms: int, mode: str = "serial", num_wg: int = 0,
             seg_mode: str = "off", training: bool = False) -> FwdPlan:
    """Which recurrence runs a forward over sequences of ``lengths`` tokens, at which V block, over segments or
    not.  ``num_wg`` 1 / 2 forces the serial kernel's V block (0: 2 when there are at least as many walks as SMs);
    ``seg_mode``: :func:`segments_mode`'s value; ``training``: the forward saves for a backward (the fused form
    serves inference only).  ``auto`` takes the variant of least modelled time."""
    from ..tilelang import segments
    sms = max(int(sms or 132), 1)
    chunks = tuple(-(-int(n) // BT) for n in lengths)
    key = (chunks, Hv, V, sms, mode, num_wg, seg_mode, training)
    plan = _FWD_PLANS.get(key)
    if plan is not None:
        return plan
    walks = len(chunks) * Hv
    forced_wg = num_wg in (1, 2)
    serial_wg = num_wg if forced_wg else (2 if walks >= sms else 1)
    ws_name, ws_steps = ("ws", CUTLASS_WS_STEP_US) if training else ("fused", CUTLASS_FUSED_STEP_US)
    variant, why = mode, f"FLASHQLA_CUTLASS_FWD / backend_options: {mode}"
    if mode == "fused" and training:
        variant, why = "serial", "fused serves inference forwards; a training forward takes the one-warpgroup walk"
    if mode == "auto":
        serial_us = _walk_us(chunks, Hv, V // (64 * serial_wg), CUTLASS_STEP_US[64 * serial_wg], sms)
        ws_us = _walk_us(chunks, Hv, V // 64, ws_steps[64], sms)
        variant = ws_name if ws_us < serial_us else "serial"
        why = (f"modelled {ws_us:.0f} us warp-specialised{' fused' if ws_name == 'fused' else ''} (V block 64) "
               f"against {serial_us:.0f} us one-warpgroup (V block {64 * serial_wg})")
    split = None
    if seg_mode != "off":
        if variant in ("ws", "fused"):
            split = segments.segment_plan(lengths, Hv, V, sms, 64, forced=seg_mode,
                                          steps=CUTLASS_WS_STEP_US if variant == "ws" else CUTLASS_FUSED_STEP_US,
                                          bvs=(64,))
        else:
            split = segments.segment_plan(lengths, Hv, V, sms, 64 * serial_wg, forced=seg_mode,
                                          steps=CUTLASS_STEP_US, bvs=(128, 64) if not forced_wg
                                          else (64 * serial_wg,))
        if split is not None and variant == "serial" and not forced_wg:
            serial_wg = split.bv // 64
    wg = serial_wg if variant == "serial" else 1
    name = {"ws": "warp-specialised recurrence (chunk_fwd_ws_sm90)",
            "fused": "fused warp-specialised recurrence (chunk_fwd_ws_sm90 on T diag(beta) and v)"}.get(
        variant, f"one-warpgroup recurrence (chunk_fwd_sm90, {wg} consumer warpgroup{'s' if wg > 1 else ''})")
    text = f"{name}: {why}"
    if split is not None:
        text += f"; over segments: {split.describe()}"
    plan = FwdPlan(variant, wg, serial_wg, split, text)
    if len(_FWD_PLANS) > 256:
        _FWD_PLANS.clear()
    _FWD_PLANS[key] = plan
    return plan


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """TMA needs 16-byte aligned base addresses; a contiguous view at an odd offset gets copied."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _stream():
    import cuda.bindings.driver as cuda
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


class CutlassBackend(Backend):
    name = "cutlass"
    description = "CuTe DSL (nvidia-cutlass-dsl 4.3) Hopper kernels: TMA + wgmma + mbarrier pipeline"
    priorities = {"sm_90": 20}
    has_backward = True
    _avail = None

    def version(self) -> str:
        return dsl_version() or ""

    def available(self):
        if CutlassBackend._avail is None:
            CutlassBackend._avail = self._probe()
        return CutlassBackend._avail

    @staticmethod
    def _probe():
        try:
            if importlib.util.find_spec("cutlass") is None:
                return False, "nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.3.5)"
            ver = dsl_version()
            if ver is None:
                return False, "a 'cutlass' module is importable but it is not nvidia-cutlass-dsl"
            if not ver.startswith("4.3."):
                return False, f"nvidia-cutlass-dsl {ver} is installed; this backend is written for 4.3.x (4.3.5)"
            if not torch.cuda.is_available():
                return False, "no CUDA device"
            return True, f"nvidia-cutlass-dsl {ver}"
        except Exception as exc:  # never raise from available()
            return False, f"probe failed: {type(exc).__name__}: {exc}"

    def supports(self, spec):
        if spec.device.type != "cuda" or spec.device.capability != (9, 0):
            return False, f"needs an sm_90 (Hopper) GPU, got {spec.device.arch}"
        if spec.dtype != "bfloat16":
            return False, f"q/k/v must be bfloat16, got {spec.dtype}"
        if spec.K != 128 or spec.V != 128:
            return False, f"head dims must be K = V = 128, got K = {spec.K}, V = {spec.V}"
        if spec.g_dtype != "float32":
            return False, f"g must be float32, got {spec.g_dtype}"
        if spec.beta_dtype not in ("bfloat16", "float32"):
            return False, f"beta must be bfloat16 or float32, got {spec.beta_dtype}"
        if spec.state_dtype not in (None, "float32"):
            return False, f"initial_state must be float32, got {spec.state_dtype}"
        # Offsets past 2^31 elements (o, dq/dk/dv, the chunk-major workspaces) are 64-bit in the kernels
        # (``_sm90.wide`` strides); what stays 32-bit are TMA coordinates and the indices of the per-token
        # gates and per-chunk-row vectors, the largest being (chunks * Hv) * 128 <= (tokens + 64 N) * Hv * 2
        # (tokens: B * T; spec.tokens is T, per batch row)
        if (spec.batch * spec.tokens + BT * spec.num_seqs) * spec.Hv * 2 > _INT32_MAX:
            return False, "too large for the kernels' 32-bit coordinates ((tokens + 64 N) * Hv * 2 >= 2^31)"
        return True, "bf16, K = V = 128 on sm_90"

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, spec, x):
        q_in, k_in = x.q, x.k
        q, k, v, g, beta = x.q, x.k, x.v, x.g, x.beta
        if x.use_qk_l2norm:
            q, k = _l2norm(q), _l2norm(k)
        B, T, Hqk, K = q.shape
        Hv, V = v.shape[2], v.shape[3]
        dev = q.device
        if x.varlen is not None:
            meta = x.varlen
            cu, co, ci = meta.cu_seqlens, meta.chunk_offsets, meta.chunk_indices
            N, C = meta.num_seqs, meta.total_chunks
        else:
            cu, co, ci, N, C = _dense_meta(B, T, dev)
        o = torch.empty(B, T, Hv, V, dtype=v.dtype, device=dev)
        ht = torch.empty(N, Hv, K, V, dtype=torch.float32, device=dev) if x.output_final_state else None
        h0 = x.initial_state
        lengths = x.varlen.seqlens if x.varlen is not None else [T] * B
        plan = fwd_plan(lengths, Hv, V, spec.device.sm_count, fwd_mode(x.options), forced_num_wg(x.options),
                        segments_mode() if C > 0 else "off", training=bool(spec.needs_grad))
        num_wg = plan.num_wg
        state_wg = plan.state_wg
        split = None
        if plan.split is not None:
            from ..tilelang import segments
            tables = segments.segment_tables(lengths, plan.split.seg_chunks, x.q.device)
            if tables.split_seqs:
                split = (plan.split, tables)
        aux = dict(scale=x.scale, B=B, T=T, N=N, C=C, Hqk=Hqk, Hv=Hv, num_wg=state_wg,
                   has_h0=h0 is not None, l2norm=x.use_qk_l2norm, beta_dtype=spec.beta_dtype)
        if C == 0:  # only empty sequences: nothing to compute, the state passes through
            o.zero_()
            if ht is not None:
                if h0 is not None:
                    ht.copy_(h0)
                else:
                    ht.zero_()
            saved = (q_in, k_in, v, g, beta) if spec.needs_grad else ()
            return o, ht, saved, aux

        save = bool(spec.needs_grad)
        fused = plan.variant == "fused"       # (fwd_plan gives it to inference forwards only)
        prep = compile_kernel("prep", prep_key(K, V, spec.beta_dtype, save, fused))
        if fused:
            fwd = compile_kernel("fwd_ws", (K, V, False, split is not None, True))
        elif plan.variant == "ws":
            fwd = compile_kernel("fwd_ws", (K, V, save) + ((True,) if split is not None else ()))
        else:
            fwd = compile_kernel("fwd", (K, V, num_wg, 2, save) + ((True,) if split is not None else ()))

        q, k, v = (_aligned(t) for t in (q, k, v))
        if h0 is not None:
            h0 = _aligned(h0)
        bf, f32 = torch.bfloat16, torch.float32
        # (fused: no -w / u; the t workspace holds T diag(beta), which the recurrence reads with v)
        ws_w = torch.empty(C, Hv, BT, K, dtype=bf, device=dev) if not fused else None
        ws_u = torch.empty(C, Hv, V, BT, dtype=bf, device=dev) if not fused else None
        ws_a = torch.empty(C, Hv, BT, BT, dtype=bf, device=dev)
        ws_g = torch.empty(C, Hv, BT, dtype=f32, device=dev)
        ws_t = torch.empty(C, Hv, BT, BT, dtype=bf, device=dev) if save or fused else None
        ws_s = torch.empty(C, Hv, K, V, dtype=bf, device=dev) if save else None
        ws_vn = torch.empty(C, Hv, BT, V, dtype=bf, device=dev) if save else None
        TT = B * T
        dummy = ws_g.data_ptr()  # never dereferenced when the matching flag is off
        P, I32 = _ptr, _i32
        prep(P("bfloat16", q.data_ptr(), 16), P("bfloat16", k.data_ptr(), 16), P("bfloat16", v.data_ptr(), 16),
             P("float32", g.data_ptr(), 4), _beta_ptr(beta, spec.beta_dtype),
             P("bfloat16", ws_w.data_ptr() if not fused else dummy, 16),
             P("bfloat16", ws_u.data_ptr() if not fused else dummy, 16),
             P("bfloat16", ws_a.data_ptr(), 16), P("float32", ws_g.data_ptr(), 16),
             P("bfloat16", ws_t.data_ptr() if ws_t is not None else dummy, 16),
             P("int32", cu.data_ptr(), 4), P("int32", ci.data_ptr(), 4),
             I32(TT), I32(C), I32(N), I32(Hqk), I32(Hv), _f32(x.scale), _stream())
        if split is not None:
            # the walks over segments: their boundaries, (sequence, first chunk, is-last) and each head's start
            from ..tilelang import segments
            _, tables = split
            kf = k.reshape(TT, Hqk, K)
            # (on k after the L2 norm: the search needs no norm of its own)
            starts = segments.walk_starts(kf, g.reshape(TT, Hv).float().contiguous(),
                                          beta.reshape(TT, Hv).contiguous(), tables, False)
            walk_tabs = (tables.cu_seqlens, tables.chunk_offsets, tables.seg_table, starts)
            walks = tables.num_segments
        else:
            walk_tabs = (cu, co, cu, cu)        # (the last two: placeholders, never read)
            walks = N
        walk_args = tuple(P("int32", t.data_ptr(), 4) for t in walk_tabs)
        fwd(P("bfloat16", q.data_ptr(), 16), P("bfloat16", k.data_ptr(), 16),
            # (fused: T diag(beta) and the input v in the places of -w and u^T)
            P("bfloat16", (ws_t if fused else ws_w).data_ptr(), 16),
            P("bfloat16", (v if fused else ws_u).data_ptr(), 16),
            P("bfloat16", ws_a.data_ptr(), 16), P("float32", ws_g.data_ptr(), 16),
            P("float32", h0.data_ptr() if h0 is not None else dummy, 16),
            P("float32", ht.data_ptr() if ht is not None else dummy, 16),
            P("bfloat16", o.data_ptr(), 16),
            P("bfloat16", ws_s.data_ptr() if save else dummy, 16),
            P("bfloat16", ws_vn.data_ptr() if save else dummy, 16),
            *walk_args, I32(TT), I32(C), I32(walks), I32(Hqk), I32(Hv), _f32(x.scale),
            I32(int(h0 is not None)), I32(int(ht is not None)), _stream())
        saved = ()
        if save:
            saved = (q_in, k_in, q, k, v, g, beta, ws_w, ws_a, ws_g, ws_t, ws_s, ws_vn, cu, co, ci)
        return o, ht, saved, aux

    # ------------------------------------------------------------------------------------------ backward
    def backward(self, spec, saved, aux, do, dht):
        B, T, N, C, Hqk, Hv = (aux[n] for n in ("B", "T", "N", "C", "Hqk", "Hv"))
        K, V = spec.K, spec.V
        TT = B * T
        if C == 0:
            q_in, k_in, v, g, beta = saved
            dh0 = None
            if aux["has_h0"]:
                dh0 = dht.float().clone() if dht is not None else torch.zeros(N, Hv, K, V, device=v.device)
            return (torch.zeros_like(q_in), torch.zeros_like(k_in), torch.zeros_like(v), torch.zeros_like(g),
                    torch.zeros_like(beta), dh0)
        q_in, k_in, q, k, v, g, beta, ws_w, ws_a, ws_g, ws_t, ws_s, ws_vn, cu, co, ci = saved
        dev = q.device
        bf, f32 = torch.bfloat16, torch.float32
        scale = aux["scale"]
        do = _aligned(do.to(bf).contiguous())
        if dht is not None:
            dht = _aligned(dht.to(f32).contiguous())
        has_h0 = aux["has_h0"]
        P, I32 = _ptr, _i32

        st = compile_kernel("bwd_state", (K, V, aux["num_wg"], 2))
        dqk = compile_kernel("bwd_dqk", (K, V))
        wy = compile_kernel("bwd_wy", (K, V, aux["beta_dtype"]))

        ws_dh = torch.empty(C, Hv, K, V, dtype=bf, device=dev)
        ws_dvn = torch.empty(C, Hv, BT, V, dtype=bf, device=dev)
        dh0 = torch.empty(N, Hv, K, V, dtype=f32, device=dev) if has_h0 else None
        dummy = ws_g.data_ptr()
        st(P("bfloat16", q.data_ptr(), 16), P("bfloat16", k.data_ptr(), 16), P("bfloat16", do.data_ptr(), 16),
           P("bfloat16", ws_w.data_ptr(), 16), P("bfloat16", ws_a.data_ptr(), 16),
           P("float32", ws_g.data_ptr(), 16),
           P("float32", dht.data_ptr() if dht is not None else dummy, 16),
           P("float32", dh0.data_ptr() if dh0 is not None else dummy, 16),
           P("bfloat16", ws_dh.data_ptr(), 16), P("bfloat16", ws_dvn.data_ptr(), 16),
           P("int32", cu.data_ptr(), 4), P("int32", co.data_ptr(), 4),
           I32(TT), I32(C), I32(N), I32(Hqk), I32(Hv), _f32(scale),
           I32(int(dht is not None)), I32(int(has_h0)), _stream())

        dq_v = torch.empty(TT, Hv, K, dtype=f32, device=dev)
        dk_v = torch.empty(TT, Hv, K, dtype=f32, device=dev)
        ws_dw = torch.empty(C, Hv, BT, K, dtype=bf, device=dev)
        ws_dg1 = torch.empty(C, Hv, BT, dtype=f32, device=dev)
        dqk(P("bfloat16", q.data_ptr(), 16), P("bfloat16", k.data_ptr(), 16), P("bfloat16", do.data_ptr(), 16),
            P("bfloat16", ws_s.data_ptr(), 16), P("bfloat16", ws_dh.data_ptr(), 16),
            P("bfloat16", ws_vn.data_ptr(), 16), P("bfloat16", ws_dvn.data_ptr(), 16),
            P("bfloat16", ws_a.data_ptr(), 16), P("float32", ws_g.data_ptr(), 16),
            P("float32", dq_v.data_ptr(), 16), P("float32", dk_v.data_ptr(), 16),
            P("bfloat16", ws_dw.data_ptr(), 16), P("float32", ws_dg1.data_ptr(), 16),
            P("int32", cu.data_ptr(), 4), P("int32", ci.data_ptr(), 4),
            I32(TT), I32(C), I32(N), I32(Hqk), I32(Hv), _f32(scale), _stream())

        dv = torch.empty(TT, Hv, V, dtype=f32, device=dev)
        dbeta = torch.empty(TT, Hv, dtype=f32, device=dev)
        dg = torch.empty(TT, Hv, dtype=f32, device=dev)
        wy(P("bfloat16", k.data_ptr(), 16), P("bfloat16", v.data_ptr(), 16), _beta_ptr(beta, aux["beta_dtype"]),
           P("bfloat16", ws_t.data_ptr(), 16), P("bfloat16", ws_dw.data_ptr(), 16),
           P("bfloat16", ws_dvn.data_ptr(), 16), P("float32", ws_g.data_ptr(), 16),
           P("float32", ws_dg1.data_ptr(), 16), P("float32", dk_v.data_ptr(), 16),
           P("float32", dv.data_ptr(), 16), P("float32", dbeta.data_ptr(), 16), P("float32", dg.data_ptr(), 16),
           P("int32", cu.data_ptr(), 4), P("int32", ci.data_ptr(), 4),
           I32(TT), I32(C), I32(N), I32(Hqk), I32(Hv), _stream())

        if debug_capture is not None:
            debug_capture.update(dS=ws_dh, dvn=ws_dvn, dw=ws_dw, dG1=ws_dg1)
        r = Hv // Hqk
        dq = dq_v.view(TT, Hqk, r, K).sum(2).view(B, T, Hqk, K)
        dk = dk_v.view(TT, Hqk, r, K).sum(2).view(B, T, Hqk, K)
        if aux["l2norm"]:
            # the kernels saw l2norm(q), l2norm(k): chain the gradient through the normalisation
            with torch.enable_grad():
                qr = q_in.detach().float().requires_grad_()
                kr = k_in.detach().float().requires_grad_()
                qn = qr * torch.rsqrt((qr * qr).sum(-1, keepdim=True) + 1e-6)
                kn = kr * torch.rsqrt((kr * kr).sum(-1, keepdim=True) + 1e-6)
                dq, dk = torch.autograd.grad([qn, kn], [qr, kr], [dq, dk])
        return (dq, dk, dv.view(B, T, Hv, V), dg.view(B, T, Hv), dbeta.view(B, T, Hv), dh0)


def _i32(x):
    import cutlass
    return cutlass.Int32(int(x))


def _f32(x):
    import cutlass
    return cutlass.Float32(float(x))


def _beta_ptr(beta, beta_dtype):
    return _ptr(beta_dtype, beta.data_ptr(), 4 if beta_dtype == "float32" else 2)


register_backend(CutlassBackend())
