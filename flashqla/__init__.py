"""flashqla: Gated Delta Network (GDN) chunked linear attention kernels, many backends, one op."""

__version__ = "0.1.0"

from .api import (GDNContext, chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd,
                  explain)
from .dispatch import BackendUnavailableError, fake_device, get_backend, list_backends, register_backend
from .dispatch.registry import Backend
from .reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from .varlen import VarlenMeta, prepare_varlen

__all__ = ["Backend", "BackendUnavailableError", "GDNContext", "VarlenMeta", "chunk_gated_delta_rule",
           "chunk_gated_delta_rule_bwd", "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_ref",
           "explain", "fake_device", "get_backend", "list_backends", "prepare_varlen",
           "recurrent_gated_delta_rule_ref", "register_backend"]
