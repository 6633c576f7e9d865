"""Command-line tools: ``python -m flashqla info | check | bench``.

* :mod:`.info`   - versions, the device, every backend's availability and the ``backend="auto"`` order;
* :mod:`.check`  - correctness of every available backend against the float64 oracle;
* :mod:`.bench`  - timing (CUDA graphs on GPU, wall clock on CPU) against FLA / FlashQLA baselines,
  with FLOP and byte counts and the roofline floor of :mod:`.roofline`.

Inputs, correctness cases and benchmark presets live in :mod:`.cases`, the tolerance table in
:mod:`.tolerances` (one place, imported by the tests too).
"""
