"""Dispatch: CallSpec, the backend registry, device detection and the selection rule."""

from .device import DeviceInfo, detect, fake_device
from .registry import (Backend, BackendRuntimeError, BackendUnavailableError, Candidate, Decision, FwdInputs, decide,
                       KernelBuildError, get_backend, list_backends, match_priority, priority_of, register_backend, select,
                       unregister_backend)
from .spec import CallSpec

__all__ = ["Backend", "BackendRuntimeError", "BackendUnavailableError", "CallSpec", "Candidate", "Decision", "DeviceInfo",
           "FwdInputs", "KernelBuildError", "decide", "detect", "fake_device", "get_backend", "list_backends", "match_priority",
           "priority_of", "register_backend", "select", "unregister_backend"]
