"""A notice on stderr while a kernel build runs long.

A kernel's first use on a machine with a cold cache builds it: 10-30 s per TileLang variant, seconds per CuTe
DSL one, and a first call may need several.  Without a word the process just looks hung, so a build still
running after ``FLASHQLA_BUILD_NOTICE_S`` seconds (default 2; ``off`` or a negative number: never) prints
one line when it passes that mark and one when it ends, with the running count of this process's builds.
Builds that hit a disk cache end well inside the mark and print nothing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

_DEFAULT_DELAY_S = 2.0
_lock = threading.Lock()
_builds = [0]     # builds started in this process (the notices number them)
_quiet = [0]      # > 0 inside quiet()


@contextmanager
def quiet():
    """No notices inside (a caller that reports each build itself, e.g. ``python -m flashqla precompile``)."""
    with _lock:
        _quiet[0] += 1
    try:
        yield
    finally:
        with _lock:
            _quiet[0] -= 1


def notice_delay() -> float:
    """Seconds a build runs before its notice (negative: no notice), from ``FLASHQLA_BUILD_NOTICE_S``."""
    raw = os.environ.get("FLASHQLA_BUILD_NOTICE_S", "").strip().lower()
    if not raw:
        return _DEFAULT_DELAY_S
    if raw in ("off", "none", "no"):
        return -1.0
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"FLASHQLA_BUILD_NOTICE_S must be a number of seconds or 'off', got {raw!r}") from None


@contextmanager
def build_notice(backend: str, name: str, key, stream=None):
    """Wrap one kernel build; prints to ``stream`` (default stderr) only if it outlasts the notice delay."""
    delay = notice_delay()
    with _lock:
        _builds[0] += 1
        nth = _builds[0]
    if delay < 0 or _quiet[0]:
        yield
        return
    out = stream if stream is not None else sys.stderr
    state = {"shown": False}
    t0 = time.perf_counter()

    def show():
        with _lock:
            if state.get("done"):
                return
            state["shown"] = True
            print(f"flashqla: building {backend} kernel {name} {key} (build {nth} of this process; first use "
                  f"on this machine, cached afterwards) ...", file=out, flush=True)

    timer = threading.Timer(delay, show)
    timer.daemon = True
    timer.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        timer.cancel()
        with _lock:
            state["done"] = True
            if state["shown"]:
                print(f"flashqla: {backend} kernel {name} {'built' if ok else 'failed'} after "
                      f"{time.perf_counter() - t0:.1f} s", file=out, flush=True)
