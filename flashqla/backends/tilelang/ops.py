"""Host side of the TileLang backend: chunk metadata, buffers, kernel launches.

Nothing here reads device memory on the host: varlen metadata comes from ``VarlenMeta`` (built once
by validation or ``prepare_varlen``), and the equal-length batch case gets the same three int32
tensors from ``torch.arange`` on the device, so both cases run the same kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..._env import env_choice, env_options
from ...dispatch.device import detect
from ..gva import gva_sum
from ._compile import get_kernel
from .chunk_bwd_dqk_v2_sm90 import build_bwd_dqk_v2
from .chunk_bwd_whole_sm90 import build_bwd_whole
from .chunk_bwd_state_sm90 import build_bwd_state
from .chunk_bwd_state_ws_sm90 import build_bwd_state_ws
from .chunk_bwd_wy_v2_sm90 import build_bwd_wy_v2
from .chunk_fwd_sm90 import build_fwd
from .chunk_fwd_ws_sm90 import build_fwd_ws, ws_layout
from .chunk_intra_sm90 import build_intra
from . import segments

CHUNK = 64
# State columns per CTA of the recurrence kernels (V / BV CTAs per sequence and head).
FWD_BV = 64
BWD_BV = 64
# The warp-specialised forward recurrence picks its V-block per call (see fwd_ws_bv).
FWD_WS_BVS = (32, 64, 128)

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
    busy_seqs: float = 0.0        # VarlenMeta.busy_seqs of a varlen batch (unequal lengths), 0: num_seqs

    @classmethod
    def of_lengths(cls, lengths) -> "ChunkMeta":
        """Host-only metadata of sequences of ``lengths`` tokens, for the cost models (no device tensors)."""
        lengths = [int(n) for n in lengths]
        longest = max(lengths, default=0)
        return cls(None, None, None, len(lengths), sum((n + CHUNK - 1) // CHUNK for n in lengths),
                   sum(lengths) / longest if longest else 0.0)


_META_CACHE: dict = {}
_DUMMIES: dict = {}


def chunk_meta(varlen, B: int, T: int, device) -> ChunkMeta:
    if varlen is not None:
        return ChunkMeta(varlen.cu_seqlens, varlen.chunk_offsets, varlen.chunk_indices,
                         varlen.num_seqs, varlen.total_chunks, varlen.busy_seqs)
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


def intra_head_major() -> bool:
    """Stage 1's grid order: ``FLASHQLA_TILELANG_INTRA_ORDER=head`` launches the value heads of one chunk
    together (``build_intra(head_major=True)``, experimental); ``chunk`` (default) the chunks of one head.  Measured
    slower (H100, session 25 run 6, Tb form): 0.210 -> 0.266 ms at 16/32 1x32768, 0.210 -> 0.289 at 32/32."""
    return env_choice("FLASHQLA_TILELANG_INTRA_ORDER", ("chunk", "head"), "chunk") == "head"


def intra_compact() -> bool:
    """``FLASHQLA_TILELANG_INTRA_COMPACT=1`` (session 20; off: measured slower in session 23): stage 1's Tb forms
    with unpadded, XOR-swizzled A and X tiles (``build_intra(compact=True)``).  A then shares the k tile's space: 33 KB
    of shared memory instead of 53 (ptxas for sm_90a: 96 registers instead of 84), so five CTAs per SM instead of
    four.  Stage 1 is 0.23 of the fused forward's 0.62 ms at 16/32 4x8192, and it waits on latency.  Session 23
    (H100; GPU tests pass) measured it slower, not faster: stage 1 0.226 -> 0.299 ms at 16/32 1x32768 and 0.226 ->
    0.300 at 16/32 4x8192 (forward 0.649 -> 0.719 and 0.619 -> 0.693 ms), so it stays off.  That was with the
    CUDA-core inverse, whose shared-memory pipe was already saturated (session 25); with the tensor-core one (the
    default since session 25) the compact tiles are read by ``flq_inv64_mma_sw``, not yet measured.  Not with the
    persistent form (:func:`intra_persist`), whose k tile is live through the whole loop."""
    return env_choice("FLASHQLA_TILELANG_INTRA_COMPACT", ("0", "1"), "0") == "1"


def intra_inv_mma() -> bool:
    """``FLASHQLA_TILELANG_INTRA_INV``: how stage 1 forms ``X = (I + A)^-1``.  ``mma`` (default since session 25): its
    products on the tensor cores as 3xTF32 ``mma.sync`` fragments (``intra_inverse_mma.py``); ``fma``: the blocked
    inverse on the CUDA cores (``chunk_intra_sm90``'s P1-P3).  Why: Nsight Compute (H100, 16/32 1x32768, session 25
    run 1) had stage 1's shared-memory pipe at 89%, 1828 of its 2618 wavefronts per (chunk, head) in the inverse;
    with ``mma`` 1642 wavefronts in all, the pipe at 66%.  Measured (H100, run 2, kernel times; GPU test passed):
    the Tb form 0.224 -> 0.208 ms at 16/32 1x32768 (forward 0.639 -> 0.621), 0.226 -> 0.206 at 8/32 (0.642 ->
    0.621), 0.226 -> 0.213 at 32/32, 0.225 -> 0.209 at 16/32 4x8192; the training form (Tb and X) unchanged, 0.252.
    Outputs within 1e-6 (relative L2) of ``fma``'s.  With ``FLASHQLA_TILELANG_INTRA_COMPACT=1`` it reads the compact
    form's swizzled tiles (``flq_inv64_mma_sw``: A over the k tile, ~35 KB, five CTAs per SM by registers)."""
    return env_choice("FLASHQLA_TILELANG_INTRA_INV", ("fma", "mma"), "mma") == "mma"


def intra_uniform() -> bool:
    """``FLASHQLA_TILELANG_INTRA_UNIFORM`` (default 1, session 25): where every sequence of a call has one length,
    stage 1's CTAs find their rows from their chunk number (``build_intra(uniform=True)``) instead of two dependent
    table loads ahead of their tile loads (Nsight Compute, session 25: a third of stage 1's stall samples sit in the
    CTA's prologue, waiting on loads).  Bitwise the table lookup's results (GPU test, 6 dense cases, forward and
    backward).  Measured (H100, session 25 run 6, Tb form with the mma inverse): 0.209 -> 0.210 ms at 16/32 1x32768,
    0.215 -> 0.210 at 32/32: the table loads were not the prologue's long wait (the gate / beta and k tile loads
    that follow are).  Kept, as one dependent load fewer.  ``0``: the table lookup always."""
    return env_choice("FLASHQLA_TILELANG_INTRA_UNIFORM", ("0", "1"), "1") == "1"


def _key(base: tuple, *options) -> tuple:
    """A compile key: ``base`` and the builder's optional arguments as ``(value, default)`` pairs in its order, up
    to the last one that is not at its default.  An option added later leaves the keys of the calls that do not
    set it as they were, so carried compile caches keep matching."""
    values = [v for v, _ in options]
    while values and values[-1] == options[len(values) - 1][1]:
        values.pop()
    return base + tuple(values)


def intra_kernel(dtype, beta_dtype, K, V, l2norm, save_x, uniform=False):
    """Stage 1 of the unfused forward (w, u, G and, for the backward, X).  ``uniform``: every sequence has the same
    length and the chunks are numbered sequence by sequence (a dense ``[B, T]`` call), so a CTA finds its rows from
    its chunk number (``build_intra(uniform=True)``)."""
    key = (_tl_dtype(dtype), _tl_dtype(beta_dtype), K, V, bool(l2norm), bool(save_x))
    # (tb_only, scores, head_major, threads, hw_ex2, compact, inv_mma, uniform)
    return get_kernel("fwd_intra_sm90", build_intra, _key(key, (False, False), (False, False),
                                                           (intra_head_major(), False), (128, 128), (False, False),
                                                           (False, False), (intra_inv_mma(), False),
                                                           (bool(uniform), False)))


