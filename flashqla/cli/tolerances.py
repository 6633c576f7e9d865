"""The tolerance table of ``check``: relative L2 error vs the float64 oracle, per input dtype.

One table serves ``python -m flashqla check`` and the test suite: it lives in
:data:`flashqla.testing.TOLERANCES` and is re-exported here, so the CLI, its tests and the shared
correctness suite can never disagree.  ``||x - ref|| / ||ref||`` with ``ref`` from the float64
recurrence on float64 copies of the inputs (the inputs' own rounding is not counted); inputs: q, k
L2-normalised, ``beta = sigmoid(randn)``, ``g = logsigmoid(randn)``.

    dtype        o / ht (final state)   dq dk dv dh0   dg dbeta
    float32      1e-5                   1e-5           1e-5      (exact fp32 math: cpu, reference)
    float32-tc   2e-3                   5e-3           1e-2      (fp32 inputs on tensor cores: tf32)
    bfloat16     5e-3                   1e-2           2e-2
    float16      as bfloat16
"""

from __future__ import annotations

from ..testing import GRAD_NAMES, TOLERANCES, tolerance_key

QUANTITIES = ("o", "ht") + tuple(GRAD_NAMES)
_ALIASES = {"state": "ht", "final_state": "ht"}


def tolerance(dtype, quantity: str, exact_fp32: bool = True) -> float:
    """Tolerance for ``quantity`` (o, ht / state, dq, dk, dv, dg, dbeta, dh0) from inputs of ``dtype``
    (a torch dtype or its name; fp32 on tensor cores: ``exact_fp32=False``)."""
    name = str(dtype).replace("torch.", "")
    if name == "float32" and not exact_fp32:
        name = "float32-tc"
    q = _ALIASES.get(quantity, quantity)
    try:
        return TOLERANCES[name][q]
    except KeyError:
        raise KeyError(f"no tolerance for dtype {name!r} / quantity {quantity!r}; dtypes: "
                       f"{', '.join(TOLERANCES)}; quantities: {', '.join(QUANTITIES)}") from None


__all__ = ["QUANTITIES", "TOLERANCES", "tolerance", "tolerance_key"]
