"""Exact context parallelism (CP): split long sequences into segments, run the segments side by side.

Why.  The chunked kernels are parallel over chunks except for one sequential scan of the state along each
sequence, whose parallelism is only (sequences x value heads x V tiles).  A few long sequences with few
heads (long-context prefill, tensor parallelism splitting the heads) leave most SMs idle.  CP cuts each
long sequence into segments and runs the segments of *all* sequences as ONE packed varlen batch, so the
sequential scan is segment-long instead of sequence-long.

The math (exact, for any gate including g = 0).  Per value head, a segment's end state is affine in its
start state::

    S_end = M S_start + S_local

``S_local`` is the segment's end state from a zero start state and ``M`` (K x K) is the product over the
segment's tokens of ``exp(g_t) (I - beta_t k_t k_t^T)``, latest token on the left.  Per 64-token chunk
(u = 0 in the chunk update of :mod:`flashqla.reference`)::

    M_chunk = Gamma_C I - (exp(G_C - G) * k)^T w,     w = T (beta * Gamma * k),  T = (I + A)^-1

(every exponent is <= 0 for g <= 0, so nothing overflows and nothing is dropped: unlike cut-off CP schemes
that neglect decayed terms, this is exact up to rounding).

Forward: (1) run the non-last segments of every split sequence from a zero state (their final states,
``S_local``), (2) compute ``M`` per segment (torch ops, batched over segments, heads and chunks, float32
accumulate; a tree product within blocks of chunks, a bounded memory budget), (3) scan the segments of each
sequence in order, ``S_start[i+1] = M[i] S_start[i] + S_local[i]``, (4) run all segments again with their
true start states: ``o`` and the final states.

Backward (exact, ``M`` is not differentiated): the gradient is the sum of each segment's backward given its
true start state and its true end-state cotangent ``dS_end[i] = dh0[i+1]``.  One backward of the packed
batch with ``dht = 0`` gives each segment's ``dh0_local`` (``dh0`` does not depend on the start state:
the segment map is affine), a backward scan ``dh0[i] = dh0_local[i] + M[i]^T dS_end[i]`` gives the true
cotangents, and a second backward of the packed batch with them gives every gradient.

Cost: two forward passes and two backward passes of the backend plus the ``M`` products, against one of
each; it pays when the sequential scan dominates (see :func:`segment_plan`, whose constants are rough
guesses meant to be calibrated on the GPU).

Memory beyond the plain op: one fp32 ``K x K`` matrix per (segment of a split sequence, value head), kept for
the backward; start states and end states per segment (``[segments, Hv, K, V]`` fp32); the gathered copy of
the non-last segments' inputs for pass (1); temporaries of the ``M`` computation bounded by
``memory_budget`` (256 MiB by default, the chunk block shrinks to fit).

Everything here goes through the public backend contract (``select(spec)`` -> ``backend.forward`` /
``backend.backward``), so every backend gets CP for free.  Backends must tolerate two ``backward`` calls on
one ``saved`` (none of ours mutates it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .dispatch.registry import FwdInputs, select
from .reference import CHUNK_SIZE, l2norm
from .validation import validate
from .varlen import VarlenMeta, prepare_varlen

__all__ = ["CPCostModel", "CPPlan", "segment_plan", "split_even", "cp_plan", "chunk_gated_delta_rule_cp",
           "transition_matrices"]


# ---------------------------------------------------------------------------------------------------------
# The plan and its cost model
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CPCostModel:
    """A rough makespan model, in units of one chunk step of the sequential state scan for one
    (segment, head, V tile) lane on one SM.  Uncalibrated guesses: measure on the GPU and adjust.

    slots_per_sm     lanes of the state scan resident per SM at once
    state_tile_v     V columns per lane (a lane is a (sequence, head, V tile) program of the scan)
    parallel_cost    work of the chunk-parallel kernels (kkt, solve, w/u, output) per (chunk, head),
                     spread over every SM
    m_cost           work of the M products per (chunk, head) at K = V = 128 (scaled by K(64+K)/(128V))
    pass_overhead    fixed cost of each extra pass (launches, gathers, the segment scan)
    backward_factor  one backward pass costs this many forward passes
    min_gain         CP is used only when the model predicts at least this relative saving
    """

    slots_per_sm: int = 2
    state_tile_v: int = 64
    parallel_cost: float = 0.5
    m_cost: float = 1.0
    pass_overhead: float = 30.0
    backward_factor: float = 2.0
    min_gain: float = 0.15


@dataclass(frozen=True)
class CPPlan:
    """How CP splits one call: the segment lengths of every sequence, and why."""

    seqlens: tuple
    segments: tuple            # per sequence, a tuple of segment lengths summing to its length
    num_heads: int
    sm_count: int
    segment_len: int = 0       # the target segment length (0: none / explicit segments)
    cost_plain: float = 0.0    # model time without CP (CPCostModel units)
    cost_cp: float = 0.0       # model time with this plan
    reason: str = ""

    @property
    def enabled(self) -> bool:
        return any(len(s) > 1 for s in self.segments)

    @property
    def num_segments(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def split_sequences(self) -> int:
        return sum(1 for s in self.segments if len(s) > 1)

    @property
    def max_segments(self) -> int:
        return max((len(s) for s in self.segments), default=0)

    def describe(self) -> str:
        n = len(self.seqlens)
        if not self.enabled:
            return f"context parallelism off: {self.reason}"
        lens = [x for s in self.segments if len(s) > 1 for x in s]
        speed = f"; model speedup {self.cost_plain / self.cost_cp:.2f}x" if self.cost_cp > 0 else ""
        return (f"context parallelism on: {self.split_sequences} of {n} sequence(s) split into "
                f"{sum(len(s) for s in self.segments if len(s) > 1)} segments of {min(lens)}..{max(lens)} "
                f"tokens (at most {self.max_segments} per sequence; {self.num_segments} segments in one "
                f"packed launch, {self.num_heads} value heads, {self.sm_count} SMs{speed}); {self.reason}")

    def __str__(self) -> str:
        return self.describe()


def split_even(length: int, n: int, chunk: int = CHUNK_SIZE) -> tuple:
    """``length`` tokens in at most ``n`` segments of whole chunks (balanced; the last one takes the rest)."""
    if length <= 0:
        return (0,)
    chunks = -(-length // chunk)
    n = max(1, min(int(n), chunks))
    base, extra = divmod(chunks, n)
    counts = [base + (1 if i < extra else 0) for i in range(n)]
    out = [c * chunk for c in counts[:-1]]
    out.append(length - sum(out))
    return tuple(out)


def _model_cost(segments, num_heads, head_dim_k, head_dim_v, sm_count, needs_grad, cost: CPCostModel):
    sm = max(1, int(sm_count))
    lanes = num_heads * max(1, -(-head_dim_v // cost.state_tile_v))
    slots = sm * max(1, cost.slots_per_sm)

    def one_pass(chunk_lists):
        work = sum(chunk_lists)
        if work == 0:
            return 0.0
        return cost.parallel_cost * work * num_heads / sm + max(max(chunk_lists), work * lanes / slots)

    seq_chunks = [-(-sum(s) // CHUNK_SIZE) for s in segments]
    plain = one_pass(seq_chunks) * (1.0 + (cost.backward_factor if needs_grad else 0.0))
    if not any(len(s) > 1 for s in segments):
        return plain, plain
    all_segs = [-(-x // CHUNK_SIZE) for s in segments for x in s]
    local = [-(-x // CHUNK_SIZE) for s in segments if len(s) > 1 for x in s[:-1]]
    split_chunks = sum(-(-x // CHUNK_SIZE) for s in segments if len(s) > 1 for x in s)
    m_scale = head_dim_k * (CHUNK_SIZE + head_dim_k) / (128.0 * max(1, head_dim_v))
    m_work = cost.m_cost * m_scale * split_chunks * num_heads / sm
    run = one_pass(all_segs)
    fwd = one_pass(local) + run + m_work + 2 * cost.pass_overhead
    bwd = (2 * cost.backward_factor * run + cost.pass_overhead) if needs_grad else 0.0
    return plain, fwd + bwd


def segment_plan(seqlens: Sequence[int], num_heads: int, sm_count: int, *, head_dim_k: int = 128,
                 head_dim_v: int = 128, needs_grad: bool = False, segment_len: Optional[int] = None,
                 min_segment_len: int = 512, max_segments: int = 64,
                 cost: Optional[CPCostModel] = None) -> CPPlan:
    """Choose whether and how to split: one target segment length (a multiple of 64) for the whole call;
    every sequence longer than it is cut into balanced segments of whole chunks.

    ``num_heads`` is the number of value heads Hv; ``sm_count`` the SMs of the device (CPU: threads).
    With ``segment_len`` given the plan uses it without asking the model.  CP pays when
    ``Hv * num_seqs`` lanes are few against the SMs and sequences are long: then the sequential state scan
    (sequence-long) dominates and segments shorten it.
    """
    cost = cost or CPCostModel()
    seqlens = tuple(int(x) for x in seqlens)
    args = (num_heads, head_dim_k, head_dim_v, sm_count, needs_grad, cost)

    def make(seg_len):
        return tuple(split_even(L, min(max_segments, -(-L // seg_len))) if L > seg_len else (max(L, 0),)
                     for L in seqlens)

    plain_segs = tuple((max(L, 0),) for L in seqlens)
    plain, _ = _model_cost(plain_segs, *args)
    if segment_len is not None:
        seg_len = max(CHUNK_SIZE, -(-int(segment_len) // CHUNK_SIZE) * CHUNK_SIZE)
        segs = make(seg_len)
        _, c = _model_cost(segs, *args)
        return CPPlan(seqlens, segs, num_heads, int(sm_count), seg_len, plain, c,
                      f"segment length {seg_len} requested")
    longest = max(seqlens, default=0)
    if longest <= min_segment_len:
        return CPPlan(seqlens, plain_segs, num_heads, int(sm_count), 0, plain, plain,
                      f"no sequence is longer than the minimum segment ({min_segment_len} tokens)")
    best = (plain, 0, plain_segs)
    seg_len = max(CHUNK_SIZE, -(-min_segment_len // CHUNK_SIZE) * CHUNK_SIZE)
    while seg_len < longest:
        segs = make(seg_len)
        _, c = _model_cost(segs, *args)
        if c < best[0]:
            best = (c, seg_len, segs)
        seg_len *= 2
    c, seg_len, segs = best
    lanes = num_heads * len(seqlens)
    if seg_len == 0 or c > plain * (1.0 - cost.min_gain):
        return CPPlan(seqlens, plain_segs, num_heads, int(sm_count), 0, plain, plain,
                      f"the model predicts no gain worth it ({lanes} (sequence, head) lanes for "
                      f"{sm_count} SMs, longest sequence {longest} tokens)")
    return CPPlan(seqlens, segs, num_heads, int(sm_count), seg_len, plain, c,
                  f"{lanes} (sequence, head) lanes for {sm_count} SMs, longest sequence {longest} tokens")


def _default_sm_count(device: torch.device, spec=None) -> int:
    if spec is not None and spec.device.sm_count:
        return int(spec.device.sm_count)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, torch.get_num_threads())


def _resolve_plan(segments, seqlens, spec, device, sm_count, cost, min_segment_len, max_segments) -> CPPlan:
    seqlens = tuple(seqlens)
    sm = sm_count if sm_count is not None else _default_sm_count(device, spec)
    model_args = (spec.Hv, spec.K, spec.V, sm, spec.needs_grad, cost or CPCostModel())
    if segments is None:
        return segment_plan(seqlens, spec.Hv, sm, head_dim_k=spec.K, head_dim_v=spec.V,
                            needs_grad=spec.needs_grad, min_segment_len=min_segment_len,
                            max_segments=max_segments, cost=cost)
    if isinstance(segments, CPPlan):
        if tuple(segments.seqlens) != seqlens:
            raise ValueError(f"the CPPlan was made for sequence lengths {segments.seqlens}, this call has {seqlens}")
        return segments
    if isinstance(segments, bool):
        raise TypeError("segments must be None, an int, a per-sequence list or a CPPlan, got a bool")
    if isinstance(segments, int):
        if segments < 1:
            raise ValueError(f"segments must be >= 1, got {segments}")
        segs = tuple(split_even(L, segments) for L in seqlens)
        why = f"{segments} segments per sequence requested"
    else:
        segments = list(segments)
        if len(segments) != len(seqlens):
            raise ValueError(f"segments must have one entry per sequence ({len(seqlens)}), got {len(segments)}")
        segs = []
        for i, (L, s) in enumerate(zip(seqlens, segments)):
            if isinstance(s, int) and not isinstance(s, bool):
                if s < 1:
                    raise ValueError(f"segments[{i}] must be >= 1, got {s}")
                segs.append(split_even(L, s))
                continue
            s = tuple(int(x) for x in s)
            if L == 0 and s in ((), (0,)):
                segs.append((0,))
                continue
            if not s or any(x <= 0 for x in s) or sum(s) != L:
                raise ValueError(f"segments[{i}] must be positive lengths summing to the sequence length {L}, "
                                 f"got {s}")
            segs.append(s)
        segs = tuple(segs)
        why = "explicit segments"
    plain, c = _model_cost(segs, *model_args)
    return CPPlan(seqlens, segs, spec.Hv, int(sm), 0, plain, c, why)


# ---------------------------------------------------------------------------------------------------------
# The transition matrices M
# ---------------------------------------------------------------------------------------------------------

def _chunk_transition(k, g, beta):
    """M of each 64-token chunk.  k [..., C, K], g and beta [..., C] in the compute dtype -> [..., K, K]."""
    C, K = k.shape[-2], k.shape[-1]
    G = g.cumsum(-1)
    idx = torch.arange(C, device=k.device)
    strict = idx[:, None] > idx[None, :]
    # masked_fill before exp: the upper triangle holds positive exponents that could overflow.
    decay = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~strict, float("-inf")))
    A = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay
    A = A + torch.eye(C, dtype=k.dtype, device=k.device)
    w = torch.linalg.solve_triangular(A, (beta * torch.exp(G))[..., None] * k, upper=False, unitriangular=True)
    GC = G[..., -1:]
    kd = torch.exp(GC - G)[..., None] * k
    eye = torch.eye(K, dtype=k.dtype, device=k.device)
    return torch.exp(GC)[..., None] * eye - kd.transpose(-1, -2) @ w


def _tree_product(x):
    """x [R, n, ..., K, K] -> x[:, n-1] @ ... @ x[:, 0] in log2(n) batched matmuls."""
    while x.shape[1] > 1:
        if x.shape[1] % 2:
            eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
            x = torch.cat([x, eye.expand(x.shape[0], 1, *x.shape[2:]).contiguous()], 1)
        x = x[:, 1::2] @ x[:, 0::2]
    return x[:, 0]


def transition_matrices(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ranges: Sequence[tuple],
                        use_qk_l2norm: bool = False, compute_dtype: Optional[torch.dtype] = None,
                        memory_budget: int = 256 << 20) -> torch.Tensor:
    """``M`` of every token range: ``[R, Hv, K, K]`` with ``S_end = M S_start + S_local`` per value head.

    ``k`` ``[1, T, Hqk, K]``, ``g`` and ``beta`` ``[1, T, Hv]`` (packed); ``ranges`` (start, length) pairs.
    Chunks of 64 tokens from each range's start; per chunk the UT form, then a tree product over blocks
    of chunks (block size from ``memory_budget`` bytes of temporaries) and a running product over blocks.
    A padded token (k = 0, beta = 0, g = 0) is the identity, so ranges of any lengths batch together.
    """
    dev = k.device
    Hqk, K = k.shape[2], k.shape[3]
    Hv = g.shape[2]
    ratio = Hv // Hqk
    cd = compute_dtype or (torch.float64 if torch.float64 in (k.dtype, g.dtype, beta.dtype) else torch.float32)
    R = len(ranges)
    eye = torch.eye(K, dtype=cd, device=dev)
    acc = eye.expand(R, Hv, K, K).contiguous()
    C = CHUNK_SIZE
    nmax = max((-(-int(L) // C) for _, L in ranges), default=0)
    if R == 0 or nmax == 0:
        return acc
    starts = torch.tensor([int(s) for s, _ in ranges], dtype=torch.int64).to(dev)
    lens = torch.tensor([int(L) for _, L in ranges], dtype=torch.int64).to(dev)
    pos = torch.arange(nmax * C, device=dev)
    valid = pos[None, :] < lens[:, None]                      # [R, nmax*C]
    tok = torch.where(valid, starts[:, None] + pos[None, :], torch.zeros_like(pos)[None, :])
    elem = torch.finfo(cd).bits // 8
    per_chunk = R * Hv * elem * (3 * C * C + 3 * K * K + 6 * C * K)
    blk = max(1, min(nmax, memory_budget // max(1, per_chunk)))
    blk = 1 << (blk.bit_length() - 1)
    k0, g0, b0 = k[0], g[0], beta[0]
    for j0 in range(0, nmax, blk):
        jb = min(blk, nmax - j0)
        ix = tok[:, j0 * C:(j0 + jb) * C].reshape(-1)
        vm = valid[:, j0 * C:(j0 + jb) * C].reshape(R, jb, C)
        kk = k0.index_select(0, ix).reshape(R, jb, C, Hqk, K).to(cd)
        if use_qk_l2norm:
            kk = l2norm(kk)
        kk = torch.where(vm[..., None, None], kk, torch.zeros((), dtype=cd, device=dev))
        gg = torch.where(vm[..., None], g0.index_select(0, ix).reshape(R, jb, C, Hv).to(cd),
                         torch.zeros((), dtype=cd, device=dev))
        bb = torch.where(vm[..., None], b0.index_select(0, ix).reshape(R, jb, C, Hv).to(cd),
                         torch.zeros((), dtype=cd, device=dev))
        if ratio > 1:
            kk = kk.repeat_interleave(ratio, dim=3)
        Mc = _chunk_transition(kk.permute(0, 1, 3, 2, 4), gg.permute(0, 1, 3, 2), bb.permute(0, 1, 3, 2))
        acc = _tree_product(Mc) @ acc
    return acc


# ---------------------------------------------------------------------------------------------------------
# The segmented-call engine (shared with flashqla.distributed)
# ---------------------------------------------------------------------------------------------------------

def _make_meta(cu: Sequence[int], device: torch.device) -> VarlenMeta:
    """prepare_varlen on a host tensor (no device->host sync), then the tensors moved to ``device``."""
    m = prepare_varlen(torch.tensor(list(cu), dtype=torch.int32))
    if device.type == "cpu":
        return m
    return VarlenMeta(m.cu_seqlens.to(device), m.cu_seqlens_cpu, m.chunk_offsets.to(device),
                      m.chunk_indices.to(device), m.chunk_size)


@dataclass
class _Layout:
    """Sequences (packed token ranges) cut into segments; ``chains`` are the sequences whose segments get
    an (M, S_local) row each, rows of one chain consecutive."""

    seq_start: list
    seq_segs: list             # per sequence, tuple of segment lengths
    chains: list               # sequence indices
    seg_cu: list = field(default_factory=list)
    first_seg: list = field(default_factory=list)
    row0: list = field(default_factory=list)     # per chain, its first row
    rows: int = 0

    def __post_init__(self):
        cu, first = [0], []
        for s0, segs in zip(self.seq_start, self.seq_segs):
            if s0 != cu[-1]:
                raise ValueError("sequences must tile the packed tokens in order")
            first.append(len(cu) - 1)
            for x in segs:
                cu.append(cu[-1] + x)
        self.seg_cu, self.first_seg = cu, first
        r0, r = [], 0
        for c in self.chains:
            r0.append(r)
            r += len(self.seq_segs[c])
        self.row0, self.rows = r0, r

    @property
    def num_segments(self) -> int:
        return len(self.seg_cu) - 1

    def last_seg(self, n: int) -> int:
        return self.first_seg[n] + len(self.seq_segs[n]) - 1

    def chain_len(self, i: int) -> int:
        return len(self.seq_segs[self.chains[i]])

    def row_segments(self) -> list:
        """Segment index of every row."""
        return [self.first_seg[c] + j for c in self.chains for j in range(len(self.seq_segs[c]))]

    def row_ranges(self) -> list:
        return [(self.seg_cu[s], self.seg_cu[s + 1] - self.seg_cu[s]) for s in self.row_segments()]


class _Engine:
    """The phases of a segmented call on packed tensors ``[1, T, ...]``, all through one backend name."""

    def __init__(self, backend: str, scale: float, use_qk_l2norm: bool, layout: _Layout, state_dtype):
        self.backend = backend
        self.scale = scale
        self.l2norm = use_qk_l2norm
        self.layout = layout
        self.sd = state_dtype

    # -- backend calls --------------------------------------------------------------------------------
    def forward_call(self, q, k, v, g, beta, cu, h0, out_final: bool, needs_grad: bool):
        """One backend forward of a packed varlen batch; returns (o, ht, saved, aux, backend, spec)."""
        meta = _make_meta(cu, q.device)
        spec, scale, meta = validate(q, k, v, g, beta, self.scale, h0, out_final, self.l2norm, None, meta,
                                     needs_grad=needs_grad)
        be, _ = select(spec, self.backend)
        x = FwdInputs(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(),
                      beta=beta.contiguous(), scale=scale,
                      initial_state=None if h0 is None else h0.contiguous(), cu_seqlens=meta.cu_seqlens,
                      varlen=meta, output_final_state=out_final, use_qk_l2norm=self.l2norm)
        o, ht, saved, aux = be.forward(spec, x)
        return o, ht, saved, aux, be, spec

    def local_states(self, x, segs: list) -> torch.Tensor:
        """S_local (end state from a zero start) of the given segments, one packed launch."""
        lay = self.layout
        q, k, v, g, beta = x
        Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        out = torch.zeros(len(segs), Hv, K, V, dtype=self.sd, device=q.device)
        lens = [lay.seg_cu[s + 1] - lay.seg_cu[s] for s in segs]
        if not segs or sum(lens) == 0:
            return out
        if segs == list(range(lay.num_segments)):
            sub, cu = x, lay.seg_cu
        else:
            parts = [torch.arange(lay.seg_cu[s], lay.seg_cu[s + 1], dtype=torch.int64) for s in segs]
            idx = torch.cat(parts).to(q.device)
            sub = tuple(t.index_select(1, idx) for t in x)
            cu = [0]
            for L in lens:
                cu.append(cu[-1] + L)
        with torch.no_grad():
            _, ht, _, _, _, _ = self.forward_call(*sub, cu, None, True, False)
        return ht.to(self.sd)

    def transition(self, x, rows: Optional[list] = None) -> torch.Tensor:
        """M of every row ([rows, Hv, K, K]); with ``rows`` only those are computed, the rest are I."""
        q, k, v, g, beta = x
        ranges = self.layout.row_ranges()
        with torch.no_grad():
            if rows is None:
                return transition_matrices(k, g, beta, ranges, self.l2norm, compute_dtype=self.sd)
            K, Hv = k.shape[3], g.shape[2]
            M = torch.eye(K, dtype=self.sd, device=k.device).expand(len(ranges), Hv, K, K).contiguous()
            if rows:
                M[torch.tensor(rows, device=k.device)] = transition_matrices(
                    k, g, beta, [ranges[r] for r in rows], self.l2norm, compute_dtype=self.sd)
            return M

    # -- scans over the rows of each chain ------------------------------------------------------------
    def _steps(self, forward: bool):
        """Per scan step, (rows, next rows) as device index tensors; chains of different lengths batch."""
        lay = self.layout
        nmax = max((lay.chain_len(i) for i in range(len(lay.chains))), default=0)
        order = range(nmax - 1) if forward else range(nmax - 1, 0, -1)
        steps = []
        for p in order:
            if forward:
                cur = [lay.row0[i] + p for i in range(len(lay.chains)) if lay.chain_len(i) > p + 1]
                nxt = [r + 1 for r in cur]
            else:
                cur = [lay.row0[i] + p for i in range(len(lay.chains)) if lay.chain_len(i) > p]
                nxt = [r - 1 for r in cur]
            steps.append((cur, nxt))
        return steps

    def scan_forward(self, M, S_loc, chain_start):
        """True start state of every row, given each chain's start state [C, Hv, K, V]."""
        lay = self.layout
        dev = chain_start.device
        starts = torch.empty(lay.rows, *chain_start.shape[1:], dtype=self.sd, device=dev)
        if lay.rows == 0:
            return starts
        starts[torch.tensor(lay.row0, device=dev)] = chain_start.to(self.sd)
        for cur, nxt in self._steps(True):
            ci, ni = torch.tensor(cur, device=dev), torch.tensor(nxt, device=dev)
            starts[ni] = M[ci] @ starts[ci] + S_loc[ci]
        return starts

    def chain_ends(self, M, S_loc, starts, chains: list) -> torch.Tensor:
        """End state of the given chains (positions in ``layout.chains``); needs S_loc of their last rows."""
        lay = self.layout
        last = torch.tensor([lay.row0[i] + lay.chain_len(i) - 1 for i in chains], device=starts.device,
                            dtype=torch.int64)
        return M[last] @ starts[last] + S_loc[last]

    def chain_products(self, M, chains: list) -> torch.Tensor:
        """M of each whole chain (product of its rows, latest on the left), chains batched."""
        lay = self.layout
        if not chains:
            return M.new_zeros(0, *M.shape[1:])
        r0 = [lay.row0[i] for i in chains]
        ns = [lay.chain_len(i) for i in chains]
        acc = M[torch.tensor(r0, device=M.device)].clone()
        for p in range(1, max(ns)):
            sel = [j for j in range(len(chains)) if ns[j] > p]
            si = torch.tensor(sel, device=M.device)
            rows = torch.tensor([r0[j] + p for j in sel], device=M.device)
            acc[si] = M[rows] @ acc[si]
        return acc

    def scan_backward(self, M, dh0_loc, terminal):
        """Given every row's local dh0 (backward with dht = 0) and each chain's end-state cotangent
        [C, Hv, K, V]: the true end-state cotangent of every row and the true dh0 of each chain's first row."""
        lay = self.layout
        dev = terminal.device
        dS_end = torch.empty(lay.rows, *terminal.shape[1:], dtype=self.sd, device=dev)
        if lay.rows == 0:
            return dS_end, dS_end
        last = torch.tensor([lay.row0[i] + lay.chain_len(i) - 1 for i in range(len(lay.chains))], device=dev)
        dS_end[last] = terminal.to(self.sd)
        Mt = M.transpose(-1, -2)
        for cur, nxt in self._steps(False):
            ci, ni = torch.tensor(cur, device=dev), torch.tensor(nxt, device=dev)
            dS_end[ni] = dh0_loc[ci] + Mt[ci] @ dS_end[ci]
        first = torch.tensor(lay.row0, device=dev)
        dh0_first = dh0_loc[first] + Mt[first] @ dS_end[first]
        return dS_end, dh0_first