def intra_persist(uniform: bool = True) -> bool:
    """``FLASHQLA_TILELANG_INTRA_PERSIST=auto|1|0`` (auto, the default since session 26: on where stage 1 finds its
    rows from the chunk number, ``uniform``; 1: also on the chunk table; 0: one CTA per chunk): stage 1's Tb forms
    (inference, and the fused training forward's Tb and X) as persistent CTAs, ``build_intra(persist=True)``: four
    per SM, each walking every ``nprog``-th chunk of its value head and loading the next chunk's k tile (TMA), gates
    and beta while it forms this one's A, inverse and Tb.  Why: with the tensor-core inverse, a third of stage 1's
    stall samples wait in each CTA's prologue for exactly those loads (Nsight Compute, H100, session 25 run 3), and
    with four CTAs per SM nothing hides them.  Tb and X go to global memory from the X tile directly (no staging
    tile: shared memory stays at 52 KB, four CTAs per SM).  Needs the tensor-core inverse
    (``FLASHQLA_TILELANG_INTRA_INV=mma``).

    Measured (H100, session 26 runs 1-2): the Tb form 0.208 -> 0.190 ms and the training form 0.252 -> 0.221 at
    16/32 1x32768; eager wall time per call, forward 0.635 -> 0.614 ms (16/32 1x32768), 0.638 -> 0.617 (32/32),
    0.638 -> 0.618 (8/32), 0.606 -> 0.594 (16/32 4x8192); fwd+bwd 2.821 -> 2.773 (16/32 1x32768), 2.895 -> 2.808
    (32/32), 2.931 -> 2.884 (8/32), 2.750 -> 2.700 (16/32 4x8192).  Outputs and gradients on those rows bitwise those
    of one CTA per chunk.  (The halo searches beside it on the side stream then wait for SMs: their kernel time
    grows, 0.011 -> 0.042 ms, but they overlap stage 1; see :func:`intra_persist_ctas_per_sm`.)

    Why auto leaves the chunk table (varlen calls of unequal lengths) out: it is slower there.  Session 29 (H100)
    ran ``test_gpu_intra_persist_walks_several_chunks`` (CTAs that walk several chunks of the table), which passes,
    then timed the forward with ``FLASHQLA_TILELANG_INTRA_PERSIST=1`` against auto in CUDA graphs: 16/32
    28672+4096 0.632 -> 0.669 ms (stage 1 0.210 -> 0.242) and 4/16 4096+28672 0.328 -> 0.343
    (``benchmarks/results/h100_2026-12-06_s29run4_sweep_persist_varlen_fwd.json``)."""
    mode = env_choice("FLASHQLA_TILELANG_INTRA_PERSIST", ("auto", "0", "1"), "auto")
    return intra_inv_mma() and (mode == "1" or (mode == "auto" and bool(uniform)))


def stage1_forms(equal_lengths: bool, num_chunks: int) -> tuple:
    """``(uniform, persist)`` of a call's stage 1: whether it finds a chunk's rows from the chunk number
    (:func:`intra_uniform`, where every sequence has one length) and whether it takes the persistent Tb forms
    (:func:`intra_persist`; a call with no chunks has no stage 1 to run)."""
    uniform = intra_uniform() and equal_lengths
    return uniform, intra_persist(uniform) and num_chunks > 0


def intra_persist_ctas_per_sm() -> int:
    """``FLASHQLA_TILELANG_INTRA_PERSIST_CTAS`` (1-4, default 4): the persistent stage 1's CTAs per SM in its grid.
    The kernel is built for four (``__launch_bounds__(128, 4)``: 128 registers, the whole register file at four);
    each CTA fewer per SM frees a quarter of the register file, room for the halo searches that run beside stage 1
    on a side stream (:func:`halo_stream`).  Why it exists: at four per SM those searches found no
    SM free until stage 1 ended (H100, session 26 run 2: walk_start 0.011 -> 0.042-0.088 ms in the forward)."""
    from .chunk_intra_sm90 import PERSIST_CTAS_PER_SM
    return int(env_choice("FLASHQLA_TILELANG_INTRA_PERSIST_CTAS",
                          tuple(str(i) for i in range(1, PERSIST_CTAS_PER_SM + 1)), str(PERSIST_CTAS_PER_SM)))


