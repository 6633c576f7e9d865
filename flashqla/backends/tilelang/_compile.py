"""Compile cache of the TileLang kernels.

Every kernel is built from a *key* that holds only what changes the generated code (head dims, dtypes,
flags, tile sizes); token counts, batch, number of sequences and head counts are symbolic
(``T.dynamic``) in the kernels, so a new length never recompiles.  Two levels of caching:

* in memory: ``_KERNELS[(builder name, key)]`` -> the compiled ``JITKernel``;
* on disk: ``tilelang.compile`` goes through TileLang's own kernel cache (``TILELANG_CACHE_DIR``,
  default ``~/.tilelang/cache``), so a new process reuses earlier builds.

``COMPILE_COUNT`` counts in-memory misses (calls into ``tilelang.compile``); tests read it through
:func:`compile_count` to check that a second sequence length does not compile again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

from ..._build_notice import build_notice

# Kernels are compiled for Hopper with the architecture-specific features (wgmma, TMA, setmaxnreg)
# enabled; "sm_90a" also lets the kernels compile on a machine without a GPU.
TARGET = {"kind": "cuda", "arch": "sm_90a"}

COMPILE_COUNT = 0
COMPILE_SECONDS = 0.0
_KERNELS: dict = {}
_LOCK = threading.Lock()
# While ``record_keys()`` is active: the list that get_kernel appends (name, builder, key) to.
_RECORD = None


@contextlib.contextmanager
def record_keys():
    """Within the block ``get_kernel`` compiles nothing: it appends ``(name, builder, key)`` to the
    yielded list and returns a launcher that does nothing.  ``python -m flashqla precompile`` runs the
    host code of ``ops`` on meta tensors under it to enumerate the variants from the real code paths."""
    global _RECORD
    prev, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = prev


def _no_launch(*args, **kwargs):
    return None


def compile_count() -> int:
    return COMPILE_COUNT


def cached_kernels() -> list:
    """The (builder name, key) pairs compiled in this process."""
    return list(_KERNELS)


def get_kernel(name: str, builder: Callable[..., Any], key: tuple):
    """The compiled kernel of ``builder(*key)``; compiles it (once per process) on first use."""
    global COMPILE_COUNT, COMPILE_SECONDS
    if _RECORD is not None:
        _RECORD.append((name, builder, key))
        return _no_launch
    ck = (name, key)
    kern = _KERNELS.get(ck)
    if kern is not None:
        return kern
    with _LOCK:
        kern = _KERNELS.get(ck)
        if kern is None:
            t0 = time.perf_counter()
            try:
                import tilelang

                with build_notice("tilelang", name, key):
                    func = builder(*key)
                    kern = tilelang.compile(func, out_idx=None, target=TARGET)
            except Exception as exc:
                from ...dispatch.registry import KernelBuildError
                raise KernelBuildError("tilelang", name, key, exc) from exc
            COMPILE_SECONDS += time.perf_counter() - t0
            COMPILE_COUNT += 1
            _KERNELS[ck] = kern
    return kern
