"""In-kernel context parallelism of the tilelang forward: segments with a halo (issue #8).

Why.  The warp-specialised recurrence runs one walk per (sequence, value head, V-block) and a walk is serial
over its chunks.  With few walks (one 32k sequence at 8 or 16 value heads) most of the 132 SMs idle while
each walk takes 512 chunk steps.  Here each long sequence is cut into chunk-aligned *segments* and every
(segment, head) walks on its own SM.

Exactness.  A segment's true start state is the state after every earlier chunk of its sequence.  The
segment's CTA gets it by walking first the ``W`` chunks before its segment (the *halo*) from a zero state,
where ``W`` is the fewest chunks whose decay bound ``sum_t [g_t + log max(1, |1 - beta_t ||k_t||^2|)]`` (the
log of an upper bound of the halo's state map ``prod exp(g_t) (I - beta_t k_t k_t^T)``, per value head, see
:mod:`flashqla.cp_bounds`) is at most ``-150``: the state entering the halo then reaches the segment start
multiplied by less than ``exp(-150)``, under fp32's smallest subnormal for any state of norm below 1e20, so
dropping it changes nothing fp32 can hold.  Where no such ``W`` exists within ``MAX_HALO_CHUNKS`` (heads that
barely decay, g = 0, a NaN), or the halo reaches the sequence start, the CTA walks from the sequence start
and from ``h0``: exact with no bound at all, as slow as no split for that walk.  The halo lengths come from
one small device pass per call (:func:`walk_starts`): no host read, so the call stays capturable in a CUDA
graph, and any gate is served.

Cost.  The halo's chunks run the state chain only (no output), ~3 chunks per segment at the benchmarks'
gates (``logsigmoid(randn)``: ~-0.8 per token).  The plan (:func:`segment_plan`) takes the V-block and segment
count whose modelled makespan (list scheduling of the CTAs, up to three waves) is least, and splits only where
that beats the walk as it is.
``FLASHQLA_TILELANG_SEGMENTS``: ``auto`` (default), ``off``, or a segment length in chunks (forced).

Backward.  The gradient walk is cut the same way and walks a halo *past* each segment's end from ``dS = 0`` (its
map is the transpose of the forward's, with the same bound), or from ``dht`` at the sequence end: in the split
backward's state kernel (``chunk_bwd_state_ws`` with ``halo``, session 17) or in the whole-V fused backward
(``chunk_bwd_whole`` with ``halo``, session 18: one CTA per (segment, head) forms every gradient of its segment's
chunks; its halo chunks run whole steps and store nothing).  ``ops.bwd_plan`` models both backwards split and not
and takes the fastest; on one 32k sequence at 16/32 the whole-V kernel split 4 ways is modelled at ~2.1 ms against
~4.1 ms for the split backward.  The walk ends come from the same device pass looking forward
(``walk_starts(reverse=True)``), run with the forward because g is not saved for the backward.  CPU-tested
(lowering with pipelined wgmma, host simulation, float64 exactness of the halo), not yet on a GPU, so
``FLASHQLA_TILELANG_BWD_SEGMENTS`` is ``off`` by default.
"""

from __future__ import annotations

import functools
import heapq
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

CHUNK = 64
NEGLIGIBLE_LOG_BOUND = -150.0
# the halo search looks back at most this many chunks; past it the walk starts at the sequence start
MAX_HALO_CHUNKS = 64
# chunks the search's kernel loads per iteration (the benchmarks' gates need 3)
WALK_SEARCH_CHUNKS = 4
# halo chunks the plan assumes per segment (the benchmarks' gates need 3)
PLAN_HALO_CHUNKS = 4
# the least modelled gain worth a split, microseconds
MIN_GAIN_US = 15.0
# the tilelang forward's: its halo search runs beside stage 1 (ops.halo_stream), and the model underprices its
# short unsplit walks.  Measured (H100, session 24, benchmarks/results/h100_2026-12-05_session24_README.md run 6):
# FlashQLA's 1x2048 rows, 32-chunk walks, modelled gains of 6-13 us, split / whole 0.036 / 0.050 ms at 2/8,
# 0.047 / 0.057 at 4/16, 0.048 / 0.061 at 16/16.  The 24-64-head rows stay whole (modelled gains under 10%):
# forced splits measured 4% faster there at best, and up to 35% slower
FWD_MIN_GAIN_US = 5.0
# modelled time of one chunk step of the recurrence, per V-block, in microseconds, with the SMs busy (H200,
# session 17 run 1, benchmarks/results/h200_2026-12-04_session17_README.md: BV 128 split walks, 0.419 ms for
# 132 chunk steps at 16/32 1x32768 and 0.117 for ~36 at 2/8; BV 64, 1.007 ms for 512 at 16/64; BV 32, 0.744
# for 512 at 16/32)
STEP_US = {128: 3.2, 64: 1.95, 32: 1.45}
# and with few CTAs (BV 32: 0.599 ms for 512 chunks at 2/8 1x32768; the others guessed)
STEP_US_FEW = {128: 2.6, 64: 1.6, 32: 1.17}
# what a split adds besides its walks.  The halo search took 20 us at 2/8 1x32768 (run 6), but the step times
# above overstate short split walks; at 8 the 32-head 1x4096 rows stay split, which made them faster (16/32:
# 0.131 ms unsplit in run 1, 0.119 split in run 4)
SPLIT_FIXED_US = 8.0


