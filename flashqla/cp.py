"""Exact context parallelism (CP): split long sequences into segments, run the segments side by side.

Why.  The chunked kernels are parallel over chunks except for one sequential scan of the state along each
sequence, whose parallelism is only (sequences x value heads x V tiles).  A few long sequences with few
heads (long-context prefill, tensor parallelism splitting the heads) leave most SMs idle.  CP cuts each
long sequence into segments and runs the segments of *all* sequences as packed varlen batches, so the
sequential scan is segment-long instead of sequence-long.

The math (exact, for any gate including g = 0).  Per value head, a segment's end state is affine in its
start state::

    S_end = M S_start + S_local

``S_local`` is the segment's end state from a zero start state and ``M`` (K x K) is the product over the
segment's tokens of ``exp(g_t) (I - beta_t k_t k_t^T)``, latest token on the left.  By linearity the
backend's own forward computes both: from a zero start with the true ``v`` it ends in ``S_local``; from
the start state ``I`` (K x K, i.e. K value columns) with ``v = 0`` it ends in ``M I + 0 = M``.  No decayed
term is dropped anywhere (unlike cut-off CP schemes), so this is exact up to rounding.

Forward (``K == V``, the case that must be fast):

1. ONE backend forward over a packed batch that holds every non-last segment of each split sequence with
   its true ``v`` (the first segment starting from the caller's initial state, the others from zero), and
   the segments whose ``M`` is needed again with ``v = 0`` and start state ``I``.  Its final states are
   the ``S_local`` (true end state for a first segment) and the ``M`` of every row.  The inputs are
   gathered with one ``torch.cat`` per tensor over merged token ranges; ``q`` is not gathered (``o`` of
   this pass is discarded, ``k`` stands in for it).
2. The segment scan ``S_start[p+1] = M[p] S_start[p] + S_local[p]``: one batched matmul
   (``torch.baddbmm``) per segment position p, batched over the split sequences and heads, on contiguous
   blocks (rows are stored position-major with the split sequences in decreasing segment count, so the
   sequences still running at position p are a prefix of block p).
3. ONE backend forward over *all* segments with their true start states: a varlen view of the caller's
   tokens with a finer ``cu_seqlens`` (no gather).  It gives ``o`` and the final states.

Windows (K == V, not under CUDA-graph capture).  ``||M|| <= prod_t exp(g_t)
max(1, |1 - beta_t ||k_t||^2|)``.  Where that bound over a segment's last few chunks is below
``exp(-150)`` for every head, the state entering those chunks cannot reach the segment's end in fp32 (the
term is under fp32's smallest subnormal for any state of norm below 1e20): the end state is that window's
end state from zero, and M is not needed.  The op reads these window lengths on the host (one sync, see
below), and phase 1 runs the windows and only the M rows that are not negligible.  With decaying gates phase 1 falls
from about two segments' tokens per boundary to a few chunks; with gates that do not decay (g = 0 heads)
nothing changes.  The result is the fixed structure's to rounding; ``windows="off"`` turns this off.
No call reads the window lengths before it runs: a read in the middle of the call would leave the GPU idle
from the moment the queue drains until the host has launched the rest.  Every call computes its window
lengths on the device (one launch) and copies them to the host behind an event; the host checks them after
everything is launched.  A plan's first call runs the fixed structure (exact for any gates; it also loads
the kernels a CUDA-graph capture of the call runs) and keeps the windows it read; a repeated call runs with
the windows its plan kept.  In the rare case they do not cover this call's gates (a longer window needed,
or none exists), the call runs again with the wider configuration (the per-row maximum; a row without a
window runs in full), which the plan keeps from then on.
Training calls take them too: M (and M^T in the backward scan) is zero where a segment's trailing window
is negligible, and where every segment p >= 1 has a leading window (the same bound from its start), the
backward's first pass (each segment's dh0 with a zero end cotangent) runs a forward and backward of those
windows only, from the saved inputs, instead of a backward over every token.

Session 17: the tilelang backend now splits long walks inside its kernels instead (``backends/tilelang/segments.py``:
a halo per segment sized by this module's bound on the device, falling back to the walk from the sequence start),
which is what the paragraph below asked for; at 2/8 1x32768 its forward takes 0.210 ms of kernels in a graph-safe
call.  This module stays the backend-agnostic, transition-exact CP.

Next (not built; H200, session 9, ``benchmarks/cp_graph_probe.py``).  At 2/8 heads x one 32k sequence the
windowed passes take 0.231 ms in a CUDA graph and 1.16 ms eagerly (FlashQLA: 0.254 eager): the host path is
the limit, and the per-call read of the window lengths is what keeps the call out of a graph.  Copying the
inputs into a graph of our own and checking the windows costs 0.72 ms, so that does not pay.  What would:
windows that never leave the device.  The plan fixes a window cap W per segment (from the memo: the widest
seen), so the windowed pass has host-known ranges; the window-count kernel sets a device flag when a segment
needs more than W; the fixed structure's passes (full-segment S and M) are launched too, with kernels that
return at once while the flag is clear, and the scan takes S and M from whichever ran (``torch.where`` on the
flag).  No host read at all, exact for any gates, capturable by the caller; the flag, read a call later
without a sync, widens W for the next calls.  Cost when the windows hold: the windowed kernels plus a few
empty launches.  It needs an early-exit flag argument in each backend's forward kernels.

For ``K != V`` the ``M`` come from :func:`transition_matrices` (torch ops; also the test oracle), or with
``transitions="kernel"`` from a separate backend forward with ``V' = K``.

Backward (exact, ``M`` is not differentiated): the gradient is the sum of each segment's backward given its
true start state and its true end-state cotangent ``dS_end[p] = dh0[p+1]``.  One backward of the packed
segments with ``dht = 0`` gives each segment's ``dh0_local`` (``dh0`` does not depend on the start state:
the segment map is affine), a backward scan ``dS_end[p-1] = dh0_local[p] + M[p]^T dS_end[p]`` (batched
matmuls again) gives the true cotangents, and a second backward with them gives every gradient.

Host syncs and CUDA graphs.  The plan needs host-known sequence lengths: the op's ``VarlenMeta`` carries
them (``varlen_meta=flashqla.prepare_varlen(cu_seqlens)``, or dense inputs).  Everything the plan derives
(the packed ``cu_seqlens`` and chunk metadata of both passes, the index tensors that move states between
segment order and scan order) is built on the host once per (plan, flags, device) and uploaded with
pinned, non-blocking copies into a small cache; a repeated call (a CUDA graph capture after its warm-up)
makes no host->device copy, no device->host copy and no ``.item()``/``.tolist()``: it is capturable.

Cost: two forward passes (the first one over about twice the non-last tokens, in one launch), two backward
passes, ``2 x segments`` small batched matmuls, against one forward and one backward; it pays when the
sequential scan dominates (few heads, long sequences; see :func:`segment_plan`, whose constants are rough
guesses meant to be calibrated on the GPU with ``benchmarks/check_cp.py``).

Memory beyond the plain op: the gathered inputs of the first pass (about 2x the non-last tokens' k, g,
beta, v) and its discarded ``o``; per (segment of a split sequence, value head) one fp32 ``K x K`` matrix
kept for the backward, start states and cotangents (``[segments, Hv, K, V]`` fp32).

Everything here goes through the public backend contract (``select(spec)`` -> ``backend.forward`` /
``backend.backward``), so every backend gets CP for free.  Backends must tolerate two ``backward`` calls on
one ``saved`` (none of ours mutates it) and must not write to their inputs (``q`` and ``k`` may alias).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .cp_bounds import window_counts
from .dispatch.registry import FwdInputs, select
from .dispatch.spec import dtype_name
from .reference import CHUNK_SIZE, l2norm
from .validation import validate
from .varlen import VarlenMeta, prepare_varlen

__all__ = ["CPCostModel", "CPPlan", "segment_plan", "split_even", "cp_plan", "chunk_gated_delta_rule_cp",
           "transition_matrices"]

_TRANSITIONS = ("auto", "kernel", "torch")


# ---------------------------------------------------------------------------------------------------------
# The plan and its cost model
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CPCostModel:
    """A rough makespan model, in units of one chunk step of the sequential state scan for one
    (segment, head, V tile) lane on one SM (about 2-3 us on an H200 at K = V = 128, from the plain
    tilelang forward at 2/8 heads on 1x32768: 1.77 ms for 512 chunk steps).  Uncalibrated guesses for
    the new pass structure: measure with ``benchmarks/check_cp.py`` and adjust.

    slots_per_sm     lanes of the state scan resident per SM at once (one CTA per SM in the recurrences)
    state_tile_v     V columns per lane (a lane is a (sequence, head, V tile) program of the scan)
    parallel_cost    work of the chunk-parallel kernels (kkt, solve, w/u, output) per (chunk, head),
                     spread over every SM (about 1.3: 0.47 ms of the 16/32 forward at 1x32768)
    m_cost           work of the torch M products per (chunk, head) at K = V = 128 (scaled by K(64+K)/(128V));
                     only when K != V (else M comes out of the first pass); about 4: ~5 MFLOP of fp32
                     matmuls (chunk UT form + tree product) at ~0.45 TFLOP/s per SM
    gather_cost      per (chunk, head) of the first pass: copying its inputs (k, g, beta, v) into the packed
                     batch, spread over every SM
    scan_step        one batched matmul of the segment scan (latency bound: a few us)
    pass_overhead    fixed cost of each backend pass (launches, tail of the last wave)
    backward_factor  one backward pass costs this many forward passes
    min_gain         CP is used only when the model predicts at least this relative saving
    window_host      a windowed call's extra host time (the window launch and its read, the gathers of
                     phase 1; eager calls only), in chunk steps: 150, uncalibrated (H200, session 8: a
                     windowed call's host path took ~2 ms against 0.28 ms of kernels)
    """

    slots_per_sm: int = 1
    state_tile_v: int = 64
    parallel_cost: float = 1.3
    m_cost: float = 4.0
    gather_cost: float = 0.05
    scan_step: float = 3.0
    pass_overhead: float = 8.0
    backward_factor: float = 2.0
    min_gain: float = 0.15
    window_host: float = 150.0


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
    transitions: str = ""      # how M is computed: "kernel" (by the backend's forward) or "torch"

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
        how = {"kernel": "; M by the backend's forward (fused with the local pass)",
               "torch": "; M by torch ops (K != V)"}.get(self.transitions, "")
        return (f"context parallelism on: {self.split_sequences} of {n} sequence(s) split into "
                f"{sum(len(s) for s in self.segments if len(s) > 1)} segments of {min(lens)}..{max(lens)} "
                f"tokens (at most {self.max_segments} per sequence; {self.num_segments} segments in the "
                f"packed launch, {self.num_heads} value heads, {self.sm_count} SMs{speed}{how}); {self.reason}")

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


def _nchunks(x: int) -> int:
    return -(-int(x) // CHUNK_SIZE)


# Chunks a window is assumed to span when the plan is made (the gates are read only after it): logsigmoid
# gates reach the bound in 3-4 chunks.  With gates that do not decay the call runs the fixed structure; the
# plan is then held to the fixed structure's cost as well (see segment_plan).
WINDOW_GUESS_CHUNKS = 4
# A windowed plan is taken only where its fixed structure (what runs when the gates do not decay) costs at
# most this much of the plain call: e.g. 32 heads x 32k tokens, 2 segments, 1.13x plain fixed, 0.64x windowed.
WINDOWED_FIXED_SLACK = 1.15


def _model_cost(segments, num_heads, head_dim_k, head_dim_v, sm_count, needs_grad, cost: CPCostModel,
                windowed: bool = False):
    """(plain, cp) model times of one call; the CP pass structure is the one :func:`chunk_gated_delta_rule_cp`
    runs (first pass fused with the M sequences when K == V; ``windowed``: the first pass runs a window of
    ``WINDOW_GUESS_CHUNKS`` per boundary and no M, and the backward's first pass such a window per segment)."""
    sm = max(1, int(sm_count))
    lanes = num_heads * max(1, -(-head_dim_v // cost.state_tile_v))
    slots = sm * max(1, cost.slots_per_sm)

    def one_pass(chunk_lists):
        work = sum(chunk_lists)
        if work == 0:
            return 0.0
        return (cost.parallel_cost * work * num_heads / sm + max(max(chunk_lists), work * lanes / slots)
                + cost.pass_overhead)

    plain_fwd = one_pass([_nchunks(sum(s)) for s in segments])
    bwd = cost.backward_factor if needs_grad else 0.0
    plain = plain_fwd * (1.0 + bwd)
    chains = [s for s in segments if len(s) > 1]
    if not chains:
        return plain, plain
    s_rows = [_nchunks(x) for s in chains for x in s[:-1]]
    m_rows = [_nchunks(x) for s in chains for x in (s[1:] if needs_grad else s[1:-1])]
    if windowed:
        s_rows, m_rows = [min(x, WINDOW_GUESS_CHUNKS) for x in s_rows], []
    if head_dim_k == head_dim_v:
        first = one_pass(s_rows + m_rows) + cost.gather_cost * sum(s_rows + m_rows) * num_heads / sm
    else:
        m_scale = head_dim_k * (CHUNK_SIZE + head_dim_k) / (128.0 * max(1, head_dim_v))
        first = one_pass(s_rows) + cost.m_cost * m_scale * sum(m_rows) * num_heads / sm
    nmax = max(len(s) for s in chains)
    run = one_pass([_nchunks(x) for s in segments for x in s])
    fwd = first + max(0, nmax - 2) * cost.scan_step + run + (cost.window_host if windowed else 0.0)
    if windowed:
        # the backward's first pass runs over the leading windows instead of every segment
        lead = one_pass([min(_nchunks(x), WINDOW_GUESS_CHUNKS) for s in chains for x in s[1:]])
        back = ((1.0 + bwd) * lead + bwd * run + (nmax - 1) * cost.scan_step) if needs_grad else 0.0
    else:
        back = (2.0 * bwd * run + (nmax - 1) * cost.scan_step) if needs_grad else 0.0
    return plain, fwd + back


def segment_plan(seqlens: Sequence[int], num_heads: int, sm_count: int, *, head_dim_k: int = 128,
                 head_dim_v: int = 128, needs_grad: bool = False, segment_len: Optional[int] = None,
                 min_segment_len: int = 512, max_segments: int = 64,
                 cost: Optional[CPCostModel] = None, windowed: bool = False) -> CPPlan:
    """Choose whether and how to split: one target segment length (a multiple of 64) for the whole call;
    every sequence longer than it is cut into balanced segments of whole chunks.

    ``num_heads`` is the number of value heads Hv; ``sm_count`` the SMs of the device (CPU: threads).
    With ``segment_len`` given the plan uses it without asking the model.  CP pays when
    ``Hv * num_seqs`` lanes are few against the SMs and sequences are long: then the sequential state scan
    (sequence-long) dominates and segments shorten it.

    ``windowed`` (a call that may take windows, see ``chunk_gated_delta_rule_cp``): the plan
    minimises the windowed cost, among segment lengths whose fixed-structure cost is at most
    ``WINDOWED_FIXED_SLACK`` times the plain call's (the gates may not decay, and then the call runs that
    structure).
    """
    cost = cost or CPCostModel()
    seqlens = tuple(int(x) for x in seqlens)
    args = (num_heads, head_dim_k, head_dim_v, sm_count, needs_grad, cost)
    how = "kernel" if head_dim_k == head_dim_v else "torch"

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
                      f"segment length {seg_len} requested", how)
    longest = max(seqlens, default=0)
    if longest <= min_segment_len:
        return CPPlan(seqlens, plain_segs, num_heads, int(sm_count), 0, plain, plain,
                      f"no sequence is longer than the minimum segment ({min_segment_len} tokens)")
    best = (plain, 0, plain_segs)
    seg_len = max(CHUNK_SIZE, -(-min_segment_len // CHUNK_SIZE) * CHUNK_SIZE)
    while seg_len < longest:
        segs = make(seg_len)
        _, c = _model_cost(segs, *args)
        if windowed and c <= plain * WINDOWED_FIXED_SLACK:
            c = _model_cost(segs, *args, windowed=True)[1]
        if c < best[0]:
            best = (c, seg_len, segs)
        seg_len *= 2
    c, seg_len, segs = best
    lanes = num_heads * len(seqlens)
    if seg_len == 0 or c > plain * (1.0 - cost.min_gain):
        return CPPlan(seqlens, plain_segs, num_heads, int(sm_count), 0, plain, plain,
                      f"the model predicts no gain worth it ({lanes} (sequence, head) lanes for "
                      f"{sm_count} SMs, longest sequence {longest} tokens)")
    win = "; cost with windows of about 4 chunks (decaying gates)" if windowed else ""
    return CPPlan(seqlens, segs, num_heads, int(sm_count), seg_len, plain, c,
                  f"{lanes} (sequence, head) lanes for {sm_count} SMs, longest sequence {longest} tokens{win}", how)


def _default_sm_count(device: torch.device, spec=None) -> int:
    if spec is not None and spec.device.sm_count:
        return int(spec.device.sm_count)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, torch.get_num_threads())


_PLANS: "OrderedDict[Any, CPPlan]" = OrderedDict()     # automatic / per-count plans of recent call shapes


def _resolve_plan(segments, seqlens, spec, device, sm_count, cost, min_segment_len, max_segments,
                  windowed: bool = False) -> CPPlan:
    seqlens = tuple(seqlens)
    if segments is None or (isinstance(segments, int) and not isinstance(segments, bool)):
        # (the plan is pure host arithmetic on these; a repeated call shape skips it)
        sm = sm_count if sm_count is not None else _default_sm_count(device, spec)
        key = (segments, seqlens, spec, str(device), sm, cost, min_segment_len, max_segments, windowed)
        plan = _PLANS.get(key)
        if plan is None:
            plan = _resolve_plan_uncached(segments, seqlens, spec, device, sm, cost, min_segment_len,
                                          max_segments, windowed)
            _PLANS[key] = plan
            if len(_PLANS) > _CACHE_MAX:
                _PLANS.popitem(last=False)
        return plan
    return _resolve_plan_uncached(segments, seqlens, spec, device, sm_count, cost, min_segment_len, max_segments,
                                  windowed)


def _resolve_plan_uncached(segments, seqlens, spec, device, sm_count, cost, min_segment_len, max_segments,
                           windowed: bool = False) -> CPPlan:
    sm = sm_count if sm_count is not None else _default_sm_count(device, spec)
    model_args = (spec.Hv, spec.K, spec.V, sm, spec.needs_grad, cost or CPCostModel())
    how = "kernel" if spec.K == spec.V else "torch"
    if segments is None:
        return segment_plan(seqlens, spec.Hv, sm, head_dim_k=spec.K, head_dim_v=spec.V,
                            needs_grad=spec.needs_grad, min_segment_len=min_segment_len,
                            max_segments=max_segments, cost=cost, windowed=windowed)
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
    return CPPlan(seqlens, segs, spec.Hv, int(sm), 0, plain, c, why, how)


# ---------------------------------------------------------------------------------------------------------
# Small device-side constants (index tensors, varlen metadata), built once per key
# ---------------------------------------------------------------------------------------------------------

_CACHE_MAX = 64
_CACHE: "OrderedDict[Any, list]" = OrderedDict()   # (key, device) -> [object, used by a captured graph]
_BUILT_IN_CAPTURE: list = []                         # objects (and pinned sources) built during a capture


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _upload(values, dtype=torch.int64, *, device: torch.device, keep: Optional[list]) -> torch.Tensor:
    """A host list/tensor on ``device``: pinned memory and a non-blocking copy (no sync; capturable)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=dtype)
    host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    host = host.pin_memory()
    if keep is not None:
        keep.append(host)   # a captured copy re-reads its source at every replay: keep it alive
    return host.to(device, non_blocking=True)


def _device_cached(key, device: torch.device, build: Callable):
    """``build(upload)`` once per (key, device); ``upload(values, dtype)`` puts host values on the device.

    Eager calls fill an LRU cache (entries a captured CUDA graph used are never evicted: the graph reads
    their memory at every replay).  A miss during capture builds an object for that graph alone, with
    pinned sources kept alive; call the op once before capturing (the kernels need the warm-up anyway)."""
    device = torch.device(device)
    full = (key, str(device))
    capturing = _capturing(device)
    hit = _CACHE.get(full)
    if hit is not None:
        _CACHE.move_to_end(full)
        if capturing:
            hit[1] = True
        return hit[0]
    if capturing:
        keep: list = []
        try:
            obj = build(functools.partial(_upload, device=device, keep=keep))
        except Exception as exc:
            raise RuntimeError("flashqla context parallelism: building the segment metadata during CUDA graph "
                               "capture failed; run the call once before capturing (warm-up)") from exc
        _BUILT_IN_CAPTURE.append((obj, keep))
        return obj
    obj = build(functools.partial(_upload, device=device, keep=None))
    _CACHE[full] = [obj, False]
    if len(_CACHE) > _CACHE_MAX:
        for k in list(_CACHE):
            if len(_CACHE) <= _CACHE_MAX:
                break
            if not _CACHE[k][1]:
                del _CACHE[k]
    return obj


def _varlen_meta(cu: Sequence[int], upload) -> VarlenMeta:
    """prepare_varlen on the host (checks, chunk metadata), then the tensors uploaded."""
    m = prepare_varlen(torch.tensor([int(x) for x in cu], dtype=torch.int32))
    return VarlenMeta(upload(m.cu_seqlens, torch.int32), m.cu_seqlens_cpu, upload(m.chunk_offsets, torch.int32),
                      upload(m.chunk_indices, torch.int32), m.chunk_size)


def _make_meta(cu: Sequence[int], device: torch.device) -> VarlenMeta:
    """The VarlenMeta of a packed batch with offsets ``cu`` on ``device`` (cached; no sync)."""
    cu = tuple(int(x) for x in cu)
    return _device_cached(("meta", cu), device, lambda up: _varlen_meta(cu, up))


class _Idx:
    """Rows to take from / put into a tensor: a slice when they are consecutive, else a device index."""

    __slots__ = ("sl", "t", "n")

    def __init__(self, values: Sequence[int], upload):
        values = [int(x) for x in values]
        self.n = len(values)
        if not values or values == list(range(values[0], values[0] + len(values))):
            a = values[0] if values else 0
            self.sl, self.t = slice(a, a + len(values)), None
        else:
            self.sl, self.t = None, upload(values, torch.int64)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.sl] if self.sl is not None else x.index_select(0, self.t)

    def put(self, x: torch.Tensor, src: torch.Tensor) -> None:
        if self.sl is not None:
            x[self.sl] = src
        else:
            x.index_copy_(0, self.t, src)


# ---------------------------------------------------------------------------------------------------------
# Windows: where a segment's map M is negligible, its end state needs only its last few chunks
# ---------------------------------------------------------------------------------------------------------

# A map is dropped where the bound below is under exp(NEGLIGIBLE_LOG_BOUND) = 7e-66: for any state of norm
# under 1e20 the dropped term M S is then below fp32's smallest subnormal (1.4e-45), so an fp32 computation
# of the plain recurrence cannot carry it either.  (FlashQLA's CP drops terms below exp(-10) = 4.5e-5.)
NEGLIGIBLE_LOG_BOUND = -150.0
_WINDOW_MODES = ("auto", "off")


def _window_rows(seq_start, seq_segs):
    """(sequence, position) of every segment of the split sequences, and their token ranges."""
    rows, ranges = [], []
    for n, (a, segs) in enumerate(zip(seq_start, seq_segs)):
        if len(segs) < 2:
            continue
        for p, L in enumerate(segs):
            rows.append((n, p))
            ranges.append((a, a + int(L)))
            a += int(L)
    return rows, ranges


# The longest window looked for, in chunks: only these tokens at each end of a segment are read (a
# longer window means gates that decay slowly, where the fixed structure costs little more).
MAX_WINDOW_CHUNKS = 32


def _window_index(ends, upload):
    """Token indices of the last (``from_end``: backwards from the end) or first MAX_WINDOW_CHUNKS chunks of
    each range, -1 past its other end; ``ends`` = ((a, b, from_end), ...)."""
    C = CHUNK_SIZE
    n = min(MAX_WINDOW_CHUNKS, max(-(-(b - a) // C) for a, b, _ in ends))
    idx = torch.full((len(ends), n * C), -1, dtype=torch.int64)
    for r, (a, b, from_end) in enumerate(ends):
        m = min(b - a, n * C)
        idx[r, :m] = torch.arange(b - 1, b - 1 - m, -1) if from_end else torch.arange(a, a + m)
    return n, upload(idx.reshape(-1), torch.int64)


def _window_counts(k, g, beta, use_qk_l2norm: bool, seq_start, seq_segs, leading: bool = False):
    """The device half of :func:`_boundary_windows`: ``(rows, ranges, lead_rows, counts)`` with ``counts`` an
    int64 device tensor, per trailing row and then per leading row, of the fewest chunks (unrounded) whose
    bound is under ``exp(NEGLIGIBLE_LOG_BOUND)`` for every value head, 0 where none of the first
    MAX_WINDOW_CHUNKS is.  None when no sequence is split.  Nothing is read on the host."""
    rows, ranges = _window_rows(seq_start, seq_segs)
    if not rows:
        return None
    lead_rows = [(r, rg) for r, rg in zip(rows, ranges) if r[1] >= 1] if leading else []
    ends = tuple((a, b, True) for a, b in ranges) + tuple((a, b, False) for _, (a, b) in lead_rows)
    n, idx = _device_cached(("cpwin", ends, MAX_WINDOW_CHUNKS), g.device,
                            lambda up: _window_index(ends, up))
    # per candidate the first j + 1 whose bound (the largest over the heads) is under the threshold; one
    # launch on CUDA (NaN compares false: a NaN gate gets no window and runs the fixed structure, as the plain
    # op would)
    counts = window_counts(k, g, beta, idx, n, use_qk_l2norm, NEGLIGIBLE_LOG_BOUND)
    return rows, ranges, lead_rows, counts


def _windows_from_counts(found, counts: Sequence[int]):
    """The host half of :func:`_boundary_windows`: ``(trail, lead)`` from ``_window_counts``'s result and its
    counts read on the host."""
    rows, ranges, lead_rows, _ = found
    C = CHUNK_SIZE

    def rounded(w, rg):
        nc = -(-(rg[1] - rg[0]) // C)
        return 0 if w == 0 else min(nc, 1 << (int(w) - 1).bit_length())

    trail = {r: rounded(w, rg) for r, rg, w in zip(rows, ranges, counts)}
    lead = {r: rounded(w, rg) for (r, rg), w in zip(lead_rows, counts[len(rows):])}
    return trail, lead


def _boundary_windows(k, g, beta, use_qk_l2norm: bool, seq_start, seq_segs, leading: bool = False):
    """Window lengths in chunks (0: none) of the split sequences' segments, ``_window_rows`` order.
    ``trail[(n, p)]``: the fewest trailing chunks of segment p (at most MAX_WINDOW_CHUNKS) whose map is under
    ``exp(NEGLIGIBLE_LOG_BOUND)`` for every value head, rounded up to a power of two and capped at the
    segment.  Then the segment's true end state equals, to fp32 rounding, that window's end state from a
    zero start, and its M (forward scan) and M^T (backward scan) are negligible.  Any longer window serves
    too: the state entering the negligible suffix is a true state of the sequence either way.
    ``lead[(n, p)]`` (``leading``, p >= 1): the same from the segment's start; then the segment's dh0 with a
    zero end cotangent comes from that window alone.

    Computed on the device over those end tokens only, then ONE device->host copy of a few integers here.
    The op does not call this: it reads the same lengths after every pass is launched (``_start_read`` /
    ``_finish_read``, see the module docstring)."""
    found = _window_counts(k, g, beta, use_qk_l2norm, seq_start, seq_segs, leading)
    if found is None:
        return {}, {}
    return _windows_from_counts(found, found[3].tolist())


# The window configuration each plan ran with last, per (program key, device): the op runs a repeated call
# with it and checks afterwards (one read at the end of the call, not in the middle; module docstring).
_WINDOW_MEMO: "OrderedDict[Any, tuple]" = OrderedDict()


def clear_window_memo() -> None:
    """Forget the window configurations of earlier calls (the next call of each plan runs the fixed structure
    and keeps the windows it reads, as a first call does)."""
    _WINDOW_MEMO.clear()


def _normalise_windows(trail: dict, lead: dict) -> tuple:
    """(trailing windows or None, leading windows or None) as the program takes them: no trailing window at
    all is the fixed structure; the leading windows replace a backward pass only when every row has one."""
    win = trail if any(trail.values()) else None
    lead_win = lead if lead and all(lead.values()) else None
    return win, lead_win


def _covers(used: tuple, trail: dict, lead: dict) -> bool:
    """Whether the windows ``used`` (normalised) serve gates whose own windows are ``trail`` / ``lead``: each
    used window is 0 (that row runs in full) or at least as long as a window that exists."""
    win, lead_win = used
    for r, w in (win or {}).items():
        if w and not (0 < trail.get(r, 0) <= w):
            return False
    for r, w in (lead_win or {}).items():
        if not (0 < lead.get(r, 0) <= w):
            return False
    return True


def _widen(used: tuple, trail: dict, lead: dict) -> tuple:
    """The narrowest configuration that covers both ``used`` and these gates' windows: per row the longer
    window, a row without a window runs in full from then on."""
    win, lead_win = used
    old_t = win if win is not None else {r: 0 for r in trail}
    t = {r: (0 if old_t.get(r, 0) == 0 or trail.get(r, 0) == 0 else max(old_t[r], trail[r])) for r in trail}
    if lead_win is None or not lead or not all(lead.values()):
        ld = {}
    else:
        ld = {r: max(lead_win.get(r, 0), lead[r]) for r in lead}
    return _normalise_windows(t, ld)


_PINNED = threading.local()     # per thread: (numel, dtype) -> a pinned host buffer for the window counts


def _start_read(counts: torch.Tensor):
    """Copy ``counts`` to the host without waiting (pinned memory, an event behind the copy).  The pinned
    buffer is reused (per thread and size): every call waits for its copy before it returns."""
    if counts.is_cuda:
        bufs = getattr(_PINNED, "bufs", None)
        if bufs is None:
            bufs = _PINNED.bufs = {}
        key = (counts.numel(), counts.dtype)
        host = bufs.get(key)
        if host is None:
            if len(bufs) > _CACHE_MAX:
                bufs.clear()
            host = bufs[key] = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return host, ev
    return counts, None


def _finish_read(pending) -> list:
    host, ev = pending
    if ev is not None:
        ev.synchronize()
    return host.tolist()


def _use_windows(windows: str, spec, mode: str) -> bool:
    """Whether the call is planned for windows (taken at run time unless under CUDA-graph capture)."""
    if windows not in _WINDOW_MODES:
        raise ValueError(f"windows must be one of {_WINDOW_MODES}, got {windows!r}")
    return windows == "auto" and mode == "fused"


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

    The fallback of :func:`chunk_gated_delta_rule_cp` when K != V, and the oracle of the kernel-computed M.
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
    key = ("ranges", tuple((int(s), int(L)) for s, L in ranges))
    starts, lens = _device_cached(key, dev, lambda up: (up([s for s, _ in key[1]]), up([L for _, L in key[1]])))
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
    """The phases of a segmented call on packed tensors ``[1, T, ...]``, all through one backend name.

    ``flashqla.distributed`` drives it row by row (index tensors per call); the single-device op runs the
    capturable :class:`_Program` below."""

    def __init__(self, backend: str, scale: float, use_qk_l2norm: bool, layout: _Layout, state_dtype,
                 base_spec=None):
        self.backend = backend
        self.scale = scale
        self.l2norm = use_qk_l2norm
        self.layout = layout
        self.sd = state_dtype
        # the caller's validated spec: every pass's inputs are views or gathers of its tensors (same dtypes,
        # heads, device, flags), so a pass's spec is derived from it instead of validated again
        self.base_spec = base_spec

    # -- backend calls --------------------------------------------------------------------------------
    def forward_call(self, q, k, v, g, beta, cu, h0, out_final: bool, needs_grad: bool):
        """One backend forward of a packed varlen batch (``cu``: offsets or a VarlenMeta on q's device);
        returns (o, ht, saved, aux, backend, spec)."""
        meta = cu if isinstance(cu, VarlenMeta) else _make_meta(cu, q.device)
        if self.base_spec is None:
            spec, scale, meta = validate(q, k, v, g, beta, self.scale, h0, out_final, self.l2norm, None, meta,
                                         needs_grad=needs_grad)
        else:
            spec = dataclasses.replace(
                self.base_spec, state_dtype=None if h0 is None else dtype_name(h0.dtype), varlen=True,
                has_initial_state=h0 is not None, output_final_state=bool(out_final), needs_grad=bool(needs_grad),
                batch=1, tokens=q.shape[1], num_seqs=meta.num_seqs)
            scale = self.scale
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


# ---------------------------------------------------------------------------------------------------------
# The single-device op: a plan compiled once into passes and index maps (no host work on the device path)
# ---------------------------------------------------------------------------------------------------------

def _prefix(counts) -> list:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _merge(ranges) -> list:
    """Token ranges (a, b) with touching neighbours merged (fewer slices to gather)."""
    out: list = []
    for a, b in ranges:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _gather(t: torch.Tensor, ranges) -> torch.Tensor:
    """The token ranges of a packed ``[1, T, ...]`` tensor as one packed tensor (a view for one range)."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return t[:, a:b]
    return torch.cat([t[:, a:b] for a, b in ranges], 1)


class _Pass:
    """One backend forward of phase 1; only its final states are kept (``o`` is discarded).

    ranges      merged token ranges of the packed sequences (None: the caller's tokens, all segments)
    v_ranges    the same for the sequences that take the true v (the first ``zero_from`` packed tokens)
    zero_from   packed token from which v = 0 (the M sequences), None when there are none
    eye_from    packed sequence from which the start state is I, None when there are none
    h0_dst/src  packed sequences that start from the caller's initial state, and its rows
    take        rows of the final states that the pass produces, in scan order
    v_cols_k    v and the states have K columns (a separate M pass when K != V)
    """

    def __init__(self):
        self.ranges = None
        self.v_ranges = None
        self.tokens = 0
        self.zero_from = None
        self.eye_from = None
        self.num = 0
        self.meta = None
        self.h0_dst = self.h0_src = self.take = None
        self.v_cols_k = False


class _Program:
    """What one CP call shape runs: segment order <-> scan order maps, the passes of phase 1, the scan's
    blocks.  Built on the host once per (segments, flags, device); its device tensors are uploaded once.

    Scan order: the split sequences ("lanes", in decreasing segment count) and their segment positions p,
    stored position-major: block p holds the lanes with more than p segments, a prefix of the lanes.
    Rows of the start states / end cotangents: every (lane, p), ``off[p] + lane``.  Rows of S_local:
    (lane, p) for p < n - 1.  Rows of M: p >= 1 up to n - 2 (forward only) or n - 1 (the backward scan
    reads the last segment's M too; the first segment's M is never needed: it starts from a known state).
    """

    def __init__(self, seq_segs, has_h0: bool, needs_grad: bool, mode: str, upload, windows=None, lead=None):
        self.mode = mode
        N = len(seq_segs)
        seg_cu, first = [0], []
        for segs in seq_segs:
            first.append(len(seg_cu) - 1)
            for x in segs:
                seg_cu.append(seg_cu[-1] + int(x))
        nseg, T = len(seg_cu) - 1, seg_cu[-1]
        self.final_meta = _varlen_meta(seg_cu, upload)
        lanes = sorted((n for n in range(N) if len(seq_segs[n]) > 1), key=lambda n: -len(seq_segs[n]))
        nl = [len(seq_segs[n]) for n in lanes]
        C, nmax = len(lanes), nl[0]
        cnt = [sum(1 for x in nl if x > p) for p in range(nmax)]
        off = _prefix(cnt)
        scnt = cnt[1:]
        mcnt = [0] + [cnt[p] if needs_grad else (cnt[p + 1] if p + 1 < nmax else 0) for p in range(1, nmax)]
        self.C, self.nmax, self.cnt, self.off, self.P = C, nmax, cnt, off, off[-1]
        self.soff, self.moff = _prefix(scnt), _prefix(mcnt)
        self.NS, self.NM = self.soff[-1], self.moff[-1]

        def seg(l, p):
            return first[lanes[l]] + p

        def rng(l, p):
            s = seg(l, p)
            return seg_cu[s], seg_cu[s + 1]

        # windows (see _boundary_windows): per (sequence, p) the trailing chunks of segment p whose map M is
        # negligible, 0 where it is not.  Such a segment's S row runs over that window only, from zero, and
        # its M is zero (not computed).
        def wchunks(l, p):
            return 0 if windows is None else windows.get((lanes[l], p), 0)

        def s_rng(l, p):
            a, b = rng(l, p)
            w = wchunks(l, p)
            return (a, b) if w == 0 else (max(a, b - w * CHUNK_SIZE), b)

        by_seq = sorted(range(C), key=lambda l: lanes[l])   # token order: touching ranges merge
        s_list = [(l, p) for l in by_seq for p in range(nl[l] - 1)]
        m_list = [(l, p) for l in by_seq for p in range(1, nl[l] if needs_grad else nl[l] - 1)]
        s_pm = [(l, p) for p in range(nmax - 1) for l in range(scnt[p])]
        m_pm = [(l, p) for p in range(1, nmax) for l in range(mcnt[p])]
        s_pos = {lp: i for i, lp in enumerate(s_list)}
        m_pos = {lp: i for i, lp in enumerate(m_list)}
        # (a window that does not reach back to the sequence start starts from zero: the caller's initial
        # state reaches its end through a negligible map, like every other state before the window)
        lane_h0 = [(i, lanes[l]) for i, (l, p) in enumerate(s_list)
                   if p == 0 and s_rng(l, p)[0] == rng(l, p)[0]] if has_h0 else []
        m_run = [lp for lp in m_list if wchunks(*lp) == 0]
        self.m_put = None if len(m_run) == len(m_list) else \
            _Idx([i for i, lp in enumerate(m_pm) if wchunks(*lp) == 0], upload)
        # every M negligible: the scans are copies (start[p + 1] = S_local[p], dS_end[p - 1] = dh0_local[p])
        self.m_zero = bool(m_list) and not m_run

        def gathered(seqs, zero_seq, eye_seq, h0_pairs, take, v_cols_k=False):
            ps = _Pass()
            rs = [s_rng(l, p) if i < zero_seq else rng(l, p) for i, (l, p) in enumerate(seqs)]
            cu = _prefix(b - a for a, b in rs)
            ps.ranges, ps.v_ranges = _merge(rs), _merge(rs[:zero_seq])
            ps.tokens, ps.num, ps.meta = cu[-1], len(seqs), _varlen_meta(cu, upload)
            ps.zero_from = cu[zero_seq] if zero_seq < len(seqs) else None
            ps.eye_from = eye_seq if eye_seq < len(seqs) else None
            ps.h0_dst = _Idx([i for i, _ in h0_pairs], upload)
            ps.h0_src = _Idx([n for _, n in h0_pairs], upload)
            ps.take = _Idx(take, upload)
            ps.v_cols_k = v_cols_k
            return ps

        def full_run(take_pm):
            ps = _Pass()
            ps.tokens, ps.num, ps.meta = T, nseg, self.final_meta
            pairs = [(first[n], n) for n in lanes] if has_h0 else []
            ps.h0_dst = _Idx([i for i, _ in pairs], upload)
            ps.h0_src = _Idx([n for _, n in pairs], upload)
            ps.take = _Idx([seg(l, p) for l, p in take_pm], upload)
            return ps

        self.passes = []
        self.m_ranges = None
        if mode == "fused" and m_list:
            # the S rows and the M rows still needed in one launch (with windows, maybe no M row at all)
            run_pos = {lp: i for i, lp in enumerate(m_run)}
            take = [s_pos[lp] for lp in s_pm] + [len(s_list) + run_pos[lp] for lp in m_pm if lp in run_pos]
            self.passes.append(gathered(s_list + m_run, len(s_list), len(s_list), lane_h0, take))
        else:
            # S_local alone: a gather of the non-last segments, or (when that is many slices and the rest
            # of the tokens is not larger) all segments straight from the caller's tokens, no copy at all
            ts = sum(b - a for a, b in (rng(l, p) for l, p in s_list))
            if len(_merge(rng(l, p) for l, p in s_list)) > 1 and T - ts <= ts:
                self.passes.append(full_run(s_pm))
            else:
                self.passes.append(gathered(s_list, len(s_list), len(s_list), lane_h0,
                                            [s_pos[lp] for lp in s_pm]))
            if mode == "kernel" and m_list:
                self.passes.append(gathered(m_list, 0, 0, [], [m_pos[lp] for lp in m_pm], v_cols_k=True))
            elif mode == "torch":
                self.m_ranges = [(seg_cu[seg(l, p)], seg_cu[seg(l, p) + 1] - seg_cu[seg(l, p)]) for l, p in m_pm]

        # segment order <-> scan order
        self.lane_rows = _Idx(lanes, upload)                   # rows of h0 / dht of the lanes
        row_of = {seg(l, p): off[p] + l for l in range(C) for p in range(nl[l])}
        seq_of_seg = {first[n]: n for n in range(N)}
        self.has_unsplit = C < N

        def seg_map(extra):
            return [row_of[s] if s in row_of else extra(seq_of_seg[s]) for s in range(nseg)]

        cat_map = seg_map(lambda n: self.P + n)
        self.map_cat = _Idx(cat_map, upload)                   # from cat([rows, per-sequence states])
        if self.has_unsplit:
            self.map_zero_start = _Idx(seg_map(lambda n: 0), upload)   # no h0: block 0 rows are zero
            self.map_zero_end = _Idx(seg_map(lambda n: off[nl[0] - 1]), upload)  # no dht: terminal rows are 0
        else:
            self.map_zero_start = self.map_zero_end = self.map_cat
        self.dloc = _Idx([seg(l, p) for p in range(1, nmax) for l in range(cnt[p])], upload)
        self.dloc_dst = _Idx([off[p - 1] + l for p in range(1, nmax) for l in range(cnt[p])], upload) \
            if self.m_zero else None
        # leading windows (backward): per dloc row (p >= 1, scan order) the first chunks of its segment, whose
        # dh0 with a zero end cotangent is the segment's (see _boundary_windows); None: a full backward pass
        self.lead = None
        if lead is not None:
            rs = []
            for p in range(1, nmax):
                for l in range(cnt[p]):
                    a, b = rng(l, p)
                    rs.append((a, min(b, a + lead[(lanes[l], p)] * CHUNK_SIZE)))
            self.lead = (_merge(rs), _varlen_meta(_prefix(b - a for a, b in rs), upload), len(rs))
        self.term = _Idx([off[nl[l] - 1] + l for l in range(C)], upload)
        self.last = _Idx([first[n] + len(seq_segs[n]) - 1 for n in range(N)], upload)
        self.first = _Idx(first, upload)


def _run_pass(eng: "_Engine", ps: _Pass, x, h0s) -> torch.Tensor:
    """Phase-1 pass: final states of its packed sequences, in scan order."""
    q, k, v, g, beta = x
    Hv, K = v.shape[2], k.shape[3]
    Vp = K if ps.v_cols_k else v.shape[3]
    if ps.ranges is None:
        kk, vv, gg, bb = k, v, g, beta
    else:
        kk, gg, bb = (_gather(t, ps.ranges) for t in (k, g, beta))
        if ps.zero_from is None:
            vv = _gather(v, ps.v_ranges)
        else:
            vv = v.new_empty(1, ps.tokens, Hv, Vp)
            if ps.zero_from > 0:
                if len(ps.v_ranges) == 1:
                    a, b = ps.v_ranges[0]
                    vv[:, :ps.zero_from].copy_(v[:, a:b])
                else:
                    torch.cat([v[:, a:b] for a, b in ps.v_ranges], 1, out=vv[:, :ps.zero_from])
            vv[:, ps.zero_from:].zero_()
    h = None
    use_h0 = h0s is not None and ps.h0_dst.n > 0
    if ps.eye_from is not None or use_h0:
        h = torch.zeros(ps.num, Hv, K, Vp, dtype=eng.sd, device=k.device)
        if use_h0:
            ps.h0_dst.put(h, ps.h0_src.take(h0s))
        if ps.eye_from is not None:
            h[ps.eye_from:].diagonal(dim1=-2, dim2=-1).fill_(1.0)
    # o of this pass is discarded: k stands in for q (no gather of q)
    _, ht, _, _, _, _ = eng.forward_call(kk, kk, vv, gg, bb, ps.meta, h, True, False)
    return ps.take.take(ht).to(eng.sd)


def _phase1(eng: "_Engine", prog: _Program, x, h0s):
    """S_local (scan order) and M (scan order, blocks p >= 1)."""
    outs = [_run_pass(eng, ps, x, h0s) for ps in prog.passes]
    if prog.mode == "fused" and prog.NM:
        if prog.m_put is None:
            return outs[0][:prog.NS], outs[0][prog.NS:]
        # windows: the negligible maps are zero, the others come from the pass
        K, Hv = x[1].shape[3], x[3].shape[2]
        M = outs[0].new_zeros(prog.NM, Hv, K, K)
        prog.m_put.put(M, outs[0][prog.NS:])
        return outs[0][:prog.NS], M
    S = outs[0]
    K, Hv = x[1].shape[3], x[3].shape[2]
    if prog.mode == "kernel" and prog.NM:
        return S, outs[1]
    if prog.mode == "torch" and prog.NM:
        return S, transition_matrices(x[1], x[3], x[4], prog.m_ranges, eng.l2norm, compute_dtype=eng.sd)
    return S, S.new_zeros(0, Hv, K, K)


def _lead_dh0(eng: "_Engine", prog: _Program, xs, do_p) -> torch.Tensor:
    """dh0 of every leading window (dloc rows, scan order) with a zero end cotangent.  dh0 does not depend on
    the start state (the segment map is affine), so the windows start from zero."""
    ranges, meta, n = prog.lead
    q, k, v, g, beta, do_w = (_gather(t, ranges) for t in (*xs, do_p))
    Hv, K, V = v.shape[2], k.shape[3], v.shape[3]
    h0 = torch.zeros(n, Hv, K, V, dtype=eng.sd, device=k.device)
    _, _, saved, aux, be, spec = eng.forward_call(q, k, v, g, beta, meta, h0, False, True)
    return be.backward(spec, saved, aux, do_w, None)[5].to(eng.sd)


def _pack(t: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [1, B*T, ...] (a view for contiguous inputs: segments are then plain token ranges)."""
    return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])


def _cast(grads, dtypes):
    return tuple(None if gr is None or dt is None else gr.to(dt) for gr, dt in zip(grads, dtypes))


@dataclass
class _CPConfig:
    engine: "_Engine"
    program: _Program
    shape: tuple               # (B, T) of the caller's tensors
    output_final_state: bool
    needs_grad: bool


def _bmm_into(out, add, a, b):
    """out = a @ b + add for blocks of rows: out, add, b [rows, Hv, K, V], a [rows * Hv, K, K] (one batched
    matmul, written in place into the contiguous block ``out``)."""
    K, V = b.shape[-2], b.shape[-1]
    torch.baddbmm(add.reshape(-1, K, V), a, b.reshape(-1, K, V), out=out.view(-1, K, V))


class _CPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cfg: _CPConfig):
        eng, prog = cfg.engine, cfg.program
        sd = eng.sd
        x = tuple(_pack(t) for t in (q, k, v, g, beta))
        dev = q.device
        Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        h0s = None if h0 is None else h0.to(sd)
        # (1) local end states and transitions: one backend pass when K == V
        S, M = _phase1(eng, prog, x, h0s)
        # (2) the segment scan, block by block (a prefix of the lanes is still running at position p)
        C, cnt, off, soff, moff = prog.C, prog.cnt, prog.off, prog.soff, prog.moff
        starts = torch.empty(prog.P, Hv, K, V, dtype=sd, device=dev)
        if h0s is not None:
            starts[:C] = prog.lane_rows.take(h0s)
        else:
            starts[:C].zero_()
        starts[off[1]:off[1] + cnt[1]] = S[:cnt[1]]
        if prog.m_zero:
            # (windows: every M is negligible, so start[p + 1] = S_local[p]; blocks 1.. of starts hold S's rows)
            starts[off[2]:off[2] + prog.NS - cnt[1]] = S[cnt[1]:]
        for p in range(1, 1 if prog.m_zero else prog.nmax - 1):
            a = cnt[p + 1]
            _bmm_into(starts[off[p + 1]:off[p + 1] + a], S[soff[p]:soff[p] + a],
                      M[moff[p]:moff[p] + a].reshape(-1, K, K), starts[off[p]:off[p] + a])
        # (3) every segment with its true start state: the caller's tokens with the segments' cu_seqlens
        if h0s is not None and prog.has_unsplit:
            h0_seg = prog.map_cat.take(torch.cat([starts, h0s]))
        else:
            h0_seg = (prog.map_cat if h0s is not None else prog.map_zero_start).take(starts)
        want_ht = cfg.output_final_state or cfg.needs_grad
        o, ht_seg, saved, aux, be, spec = eng.forward_call(*x, prog.final_meta, h0_seg, want_ht, cfg.needs_grad)
        ctx.be, ctx.spec, ctx.aux, ctx.cfg = be, spec, aux, cfg
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, None if h0 is None else h0.dtype)
        ctx.n_saved = len(saved)
        if cfg.needs_grad:
            # (leading windows: the backward runs a forward of its own over them, from the caller's inputs)
            ctx.save_for_backward(*saved, M, *(x if prog.lead is not None else ()))
        B, T = cfg.shape
        o = o.reshape(B, T, Hv, V)
        if cfg.output_final_state:
            ht = prog.last.take(ht_seg)
        else:
            ht = o.new_empty(0)
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        cfg = ctx.cfg
        eng, prog = cfg.engine, cfg.program
        sd = eng.sd
        tensors = ctx.saved_tensors
        saved, M, xs = tensors[:ctx.n_saved], tensors[ctx.n_saved], tensors[ctx.n_saved + 1:]
        B, T = cfg.shape
        do_p = _pack(do.contiguous())
        dev = do.device
        Hv, K, V = ctx.spec.Hv, ctx.spec.K, ctx.spec.V
        if dht is not None and dht.numel() == 0:
            dht = None
        C, cnt, off, moff = prog.C, prog.cnt, prog.off, prog.moff
        # local dh0 of every segment: a backward with dht = 0 (only dh0 is kept), rows p >= 1 in scan order;
        # with leading windows, a forward and backward of those windows alone
        if prog.lead is not None:
            dloc = _lead_dh0(eng, prog, xs, do_p)
        else:
            g1 = ctx.be.backward(ctx.spec, saved, ctx.aux, do_p, None)
            dloc = prog.dloc.take(g1[5]).to(sd)
            del g1
        # the backward scan: dS_end[p - 1] = dh0_local[p] + M[p]^T dS_end[p]; each lane's last row is dht
        dS = torch.empty(prog.P, Hv, K, V, dtype=sd, device=dev)
        if dht is not None:
            prog.term.put(dS, prog.lane_rows.take(dht).to(sd))
        elif prog.term.sl is not None:
            dS[prog.term.sl].zero_()
        else:
            dS.index_fill_(0, prog.term.t, 0.0)
        if prog.m_zero:
            prog.dloc_dst.put(dS, dloc)       # every M negligible: dS_end[p - 1] = dh0_local[p]
        for p in range(0 if prog.m_zero else prog.nmax - 1, 0, -1):
            c = cnt[p]
            _bmm_into(dS[off[p - 1]:off[p - 1] + c], dloc[off[p] - C:off[p] - C + c],
                      M[moff[p]:moff[p] + c].reshape(-1, K, K).transpose(-1, -2), dS[off[p]:off[p] + c])
        if dht is not None and prog.has_unsplit:
            dht_seg = prog.map_cat.take(torch.cat([dS, dht.to(sd)]))
        else:
            dht_seg = (prog.map_cat if dht is not None else prog.map_zero_end).take(dS)
        dq, dk, dv, dg, dbeta, dh0_seg = ctx.be.backward(ctx.spec, saved, ctx.aux, do_p, dht_seg)
        shp = lambda t: t.reshape(B, T, *t.shape[2:])  # noqa: E731
        dh0 = prog.first.take(dh0_seg) if ctx.dtypes[5] is not None else None
        grads = (shp(dq), shp(dk), shp(dv), shp(dg), shp(dbeta), dh0)
        return _cast(grads, ctx.dtypes) + (None,)


def _seq_bounds(B: int, T: int, meta: Optional[VarlenMeta]):
    if meta is None:
        return [b * T for b in range(B)], [T] * B
    return list(meta.cu_seqlens_cpu[:-1]), meta.seqlens


# Backends on which the automatic plan (``segments=None``) stays off, with the measurement that says why.
# A forced segment count still runs CP on them.
AUTO_DECLINED = {
    "triton": "CP on the triton backend measured slower than plain on the H200 (2/8 heads, one 32768-token "
              "sequence, forward: 1.040 ms plain, 1.334 ms with 8 windowed segments, s8 run 2; 1.489 against "
              "2.29 ms in session 4, benchmarks/results/h200_2026-12-03_s4run4_check_cp.log)",
    "tilelang": "CP on the tilelang backend measured slower than plain on the H200: its host path (~2 ms per "
                "call on that machine's CPU) outweighs the kernels it saves (2/8 heads, one 32768-token "
                "sequence, forward: 0.714 ms plain, 1.218 ms with automatic windowed CP, whose kernels take "
                "0.28 ms; every long-sequence row of the grid slower or even, "
                "benchmarks/results/h200_2026-12-03_s8run2_cpw_spec.md and _s8run2_profile_cp.json); forced "
                "segment counts still run",
}


def auto_declined(backend_name: str, device: torch.device) -> Optional[str]:
    """Why the automatic plan stays off for this backend on this device (None: the cost model decides)."""
    if device.type != "cuda":
        return None
    return AUTO_DECLINED.get(backend_name)


def _transition_mode(transitions: str, K: int, V: int) -> str:
    if transitions not in _TRANSITIONS:
        raise ValueError(f"transitions must be one of {_TRANSITIONS}, got {transitions!r}")
    if transitions == "torch":
        return "torch"
    if K == V:
        return "fused"
    return "kernel" if transitions == "kernel" else "torch"


def cp_plan(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, cu_seqlens=None, segments=None, *, varlen_meta=None,
            sm_count: Optional[int] = None, needs_grad: Optional[bool] = None,
            cost: Optional[CPCostModel] = None, min_segment_len: int = 512, max_segments: int = 64,
            transitions: str = "auto", windows: str = "auto") -> CPPlan:
    """The :class:`CPPlan` :func:`chunk_gated_delta_rule_cp` would use for these arguments (nothing runs)."""
    spec, _, meta = validate(q, k, v, g, beta, scale, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, cu_seqlens, varlen_meta, needs_grad=needs_grad)
    _, lens = _seq_bounds(q.shape[0], q.shape[1], meta)
    windowed = _use_windows(windows, spec, _transition_mode(transitions, spec.K, spec.V))
    return _resolve_plan(segments, lens, spec, q.device, sm_count, cost, min_segment_len, max_segments,
                         windowed)


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
    transitions: str = "auto",
    windows: str = "auto",
):
    """:func:`flashqla.chunk_gated_delta_rule` with exact context parallelism; same arguments and results.

    ``segments``: ``None`` lets :func:`segment_plan` decide from the call shape and ``sm_count`` (default:
    the device's SMs; CPU: torch threads); an int splits every sequence into that many segments of whole
    chunks (``1``: no CP); a list gives per sequence a segment count or explicit segment lengths; or a
    :class:`CPPlan` (from :func:`cp_plan`).  When no sequence is split this is exactly the plain op.
    Every pass runs on the backend chosen by ``backend``.

    ``transitions``: how the segment maps M are computed: ``"auto"`` by the backend's forward fused into
    the local pass when K == V, else torch ops; ``"kernel"`` by the backend also when K != V (a separate
    pass with K value columns); ``"torch"`` always torch ops (:func:`transition_matrices`).

    ``windows``: ``"auto"`` (default) lets a call with K == V that is not under CUDA-graph capture look at
    the gates first: where a segment's map M is negligible (below ``exp(-150)`` by a norm bound, so fp32
    cannot carry the dropped term; see :func:`_boundary_windows`), its end state comes from its last few
    chunks alone and its M is not computed; with gradients, its dh0 from its first few chunks.  With
    decaying gates phase 1 then shrinks from about two segments' work per boundary to a few chunks, and the
    backward from two full passes to one.  This reads a few integers on the host after everything is
    launched: a plan's first call runs the fixed structure and keeps the windows it read, later calls run
    with them (and again, wider, if this call's gates need more; see the module docstring).  ``"off"``: the
    fixed pass structure always.

    No host sync when the sequence lengths are known on the host (dense inputs, or ``varlen_meta``) and
    windows are off or not taken (under capture); after one call with the same plan (warm-up) the call is
    CUDA-graph capturable, forward and backward.
    """
    spec, scale_f, meta = validate(q, k, v, g, beta, scale, initial_state, output_final_state,
                                   use_qk_l2norm_in_kernel, cu_seqlens, varlen_meta)
    mode = _transition_mode(transitions, spec.K, spec.V)
    windowed = _use_windows(windows, spec, mode)
    B, T = q.shape[0], q.shape[1]
    plan = None
    declined = None
    starts: list = []
    if segments is None and B > 0 and T > 0:
        be, _ = select(spec, backend)
        declined = auto_declined(be.name, q.device)
    if B > 0 and T > 0 and declined is None:
        starts, lens = _seq_bounds(B, T, meta)
        plan = _resolve_plan(segments, lens, spec, q.device, sm_count, cost, min_segment_len, max_segments,
                             windowed)
    if plan is None or not plan.enabled:
        from .api import chunk_gated_delta_rule
        return chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel, cu_seqlens, backend, varlen_meta=meta)
    f64 = torch.float64 in (q.dtype, g.dtype, beta.dtype) or (
        initial_state is not None and initial_state.dtype == torch.float64)
    has_h0 = initial_state is not None
    key = ("cp", tuple(plan.segments), has_h0, bool(spec.needs_grad), mode)
    eng = _Engine(backend, scale_f, bool(use_qk_l2norm_in_kernel), None, torch.float64 if f64 else torch.float32,
                  base_spec=spec)

    def run(windows: tuple):
        k2 = key
        if windows != (None, None):
            k2 = key + tuple(tuple(sorted((w or {}).items())) for w in windows)
        prog = _device_cached(k2, q.device, lambda up: _Program(plan.segments, has_h0, spec.needs_grad, mode, up,
                                                                windows=windows[0], lead=windows[1]))
        cfg = _CPConfig(eng, prog, (B, T), bool(output_final_state), spec.needs_grad)
        return _CPFunction.apply(q, k, v, g, beta, initial_state, cfg)

    found = None
    if windowed and not _capturing(q.device):
        # the fixed structure's program is built on every windowed call (a plan's first call also runs it):
        # a CUDA-graph capture after this warm-up runs it
        _device_cached(key, q.device, lambda up: _Program(plan.segments, has_h0, spec.needs_grad, mode, up))
        found = _window_counts(_pack(k), _pack(g), _pack(beta), bool(use_qk_l2norm_in_kernel), starts,
                               plan.segments, leading=spec.needs_grad)
    if found is None:
        o, ht = run((None, None))
        return o, (ht if output_final_state else None)
    mkey = (key, str(q.device))
    used = _WINDOW_MEMO.get(mkey)
    pending = _start_read(found[3])
    if used is None:
        # a plan's first call runs the fixed structure, which needs no windows: it is exact for any gates, and
        # it loads that structure's kernels, which a CUDA-graph capture of this call runs (no kernel can be
        # compiled or loaded during a capture; s8 run 3 failed so after windowed warm-up calls)
        o, ht = run((None, None))
        used = _normalise_windows(*_windows_from_counts(found, _finish_read(pending)))
    else:
        # a repeated call: run with the windows the plan ran with last, read these gates' windows at the end,
        # and run again, wider, in the rare case they do not cover them
        o, ht = run(used)
        trail, lead = _windows_from_counts(found, _finish_read(pending))
        if not _covers(used, trail, lead):
            used = _widen(used, trail, lead)
            o, ht = run(used)
    _WINDOW_MEMO[mkey] = used
    _WINDOW_MEMO.move_to_end(mkey)
    if len(_WINDOW_MEMO) > _CACHE_MAX:
        _WINDOW_MEMO.popitem(last=False)
    return o, (ht if output_final_state else None)
