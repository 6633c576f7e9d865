"""Device detection for dispatch, with an override for tests and tooling.

An architecture tag is ``"cpu"`` or ``"sm_<major><minor>"`` (``"sm_90"`` for Hopper).  Backend
priorities are keyed by patterns over these tags (see ``registry.match_priority``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass(frozen=True)
class DeviceInfo:
    type: str                                   # "cpu" or "cuda"
    capability: Optional[tuple[int, int]] = None  # CUDA compute capability
    name: str = ""
    sm_count: int = 0
    faked: bool = False

    @property
    def arch(self) -> str:
        if self.type == "cuda" and self.capability is not None:
            return f"sm_{self.capability[0]}{self.capability[1]}"
        return self.type

    def describe(self) -> str:
        tag = self.arch if self.type != "cpu" else "cpu"
        extra = f" ({self.name})" if self.name else ""
        return f"{tag}{extra}{' [faked]' if self.faked else ''}"


_override = threading.local()


@functools.lru_cache(maxsize=None)
def _cuda_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo("cuda", (props.major, props.minor), props.name, props.multi_processor_count)


def detect(device: torch.device) -> DeviceInfo:
    """The DeviceInfo of ``device``, or the faked one inside :func:`fake_device`."""
    fake = getattr(_override, "info", None)
    if fake is not None:
        return fake
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_info(index)
    return DeviceInfo(device.type, None, "")


@contextlib.contextmanager
def fake_device(type: str = "cuda", capability: Optional[tuple[int, int]] = (9, 0), name: str = "fake",
                sm_count: int = 132) -> Iterator[DeviceInfo]:
    """Make dispatch believe the tensors live on this device (testing selection without a GPU)."""
    info = DeviceInfo(type, tuple(capability) if capability is not None else None, name, sm_count, faked=True)
    prev = getattr(_override, "info", None)
    _override.info = info
    try:
        yield info
    finally:
        _override.info = prev
