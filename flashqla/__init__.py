"""flashqla: Gated Delta Network (GDN) chunked linear attention kernels, many backends, one op."""

__version__ = "0.1.0"

from .api import (GDNContext, chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd,
                  explain)
from .dispatch import BackendUnavailableError, fake_device, get_backend, list_backends, register_backend
from .dispatch.registry import Backend
from .reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from .varlen import VarlenMeta, prepare_varlen
from .cp import chunk_gated_delta_rule_cp, cp_plan
from .decode import gated_delta_rule_decode
from .gating import gdn_gating, gdn_gating_ref

__all__ = ["Backend", "BackendUnavailableError", "GDNContext", "VarlenMeta", "chunk_gated_delta_rule",
           "chunk_gated_delta_rule_bwd", "chunk_gated_delta_rule_cp", "chunk_gated_delta_rule_fwd", "cp_plan",
           "gated_delta_rule_decode", "gdn_gating", "gdn_gating_ref", "chunk_gated_delta_rule_ref",
           "explain", "fake_device", "get_backend", "list_backends", "prepare_varlen",
           "recurrent_gated_delta_rule_ref", "register_backend"]
