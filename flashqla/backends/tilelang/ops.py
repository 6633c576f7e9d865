"""Host side of the TileLang backend: chunk metadata, buffers, kernel launches.

Nothing here reads device memory on the host: varlen metadata comes from ``VarlenMeta`` (built once
by validation or ``prepare_varlen``), and the equal-length batch case gets the same three int32
tensors from ``torch.arange`` on the device, so both cases run the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ._compile import get_kernel
from .chunk_fwd_sm90 import build_fwd
from .chunk_intra_sm90 import build_intra

CHUNK = 64
# State columns per CTA of the recurrence kernel (V / BV CTAs per sequence and head).
FWD_BV = 64

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _tl_dtype(dt: torch.dtype) -> str:
    return _DTYPE_NAMES[dt]


@dataclass
class ChunkMeta:
    cu_seqlens: torch.Tensor      # int32 [N+1]
    chunk_offsets: torch.Tensor   # int32 [N+1]
    chunk_indices: torch.Tensor   # int32 [NC, 2]
    num_seqs: int
    num_chunks: int


_META_CACHE: dict = {}
_DUMMIES: dict = {}


def chunk_meta(varlen, B: int, T: int, device) -> ChunkMeta:
    if varlen is not None:
        return ChunkMeta(varlen.cu_seqlens, varlen.chunk_offsets, varlen.chunk_indices,
                         varlen.num_seqs, varlen.total_chunks)
    key = (B, T, str(device))
    m = _META_CACHE.get(key)
    if m is None:
        nc = (T + CHUNK - 1) // CHUNK
        ar = torch.arange(B + 1, device=device, dtype=torch.int32)
        cidx = torch.stack([torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(nc),
                            torch.arange(nc, device=device, dtype=torch.int32).repeat(B)], 1).contiguous()
        m = ChunkMeta(ar * T, ar * nc, cidx, B, B * nc)
        if len(_META_CACHE) > 64:
            _META_CACHE.clear()
        _META_CACHE[key] = m
    return m


def dummy(shape, dtype, device) -> torch.Tensor:
    """A small placeholder for a tensor argument a kernel variant does not touch."""
    key = (tuple(shape), dtype, str(device))
    t = _DUMMIES.get(key)
    if t is None:
        t = torch.zeros(shape, dtype=dtype, device=device)
        _DUMMIES[key] = t
    return t


def aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned start (what TMA descriptors need)."""
    t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def intra_kernel(dtype, beta_dtype, K, V, l2norm, save_x):
    return get_kernel("fwd_intra_sm90", build_intra,
                      (_tl_dtype(dtype), _tl_dtype(beta_dtype), K, V, bool(l2norm), bool(save_x)))


def fwd_kernel(dtype, K, V, l2norm, has_h0, store_ht, save_states, BV=FWD_BV):
    return get_kernel("fwd_recurrent_sm90", build_fwd,
                      (_tl_dtype(dtype), K, V, BV, bool(l2norm), bool(has_h0), bool(store_ht),
                       bool(save_states)))


@dataclass
class FwdResult:
    o: torch.Tensor
    ht: Optional[torch.Tensor]
    w: torch.Tensor
    u: torch.Tensor
    G: torch.Tensor
    X: Optional[torch.Tensor]
    h: Optional[torch.Tensor]
    v_new: Optional[torch.Tensor]
    meta: ChunkMeta


def forward(q, k, v, g, beta, scale: float, h0, varlen, output_final_state: bool, l2norm: bool,
            save: bool) -> FwdResult:
    """q, k [B, T, Hqk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; h0 [N, Hv, K, V] or None."""
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    dev = q.device
    dt = q.dtype
    meta = chunk_meta(varlen, B, T, dev)
    NT, NC, NS = B * T, meta.num_chunks, meta.num_seqs
    ratio = Hv // Hqk

    qf = aligned(q.reshape(NT, Hqk, K))
    kf = aligned(k.reshape(NT, Hqk, K))
    vf = aligned(v.reshape(NT, Hv, V))
    gf = g.reshape(NT, Hv).to(torch.float32).contiguous()
    if beta.dtype not in _DTYPE_NAMES:
        beta = beta.to(torch.float32)
    bf = beta.reshape(NT, Hv).contiguous()

    w = torch.empty(NC, Hv, CHUNK, K, dtype=dt, device=dev)
    u = torch.empty(NC, Hv, CHUNK, V, dtype=dt, device=dev)
    G = torch.empty(NC, Hv, CHUNK, dtype=torch.float32, device=dev)
    X = torch.empty(NC, Hv, CHUNK, CHUNK, dtype=torch.float32, device=dev) if save else \
        dummy((1, 1, CHUNK, CHUNK), torch.float32, dev)
    intra_kernel(dt, bf.dtype, K, V, l2norm, save)(
        kf, vf, gf, bf, meta.cu_seqlens, meta.chunk_indices, w, u, G, X, ratio)

    o = torch.empty(NT, Hv, V, dtype=dt, device=dev)
    has_h0 = h0 is not None
    h0f = aligned(h0.to(torch.float32)) if has_h0 else dummy((1, 1, K, V), torch.float32, dev)
    ht = torch.empty(NS, Hv, K, V, dtype=torch.float32, device=dev) if output_final_state else \
        dummy((1, 1, K, V), torch.float32, dev)
    if save:
        hs = torch.empty(NC, Hv, K, V, dtype=dt, device=dev)
        vn = torch.empty(NC, Hv, CHUNK, V, dtype=dt, device=dev)
    else:
        hs = dummy((1, 1, K, V), dt, dev)
        vn = dummy((1, 1, CHUNK, V), dt, dev)
    fwd_kernel(dt, K, V, l2norm, has_h0, output_final_state, save)(
        qf, kf, w, u, G, meta.cu_seqlens, meta.chunk_offsets, h0f, o, ht, hs, vn, float(scale), ratio)

    return FwdResult(o.reshape(B, T, Hv, V), ht if output_final_state else None, w, u, G,
                     X if save else None, hs if save else None, vn if save else None, meta)
