"""The tolerance table of ``check`` (and of the tests that import it): relative L2 error vs the oracle.

``||x - ref|| / ||ref||`` with ``ref`` from the float64 recurrence on float64 copies of the inputs
(so the rounding of the inputs themselves is not counted).  Inputs: q, k L2-normalised,
``beta = sigmoid(randn)``, ``g = logsigmoid(randn)``.  Quantities: ``o``, ``state`` (the final state)
and the gradients ``dq dk dv dg dbeta dh0``.
"""

from __future__ import annotations

QUANTITIES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")

_FP32 = {q: 1e-5 for q in QUANTITIES}
_BF16 = {"o": 5e-3, "state": 5e-3, "dq": 1e-2, "dk": 1e-2, "dv": 1e-2, "dh0": 1e-2, "dg": 2e-2, "dbeta": 2e-2}

TOLERANCES = {
    "float64": {q: 1e-10 for q in QUANTITIES},
    "float32": _FP32,
    "bfloat16": _BF16,
    # float16 keeps 3 more mantissa bits than bfloat16; the bf16 budget is a safe upper bound.
    "float16": dict(_BF16),
}


def tolerance(dtype, quantity: str) -> float:
    """Tolerance for ``quantity`` computed from inputs of ``dtype`` (a torch dtype or its name)."""
    name = str(dtype).replace("torch.", "")
    try:
        return TOLERANCES[name][quantity]
    except KeyError:
        raise KeyError(f"no tolerance for dtype {name!r} / quantity {quantity!r}; dtypes: "
                       f"{', '.join(TOLERANCES)}; quantities: {', '.join(QUANTITIES)}") from None
