"""Exact context parallelism across processes: each rank holds a contiguous slice of the token stream.

Layout.  Let W ranks of ``group`` hold consecutive slices of the same token stream, rank order = time order.

* Dense (``cu_seqlens=None``): every rank holds ``q, k [B, T_r, Hqk, K]``, ``v [B, T_r, Hv, V]``, ``g, beta
  [B, T_r, Hv]``: the r-th time slice of the same B sequences (``T_r`` may differ between ranks, and may
  be 0).  Sequence b is the concatenation of the ranks' slices.  ``initial_state [B, Hv, K, V]`` is read on
  rank 0 only (other ranks' values are ignored and get zero gradient).
* Varlen (``cu_seqlens`` given, B = 1): rank r holds ``n_r`` pieces of sequences, local int32
  ``cu_seqlens [n_r + 1]`` over its ``T_r`` tokens, and ``seq_ids`` (n_r ints, strictly increasing): the
  global sequence id of each local piece.  A rank's first piece continues the previous rank's last piece
  (the previous rank holding any piece) iff their ids are equal; so only the first and the last local piece
  can straddle a boundary, and one sequence may span many ranks (each middle rank then holds just that one
  piece).  Ids must not decrease across ranks.  ``initial_state [n_r, Hv, K, V]`` gives the start state of
  the local pieces that *begin* their sequence here; the entry of a piece continuing from the previous rank
  is ignored (zero gradient).  A rank may hold no tokens (``cu_seqlens = [0]``, ``seq_ids = []``).

Results (per rank): ``o`` for the local tokens and, with ``output_final_state``, ``[n_r (or B), Hv, K, V]``
the state at the end of each local piece: the sequence's final state for the piece that ends it, the
hand-over state for a piece that continues on the next rank.  Gradients flow through all of it.

Algorithm (same algebra as :mod:`flashqla.cp`).  Forward: each rank computes, for the piece it hands over,
the affine map ``S_out = M S_in + S`` (M = 0 when that piece starts here, from its known start state), the
ranks ``all_gather`` (M, S) and each scans the ranks before it to get its incoming state, then runs its
pieces with their true start states.  Backward: each rank computes ``b`` = the cotangent of its incoming
state from its own tokens and its own ``dht``, the ranks ``all_gather`` b, each scans the ranks after it
(``dS_in = b + M^T dS_out``) to get the cotangent arriving at the end of the piece it handed over, and runs
its pieces' backward with true start states and true end cotangents.  Locally, long pieces are further cut
into segments (``segments``, as in :func:`flashqla.cp.chunk_gated_delta_rule_cp`).

Collectives: ``torch.distributed.all_gather`` only (one of 12 ints of metadata, then (M, S) forward and b
backward: ``L x Hv x K x (K + V)`` floats per rank, L = B dense or 1 varlen).  Works with gloo (CPU tensors)
and NCCL (CUDA tensors; set the device per rank).  Every rank of the group must call the op, and every rank
must run its backward when one does (as with DDP): the backward is collective too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .cp import (_cast, _Engine, _Layout, _pack, _resolve_plan, _seq_bounds)
from .validation import validate

__all__ = ["chunk_gated_delta_rule_distributed"]


def _world(group):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather(t: torch.Tensor, world: int, group) -> list:
    if world == 1:
        return [t]
    import torch.distributed as dist
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return out


_META = 12  # ok, mode, n, first_id, last_id, T, Hqk, Hv, K, V, needs_grad, float64


@dataclass
class _DistConfig:
    engine: _Engine
    shape: tuple          # (B, T_r)
    num_pieces: int
    lane_in: list         # per lane: local piece continuing from the previous rank, or None
    lane_out: list        # per lane: local piece continuing on the next rank, or None
    world: int
    rank: int
    active: list          # per rank: holds pieces (varlen) / always (dense)
    joined_prev: list     # per rank
    joined_next: list     # per rank
    group: Any
    output_final_state: bool
    needs_grad: bool
    has_h0: bool


def _run(eng: _Engine, x, h0_seg, want_ht, needs_grad):
    """The full local run; a rank without tokens passes the states through."""
    lay = eng.layout
    if lay.seg_cu[-1] == 0:
        v = x[2]
        return v.new_zeros(1, 0, v.shape[2], v.shape[3]), h0_seg, (), None, None, None
    return eng.forward_call(*x, lay.seg_cu, h0_seg, want_ht, needs_grad)


class _DistFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cfg: _DistConfig):
        eng, lay = cfg.engine, cfg.engine.layout
        dev = q.device
        x = tuple(_pack(t) for t in (q, k, v, g, beta))
        Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        L = len(cfg.lane_in)
        pos = {c: i for i, c in enumerate(lay.chains)}
        row_segs = lay.row_segments()
        out_chains = {pos[c] for c in cfg.lane_out if c is not None}
        in_chains = {pos[c] for c in cfg.lane_in if c is not None}
        # Local end states from zero starts: non-last rows of every chain, plus the last row of the
        # chains whose end is handed to the next rank.
        need = []
        for i in range(len(lay.chains)):
            r0, n = lay.row0[i], lay.chain_len(i)
            need.extend(range(r0, r0 + n if i in out_chains else r0 + n - 1))
        S_loc = torch.zeros(lay.rows, Hv, K, V, dtype=eng.sd, device=dev)
        if need:
            S_loc[torch.tensor(need, device=dev)] = eng.local_states(x, [row_segs[r] for r in need])
        M = eng.transition(x)
        # Chain start states known locally (the incoming one is still unknown: 0 for now).
        cs0 = torch.zeros(len(lay.chains), Hv, K, V, dtype=eng.sd, device=dev)
        known = [i for i in range(len(lay.chains)) if i not in in_chains]
        if h0 is not None and known:
            ki = torch.tensor(known, device=dev)
            cs0[ki] = h0[torch.tensor([lay.chains[i] for i in known], device=dev)].to(eng.sd)
        starts0 = eng.scan_forward(M, S_loc, cs0)
        # What this rank hands over, as an affine map of what it receives: S_out = M_pub S_in + S_pub.
        M_pub = torch.zeros(L, Hv, K, K, dtype=eng.sd, device=dev)
        S_pub = torch.zeros(L, Hv, K, V, dtype=eng.sd, device=dev)
        lanes_out = [l for l in range(L) if cfg.lane_out[l] is not None]
        if lanes_out:
            li = torch.tensor(lanes_out, device=dev)
            S_pub[li] = eng.chain_ends(M, S_loc, starts0, [pos[cfg.lane_out[l]] for l in lanes_out])
            through = [l for l in lanes_out if cfg.lane_in[l] == cfg.lane_out[l]]
            if through:
                M_pub[torch.tensor(through, device=dev)] = eng.chain_products(
                    M, [pos[cfg.lane_out[l]] for l in through])
        M_all = torch.stack(_all_gather(M_pub, cfg.world, cfg.group), 0)
        S_all = _all_gather(S_pub, cfg.world, cfg.group)
        carry = None
        for j in range(cfg.rank):
            if not cfg.active[j]:
                continue
            cin = carry if cfg.joined_prev[j] else None
            out = S_all[j] if cin is None else S_all[j] + M_all[j] @ cin
            carry = out if cfg.joined_next[j] else None
        cs = cs0
        lanes_in = [l for l in range(L) if cfg.lane_in[l] is not None]
        if lanes_in:
            if carry is None:
                raise RuntimeError("flashqla.distributed: internal error, no incoming state for a continued piece")
            cs = cs0.clone()
            cs[torch.tensor([pos[cfg.lane_in[l]] for l in lanes_in], device=dev)] = \
                carry[torch.tensor(lanes_in, device=dev)]
        starts = eng.scan_forward(M, S_loc, cs) if lay.rows else starts0
        # The local run with true start states.
        state_dtype = h0.dtype if h0 is not None else eng.sd
        h0_seg = torch.zeros(lay.num_segments, Hv, K, V, dtype=state_dtype, device=dev)
        if h0 is not None and cfg.num_pieces:
            h0_seg[torch.tensor(lay.first_seg, device=dev)] = h0
        if lay.rows:
            h0_seg[torch.tensor(row_segs, device=dev)] = starts.to(state_dtype)
        want_ht = cfg.output_final_state or cfg.needs_grad
        o, ht_seg, saved, aux, be, spec = _run(eng, x, h0_seg, want_ht, cfg.needs_grad)
        ctx.be, ctx.spec, ctx.aux, ctx.cfg = be, spec, aux, cfg
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, None if h0 is None else h0.dtype)
        ctx.n_saved = len(saved)
        ctx.state_dtype = state_dtype
        if cfg.needs_grad:
            ctx.save_for_backward(*saved, M, M_all)
        B, T = cfg.shape
        o = o.reshape(B, T, Hv, V)
        if cfg.output_final_state:
            if cfg.num_pieces:
                ht = ht_seg[torch.tensor([lay.last_seg(n) for n in range(cfg.num_pieces)], device=dev)]
            else:
                ht = torch.zeros(0, Hv, K, V, dtype=state_dtype, device=dev)
        else:
            ht = o.new_empty(0)
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        cfg, eng = ctx.cfg, ctx.cfg.engine
        lay = eng.layout
        tensors = ctx.saved_tensors
        saved, M, M_all = tensors[:ctx.n_saved], tensors[ctx.n_saved], tensors[ctx.n_saved + 1]
        B, T = cfg.shape
        dev = do.device
        Hv, K, V = M_all.shape[2], M_all.shape[3], do.shape[3]
        L = len(cfg.lane_in)
        N = cfg.num_pieces
        pos = {c: i for i, c in enumerate(lay.chains)}
        row_segs = lay.row_segments()
        do_p = _pack(do.contiguous())
        if dht is not None and (dht.numel() == 0 or not cfg.output_final_state):
            dht = None
        has_tokens = lay.seg_cu[-1] > 0
        C = len(lay.chains)
        if has_tokens and lay.rows:
            g1 = ctx.be.backward(ctx.spec, saved, ctx.aux, do_p, None)
            dh0_loc = g1[5][torch.tensor(row_segs, device=dev)].to(eng.sd)
            del g1
        else:
            dh0_loc = torch.zeros(lay.rows, Hv, K, V, dtype=eng.sd, device=dev)
        term0 = torch.zeros(C, Hv, K, V, dtype=eng.sd, device=dev)
        if dht is not None and C:
            term0 = dht[torch.tensor(lay.chains, device=dev)].to(eng.sd)
        # b: the cotangent of this rank's incoming state from its own tokens and dht.
        b_pub = torch.zeros(L, Hv, K, V, dtype=eng.sd, device=dev)
        lanes_in = [l for l in range(L) if cfg.lane_in[l] is not None]
        if lanes_in:
            _, dh0_first = eng.scan_backward(M, dh0_loc, term0)
            b_pub[torch.tensor(lanes_in, device=dev)] = dh0_first[
                torch.tensor([pos[cfg.lane_in[l]] for l in lanes_in], device=dev)]
        b_all = _all_gather(b_pub, cfg.world, cfg.group)
        carry = None
        for j in range(cfg.world - 1, cfg.rank, -1):
            if not cfg.active[j]:
                continue
            cin = carry if cfg.joined_next[j] else None
            dS_in = b_all[j] if cin is None else b_all[j] + M_all[j].transpose(-1, -2) @ cin
            carry = dS_in if cfg.joined_prev[j] else None
        term = term0
        lanes_out = [l for l in range(L) if cfg.lane_out[l] is not None]
        if lanes_out:
            if carry is None:
                raise RuntimeError("flashqla.distributed: internal error, no cotangent for a handed-over state")
            term = term0.clone()
            ci = torch.tensor([pos[cfg.lane_out[l]] for l in lanes_out], device=dev)
            term[ci] = term[ci] + carry[torch.tensor(lanes_out, device=dev)]
        sdt = ctx.state_dtype
        dht_seg = torch.zeros(lay.num_segments, Hv, K, V, dtype=sdt, device=dev)
        if dht is not None and N:
            dht_seg[torch.tensor([lay.last_seg(n) for n in range(N)], device=dev)] = dht.to(sdt)
        if lay.rows:
            dS_end, _ = eng.scan_backward(M, dh0_loc, term)
            dht_seg[torch.tensor(row_segs, device=dev)] = dS_end.to(sdt)
        if has_tokens:
            dq, dk, dv, dg, dbeta, dh0_seg = ctx.be.backward(ctx.spec, saved, ctx.aux, do_p, dht_seg)
            shp = lambda t: t.reshape(B, T, *t.shape[2:])  # noqa: E731
            grads = [shp(dq), shp(dk), shp(dv), shp(dg), shp(dbeta)]
        else:
            grads = [None] * 5
            dh0_seg = dht_seg  # no tokens: the end state is the start state
        dh0 = None
        if ctx.dtypes[5] is not None:
            dh0 = torch.zeros(N, Hv, K, V, dtype=sdt, device=dev)
            if N:
                dh0 = dh0_seg[torch.tensor(lay.first_seg, device=dev)].clone()
                cont = [c for c in cfg.lane_in if c is not None]
                if cont:
                    dh0[torch.tensor(cont, device=dev)] = 0  # ignored entries
        grads.append(dh0)
        return _cast(tuple(grads), ctx.dtypes) + (None,)


def chunk_gated_delta_rule_distributed(
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
    seq_ids: Optional[Sequence[int]] = None,
    backend: str = "auto",
    group: Any = None,
    segments: Any = None,
    *,
    sm_count: Optional[int] = None,
    min_segment_len: int = 512,
    max_segments: int = 64,
):
    """The gated delta rule over a token stream sharded in time across the ranks of ``group``.

    Call it on every rank with that rank's slice (layout in the module docstring); returns the local
    ``(o, final_state)``.  ``backend`` picks the local backend; ``segments`` cuts long local pieces further
    (as in :func:`flashqla.cp.chunk_gated_delta_rule_cp`; None: the cost model decides).  Without an
    initialised process group (or with one rank) this is single-device CP.
    """
    world, rank = _world(group)
    dev = q.device
    err: Optional[BaseException] = None
    meta = [0] * _META
    try:
        spec, scale_f, vmeta = validate(q, k, v, g, beta, scale, initial_state, output_final_state,
                                        use_qk_l2norm_in_kernel, cu_seqlens, None)
        B, T = q.shape[0], q.shape[1]
        if vmeta is None:
            ids = list(range(B))
            mode = 1
        else:
            if seq_ids is None:
                raise ValueError("with cu_seqlens, pass seq_ids: the global sequence id of each local piece "
                                 "(pieces with equal ids on neighbouring ranks are one sequence)")
            ids = [int(i) for i in (seq_ids.tolist() if isinstance(seq_ids, torch.Tensor) else seq_ids)]
            if len(ids) != vmeta.num_seqs:
                raise ValueError(f"seq_ids must have one id per local piece ({vmeta.num_seqs}), got {len(ids)}")
            if any(b <= a for a, b in zip(ids, ids[1:])) or any(i < 0 for i in ids):
                raise ValueError(f"seq_ids must be non-negative and strictly increasing, got {ids}")
            mode = 2
        f64 = torch.float64 in (q.dtype, g.dtype, beta.dtype) or (
            initial_state is not None and initial_state.dtype == torch.float64)
        meta = [1, mode, len(ids), ids[0] if ids else -1, ids[-1] if ids else -1, T, spec.Hqk, spec.Hv,
                spec.K, spec.V, int(spec.needs_grad), int(f64)]
    except Exception as exc:  # every rank must reach the metadata exchange, or the others would hang
        err = exc
    info = _all_gather(torch.tensor(meta, dtype=torch.int64, device=dev), world, group)
    info = [t.tolist() for t in info]
    if err is not None:
        raise err
    bad = [j for j in range(world) if info[j][0] != 1]
    if bad:
        raise ValueError(f"flashqla.distributed: rank(s) {bad} rejected their inputs (see their error)")
    for name, col in (("layout (dense / varlen)", 1), ("Hqk", 6), ("Hv", 7), ("K", 8), ("V", 9),
                      ("needs_grad", 10), ("float64", 11)):
        vals = [info[j][col] for j in range(world)]
        if len(set(vals)) != 1:
            raise ValueError(f"flashqla.distributed: ranks disagree on {name}: {vals}")
    mode = info[0][1]
    if mode == 1:
        nb = [info[j][2] for j in range(world)]
        if len(set(nb)) != 1:
            raise ValueError(f"flashqla.distributed: dense layout needs one batch size B on every rank, got {nb}")
        active = [True] * world
        jp = [j > 0 for j in range(world)]
        jn = [j < world - 1 for j in range(world)]
        lane_in = [b if jp[rank] else None for b in range(B)]
        lane_out = [b if jn[rank] else None for b in range(B)]
    else:
        active = [info[j][2] > 0 for j in range(world)]
        jp, jn = [False] * world, [False] * world
        prev = None
        for j in range(world):
            if not active[j]:
                continue
            if prev is not None:
                if info[j][3] < info[prev][4]:
                    raise ValueError(f"flashqla.distributed: seq_ids must not decrease across ranks: rank {prev} "
                                     f"ends with id {info[prev][4]}, rank {j} starts with {info[j][3]}")
                if info[j][3] == info[prev][4]:
                    jp[j] = jn[prev] = True
            prev = j
        n = len(ids)
        lane_in = [0 if jp[rank] else None]
        lane_out = [n - 1 if jn[rank] else None]
    starts, lens = _seq_bounds(B, T, vmeta)
    if B > 0 and T > 0:
        plan = _resolve_plan(segments, lens, spec, dev, sm_count, None, min_segment_len, max_segments)
        segs = list(plan.segments)
    else:
        segs = [(max(L, 0),) for L in lens]
    lane_pieces = {c for c in lane_in + lane_out if c is not None}
    chains = [c for c in range(len(lens)) if len(segs[c]) > 1 or c in lane_pieces]
    layout = _Layout(starts, segs, chains)
    eng = _Engine(backend, scale_f, bool(use_qk_l2norm_in_kernel), layout,
                  torch.float64 if info[0][11] else torch.float32)
    h0 = initial_state  # entries of continued pieces are ignored (they are lane_in chains)
    cfg = _DistConfig(eng, (B, T), len(lens), lane_in, lane_out, world, rank, active, jp, jn, group,
                      bool(output_final_state), spec.needs_grad, h0 is not None)
    o, ht = _DistFunction.apply(q, k, v, g, beta, h0, cfg)
    return o, (ht if output_final_state else None)