def _pack(t: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [1, B*T, ...] (a view for contiguous inputs: segments are then plain token ranges)."""
    return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])


def _cast(grads, dtypes):
    return tuple(None if gr is None or dt is None else gr.to(dt) for gr, dt in zip(grads, dtypes))


@dataclass
class _CPConfig:
    engine: _Engine
    shape: tuple               # (B, T) of the caller's tensors
    num_seqs: int
    output_final_state: bool
    needs_grad: bool


class _CPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cfg: _CPConfig):
        eng, lay = cfg.engine, cfg.engine.layout
        x = tuple(_pack(t) for t in (q, k, v, g, beta))
        dev = q.device
        Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        N = cfg.num_seqs
        # (1) + (2): local end states of the non-last segments of split sequences, and every row's M.
        row_segs = lay.row_segments()
        nonlast_rows = [r for i in range(len(lay.chains))
                        for r in range(lay.row0[i], lay.row0[i] + lay.chain_len(i) - 1)]
        nonlast = [row_segs[r] for r in nonlast_rows]
        S_nonlast = eng.local_states(x, nonlast)
        S_loc = torch.zeros(lay.rows, Hv, K, V, dtype=eng.sd, device=dev)
        if nonlast:
            S_loc[torch.tensor(nonlast_rows, device=dev)] = S_nonlast
        # The forward scan reads M of the non-last rows, the backward scan that of the non-first rows.
        M = eng.transition(x, None if cfg.needs_grad else nonlast_rows)
        # (3): the segment scan.
        if h0 is not None:
            chain_start = h0[torch.tensor(lay.chains, device=dev)].to(eng.sd)
        else:
            chain_start = torch.zeros(len(lay.chains), Hv, K, V, dtype=eng.sd, device=dev)
        starts = eng.scan_forward(M, S_loc, chain_start)
        # (4): every segment with its true start state, one packed launch.
        state_dtype = h0.dtype if h0 is not None else eng.sd
        h0_seg = torch.zeros(lay.num_segments, Hv, K, V, dtype=state_dtype, device=dev)
        if h0 is not None:
            h0_seg[torch.tensor(lay.first_seg, device=dev)] = h0
        h0_seg[torch.tensor(row_segs, device=dev)] = starts.to(state_dtype)
        want_ht = cfg.output_final_state or cfg.needs_grad
        o, ht_seg, saved, aux, be, spec = eng.forward_call(*x, lay.seg_cu, h0_seg, want_ht, cfg.needs_grad)
        ctx.be, ctx.spec, ctx.aux, ctx.cfg = be, spec, aux, cfg
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, None if h0 is None else h0.dtype)
        ctx.n_saved = len(saved)
        if cfg.needs_grad:
            ctx.save_for_backward(*saved, M)
        B, T = cfg.shape
        o = o.reshape(B, T, Hv, V)
        if cfg.output_final_state:
            last = torch.tensor([lay.last_seg(n) for n in range(N)], device=dev)
            ht = ht_seg[last]
        else:
            ht = o.new_empty(0)
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        cfg, eng = ctx.cfg, ctx.cfg.engine
        lay = eng.layout
        tensors = ctx.saved_tensors
        saved, M = tensors[:ctx.n_saved], tensors[ctx.n_saved]
        B, T = cfg.shape
        do_p = _pack(do.contiguous())
        dev = do.device
        Hv, K, V = ctx.spec.Hv, ctx.spec.K, ctx.spec.V
        N = cfg.num_seqs
        if dht is not None and dht.numel() == 0:
            dht = None
        row_segs = lay.row_segments()
        # Local dh0 of every row: a backward with dht = 0 (only dh0 is kept).
        g1 = ctx.be.backward(ctx.spec, saved, ctx.aux, do_p, None)
        dh0_loc = g1[5][torch.tensor(row_segs, device=dev)].to(eng.sd)
        del g1
        if dht is not None:
            terminal = dht[torch.tensor(lay.chains, device=dev)].to(eng.sd)
        else:
            terminal = torch.zeros(len(lay.chains), Hv, K, V, dtype=eng.sd, device=dev)
        dS_end, _ = eng.scan_backward(M, dh0_loc, terminal)
        sd = ctx.spec.state_dtype and getattr(torch, ctx.spec.state_dtype)
        dht_seg = torch.zeros(lay.num_segments, Hv, K, V, dtype=sd or torch.float32, device=dev)
        if dht is not None:
            dht_seg[torch.tensor([lay.last_seg(n) for n in range(N)], device=dev)] = dht.to(dht_seg.dtype)
        dht_seg[torch.tensor(row_segs, device=dev)] = dS_end.to(dht_seg.dtype)
        dq, dk, dv, dg, dbeta, dh0_seg = ctx.be.backward(ctx.spec, saved, ctx.aux, do_p, dht_seg)
        shp = lambda t: t.reshape(B, T, *t.shape[2:])  # noqa: E731
        dh0 = None
        if ctx.dtypes[5] is not None:
            dh0 = dh0_seg[torch.tensor(lay.first_seg, device=dev)]
        grads = (shp(dq), shp(dk), shp(dv), shp(dg), shp(dbeta), dh0)
        return _cast(grads, ctx.dtypes) + (None,)


def _seq_bounds(B: int, T: int, meta: Optional[VarlenMeta]):
    if meta is None:
        return [b * T for b in range(B)], [T] * B
    cu = meta.cu_seqlens_cpu
    return list(cu[:-1]), [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


def cp_plan(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, cu_seqlens=None, segments=None, *, varlen_meta=None,
            sm_count: Optional[int] = None, needs_grad: Optional[bool] = None,
            cost: Optional[CPCostModel] = None, min_segment_len: int = 512, max_segments: int = 64) -> CPPlan:
    """The :class:`CPPlan` :func:`chunk_gated_delta_rule_cp` would use for these arguments (nothing runs)."""
    spec, _, meta = validate(q, k, v, g, beta, scale, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, cu_seqlens, varlen_meta, needs_grad=needs_grad)
    _, lens = _seq_bounds(q.shape[0], q.shape[1], meta)
    return _resolve_plan(segments, lens, spec, q.device, sm_count, cost, min_segment_len, max_segments)


def chunk_gated_delta_rule_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
    segments: Any = None,
    *,
    varlen_meta: Optional[VarlenMeta] = None,
    sm_count: Optional[int] = None,
    cost: Optional[CPCostModel] = None,
    min_segment_len: int = 512,
    max_segments: int = 64,
):
    """:func:`flashqla.chunk_gated_delta_rule` with exact context parallelism; same arguments and results.

    ``segments``: ``None`` lets :func:`segment_plan` decide from the call shape and ``sm_count`` (default:
    the device's SMs; CPU: torch threads); an int splits every sequence into that many segments of whole
    chunks (``1``: no CP); a list gives per sequence a segment count or explicit segment lengths; or a
    :class:`CPPlan` (from :func:`cp_plan`).  When no sequence is split this is exactly the plain op.
    The segments of all sequences run as one packed varlen batch on the backend chosen by ``backend``.
    """
    spec, scale_f, meta = validate(q, k, v, g, beta, scale, initial_state, output_final_state,
                                   use_qk_l2norm_in_kernel, cu_seqlens, varlen_meta)
    B, T = q.shape[0], q.shape[1]
    plan = None
    if B > 0 and T > 0:
        starts, lens = _seq_bounds(B, T, meta)
        plan = _resolve_plan(segments, lens, spec, q.device, sm_count, cost, min_segment_len, max_segments)
    if plan is None or not plan.enabled:
        from .api import chunk_gated_delta_rule
        return chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel, cu_seqlens, backend, varlen_meta=meta)
    chains = [n for n, s in enumerate(plan.segments) if len(s) > 1]
    layout = _Layout(starts, list(plan.segments), chains)
    f64 = torch.float64 in (q.dtype, g.dtype, beta.dtype) or (
        initial_state is not None and initial_state.dtype == torch.float64)
    eng = _Engine(backend, scale_f, bool(use_qk_l2norm_in_kernel), layout,
                  torch.float64 if f64 else torch.float32)
    cfg = _CPConfig(eng, (B, T), spec.num_seqs, bool(output_final_state), spec.needs_grad)
    o, ht = _CPFunction.apply(q, k, v, g, beta, initial_state, cfg)
    return o, (ht if output_final_state else None)
