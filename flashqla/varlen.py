"""Variable-length batches: ``cu_seqlens`` checked once on the host, plus the chunk metadata kernels use.

Checking ``cu_seqlens`` values needs them on the host, i.e. one device->host copy.  Callers that want a
sync-free op (CUDA graph capture) build the metadata once, outside the captured region, with
:func:`prepare_varlen` and pass it as ``varlen_meta=``: then the op never reads device memory on the
host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .reference import CHUNK_SIZE


@dataclass(frozen=True, eq=False)
class VarlenMeta:
    """Host-checked description of a varlen batch.

    cu_seqlens      int32 [N+1] on the tensors' device
    cu_seqlens_cpu  tuple of N+1 Python ints (the same values)
    chunk_offsets   int32 [N+1] on the device: cumulative number of 64-token chunks per sequence
    chunk_indices   int32 [total_chunks, 2] on the device: (sequence, chunk within sequence)
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: tuple
    chunk_offsets: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_cpu) - 1

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens_cpu[-1]

    @property
    def total_chunks(self) -> int:
        return int(self.chunk_indices.shape[0])

    @functools.cached_property
    def max_seqlen(self) -> int:
        # (cached: read on every call by the launch heuristics, O(N) in Python for N sequences)
        c = self.cu_seqlens_cpu
        return max((c[i + 1] - c[i] for i in range(len(c) - 1)), default=0)

    @functools.cached_property
    def busy_seqs(self) -> float:
        """How many sequences are in flight, on average, over the longest one's serial walk:
        ``sum(len) / max(len)`` (the sequence count when they are equal; ~1.14 for 28672 + 4096).  A state
        recurrence's makespan is its longest walk; short sequences finish early and leave their SMs idle, so
        the GPU backends' launch heuristics (V-block, stages) count this rather than the sequences."""
        longest = self.max_seqlen
        return self.total_tokens / longest if longest > 0 else float(self.num_seqs)

    @functools.cached_property
    def walk_order(self) -> torch.Tensor:
        """int32 [N] on the device: the sequences by descending length (ties by index).  The triton serial kernels
        launch the longest walks first with it when asked (``serial.order``), so it is built on first use, not
        for every batch; that first use uploads it and must not be inside CUDA-graph capture."""
        if self.cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("VarlenMeta.walk_order is built on the host on first use, which cannot happen during "
                               "CUDA graph capture: run the call once before capturing it")
        lens = self.seqlens
        order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
        return torch.tensor(order, dtype=torch.int32).to(self.cu_seqlens.device, non_blocking=True)

    @property
    def seqlens(self) -> list[int]:
        c = self.cu_seqlens_cpu
        return [c[i + 1] - c[i] for i in range(len(c) - 1)]


def check_cu_seqlens_values(values, total_tokens: Optional[int], name: str = "cu_seqlens") -> None:
    if len(values) < 1:
        raise ValueError(f"{name} must hold at least one value (0), got an empty tensor")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {values[0]}")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(f"{name} must be non-decreasing, got {name}[{i}] = {values[i]} > "
                             f"{name}[{i + 1}] = {values[i + 1]}")
    if total_tokens is not None and values[-1] != total_tokens:
        raise ValueError(f"{name}[-1] must equal the number of tokens T = {total_tokens}, got {values[-1]}")


def prepare_varlen(cu_seqlens: torch.Tensor, total_tokens: Optional[int] = None,
                   chunk_size: int = CHUNK_SIZE) -> VarlenMeta:
    """Check ``cu_seqlens`` (int32, 1-D, starts at 0, non-decreasing) and build the chunk metadata.

    Performs one device->host copy; call it outside CUDA-graph capture and reuse the result.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int32, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32 [N+1], got {cu_seqlens.dtype} (use cu_seqlens.to(torch.int32))")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("cu_seqlens must be checked on the host, which cannot happen during CUDA graph "
                           "capture: build flashqla.prepare_varlen(cu_seqlens) before capturing and pass it "
                           "as varlen_meta=")
    values = tuple(int(x) for x in cu_seqlens.tolist())
    check_cu_seqlens_values(values, total_tokens)
    lens = [values[i + 1] - values[i] for i in range(len(values) - 1)]
    nchunks = [(n + chunk_size - 1) // chunk_size for n in lens]
    offsets = [0]
    for n in nchunks:
        offsets.append(offsets[-1] + n)
    pairs = [(s, c) for s, n in enumerate(nchunks) for c in range(n)]
    dev = cu_seqlens.device
    chunk_offsets = torch.tensor(offsets, dtype=torch.int32).to(dev, non_blocking=True)
    chunk_indices = torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2).to(dev, non_blocking=True)
    return VarlenMeta(cu_seqlens.contiguous(), values, chunk_offsets, chunk_indices, chunk_size)
