"""A progress bar on stderr: tqdm when it is importable, else a plain counter."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, desc: str = "", enabled: bool = True):
        self.total, self.n, self.desc, self.enabled = total, 0, desc, enabled
        self._bar = None
        # Not a terminal (a log file): no carriage-return redraws, one line per event instead.
        self.lines = not sys.stderr.isatty()
        if not enabled or self.lines:
            return
        try:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
        except Exception:  # tqdm missing or broken: fall back to the counter
            self._bar = None

    def status(self, text: str) -> None:
        """What is happening now (e.g. 'compile triton 16/32 1x8192')."""
        if not self.enabled:
            return
        if self.lines:
            if not text.startswith("compile"):  # keep logs short: the slow first calls only
                return
            sys.stderr.write(f"[{self.n}/{self.total}] {text}\n")
            sys.stderr.flush()
            return
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)
        else:
            sys.stderr.write(f"\r[{self.n}/{self.total}] {self.desc} {text}"[:160].ljust(100))
            sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled or self.lines:
            return
        if self._bar is not None:
            self._bar.update(n)
        else:
            sys.stderr.write(f"\r[{self.n}/{self.total}] {self.desc}".ljust(100))
            sys.stderr.flush()

    def write(self, text: str) -> None:
        """A line that must not be overwritten by the bar."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            if self.enabled and not self.lines:
                sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled or self.lines:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()