def read_mode(name: str, default: str) -> str:
    """Environment variable ``name`` (``default`` when unset): ``auto``, ``off`` or a segment length in chunks."""
    raw = os.environ.get(name, default).strip().lower() or default
    if raw in ("auto", "off"):
        return raw
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name} must be 'auto', 'off' or a segment length in chunks (>= 1), got {raw!r}")
    return str(n)


def mode(backward: bool = False) -> str:
    """``auto``, ``off`` or a forced segment length in chunks: ``FLASHQLA_TILELANG_SEGMENTS`` (default auto),
    and for the backward's gradient walk ``FLASHQLA_TILELANG_BWD_SEGMENTS`` (default auto since session 19, when its
    GPU tests passed on the H200 and fwd+bwd went 5.34 -> 2.93 ms at 16/32 1x32768, 2.23 -> 0.47 ms at 2/4 1x32768;
    ``auto`` follows the forward's setting), which ``FLASHQLA_TILELANG_SEGMENTS=off`` also turns off."""
    fwd = read_mode("FLASHQLA_TILELANG_SEGMENTS", "auto")
    if not backward:
        return fwd
    bwd = read_mode("FLASHQLA_TILELANG_BWD_SEGMENTS", "auto")
    if fwd == "off" or bwd == "off":
        return "off"
    return fwd if bwd == "auto" else bwd


@dataclass(frozen=True)
class SegmentPlan:
    seg_chunks: int                 # target segment length in chunks
    bv: int                         # V-block of the split walk
    num_segments: int
    est_us: float                   # modelled recurrence time, split
    est_plain_us: float             # and as it is
    reason: str

    def describe(self) -> str:
        return self.reason


