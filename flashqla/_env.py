"""Reading the library's tuning switches from the environment (``FLASHQLA_*``): one choice, or a set of options.

Values are case-insensitive and stripped; an unknown value raises ``ValueError`` naming the variable and what
it accepts, so a typo never silently selects the default.
"""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple, default: str) -> str:
    """The value of environment variable ``name`` (``default`` when unset or empty), one of ``choices``."""
    v = os.environ.get(name, default).strip().lower() or default
    if v not in choices:
        raise ValueError(f"{name} must be {' or '.join(repr(c) for c in choices)}, got {v!r}")
    return v


def env_options(name: str, known: tuple, default: str = "") -> set:
    """The comma-separated options of ``name`` (``default`` when unset; ``none`` or empty: no option), each
    one of ``known``."""
    raw = os.environ.get(name, default)
    opts = {x.strip().lower() for x in raw.split(",") if x.strip()} - {"none"}
    if opts - set(known):
        raise ValueError(f"{name}: unknown {sorted(opts - set(known))}; known: {known}")
    return opts