def intra_persist_programs(num_chunks: int, Hv: int, device) -> int:
    """The persistent stage 1's CTAs per value head: the fewest that keep the chunks per CTA of one wave at
    :func:`intra_persist_ctas_per_sm` per SM (at most one CTA per chunk).

    Why the fewest: each CTA walks ``ceil(num_chunks / nprog)`` chunks at most, and that count sets stage 1's time,
    not the CTA count.  A full wave often holds more CTAs than that count needs.  At 8 value heads and 512 chunks
    (2/8 1x32768), 66 CTAs per head fill the 528 slots of 132 SMs with 7 or 8 chunks each; 64 CTAs walk 8 chunks each
    and end at the same time, and they leave 16 slots free.  The halo searches on the side stream
    (:func:`halo_stream`) run in free slots during stage 1; with none free they wait for stage 1 to end, and the
    recurrence waits for them (session 26, H100: with the 16 slots that 32 heads leave, 64 search CTAs ran beside
    stage 1, 0.042 ms of its 0.190).  Each chunk's outputs do not depend on which CTA forms them."""
    sms = detect(device).sm_count or 132
    nprog = max(1, min(num_chunks, intra_persist_ctas_per_sm() * sms // max(Hv, 1)))
    if num_chunks <= 0:
        return nprog
    per_cta = -(-num_chunks // nprog)
    return -(-num_chunks // per_cta)


def intra_tb_kernel(dtype, beta_dtype, K, l2norm, scores=False, save_x=False, uniform=False, persist=False,
                    x_beta=False):
    """Stage 1 of the fused forward: ``Tb = X diag(beta)`` and G only (``build_intra(tb_only=True)``); with
    ``scores`` also the masked, decayed scores P for the recurrence's ``pscores`` option; with ``save_x`` (the
    fused training forward) also X, for the whole-V backward.  ``uniform``: see :func:`intra_kernel`; ``persist``:
    :func:`intra_persist` (the kernel then takes the CTAs per head, :func:`intra_persist_programs`, last);
    ``x_beta`` (with ``save_x``): beta chunk-major in Tb's place (:func:`train_xbeta`)."""
    key = (_tl_dtype(dtype), _tl_dtype(beta_dtype), K, K, bool(l2norm), bool(save_x), True)
    # (scores, head_major, threads, hw_ex2, compact, inv_mma, uniform, persist, x_beta)
    key = _key(key, (bool(scores), False), (intra_head_major(), False), (128, 128), (hw_ex2(), False),
               (intra_compact() and not scores and not persist, False), (intra_inv_mma(), False),
               (bool(uniform), False), (bool(persist), False), (bool(x_beta and save_x), False))
    name = "fwd_intra_tbx_sm90" if save_x else "fwd_intra_tbs_sm90" if scores else "fwd_intra_tb_sm90"
    return get_kernel(name, build_intra, key)


def fwd_kernel(dtype, K, V, l2norm, has_h0, store_ht, save_states, BV=FWD_BV):
    return get_kernel("fwd_recurrent_sm90", build_fwd,
                      (_tl_dtype(dtype), K, V, BV, bool(l2norm), bool(has_h0), bool(store_ht),
                       bool(save_states)))


# Set by benchmarks/trace_ws.py only: while it is a tensor, ws forwards are built with ``trace=True`` and
# stamp their role timeline into it (see build_fwd_ws).
TRACE_BUFFER: Optional[torch.Tensor] = None
# the whole backward's trace buffer (``benchmarks/trace_bwd_fused.py``; None: the untraced kernel)
BWD_TRACE_BUFFER: Optional[torch.Tensor] = None


def _trace_arg(device, bwd: bool = False) -> torch.Tensor:
    """The trace parameter of the ws forward (or, ``bwd``, of the whole backward): its trace buffer while
    tracing, else a placeholder the kernel (built with ``trace=False``) never touches."""
    buf = BWD_TRACE_BUFFER if bwd else TRACE_BUFFER
    return buf if buf is not None else dummy((1, 1), torch.int64, device)


def fwd_ws_kernel(dtype, K, V, l2norm, has_h0, store_ht, save_states, BV, fused=False, pscores=False,
                  halo=False, x_beta=False):
    """``pscores``: the caller's :func:`fwd_pscores` choice (stage 1 must have written the scores); ``halo``:
    the grid runs over segments (:mod:`.segments`); ``x_beta``: the fused training walk on X and beta
    (:func:`train_xbeta`)."""
    ring, nbuf = fwd_ws_layout(BV)
    fast_exp, psplit, tchain, ostage, _, astore = fwd_ws_options()
    pscores = pscores and fused         # stage 1 writes the scores in its Tb-only form only
    psplit = psplit and not pscores     # with the scores from stage 1 there is no scores warpgroup
    key = (_tl_dtype(dtype), K, V, BV, bool(l2norm), bool(has_h0), bool(store_ht), bool(save_states), ring, nbuf,
           fast_exp, psplit)
    # (tchain, trace, fused, ostage, pscores, hw_ex2): the register-only state chain exists at BV = 64 and unfused
    # only (see build_fwd_ws)
    flags = (bool(tchain and BV == 64 and not fused and not halo), TRACE_BUFFER is not None, bool(fused),
             bool(ostage), bool(pscores), bool(fast_exp and hw_ex2()), bool(halo),
             bool(astore and (ostage or save_states)), bool(x_beta and fused and save_states and not pscores))
    return get_kernel("fwd_recurrent_ws_sm90", build_fwd_ws, _key(key, *((f, False) for f in flags)))


_WS_OPTS = ("fastexp", "psplit", "tchain", "ostage", "pscores", "astore")
# H200, 16/32 (results/h200_2026-12-03_s3run1_README.md): fastexp and psplit both on cut the recurrence
# 1.653 -> 1.442 ms at 1x32768 and 0.648 -> 0.617 ms at 4x8192; either alone gained less.  ostage (session 7,
# results/h200_2026-12-03_s7run2_sweep_fused.json): faster on all six rows, e.g. 16/32 4x8192 0.756 -> 0.670 ms,
# 16/64 4x8192 1.522 -> 1.344, 2/8 1x32768 0.866 -> 0.813.
_WS_OPTS_DEFAULT = "fastexp,psplit,ostage"
# astore (session 24, off; build_fwd_ws's async_store): the o stores and the chain's state / v_new saves wait for
# their shared-memory reads a chunk later instead of at once.  Session 36 (H100, fwd+bwd graphs at 16/32 1x32768 and
# 2x16384): bitwise the waiting stores' and no faster (training walk 0.662 against 0.657 ms), so the walk's extra
# time over the inference walk is the saves' HBM traffic, not their shared-memory reads


def fwd_ws_options() -> tuple:
    """(fast_exp, psplit, tchain, ostage, pscores, astore) of the warp-specialised forward (see ``build_fwd_ws``):
    fastexp, psplit and ostage (the TMA-stored output) on by default, astore off, pscores chosen per call by
    :func:`fwd_pscores`; ``FLASHQLA_TILELANG_WS_OPTS`` (comma separated, ``none`` or empty for none)
    overrides, and then pscores is on exactly when it is listed."""
    opts = env_options("FLASHQLA_TILELANG_WS_OPTS", _WS_OPTS, _WS_OPTS_DEFAULT)
    return ("fastexp" in opts, "psplit" in opts, "tchain" in opts, "ostage" in opts, "pscores" in opts,
            "astore" in opts)


# pscores (stage 1 writes the scores, the recurrence has no scores warpgroup) against psplit, both with ostage
# (results/h200_2026-12-03_s7run2_sweep_fused.json): it wins where the recurrence is long and stage 1 small,
# 2/8 1x32768 (BV 32) 0.813 -> 0.714 ms; it is even at 16/32 1x32768 (BV 32, 1.026 / 1.041) and loses at BV 64
# and 128 (16/64 1x32768 1.577 / 1.762, 16/32 4x8192 0.670 / 0.798).  Its stage 1 costs 0.44 against 0.28 ms
# at 32 heads x 32k tokens, so it pays only with few walks at BV 32.
_PSCORES_MAX_WALKS = 16


def fwd_pscores(fused: bool, BV: int, num_seqs: float, Hv: int) -> bool:
    """Whether the fused forward takes its scores from stage 1 (``pscores``) at this V-block and walk count:
    with ``FLASHQLA_TILELANG_WS_OPTS`` set, exactly when it lists pscores; else on at BV 32 with at most
    16 (sequence, head) walks (see ``_PSCORES_MAX_WALKS``)."""
    if not fused:
        return False
    if os.environ.get("FLASHQLA_TILELANG_WS_OPTS") is not None:
        return fwd_ws_options()[4]
    return BV == 32 and num_seqs * Hv <= _PSCORES_MAX_WALKS


def _pscores_choices(fused: bool, BV: int) -> list:
    """Every value :func:`fwd_pscores` can take at this V-block, whatever the walk count (precompile's key
    enumeration)."""
    return sorted({fwd_pscores(fused, BV, 1, 1), fwd_pscores(fused, BV, float("inf"), 1)})


def fwd_ws_layout(BV: int) -> tuple:
    """(ring slots, Sb / v_new buffers) of the warp-specialised forward at this V-block: the builder's
    choice (what fits shared memory), or ``FLASHQLA_TILELANG_WS="R,nb"`` for experiments."""
    forced = os.environ.get("FLASHQLA_TILELANG_WS", "").strip()
    if forced:
        try:
            ring, nbuf = (int(x) for x in forced.split(","))
        except ValueError:
            raise ValueError(f"FLASHQLA_TILELANG_WS must be 'R,nb' (ring slots, state buffers), got {forced!r}")
        if ring not in (2, 3) or nbuf not in (1, 2):
            raise ValueError(f"FLASHQLA_TILELANG_WS: ring slots 2 or 3, state buffers 1 or 2, got {forced!r}")
        return ring, nbuf
    return ws_layout(BV)


def fwd_variant() -> str:
    """``fused`` (default), ``ws`` or ``serial`` (one warpgroup does everything).  ``fused`` applies to
    inference forwards: stage 1 writes the 64 x 64 ``Tb`` per chunk instead of w and u, and the ws recurrence
    forms v_new from v; a forward that saves for a backward runs ``ws`` (the backward needs w).  H200 run s6
    run 4 (``results/h200_2026-12-03_s6run4_tilelang_fused_sweep.json``): fused 0.787 against ws 0.956 ms at
    16/32 4x8192, 1.751 against 1.937 at 16/32 1x32768, faster on all six rows measured.
    ``FLASHQLA_TILELANG_FWD`` overrides."""
    return env_choice("FLASHQLA_TILELANG_FWD", ("fused", "ws", "serial"), "fused")


def train_fused() -> bool:
    """``FLASHQLA_TILELANG_TRAIN_FUSED=1`` (the default since session 19): a training forward whose backward is the
    whole-V kernel (which reads X, never w or u) and whose walk is not split into segments runs the fused form too --
    stage 1 writes Tb and X (``build_intra(tb_only, save_x)``), the fused recurrence saves the chunk states and
    v_new -- instead of stage 1's w, u and X and the unfused walk; the backward then follows the forward (whole-V,
    whatever ``FLASHQLA_TILELANG_BWD`` says by then).  H200, session 19 run 3 (fwd+bwd): 2.877 -> 2.637 ms at
    16/32 8x4096, 2.790 -> 2.585 at 32/32 8x4096, 1.423 -> 1.309 at 4/16 8x4096; over segments the fused walk with
    its saves was as much slower as stage 1 got faster (16/32 1x32768: 0.75 against 0.52 ms), so split forwards
    keep the unfused pair.  ``0`` turns it off; ``all`` takes the fused form over segments as well (see
    :func:`train_fused_mode`)."""
    return train_fused_mode() != "0"


def train_fused_mode() -> str:
    """``FLASHQLA_TILELANG_TRAIN_FUSED``: ``all`` (default since session 23: split forwards too), ``1`` (unsplit
    forwards only) or ``0`` (off).  Session 20 found why the fused walk with its saves was slow over segments: its
    v_new store sat under the chain's halo branch, and ptxas spilled there and serialised all 40 wgmma; the output
    warpgroup stores them now.  Session 23 (H100, ``benchmarks/results/h100_2026-12-05_session23_README.md``),
    fwd+bwd with the GVA pair sum: 16/32 1x32768 3.131 -> 2.784 ms, 8/16 1x32768 1.645 -> 1.493, 2/4 1x32768
    0.519 -> 0.477, 16/32 4x8192 (no segments, so ``1`` and ``all`` are the same walk there) 2.732 -> 2.737."""
    return env_choice("FLASHQLA_TILELANG_TRAIN_FUSED", ("0", "1", "all"), "all")


def train_xbeta() -> bool:
    """``FLASHQLA_TILELANG_TRAIN_XBETA=1`` (session 37, off until measured on a GPU): the fused training forward's
    stage 1 writes X and beta chunk-major instead of Tb and X (``build_intra(x_beta=True)``), and its walk forms
    ``v_new = X bf16(diag(beta) Y)`` (``build_fwd_ws(x_beta=True)``): 8 KB less per chunk and head written by
    stage 1 (~0.13 GB at 16/32 one 32k sequence, where training stage 1 took 0.221 against the inference form's
    0.190 ms on an H100), and no Tb buffer.  ``0``: Tb and X, as before."""
    return env_choice("FLASHQLA_TILELANG_TRAIN_XBETA", ("0", "1"), "0") == "1"


def fwd_ws_bv(num_seqs: float, Hv: int, V: int, device) -> int:
    """V-block of the warp-specialised recurrence.  The recurrence is a serial walk per (sequence,
    head, V-block): with few of those, split V further so that more SMs walk in parallel (each walk's
    chain gets shorter GEMMs too); with many, keep whole 128-column blocks (q k^T and the w / q / k
    tiles are then loaded and multiplied once per head instead of V / BV times).  Thresholds at 70% and
    35% of the SMs (one CTA per SM).  ``num_seqs`` may be ``VarlenMeta.busy_seqs`` (unequal lengths: the walks
    in flight over the longest one; the session-7 grid ran 28672+4096 at the V-block of two equal
    sequences: 8/32 1.153 ms against 1.022 for 1x32768 at BV 32).  ``FLASHQLA_TILELANG_BV`` overrides."""
    forced = os.environ.get("FLASHQLA_TILELANG_BV", "").strip()
    if forced:
        bv = int(forced)
        if bv not in FWD_WS_BVS or V % bv:
            raise ValueError(f"FLASHQLA_TILELANG_BV must be one of {FWD_WS_BVS} dividing V={V}, got {bv}")
        return bv
    sms = detect(device).sm_count or 132
    walks = num_seqs * Hv
    if walks >= 0.7 * sms and V % 128 == 0:
        return 128
    if 2 * walks >= 0.7 * sms and V % 64 == 0:
        return 64
    return 32 if V % 32 == 0 else V


def bwd_state_kernel(dtype, K, V, l2norm, has_dht, need_dh0, BV=BWD_BV):
    return get_kernel("bwd_state_sm90", build_bwd_state,
                      (_tl_dtype(dtype), K, V, BV, bool(l2norm), bool(has_dht), bool(need_dh0)))


def bwd_state_ws_kernel(dtype, K, V, l2norm, has_dht, need_dh0, BV, halo=False):
    key = (_tl_dtype(dtype), K, V, BV, bool(l2norm), bool(has_dht), bool(need_dh0))
    return get_kernel("bwd_state_ws_sm90", build_bwd_state_ws, _key(key, (bool(halo), False)))


def bwd_variant() -> str:
    """``auto`` (default: ``whole`` where :func:`bwd_whole_pays`, else ``ws``), ``ws`` (the split backward:
    warp-specialised state-gradient recurrence, then the per-chunk dqk and wy kernels), ``serial`` (the same with
    a serial state kernel) or ``whole`` (``chunk_bwd_whole_sm90``: one CTA per (value head, sequence) forms every
    gradient at whole V; K = V = 128 without the fused L2 norm, other calls take ``ws``).
    ``FLASHQLA_TILELANG_BWD`` overrides.  (The first fused backward, ``chunk_bwd_fused_sm90`` at BV = 64, was
    retired in session 15: the whole one was faster on every row both were measured on.)"""
    return env_choice("FLASHQLA_TILELANG_BWD", ("auto", "ws", "serial", "whole"), "auto")


# Costs behind bwd_whole_pays, measured on the H200 (132 SMs; the two paths' kernel times): the whole backward's
# chunk step (one CTA walks one (value head, sequence); session 17 run 5 with ex2.approx, its default since then:
# 1.683 ms / 128 chunks at 16/32 4x8192 and 0.855 ms / 64 chunks at 4/16 8x4096, 13.2-13.4 us, each a walk per
# SM; session 16 run 2 with exp2f: 15.0-15.8 us; session 15: 17.5), the split backward's state-gradient step
# (its serial part) and its per-(chunk, value head) cost of the dqk and wy kernels at full occupancy (session 15
# run 6), in microseconds.
WHOLE_STEP_US = 13.3
SPLIT_STATE_STEP_US = 3.2
SPLIT_PAIR_US = 0.153
# What the whole-V backward also saves the forward under FLASHQLA_TILELANG_TRAIN_FUSED (the fused training forward
# runs only ahead of it), per (chunk, value head) at full occupancy: stage 1 took 0.487 ms / 16384 pairs with w, u
# and X (session 17 run 5, 16/32 4x8192) against 0.225 ms / 16384 in the Tb-only form (session 15), 0.016 us; the
# fused training form also writes X (8 KB a pair): 0.014.  Measured in session 23 (H100, fwd+bwd with the GVA pair sum,
# TRAIN_FUSED=all against 0 over segments): 0.347 ms / 16384 pairs at 16/32 1x32768, 0.152 / 8192 at 8/16 1x32768,
# 0.019-0.021; the credit takes 0.020.
TRAIN_FUSED_PAIR_CREDIT_US = 0.020


def bwd_costs(num_chunks: int, busy_seqs: float, Hv: int, device) -> tuple:
    """(whole, split): the modelled backward time in microseconds of the whole-V fused kernel and of the split
    backward for ``num_chunks`` chunks over sequences of which ``busy_seqs`` (``sum(len) / max(len)``) are in
    flight on average (``WHOLE_STEP_US`` ...).  The whole backward runs one CTA per (value head, sequence): its
    time is its longest walk, or the pairs spread over the SMs when they are more; the split backward pays a
    short serial step per chunk of the longest walk plus its per-pair kernels over the whole GPU."""
    sms = detect(device).sm_count or 132
    longest = num_chunks / busy_seqs              # chunks of the longest walk
    pairs = num_chunks * Hv
    return (max(longest, pairs / sms) * WHOLE_STEP_US,
            longest * SPLIT_STATE_STEP_US + pairs * SPLIT_PAIR_US * 132 / sms)


def bwd_whole_pays(meta: "ChunkMeta", Hv: int, device) -> bool:
    """Whether the whole-V fused backward beats the split one on this call, by :func:`bwd_costs`.  With few walks
    (one long sequence, few heads) the split backward wins; with a walk per SM or more the whole one does (at
    16/32 4x8192: 128 walks, 2.0 against 3.5 ms, session 16)."""
    model = _bwd_model(meta, Hv, device)
    return model is not None and model[0] < model[1]


def _train_fused_credit(num_chunks: int, Hv: int, device, fwd_split: bool = False) -> float:
    """Microseconds the fused training forward saves ahead of a whole-V backward (``TRAIN_FUSED_PAIR_CREDIT_US``), or
    0 where it does not run (``FLASHQLA_TILELANG_TRAIN_FUSED`` off, a forward variant other than fused, or a forward
    split into segments while ``FLASHQLA_TILELANG_TRAIN_FUSED`` is not ``all``)."""
    if not train_fused() or fwd_variant() != "fused" or (fwd_split and train_fused_mode() != "all"):
        return 0.0
    sms = detect(device).sm_count or 132
    return num_chunks * Hv * TRAIN_FUSED_PAIR_CREDIT_US * 132 / sms


def _bwd_model(meta: "ChunkMeta", Hv: int, device, fwd_split: bool = False) -> Optional[tuple]:
    """``(t_whole, t_split, busy_seqs)`` of :func:`bwd_costs` for this call, or None when it has no chunks; the
    whole-V time net of what it saves the forward (:func:`_train_fused_credit`; ``fwd_split``: the forward walks
    segments)."""
    busy = meta.busy_seqs or meta.num_seqs
    if meta.num_chunks == 0 or busy <= 0:
        return None
    t_whole, t_split = bwd_costs(meta.num_chunks, busy, Hv, device)
    return t_whole - _train_fused_credit(meta.num_chunks, Hv, device, fwd_split), t_split, busy


def bwd_choice(meta: "ChunkMeta", Hv: int, K: int, V: int, l2norm: bool, device, explain: bool = False,
               fwd_split: bool = False) -> tuple:
    """(variant, why): the backward ``backward`` runs for this call -- ``FLASHQLA_TILELANG_BWD`` if set, else the
    whole-V kernel where it serves the call and :func:`bwd_whole_pays`, else the split one (``ws``).  ``why`` is
    written only with ``explain`` (``flashqla.explain`` prints it; the call path does not need it)."""
    variant = bwd_variant()
    fits = bwd_whole_ok(K, V, l2norm)
    if variant != "auto":
        if variant == "whole" and not fits:
            return "ws", ("split backward (FLASHQLA_TILELANG_BWD=whole, but the whole-V kernel serves K = V = 128 "
                          "without the fused L2 norm only)")
        return variant, f"FLASHQLA_TILELANG_BWD={variant}"
    if not fits:
        return "ws", "split backward: the whole-V fused kernel serves K = V = 128 without the fused L2 norm only"
    model = _bwd_model(meta, Hv, device, fwd_split)
    whole = model is not None and model[0] < model[1]
    if not explain:
        return ("whole" if whole else "ws"), ""
    if model is None:
        return "ws", "split backward: no chunks"
    t_whole, t_split, busy = model
    sms = detect(device).sm_count or 132
    return ("whole" if whole else "ws",
            f"{'whole-V fused backward' if whole else 'split backward'}: {Hv * meta.num_seqs} (value head, sequence) "
            f"walks on {sms} SMs, the longest {round(meta.num_chunks / busy)} chunks; "
            f"modelled {t_whole / 1000:.2f} ms whole-V against {t_split / 1000:.2f} ms split"
            + (" (whole-V net of the fused training forward's saving)"
               if _train_fused_credit(meta.num_chunks, Hv, device, fwd_split) else ""))


def whole_nregs() -> Optional[tuple]:
    """``FLASHQLA_TILELANG_WHOLE_NREGS=chain,value,key,producer`` (a tuning experiment): the whole backward's
    setmaxnreg per role instead of ``chunk_bwd_whole_sm90.NREGS``; they must sum to at most 512, each a multiple
    of 8 from 24 to 256 (setmaxnreg's range), the three math roles at least 128 and the producer at most 128 (the
    kernel raises the first three from the launch's 128 per thread and lowers the last: anything else is an
    illegal instruction on the device)."""
    raw = os.environ.get("FLASHQLA_TILELANG_WHOLE_NREGS", "").strip()
    if not raw:
        return None
    try:
        regs = tuple(int(x) for x in raw.split(","))
    except ValueError:
        regs = ()
    if (len(regs) != 4 or sum(regs) > 512 or any(r % 8 or not 24 <= r <= 256 for r in regs)
            or min(regs[:3]) < 128 or regs[3] > 128):
        raise ValueError(f"FLASHQLA_TILELANG_WHOLE_NREGS={raw!r}: expected four multiples of 8 in [24, 256] "
                         "(chain,value,key >= 128, producer <= 128) summing to at most 512")
    return regs


def hw_ex2(part: str = "fwd") -> bool:
    """Whether the exponentials that take the hardware ex2 run as one ``ex2.approx.ftz`` each (``hw_ex2=True`` of
    their builders) instead of ``exp2f``, which wraps the same instruction in a subnormal-range test and two
    predicated multiplies.  ``part``: ``"bwd_whole"`` (the whole-V backward) or ``"fwd"`` (stage 1's Tb form, the
    ws recurrence with fastexp).  ``FLASHQLA_TILELANG_EX2``: ``auto`` (default: on for the whole backward, whose
    GPU tests pass with it and which it makes 16% faster, 2.003 -> 1.683 ms at 16/32 4x8192, session 17 runs 5-6;
    off in the forward, 2% faster there but its GPU tests have not run with it), ``approx`` (both), ``exp2f``
    (neither)."""
    choice = env_choice("FLASHQLA_TILELANG_EX2", ("auto", "exp2f", "approx"), "auto")
    if choice == "auto":
        return part == "bwd_whole"
    return choice == "approx"


def halo_step_mode() -> str:
    """How the whole-V backward runs the halo chunks of a walk over segments (``FLASHQLA_TILELANG_HALO_STEP``):
    ``whole`` (default until measured on a GPU: every role runs the whole step and stores nothing) or ``light``
    (``build_bwd_whole(light_halo=True)``, session 34: only the chain's dS and the value role's part of it, the key
    role waits; ~4 halo chunks a segment at 16/32 one 32k sequence).  A traced build runs whole halo steps."""
    return env_choice("FLASHQLA_TILELANG_HALO_STEP", ("whole", "light"), "whole")


def bwd_whole_kernel(dtype, beta_dtype, K, V, has_dht, need_dh0, halo=False, gva_pair=False, pair_zero=False):
    key = (_tl_dtype(dtype), _tl_dtype(beta_dtype), K, V, bool(has_dht), bool(need_dh0))
    light = bool(halo) and BWD_TRACE_BUFFER is None and halo_step_mode() == "light"
    # (trace, nregs, hw_ex2, halo, gva_pair, pair_zero, light_halo)
    key = _key(key, (BWD_TRACE_BUFFER is not None, False), (whole_nregs(), None), (hw_ex2("bwd_whole"), False),
               (bool(halo), False), (bool(gva_pair), False), (bool(pair_zero), False), (light, False))
    return get_kernel("bwd_whole_sm90", build_bwd_whole, key)


def gva_in_kernel(ratio: int) -> tuple:
    """``(in_kernel, why)``: whether the backward's kernels sum dq / dk over each GVA group themselves (the whole-V
    kernel, or the split backward's dqk and wy kernels, built with ``gva_pair=True``: pair reductions into zeroed
    outputs, deterministic at ratio 2 only) or write them per value head for :func:`flashqla.backends.gva.gva_sum`.
    ``FLASHQLA_TILELANG_GVA``: ``pair`` (default since session 23: in the kernels where the ratio is 2) or ``host``
    (the separate sum everywhere).  Session 23 (H100, GPU tests pass), fwd+bwd: 16/32 1x32768 3.325 -> 3.131 ms
    (the sum's 0.266 ms gone, ~0.08 ms of zeroing added), 16/32 4x8192 2.906 -> 2.732, 8/16 1x32768 1.719 ->
    1.645."""
    if ratio == 1:
        return False, "no GVA (one value head per query/key head)"
    mode = env_choice("FLASHQLA_TILELANG_GVA", ("host", "pair"), "pair")
    if mode == "pair" and ratio == 2:
        return True, "dq / dk summed over each GVA pair in the kernels (FLASHQLA_TILELANG_GVA=pair)"
    if mode == "pair":
        return False, (f"dq / dk per value head, summed by a separate kernel: GVA ratio {ratio} (the in-kernel sum, "
                       "FLASHQLA_TILELANG_GVA=pair, is deterministic at ratio 2 only)")
    return False, "dq / dk per value head, summed over each GVA group by a separate kernel (FLASHQLA_TILELANG_GVA)"


def pair_rows_mode() -> str:
    """How the whole-V backward's GVA pair-sum rows of dq / dk start (``FLASHQLA_TILELANG_GVA_ZERO``): ``host``
    (default: the host's memset before the launch, 0.083 ms of 2.8 at 16/32 one 32k sequence, H100 session 29 run
    3), ``kernel`` (``build_bwd_whole(pair_zero=True)``: one CTA of each pair zeroes a step's rows two steps ahead
    and sets a flag, the other waits on it; measured slower in session 30).  A ``store`` form (no zeroing: the
    pair's first CTA stored, the other added after a flag per chunk) was removed in session 33: on an H100 its
    gradients were wrong and its kernel 0.35 ms slower."""
    return env_choice("FLASHQLA_TILELANG_GVA_ZERO", ("host", "kernel"), "host")


def _grad_rows_buffer(pair: bool, NT: int, Hqk: int, Hv: int, D: int, dtype, device,
                      zeroed: bool = True) -> torch.Tensor:
    """dq or dk as the backward kernels write it: per value head ``[NT, Hv, D]``, or with the GVA pair sum in the
    kernels (:func:`gva_in_kernel`) ``[NT, Hqk, D]`` zeroed, which each element's two adds start from (not zeroed
    where the kernel zeroes it, ``zeroed=False``: :func:`pair_rows_mode`)."""
    if pair:
        return (torch.zeros if zeroed else torch.empty)(NT, Hqk, D, dtype=dtype, device=device)
    return torch.empty(NT, Hv, D, dtype=dtype, device=device)


def _grad_rows_total(x: torch.Tensor, pair: bool, ratio: int, dtype) -> torch.Tensor:
    """The GVA-summed gradient from :func:`_grad_rows_buffer`'s tensor after the kernels: itself where they summed
    the pairs, else the separate sum."""
    return x if pair else gva_sum(x, ratio, dtype)


def bwd_whole_ok(K: int, V: int, l2norm: bool) -> bool:
    """Whether the whole-V fused backward serves this call (K = V = 128, no fused L2 norm)."""
    return K == 128 and V == 128 and not l2norm


def _backward_whole(q, k, v, beta, G, X, hs, vn, meta, shape, scale, dof, dhtf, dh0, has_dht, has_h0,
                    split=None):
    """The whole-V fused backward's launch and the GVA sums of its per-value-head dq / dk (in the kernel, for GVA
    pairs under :func:`gva_in_kernel`).  Returns (dq, dk, dv, dg, dbeta) flattened, as ``backward``'s split path
    has them before its reshape.  ``split``: ``(tables, walk ends)`` of its walk in segments with a halo
    (``FwdResult.bwd_split``), or None."""
    B, T, Hqk, Hv, K, V = shape
    NT = B * T
    dev, dt = q.device, q.dtype
    ratio = Hv // Hqk
    f32 = torch.float32
    pair = gva_in_kernel(ratio)[0]
    # (the trace stamps and the pair's words share the kernel's one int64 parameter)
    mode = pair_rows_mode() if pair and BWD_TRACE_BUFFER is None else "host"
    pair_zero = mode == "kernel"
    dq_h = _grad_rows_buffer(pair, NT, Hqk, Hv, K, dt, dev, zeroed=mode == "host")
    dk_h = _grad_rows_buffer(pair, NT, Hqk, Hv, K, dt, dev, zeroed=mode == "host")
    dv = torch.empty(NT, Hv, V, dtype=dt, device=dev)
    dg = torch.empty(NT, Hv, dtype=f32, device=dev)
    db = torch.empty(NT, Hv, dtype=f32, device=dev)
    if dev.type == "meta":
        # (precompile's key enumeration: also the walk over segments)
        bwd_whole_kernel(dt, beta.dtype, K, V, has_dht, has_h0, True, pair, pair_zero)
    if split is not None:
        tables, ends = split
        walk_cu, walk_co, halo_args = tables.cu_seqlens, tables.chunk_offsets, (tables.seg_table_bwd, ends)
    else:
        walk_cu, walk_co = meta.cu_seqlens, meta.chunk_offsets
        halo_args = (dummy((1, 4), torch.int32, dev), dummy((1, 1), torch.int32, dev))
    if mode != "host":
        # a ticket per (grid sequence or segment, query/key head), then a flag per (chunk, query/key head)
        words = torch.zeros((walk_cu.numel() - 1) * Hqk + G.shape[0] * Hqk, 1, dtype=torch.int64, device=dev)
    else:
        words = _trace_arg(dev, bwd=True)
    bwd_whole_kernel(dt, beta.dtype, K, V, has_dht, has_h0, split is not None, pair, pair_zero)(
        q, k, v, beta, dof, G, X, hs, vn, walk_cu, walk_co, dhtf,
        dq_h, dk_h, dv, dg, db, dh0, words, float(scale), ratio, *halo_args)
    dq = _grad_rows_total(dq_h, pair, ratio, dt)
    del dq_h
    dk = _grad_rows_total(dk_h, pair, ratio, dt)
    return dq, dk, dv, dg, db.to(beta.dtype)


# the backward's warp-specialised kernel holds more tiles (fp32 Pt dO, dOs, +-dv_new): at most 64 columns
BWD_WS_BVS = (32, 64)


def bwd_dqk_kernel(dtype, K, V, l2norm, gva_pair=False):
    # (the "_v2" names keep the compile keys of the kernels' second version, the only one since session 9)
    # (threads, gva_pair)
    key = _key((_tl_dtype(dtype), K, V, bool(l2norm)), (256, 256), (bool(gva_pair), False))
    return get_kernel("bwd_dqk_v2_sm90", build_bwd_dqk_v2, key)


def bwd_wy_kernel(dtype, beta_dtype, K, V, l2norm, gva_pair=False):
    # (threads, gva_pair)
    key = _key((_tl_dtype(dtype), _tl_dtype(beta_dtype), K, V, bool(l2norm)), (256, 256), (bool(gva_pair), False))
    return get_kernel("bwd_wy_v2_sm90", build_bwd_wy_v2, key)


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
    # flattened inputs as the kernels read them (the backward reuses them)
    q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    beta: Optional[torch.Tensor] = None
    # the backward's split of its gradient walk, decided with the forward (it needs g, which is not saved):
    # (backward variant "ws" / "whole", V-block, segments.SegmentTables, walk ends [NSEG, Hv] int32), or None
    bwd_split: Optional[tuple] = None
    # the backward the forward's saves fix ("whole": a fused training forward saved Tb in w and no u), or None
    bwd_fixed: Optional[str] = None


def bv_forced() -> bool:
    """Whether ``FLASHQLA_TILELANG_BV`` forces the recurrences' V-block (see :func:`fwd_ws_bv`)."""
    return bool(os.environ.get("FLASHQLA_TILELANG_BV", "").strip())


def _meta_bvs(NS, Hv, V, dev) -> tuple:
    """Every V-block the call-time choice can make (only the forced one under FLASHQLA_TILELANG_BV): the
    meta-device key enumeration of precompile builds them all."""
    return (fwd_ws_bv(NS, Hv, V, dev),) if bv_forced() else FWD_WS_BVS


def _equal_lengths(varlen) -> bool:
    """Whether every sequence of a call has one length: a dense call, or varlen lengths all equal (precompile's
    meta-device varlen carries no lengths: no)."""
    if varlen is None:
        return True
    lens = getattr(varlen, "seqlens", None)
    return lens is not None and len(set(lens)) == 1


def seq_lengths(varlen, B: int, T: int) -> list:
    """The sequences' lengths, from the host (``VarlenMeta``) or the dense shape."""
    return varlen.seqlens if varlen is not None else [T] * B


def bwd_plan(lengths, Hv: int, K: int, V: int, l2norm: bool, device, explain: bool = False,
             fwd_split: Optional[bool] = None) -> tuple:
    """``(variant, plan, why)``: the backward this call runs (:func:`bwd_choice`'s ``whole`` / ``ws`` / ``serial``)
    and the split of its gradient walk into segments with a halo (:mod:`.segments`), or None.

    Where ``FLASHQLA_TILELANG_BWD_SEGMENTS`` allows a split, both backwards are modelled split and not: the split
    backward's gradient walk (``bwd_state_ws`` with a halo, its per-pair kernels unchanged) and the whole-V kernel's
    walk (``bwd_whole`` with a halo, ``WHOLE_STEP_US`` per step, one CTA per (segment, head)); the least modelled
    time wins (``FLASHQLA_TILELANG_BWD`` set: that backward, split where it pays).  Without a split this is
    :func:`bwd_choice`.  A V-block forced by ``FLASHQLA_TILELANG_BV`` replaces the split backward's.  ``fwd_split``:
    whether the forward walks segments, where the caller already planned it (else planned here)."""
    meta = ChunkMeta.of_lengths(lengths)
    # (the fused training forward, whose saving the whole-V backward is credited with, skips split forwards unless
    # FLASHQLA_TILELANG_TRAIN_FUSED=all)
    if fwd_split is None:
        fwd_split = fwd_segment_plan(lengths, Hv, V, device) is not None
    variant, why = bwd_choice(meta, Hv, K, V, l2norm, device, explain, fwd_split)
    model = _bwd_model(meta, Hv, device, fwd_split)
    if variant == "serial" or model is None or segments.mode(backward=True) == "off":
        return variant, None, why
    t_whole, t_split, busy = model
    sms = detect(device).sm_count or 132
    forced = bwd_variant() != "auto"
    cands = []
    if variant == "ws" or not forced:
        plain_bv = min(fwd_ws_bv(busy, Hv, V, device), BWD_WS_BVS[-1])
        plan = segments.segment_plan(lengths, Hv, V, sms, plain_bv, backward=True)
        if plan is not None and bv_forced():
            bv = min(fwd_ws_bv(plan.num_segments, Hv, V, device), BWD_WS_BVS[-1])
            plan = dataclasses.replace(plan, bv=bv, reason=f"{plan.reason}; run at BV {bv} (FLASHQLA_TILELANG_BV)")
        walk_us = meta.num_chunks / busy * SPLIT_STATE_STEP_US
        # (the split backward's per-pair kernels are the same split or not)
        cands.append(((plan.est_us if plan else walk_us) + t_split - walk_us, "ws", plan))
    if bwd_whole_ok(K, V, l2norm) and (variant == "whole" or not forced):
        plan = segments.segment_plan(lengths, Hv, V, sms, V, backward=True, steps={V: WHOLE_STEP_US}, bvs=(V,))
        # (t_whole is already net of the fused training forward's saving; the split plan's estimate is not)
        credit = _train_fused_credit(meta.num_chunks, Hv, device, fwd_split)
        cands.append((plan.est_us - credit if plan else t_whole, "whole", plan))
    t, variant, plan = min(cands, key=lambda c: c[0])
    if plan is not None and explain:
        name = "whole-V fused backward" if variant == "whole" else "split backward"
        why = (f"{name}, its gradient walk in-kernel CP: {plan.describe()}; modelled {t / 1000:.2f} ms (unsplit: "
               f"{t_whole / 1000:.2f} ms whole-V, {t_split / 1000:.2f} ms split)")
    return variant, plan, why


def fwd_few_waves() -> bool:
    """``FLASHQLA_TILELANG_FEW_WAVES`` (session 24, off until measured): the forward's planner also tries
    splitting walks that already fill the SMs, while they take at most two waves (``segments.segment_plan``'s
    ``few_waves``).  The model's case: FlashQLA's 16/48 4x8192 and 2x16384 rows run 192 / 96 whole 128- / 256-chunk
    walks at BV 128 (1.112 and 1.114 ms on the H200, session 24) where 16/48 1x32768, split into 384 walks of 64
    chunks, took 0.970; the plan for those rows becomes that same split (modelled 819 -> 661 us).  It also splits
    8/24 4x8192 and 8x4096 (410 -> 354 us modelled)."""
    return env_choice("FLASHQLA_TILELANG_FEW_WAVES", ("0", "1"), "0") == "1"


def fwd_segment_plan(lengths, Hv: int, V: int, device, variant: Optional[str] = None):
    """The in-kernel split of :mod:`.segments` for this call, or None; the serial forward has none.  A V-block
    forced by ``FLASHQLA_TILELANG_BV`` replaces the plan's."""
    if (variant or fwd_variant()) == "serial":
        return None
    sms = detect(device).sm_count or 132
    meta = ChunkMeta.of_lengths(lengths)
    plain_bv = fwd_ws_bv(meta.busy_seqs or meta.num_seqs, Hv, V, device)
    plan = segments.segment_plan(lengths, Hv, V, sms, plain_bv, min_gain_us=segments.FWD_MIN_GAIN_US,
                                 few_waves=fwd_few_waves())
    if plan is not None and bv_forced():
        bv = fwd_ws_bv(plan.num_segments, Hv, V, device)
        plan = dataclasses.replace(plan, bv=bv, reason=f"{plan.reason}; run at BV {bv} (FLASHQLA_TILELANG_BV)")
    return plan


def halo_stream() -> bool:
    """``FLASHQLA_TILELANG_HALO_STREAM`` (default 1 since session 24): the halo searches of a forward that walks
    segments (``segments.walk_starts``, its own and the backward's: ~11 us each at 16/32 1x32768) run on a side
    stream beside stage 1 instead of before the recurrence on the caller's stream; their 4-64 small CTAs fit beside
    stage 1's, and the recurrence waits for them.  Measured on an H100 (session 24 run 7, CUDA-graph medians), 0 ->
    1: forward 1x32768 rows 0.186 -> 0.183 ms (2/8), 0.338 -> 0.332 (4/16), 0.682 -> 0.670 (32/32), the others
    equal; fwd+bwd 32k in one sequence 0.481 -> 0.468 (2/4), 0.827 -> 0.813 (4/8), 1.495 -> 1.489 (8/16), 2.809 ->
    2.811 (16/32).  Outputs and gradients bitwise the same, eager and in a CUDA graph (its GPU test).  ``0``: the
    searches on the caller's stream."""
    return env_choice("FLASHQLA_TILELANG_HALO_STREAM", ("0", "1"), "1") == "1"


_HALO_STREAMS: dict = {}


def _halo_searches(kf, gf, bf, lengths, fwd_seg_chunks, bwd_seg_chunks, l2norm: bool, dev):
    """``(fwd, bwd, join)``: the forward's and the backward's ``(segment tables, walk starts)`` (None where that walk
    is not split), launched before stage 1, and ``join()``, which the caller runs after stage 1's launch and before
    the recurrence's.  Under :func:`halo_stream` the searches run on a side stream: the tables (uploaded once and
    cached) and the starts are allocated on the caller's stream, which joins the side one before it reads them, and
    the starts are recorded on the side stream, so that the allocator does not hand their memory out again while
    a search still writes it (should the caller free them early, on an error before the join)."""
    fwd_t = segments.segment_tables(lengths, fwd_seg_chunks, dev) if fwd_seg_chunks is not None else None
    bwd_t = segments.segment_tables(lengths, bwd_seg_chunks, dev) if bwd_seg_chunks is not None else None
    outs = [None if t is None else torch.empty(t.num_segments, gf.shape[1], dtype=torch.int32, device=dev)
            for t in (fwd_t, bwd_t)]
    side = main = None
    if dev.type == "cuda" and halo_stream() and (fwd_t is not None or bwd_t is not None):
        main = torch.cuda.current_stream(dev)
        side = _HALO_STREAMS.get(dev.index)
        if side is None:
            side = _HALO_STREAMS[dev.index] = torch.cuda.Stream(dev)
        side.wait_stream(main)          # (the inputs and the tables' uploads come first)
        for t in outs:
            if t is not None:
                t.record_stream(side)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        fwd = None if fwd_t is None else (fwd_t, segments.walk_starts(kf, gf, bf, fwd_t, l2norm, out=outs[0]))
        bwd = None if bwd_t is None else (bwd_t, segments.walk_starts(kf, gf, bf, bwd_t, l2norm, reverse=True,
                                                                     out=outs[1]))

    def join():
        if side is not None:
            main.wait_stream(side)
    return fwd, bwd, join


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

    variant = fwd_variant()
    walk_seqs = meta.busy_seqs or NS
    # in-kernel CP: the recurrence walks segments with a halo (see .segments); its grid and V-block follow
    # the segments, stage 1 is unchanged
    split = lengths = None
    if dev.type != "meta" and variant != "serial" and (
            segments.mode() != "auto" or walk_seqs * Hv < 0.7 * (detect(dev).sm_count or 132)):
        # (auto splits only where the walks leave SMs idle: a call with many sequences skips the host work)
        lengths = seq_lengths(varlen, B, T)
        split = fwd_segment_plan(lengths, Hv, V, dev, variant)
    if split is not None:
        walk_seqs = split.num_segments
        bv = split.bv
    else:
        bv = fwd_ws_bv(walk_seqs, Hv, V, dev)
    # The backward this call will run, planned once here where the forward depends on it: the fused training
    # forward (train_fused; the whole-V backward reads X and not w / u, so an unsplit training forward can take the
    # fused form as well) and the backward's split of its gradient walk (it needs g, which is not saved).
    train_fused_here = (save and variant == "fused" and (split is None or train_fused_mode() == "all") and
                        train_fused() and bwd_whole_ok(K, V, l2norm))
    split_bwd_here = save and variant != "serial" and segments.mode(backward=True) != "off"
    bvariant = bplan = None
    if dev.type != "meta" and (train_fused_here or split_bwd_here):
        if lengths is None:
            lengths = seq_lengths(varlen, B, T)
        bvariant, bplan, _ = bwd_plan(lengths, Hv, K, V, l2norm, dev, fwd_split=split is not None)
    bwd_fixed = "whole" if train_fused_here and bvariant == "whole" else None
    fused = variant == "fused" and (not save or bwd_fixed == "whole")
    # the halo searches of the walks split into segments (the forward's, and the backward's, which needs g), ahead
    # of stage 1 so that they may run beside it (halo_stream)
    fwd_halo, bwd_halo, halo_join = _halo_searches(
        kf, gf, bf, lengths, split.seg_chunks if split is not None else None,
        bplan.seg_chunks if split_bwd_here and bplan is not None else None, l2norm, dev)
    G = torch.empty(NC, Hv, CHUNK, dtype=torch.float32, device=dev)
    # (stage 1 finds a chunk's rows without the chunk table where every sequence has one length)
    # the persistent Tb forms of stage 1 (intra_persist), with their CTAs per head as the last argument
    uni, persist = stage1_forms(_equal_lengths(varlen), NC)
    persist_args = (intra_persist_programs(NC, Hv, dev),) if persist else ()

    def stage1_tb_forms(Tb_out, X_out=None, x_beta=False):
        # stage 1's Tb forms that share one signature (no q, no scores): with X for the whole-V backward (X_out
        # given), or the persistent inference form (X a placeholder); persistent CTAs where ``persist``;
        # ``x_beta``: Tb_out is beta chunk-major [NC, Hv, 64] fp32 (train_xbeta)
        assert X_out is not None or persist
        intra_tb_kernel(dt, bf.dtype, K, l2norm, save_x=X_out is not None, uniform=uni, persist=persist,
                        x_beta=x_beta)(
            kf, gf, bf, meta.cu_seqlens, meta.chunk_indices, Tb_out,
            X_out if X_out is not None else dummy((1, 1, CHUNK, CHUNK), dt, dev), G, ratio, *persist_args)

    def training_stage1():
        # the fused training forward's stage 1: (w, X, scores) for its walk, X for the whole-V backward.  w is Tb
        # and scores a placeholder, or (train_xbeta) w is X itself and beta chunk-major [NC, Hv, 64] fp32 takes
        # the scores' place (no Tb)
        X = torch.empty(NC, Hv, CHUNK, CHUNK, dtype=dt, device=dev)
        if train_xbeta():
            beta_chunks = torch.empty(NC, Hv, CHUNK, dtype=torch.float32, device=dev)
            stage1_tb_forms(beta_chunks, X, x_beta=True)
            return X, X, beta_chunks
        Tb = torch.empty(NC, Hv, CHUNK, CHUNK, dtype=dt, device=dev)
        stage1_tb_forms(Tb, X)
        return Tb, X, dummy((1, 1, CHUNK, CHUNK), dt, dev)

    scores = dummy((1, 1, CHUNK, CHUNK), dt, dev)     # the recurrence's last parameter, unless pscores
    pscores = False
    x_beta = fused and save and train_xbeta()
    if fused and save:
        u = vf
        w, X, scores = training_stage1()
    elif fused:
        # w is Tb [NC, Hv, 64, 64] and u is v itself (see build_fwd_ws(fused=True))
        w = torch.empty(NC, Hv, CHUNK, CHUNK, dtype=dt, device=dev)
        u = vf
        X = None
        # stage 1 and the recurrence must agree on pscores; the meta-device key enumeration (precompile)
        # runs stage 1 every way a V-block can ask for
        pscores = fwd_pscores(True, bv, walk_seqs, Hv)
        if dev.type == "meta":
            choices = sorted({ps for b in _meta_bvs(NS, Hv, V, dev) for ps in _pscores_choices(True, b)})
        else:
            choices = (pscores,)
        for ps in choices:
            if ps:
                scores = torch.empty(NC, Hv, CHUNK, CHUNK, dtype=dt, device=dev)
            q_in = qf if ps else dummy((1, 1, K), dt, dev)
            if persist and not ps:
                stage1_tb_forms(w)
                continue
            intra_tb_kernel(dt, bf.dtype, K, l2norm, scores=ps, uniform=uni)(
                q_in, kf, gf, bf, meta.cu_seqlens, meta.chunk_indices, w, scores, G, ratio)
    else:
        w = torch.empty(NC, Hv, CHUNK, K, dtype=dt, device=dev)
        u = torch.empty(NC, Hv, CHUNK, V, dtype=dt, device=dev)
        X = torch.empty(NC, Hv, CHUNK, CHUNK, dtype=dt, device=dev) if save else \
            dummy((1, 1, CHUNK, CHUNK), dt, dev)
        intra_kernel(dt, bf.dtype, K, V, l2norm, save, uniform=uni)(
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
    no_halo = (dummy((1, 4), torch.int32, dev), dummy((1, 1), torch.int32, dev))
    halo_join()
    if split is not None:
        # the walk's boundaries are the segments', and each (segment, head) starts where the halo search says
        tables, starts = fwd_halo
        walk_cu, walk_co = tables.cu_seqlens, tables.chunk_offsets
        halo_args = (tables.seg_table, starts)
    else:
        walk_cu, walk_co, halo_args = meta.cu_seqlens, meta.chunk_offsets, no_halo
    fwd_args = (qf, kf, w, u, G, walk_cu, walk_co, h0f, o, ht, hs, vn, float(scale), ratio)
    if variant == "serial":
        fwd_kernel(dt, K, V, l2norm, has_h0, output_final_state, save)(*fwd_args)
    elif dev.type == "meta":
        # key enumeration (precompile): every V-block and pscores choice, walking whole sequences or segments
        for b in _meta_bvs(NS, Hv, V, dev):
            for ps in _pscores_choices(fused, b):
                for halo in (False, True):
                    fwd_ws_kernel(dt, K, V, l2norm, has_h0, output_final_state, save, b, fused, ps, halo)(
                        *fwd_args, _trace_arg(dev), scores, *no_halo)
    else:
        fwd_ws_kernel(dt, K, V, l2norm, has_h0, output_final_state, save, bv, fused, pscores, split is not None,
                      x_beta)(*fwd_args, _trace_arg(dev), scores, *halo_args)

    if dev.type == "meta" and save and variant == "fused" and train_fused() and bwd_whole_ok(K, V, l2norm):
        # (precompile's key enumeration: the fused training forward's kernels, which the call path decides on the
        # device from the backward's plan)
        train_w, _, train_scores = training_stage1()
        for b in _meta_bvs(NS, Hv, V, dev):
            for halo in (False, True):
                fwd_ws_kernel(dt, K, V, l2norm, has_h0, output_final_state, True, b, True, False, halo,
                              train_xbeta())(qf, kf, train_w, vf, *fwd_args[4:], _trace_arg(dev), train_scores,
                                             *no_halo)

    bwd_split = None if bwd_halo is None else (bvariant, bplan.bv, *bwd_halo)
    return FwdResult(o.reshape(B, T, Hv, V), ht if output_final_state else None, w, u, G,
                     X if save else None, hs if save else None, vn if save else None, meta,
                     qf, kf, vf, bf, bwd_split, bwd_fixed)


def backward(q, k, v, beta, w, G, X, hs, vn, meta: ChunkMeta, shape, scale: float, l2norm: bool,
             has_h0: bool, do, dht, bwd_split: Optional[tuple] = None, bwd_fixed: Optional[str] = None):
    """Gradients from the forward's saved tensors (flattened q/k/v/beta, chunk-major w, G, X, chunk
    states hs and v_new).  Returns (dq, dk, dv, dg, dbeta, dh0 or None) in the input shapes: dq, dk and dv
    in the inputs' dtype, dbeta in beta's, dg and dh0 in fp32.  The kernels accumulate in fp32 and round
    dv and dbeta once, where they are final; dq and dk are rounded per value head and summed over each GVA
    group in fp32 before their last rounding (exact at ratio 1)."""
    B, T, Hqk, Hv, K, V = shape
    NT, NC, NS = B * T, meta.num_chunks, meta.num_seqs
    dev, dt = q.device, q.dtype
    ratio = Hv // Hqk
    f32 = torch.float32

    dof = aligned(do.reshape(NT, Hv, V).to(dt))
    has_dht = dht is not None
    dhtf = aligned(dht.to(f32)) if has_dht else dummy((1, 1, K, V), f32, dev)
    dh0 = torch.empty(NS, Hv, K, V, dtype=f32, device=dev) if has_h0 else dummy((1, 1, K, V), f32, dev)
    no_halo = (dummy((1, 4), torch.int32, dev), dummy((1, 1), torch.int32, dev))
    if dev.type == "meta" and bwd_variant() == "auto":
        # (precompile's key enumeration: both paths' kernels, the whole-V one also over segments)
        if bwd_whole_ok(K, V, l2norm):
            _backward_whole(q, k, v, beta, G, X, hs, vn, meta, shape, scale, dof, dhtf, dh0, has_dht, has_h0)
        variant = "ws"
    elif bwd_split is not None:
        variant = bwd_split[0]          # (decided with the forward, with the split)
    elif bwd_fixed is not None:
        variant = bwd_fixed             # (the forward's saves serve this backward only)
    else:
        variant = bwd_choice(meta, Hv, K, V, l2norm, dev)[0]
    if variant == "whole":
        split = bwd_split[2:] if bwd_split is not None and dev.type != "meta" else None
        dq, dk, dv, dg, db = _backward_whole(q, k, v, beta, G, X, hs, vn, meta, shape, scale, dof, dhtf, dh0,
                                             has_dht, has_h0, split)
        return _grads_shaped(dq, dk, dv, dg, db, dh0 if has_h0 else None, shape)
    dh = torch.empty(NC, Hv, K, V, dtype=dt, device=dev)
    dvn = torch.empty(NC, Hv, CHUNK, V, dtype=dt, device=dev)
    # segments with a halo past each one's end (see .segments; the split was decided with the forward), where the
    # split backward's ws kernel runs
    halo = bwd_split is not None and variant == "ws" and dev.type != "meta"
    if halo:
        _, bv, tables, ends = bwd_split
        walk_cu, walk_co, halo_args = tables.cu_seqlens, tables.chunk_offsets, (tables.seg_table_bwd, ends)
    else:
        bv = min(fwd_ws_bv(meta.busy_seqs or NS, Hv, V, dev), BWD_WS_BVS[-1])
        walk_cu, walk_co, halo_args = meta.cu_seqlens, meta.chunk_offsets, no_halo
    state_args = (q, k, w, G, dof, walk_cu, walk_co, dhtf, dh, dvn, dh0, float(scale), ratio)
    if variant == "serial":
        bwd_state_kernel(dt, K, V, l2norm, has_dht, has_h0)(*state_args)
    elif dev.type == "meta":
        for bv in BWD_WS_BVS:
            for halo in (False, True):
                bwd_state_ws_kernel(dt, K, V, l2norm, has_dht, has_h0, bv, halo)(*state_args, *no_halo)
    else:
        bwd_state_ws_kernel(dt, K, V, l2norm, has_dht, has_h0, bv, halo)(*state_args, *halo_args)

    # (GVA pairs summed in the dqk and wy kernels where gva_in_kernel says so: into zeroed [NT, Hqk, K] outputs)
    pair = gva_in_kernel(ratio)[0]
    dq_h = _grad_rows_buffer(pair, NT, Hqk, Hv, K, dt, dev)
    dkp = torch.empty(NC, Hv, CHUNK, K, dtype=f32, device=dev)
    dw = torch.empty(NC, Hv, CHUNK, K, dtype=dt, device=dev)
    dGp = torch.empty(NC, Hv, CHUNK, dtype=f32, device=dev)
    bwd_dqk_kernel(dt, K, V, l2norm, pair)(
        q, k, dof, G, hs, vn, dh, dvn, meta.cu_seqlens, meta.chunk_indices, dq_h, dkp, dw, dGp,
        float(scale), ratio)
    # Peak memory is reached in the wy kernel below: drop what it does not read first.  The state
    # gradients (16-bit [chunks, Hv, K, V], 537 MB at 32 heads x 32k tokens) are done with, and the GVA
    # sum of dq can happen now (the caching allocator reuses both blocks for the wy kernel's outputs).
    # (GVA: value heads h*ratio .. h*ratio + ratio - 1 read query/key head h.)
    # (Session 10's one-kernel dqk + wy, which kept dk^p, dw and dG on the chip, measured slower on the H200
    # in session 11 -- 2.73 against 1.445 + 1.201 ms at 16/32 x 32k -- and was removed.)
    del dh, state_args
    dq = _grad_rows_total(dq_h, pair, ratio, dt)
    del dq_h
    # dk per value head (GVA-summed below), dv, dg, dbeta
    dk_h = _grad_rows_buffer(pair, NT, Hqk, Hv, K, dt, dev)
    dv = torch.empty(NT, Hv, V, dtype=dt, device=dev)
    dg = torch.empty(NT, Hv, dtype=f32, device=dev)
    db = torch.empty(NT, Hv, dtype=beta.dtype, device=dev)
    bwd_wy_kernel(dt, beta.dtype, K, V, l2norm, pair)(
        k, v, beta, G, X, dw, dvn, dkp, dGp, meta.cu_seqlens, meta.chunk_indices, dk_h, dv, dg, db,
        ratio)
    del dw, dvn, dkp, dGp

    dk = _grad_rows_total(dk_h, pair, ratio, dt)
    del dk_h
    return _grads_shaped(dq, dk, dv, dg, db, dh0 if has_h0 else None, shape)


def _grads_shaped(dq, dk, dv, dg, db, dh0, shape):
    """The flat per-token gradients in the input shapes."""
    B, T, Hqk, Hv, K, V = shape
    return (dq.reshape(B, T, Hqk, K), dk.reshape(B, T, Hqk, K), dv.reshape(B, T, Hv, V),
            dg.reshape(B, T, Hv), db.reshape(B, T, Hv), dh0)