def _segments_of(chunks: Sequence[int], seg: int) -> int:
    return sum(max(1, -(-c // seg)) for c in chunks)


# the backward's gradient walk (``chunk_bwd_state_ws``): ~3.2 us per chunk step whatever the number of CTAs
# (latency-bound, its docstring; sessions 10-11 at BV 32), BV 64 guessed
STEP_BWD_US = {64: 3.8, 32: 3.2}


def _step(bv: int, ctas: int, sms: int, steps=None) -> float:
    if steps is not None:
        return steps[bv]
    return STEP_US[bv] if ctas >= 0.7 * sms else STEP_US_FEW[bv]


# the segment counts of the longest sequence the plan tries
_SPLITS = (1,) + tuple(range(2, 17)) + (20, 24, 28, 32, 40, 48, 56, 64)


def _makespan(durations: list, sms: int) -> float:
    """Greedy list scheduling in launch order (a CTA starts on the first SM that frees up)."""
    if len(durations) <= sms:
        return max(durations, default=0.0)
    free = [0.0] * sms
    heapq.heapify(free)
    end = 0.0
    for d in durations:
        t = heapq.heappop(free) + d
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def _walk_chunks(chunks: Sequence[int], seg: int, halo: int) -> list:
    """Per segment (in launch order) the chunks its walk takes: its own and the halo (none for a first one)."""
    out = []
    for c in chunks:
        parts = max(1, -(-c // seg))
        base, extra = divmod(c, parts)
        for p in range(parts):
            out.append(base + (1 if p < extra else 0) + (min(halo, p * base) if p else 0))
    return out


def _estimate(chunks: Sequence[int], seg: int, Hv: int, V: int, bv: int, sms: int, halo: int,
              steps=None) -> float:
    walks = _walk_chunks(chunks, seg, halo)
    per_seg = Hv * (V // bv)
    ctas = len(walks) * per_seg
    if ctas > 3 * sms:
        return math.inf
    step = _step(bv, ctas, sms, steps)
    longest, shortest = max(walks), min(walks)
    if ctas <= sms:
        return longest * step
    if longest <= 1.25 * shortest:
        # (nearly equal walks: whole waves; the list scheduling below costs ~0.1 ms per candidate)
        return -(-ctas // sms) * longest * step
    # one CTA per (segment, head, V-block); the heads and V-blocks of a segment launch together
    durations = [w * step for w in walks for _ in range(per_seg)]
    return _makespan(durations, sms)


_PLANS: dict = {}


def segment_plan(lengths: Sequence[int], Hv: int, V: int, sms: int, plain_bv: int,
                 forced: Optional[str] = None, backward: bool = False, steps: Optional[dict] = None,
                 bvs: Optional[tuple] = None, min_gain_us: float = MIN_GAIN_US,
                 few_waves: bool = False) -> Optional[SegmentPlan]:
    """The split of sequences of ``lengths`` tokens for ``Hv`` value heads on ``sms`` SMs, or None (no split).

    The model: one CTA per (segment, head, V-block), one CTA per SM, CTAs start in launch order on the first
    free SM (list scheduling), a CTA takes (its chunks + halo) chunk steps of ``STEP_US`` at its V-block.  It
    tries cutting the longest sequence in 2..64 segments (the others in segments of the same length) at each
    V-block (128 or 64; split walks are many, where BV 32 loses) and splits when the best beats the walk as it is
    (at ``plain_bv``) by 10% and ``min_gain_us``.  Plans are cached per (lengths, heads, SMs): a new shape costs
    0.2-1.6 ms of host time here.  ``forced``: :func:`mode`'s value.  ``backward``: the split of the backward's
    gradient walk (``STEP_BWD_US``, V-blocks 64 and 32, one split for both directions' env switch).  ``steps`` /
    ``bvs``: another walk's step times per V-block and its V-blocks, widest first (the whole-V backward: one
    V-block of V, ``ops.WHOLE_STEP_US``).  ``few_waves``: a forward whose walks already fill the SMs is searched
    too while it takes at most two waves (its CTAs <= 2 x SMs): 192 CTAs on 132 SMs are two waves of whole walks,
    which shorter walks in three waves beat."""
    forced = mode(backward) if forced is None else forced
    chunks = tuple(-(-int(n) // CHUNK) for n in lengths)
    longest = max(chunks, default=0)
    if forced == "off" or longest <= 1 or Hv <= 0:
        return None
    key = (chunks, Hv, V, sms, plain_bv, forced, backward, tuple(sorted(steps.items())) if steps else None, bvs,
           min_gain_us, few_waves)
    if key in _PLANS:
        return _PLANS[key]
    steps = steps or (STEP_BWD_US if backward else None)
    bvs = bvs or ((64, 32) if backward else (128, 64))
    plain = _estimate(chunks, longest, Hv, V, plain_bv, sms, 0, steps)
    plan = None
    if forced != "auto":
        seg = int(forced)
        nseg = _segments_of(chunks, seg)
        bv = plain_bv_for(Hv * nseg, V, sms)
        # (the widest of the walk's V-blocks up to that one, else its narrowest)
        bv = next((b for b in bvs if b <= bv), bvs[-1])
        est = _estimate(chunks, seg, Hv, V, bv, sms, PLAN_HALO_CHUNKS, steps) + SPLIT_FIXED_US
        plan = SegmentPlan(seg, bv, nseg, est, plain, f"forced: segments of {seg} chunks, {nseg} "
                           f"segments at BV {bv}")
    elif (backward or Hv * len(chunks) * V / 128 < 0.7 * sms or plain_bv < 128
          or (few_waves and Hv * len(chunks) * (V // plain_bv) <= 2 * sms)):
        # (a forward with a walk per SM at whole V-blocks has nothing to gain, unless its waves are few and
        # uneven; the bound also keeps the search's host time off large batches)
        best = None
        for bv in bvs:
            if V % bv:
                continue
            for parts in _SPLITS[1:]:
                seg = -(-longest // parts)
                if seg < 1 or (parts > 1 and seg == longest):
                    continue
                est = _estimate(chunks, seg, Hv, V, bv, sms, PLAN_HALO_CHUNKS, steps) + SPLIT_FIXED_US
                if best is None or est < best[0]:
                    best = (est, seg, bv)
        # (and by min_gain_us: a split adds the halo search's launch and host work)
        if best is not None and best[0] <= 0.9 * plain and plain - best[0] >= min_gain_us:
            est, seg, bv = best
            nseg = _segments_of(chunks, seg)
            plan = SegmentPlan(seg, bv, nseg, est, plain,
                               f"split: {nseg} segments of <= {seg} chunks at BV {bv} ({Hv * nseg * (V // bv)} "
                               f"CTAs on {sms} SMs), modelled {est:.0f} us against {plain:.0f} us for the "
                               f"{longest}-chunk walk at BV {plain_bv}")
    if len(_PLANS) > 256:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def plain_bv_for(walks: float, V: int, sms: int) -> int:
    # fwd_ws_bv's rule without its environment override (avoids an import cycle with ops)
    if walks >= 0.7 * sms and V % 128 == 0:
        return 128
    if 2 * walks >= 0.7 * sms and V % 64 == 0:
        return 64
    return 32 if V % 32 == 0 else V


@dataclass
class SegmentTables:
    cu_seqlens: torch.Tensor        # int32 [NSEG + 1]: the segments' token boundaries
    chunk_offsets: torch.Tensor     # int32 [NSEG + 1]: their first chunks
    seg_table: torch.Tensor         # int32 [NSEG, 4]: (sequence, its first chunk, is-last, 0)
    seg_table_bwd: torch.Tensor     # int32 [NSEG, 4]: (sequence, its end chunk, is-first, its end token)
    num_segments: int
    split_seqs: int                 # sequences cut in more than one segment


def split_lengths(lengths: Sequence[int], seg_chunks: int) -> list:
    """Per sequence, its segments' lengths in tokens: balanced whole chunks, the tail (a partial chunk) in the
    last; a sequence of at most ``seg_chunks`` chunks (also length 0) stays whole."""
    out = []
    for n in lengths:
        n = int(n)
        nc = -(-n // CHUNK)
        parts = max(1, -(-nc // seg_chunks))
        base, extra = divmod(nc, parts)
        segs, left = [], n
        for p in range(parts):
            c = base + (1 if p < extra else 0)
            t = min(c * CHUNK, left) if p < parts - 1 else left
            segs.append(t)
            left -= t
        out.append(segs)
    return out


_TABLES: dict = {}


def segment_tables(lengths: Sequence[int], seg_chunks: int, device) -> SegmentTables:
    """The segment metadata of one split, built on the host once per (lengths, segment length, device) and
    uploaded without a sync; a repeated call (a CUDA graph replay's capture) reads it from this cache."""
    key = (tuple(int(n) for n in lengths), int(seg_chunks), str(device))
    t = _TABLES.get(key)
    if t is not None:
        return t
    cu, co, tab, tab_b = [0], [0], [], []
    split = 0
    seq_c0 = 0
    for s, segs in enumerate(split_lengths(lengths, seg_chunks)):
        split += len(segs) > 1
        seq_c1 = seq_c0 + sum(-(-n // CHUNK) for n in segs)
        seq_eos = cu[-1] + sum(segs)
        for p, n in enumerate(segs):
            tab.append((s, seq_c0, int(p == len(segs) - 1), 0))
            tab_b.append((s, seq_c1, int(p == 0), seq_eos))
            cu.append(cu[-1] + n)
            co.append(co[-1] + -(-n // CHUNK))
        seq_c0 = co[-1]

    def up(x):
        t = torch.tensor(x, dtype=torch.int32)
        if torch.device(device).type == "cuda":
            t = t.pin_memory().to(device, non_blocking=True)
        else:
            t = t.to(device)
        return t

    t = SegmentTables(up(cu), up(co), up(tab).reshape(-1, 4), up(tab_b).reshape(-1, 4), len(tab), split)
    if len(_TABLES) > 64:
        _TABLES.clear()
    _TABLES[key] = t
    return t


def walk_starts_ref(k, g, beta, tables: SegmentTables, l2norm: bool, max_halo: int = MAX_HALO_CHUNKS,
                    threshold: float = NEGLIGIBLE_LOG_BOUND, reverse: bool = False) -> torch.Tensor:
    """``[NSEG, Hv]`` int32: per segment and value head the global chunk its walk starts from (torch ops; the
    CPU path and the oracle of :func:`walk_starts`).  ``k [NT, Hqk, K]``, ``g`` / ``beta`` ``[NT, Hv]``
    (packed rows).  ``reverse`` (the backward's gradient walk): the chunk its walk *ends* at (exclusive), past
    the segment's end, or the sequence's end chunk."""
    from ...cp_bounds import token_log_bound

    dev = g.device
    ell = token_log_bound(k[None], g[None], beta[None], l2norm).double()      # [NT, Hv]
    NT, Hv = ell.shape
    cu = tables.cu_seqlens.to(dev).long()
    co = tables.chunk_offsets.to(dev).long()
    cs0 = tables.seg_table.to(dev)[:, 1].long()
    nseg = tables.num_segments
    # per token its global chunk, and per chunk the summed bound (a NaN stays in its chunk)
    seg_of = torch.repeat_interleave(torch.arange(nseg, device=dev), cu[1:] - cu[:-1])
    tok = torch.arange(NT, device=dev)
    chunk = co[seg_of] + (tok - cu[seg_of]) // CHUNK
    NC = int(co[-1]) if nseg else 0
    sums = torch.zeros(max(NC, 1), Hv, dtype=torch.float64, device=dev).index_add_(0, chunk, ell[:NT])
    m = torch.arange(1, max_halo + 1, device=dev)
    if reverse:
        c1 = co[1:]
        ce = tables.seg_table_bwd.to(dev)[:, 1].long()
        at = c1[:, None] + m[None, :] - 1                             # [NSEG, M]: the m-th chunk after
        valid = m[None, :] <= (ce - c1)[:, None]
        edge, last = c1, ce
    else:
        c0 = co[:-1]
        at = c0[:, None] - m[None, :]                                 # [NSEG, M]: the m-th chunk before
        valid = m[None, :] <= (c0 - cs0)[:, None]
        edge, last = c0, cs0
    cum = torch.where(valid[..., None], sums[at.clamp(min=0, max=max(NC - 1, 0))],
                      torch.zeros((), dtype=sums.dtype, device=dev))
    cum = cum.cumsum(1)
    hit = (cum <= threshold) & valid[..., None]                       # NaN compares false
    first = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.zeros((), dtype=torch.long, device=dev))
    sign = 1 if reverse else -1
    start = torch.where(first > 0, edge[:, None] + sign * first, last[:, None].expand(-1, Hv))
    return start.to(torch.int32)


def _into(out: Optional[torch.Tensor], result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def walk_start_kernel(k_ptr, g_ptr, b_ptr, cu_ptr, co_ptr, tab_ptr, out_ptr, threshold, max_halo,
                          stride_kt, stride_kh, stride_gt, stride_bt, Hv, RATIO: tl.constexpr,
                          R_P: tl.constexpr, K: tl.constexpr, L2: tl.constexpr, C: tl.constexpr,
                          REVERSE: tl.constexpr, CPI: tl.constexpr):
        # one program per (segment, query/key head) and its RATIO value heads: back from the segment start, CPI
        # chunks per iteration, the running bound per head; a head's walk starts at the first chunk count whose
        # sum is under the threshold, else (none within max_halo, or a NaN) at the sequence's first chunk.  (Looping
        # over the key heads inside one program serialised a [64, K] load per head and chunk: 30-70 us.  A chunk
        # per iteration made the usual 3-chunk halo three dependent load rounds: 20 us at 2/8 1x32768, session 17
        # run 6; CPI = 4 loads them in one.)
        # (REVERSE, the backward's walk: forward from the segment's end; tab is then the backward table, whose
        # second column is the sequence's end chunk and fourth its end token, which masks a partial last chunk)
        e = tl.program_id(0)
        hq = tl.program_id(1)
        if REVERSE:
            bos = tl.load(cu_ptr + e + 1)
            c0 = tl.load(co_ptr + e + 1)
            cs0 = tl.load(tab_ptr + 4 * e + 1)
            seq_eos = tl.load(tab_ptr + 4 * e + 3)
        else:
            bos = tl.load(cu_ptr + e)
            c0 = tl.load(co_ptr + e)
            cs0 = tl.load(tab_ptr + 4 * e + 1)
            seq_eos = bos
        r = tl.arange(0, R_P)
        hv = hq * RATIO + r
        hmask = r < RATIO
        rows = tl.arange(0, CPI * C)
        jrow = rows // C                       # the row's chunk within the iteration
        jj = tl.arange(0, CPI)[:, None]
        KB: tl.constexpr = 32 if K > 32 else K
        cols = tl.arange(0, KB)
        lim = tl.minimum(tl.abs(c0 - cs0), max_halo)
        start = tl.zeros((R_P,), tl.int32) + cs0
        found = r >= RATIO                     # padding heads count as found
        cum = tl.zeros((R_P,), tl.float32)
        m = 1                                  # the chunk count of the iteration's first chunk
        while (m <= lim) & (tl.sum(found.to(tl.int32), axis=0) < R_P):
            if REVERSE:
                tok = bos + (m - 1) * C + rows
                tmask = (tok < seq_eos) & (m + jrow <= lim)
            else:
                tok = bos - (m + jrow) * C + rows % C
                tmask = (tok >= 0) & (m + jrow <= lim)
            mask2 = tmask[:, None] & hmask[None, :]
            g = tl.load(g_ptr + tok[:, None] * stride_gt + hv[None, :], mask=mask2, other=0.0)
            b = tl.load(b_ptr + tok[:, None] * stride_bt + hv[None, :], mask=mask2, other=0.0)
            g = g.to(tl.float32)
            b = b.to(tl.float32)
            if L2:
                bk = b
            else:
                # ||k||^2 by column blocks (a whole [CPI * C, K] tile in registers spilled)
                kk = tl.zeros((CPI * C,), tl.float32)
                for kb in tl.static_range(K // KB):
                    kt = tl.load(k_ptr + tok[:, None] * stride_kt + hq * stride_kh + kb * KB + cols[None, :],
                                 mask=tmask[:, None], other=0.0).to(tl.float32)
                    kk += tl.sum(kt * kt, axis=1)
                bk = b * kk[:, None]
            f = tl.abs(1.0 - bk) + 0.02 * tl.abs(bk)
            ell = tl.where(mask2, g + tl.log(tl.maximum(f, 1.0)), 0.0)
            # per chunk of the iteration its sum, then the running bound after each ([CPI, R_P]; the chunks past
            # lim add 0 and cannot hit)
            per_chunk = tl.sum(tl.reshape(ell, (CPI, C, R_P)), axis=1)
            cumc = cum[None, :] + tl.cumsum(per_chunk, axis=0)
            hit = (cumc <= threshold) & (m + jj <= lim)        # NaN compares false
            first = tl.min(tl.where(hit, jj, CPI), axis=0)
            new = (first < CPI) & (~found)
            if REVERSE:
                start = tl.where(new, c0 + m + first, start)
            else:
                start = tl.where(new, c0 - m - first, start)
            found = found | new
            cum = tl.sum(tl.where(jj == CPI - 1, cumc, 0.0), axis=0)
            m += CPI
        tl.store(out_ptr + e * Hv + hv, start, mask=hmask)

    return walk_start_kernel


def walk_starts(k, g, beta, tables: SegmentTables, l2norm: bool, max_halo: int = MAX_HALO_CHUNKS,
                threshold: float = NEGLIGIBLE_LOG_BOUND, force_kernel: bool = False,
                reverse: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`walk_starts_ref` in one Triton launch on CUDA (``force_kernel``: also elsewhere, for the
    interpreter tests).  ``k [NT, Hqk, K]``, ``g [NT, Hv]`` fp32, ``beta [NT, Hv]``, all with unit last stride.
    ``out``: the ``[NSEG, Hv]`` int32 result tensor, allocated by the caller (on the stream that reads it, when
    this runs on another one); else a new one."""
    K = k.shape[-1]
    if not (k.is_cuda or force_kernel) or K & (K - 1):
        return _into(out, walk_starts_ref(k, g, beta, tables, l2norm, max_halo, threshold, reverse))
    try:
        import triton
    except ImportError:         # (torch's CUDA wheels ship it; the ref runs on the device too)
        return _into(out, walk_starts_ref(k, g, beta, tables, l2norm, max_halo, threshold, reverse))
    Hqk, Hv = k.shape[1], g.shape[1]
    if out is None:
        out = torch.empty(tables.num_segments, Hv, dtype=torch.int32, device=g.device)
    if tables.num_segments == 0:
        return out
    ratio = Hv // Hqk
    _kernel()[(tables.num_segments, Hqk)](
        k, g, beta, tables.cu_seqlens, tables.chunk_offsets, tables.seg_table_bwd if reverse else tables.seg_table,
        out, float(threshold), int(max_halo), k.stride(0), k.stride(1), g.stride(0), beta.stride(0), Hv,
        RATIO=ratio, R_P=triton.next_power_of_2(ratio), K=K, L2=bool(l2norm), C=CHUNK, REVERSE=bool(reverse),
        CPI=WALK_SEARCH_CHUNKS, num_warps=8)
    return out
