"""Inputs and the row presets of ``bench`` (``check`` uses the shared suite's cases, flashqla.testing).

Inputs follow the usual GDN recipe: q, k L2-normalised over K (unless the case tests the fused
L2 norm, then they are plain Gaussian), v Gaussian, ``g = logsigmoid(randn)`` (times a factor for the
strong-decay case) in float32, ``beta = sigmoid(randn)``.  Sequences are packed (B = 1 plus int32
``cu_seqlens``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ..reference import l2norm

HEAD_DIM = 128


def _gen(device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def make_inputs(seqlens=None, Hqk: int = 2, Hv: int = 4, K: int = HEAD_DIM, V: int = HEAD_DIM,
                dtype=torch.bfloat16, device="cpu", *, batch: Optional[int] = None, T: Optional[int] = None,
                h0: bool = False, normalize_qk: bool = True, g_scale: float = 1.0, beta_dtype=None,
                seed: int = 0) -> dict:
    """Random GDN inputs.

    Packed when ``seqlens`` is given (B = 1, int32 ``cu_seqlens`` on ``device``), else ``batch`` sequences
    of ``T`` tokens.  Returns a dict with q, k, v, g, beta, initial_state (or None), cu_seqlens (or None),
    seqlens (list of ints).
    """
    device = torch.device(device)
    gen = _gen(device, seed)
    if seqlens is not None:
        seqlens = [int(n) for n in seqlens]
        B, TT = 1, sum(seqlens)
        cu = torch.tensor([0] + list(_cumsum(seqlens)), dtype=torch.int32, device=device)
        N = len(seqlens)
    else:
        B, TT, cu = int(batch or 1), int(T), None
        seqlens, N = [TT] * B, B
    beta_dtype = beta_dtype or dtype

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q, k = randn(B, TT, Hqk, K), randn(B, TT, Hqk, K)
    if normalize_qk:
        q, k = l2norm(q), l2norm(k)
    v = randn(B, TT, Hv, V)
    g = F.logsigmoid(randn(B, TT, Hv)) * g_scale
    beta = torch.sigmoid(randn(B, TT, Hv))
    state = randn(N, Hv, K, V) * 0.5 if h0 else None
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.float(), beta=beta.to(beta_dtype),
                initial_state=state, cu_seqlens=cu, seqlens=seqlens)


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


# --------------------------------------------------------------------------------------------------
# bench presets


@dataclass(frozen=True)
class BenchRow:
    Hqk: int
    Hv: int
    seqlens: tuple
    label: str = ""

    @property
    def tokens(self) -> int:
        return int(sum(self.seqlens))

    @property
    def heads(self) -> str:
        return f"{self.Hqk}/{self.Hv}"

    @property
    def shape(self) -> str:
        return self.label or seqlens_label(self.seqlens)

    def name(self) -> str:
        return f"{self.heads} {self.shape}"


@dataclass
class Preset:
    name: str
    mode: str                   # "fwd" or "fwdbwd"
    rows: list = field(default_factory=list)
    about: str = ""


def seqlens_label(seqlens) -> str:
    s = list(seqlens)
    if len(set(s)) == 1:
        return f"{len(s)}x{s[0]}"
    if len(s) <= 3:
        return "+".join(str(x) for x in s)
    return f"{len(s)} seqs/{sum(s)}"


def random_split(total: int, n: int, seed: int) -> tuple:
    """``n`` random sequence lengths (each at least 64 tokens) summing to ``total``; deterministic."""
    if n == 1:
        return (total,)
    rng = random.Random(seed)
    lo = 64
    free = max(total - n * lo, 0)
    cuts = sorted(rng.randint(0, free) for _ in range(n - 1))
    edges = [0] + cuts + [free]
    parts = [edges[i + 1] - edges[i] + lo for i in range(n)]
    parts[-1] += total - sum(parts)  # only when total < n * lo
    return tuple(parts)


QWEN35_HEADS = [(2, 8), (4, 16), (8, 32), (16, 32), (16, 64)]
QWEN35_FWD_SEQS = [(32768,), (8192,), (28672, 4096), (8192,) * 4, (1024,) * 8]
FLASHQLA_FWD_HEADS = [(2, 8), (4, 16), (8, 32), (16, 64), (16, 32), (8, 24), (16, 48), (16, 16), (32, 32)]
FLASHQLA_FWD_SEQS = [(32768,), (16384,), (8192,), (4096,), (2048,), (28672, 4096), (16384, 16384),
                     (4096, 28672), (8192,) * 4, (4096,) * 8, (2048,) * 4, (1024,) * 8]
FLASHQLA_BWD_HEADS = [(16, 32), (8, 16), (4, 8), (2, 4)]


def _tok(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def presets(device_type: str = "cuda") -> dict:
    """All presets.  ``quick`` is small; on the CPU it is smaller still."""
    out = {}
    if device_type == "cuda":
        quick = [BenchRow(2, 4, (4096,)), BenchRow(16, 32, (8192,)), BenchRow(16, 32, (2048, 1000, 1, 67))]
    else:
        quick = [BenchRow(1, 2, (192,)), BenchRow(2, 4, (64, 1, 100))]
    out["quick"] = Preset("quick", "fwd", quick, "a few small rows (a smoke test of the harness)")
    out["qwen35-fwd"] = Preset("qwen35-fwd", "fwd",
                               [BenchRow(a, b, s) for a, b in QWEN35_HEADS for s in QWEN35_FWD_SEQS],
                               "Qwen3.5 head configurations (TP8..TP1) x prefill batch shapes, forward")
    rows = []
    for a, b in QWEN35_HEADS:
        for total in (8192, 32768):
            for n in (1, 4):
                rows.append(BenchRow(a, b, (total // n,) * n, f"{n}x{_tok(total // n)}"))
    out["qwen35-bwd"] = Preset("qwen35-bwd", "fwdbwd", rows, "Qwen3.5 heads x {8k, 32k} tokens x {1, 4} seqs, "
                               "forward + backward")
    out["flashqla-fwd"] = Preset("flashqla-fwd", "fwd",
                                 [BenchRow(a, b, s) for a, b in FLASHQLA_FWD_HEADS for s in FLASHQLA_FWD_SEQS],
                                 "the forward grid of FlashQLA's published benchmark")
    rows = []
    for a, b in FLASHQLA_BWD_HEADS:
        for total in (8192, 32768):
            for n in (1, 2, 4, 8):
                s = random_split(total, n, seed=1000 * n + total)
                rows.append(BenchRow(a, b, s, f"{_tok(total)} in {n} random seqs"))
    out["flashqla-bwd"] = Preset("flashqla-bwd", "fwdbwd", rows,
                                 "the backward grid of FlashQLA's published benchmark (random sequence splits)")
    return out
