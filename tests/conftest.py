"""Test configuration: GPU marker handling and the Triton interpreter on GPU-less machines."""

import os

import pytest
import torch

# Triton decides at decoration time whether a kernel is interpreted, so this must happen before any
# flashqla triton module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
