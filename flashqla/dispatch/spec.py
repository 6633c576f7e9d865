"""CallSpec: what one call of the op is, as a small frozen, hashable value.

Backends decide from a CallSpec alone, so ``explain()`` can show every decision without running a
kernel, and compile caches can key on the fields that change generated code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .device import DeviceInfo


def dtype_name(dt: Optional[torch.dtype]) -> Optional[str]:
    return None if dt is None else str(dt).replace("torch.", "")


@dataclass(frozen=True)
class CallSpec:
    device: DeviceInfo
    dtype: str                 # q/k/v dtype, e.g. "bfloat16"
    g_dtype: str
    beta_dtype: str
    state_dtype: Optional[str]  # dtype of initial_state, None when there is none
    K: int
    V: int
    Hqk: int
    Hv: int
    varlen: bool
    has_initial_state: bool
    output_final_state: bool
    use_qk_l2norm: bool
    needs_grad: bool
    state_layout: str = "KV"   # [N, Hv, K, V]
    # Sizes below do not change generated code; they inform cost models (CP, per-shape ordering).
    batch: int = field(default=1, compare=False, hash=False)
    tokens: int = field(default=0, compare=False, hash=False)
    num_seqs: int = field(default=1, compare=False, hash=False)

    @property
    def group_ratio(self) -> int:
        return self.Hv // self.Hqk

    def summary(self) -> str:
        feats = [f"{self.dtype}", f"K={self.K}", f"V={self.V}", f"Hqk/Hv={self.Hqk}/{self.Hv}"]
        if self.varlen:
            feats.append(f"varlen({self.num_seqs} seqs)")
        if self.has_initial_state:
            feats.append("h0")
        if self.output_final_state:
            feats.append("ht")
        if self.use_qk_l2norm:
            feats.append("qk-l2norm")
        if self.needs_grad:
            feats.append("grad")
        return f"{self.device.describe()} | " + " ".join(feats)
