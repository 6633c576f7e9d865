"""flashqla.distributed across real processes: 2 and 3 gloo ranks on this machine (NCCL with >= 2 GPUs).

Each worker builds the same global problem, takes its slice, runs chunk_gated_delta_rule_distributed forward
and backward and saves its local results.  The parent checks them against the same problem computed in one
process, piece after piece with the state handed over (float64 oracle, and the plain op): outputs, the
per-piece end states (hand-over states included, with their own random cotangents), every gradient.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Optional

import pytest
import torch

from flashqla.testing import Case, make_inputs, rel_l2

TOL = 1e-5
TIMEOUT_S = 150


@dataclass(frozen=True)
class DCase:
    name: str
    splits: tuple                     # tokens per rank (dense: time steps of every sequence)
    B: int = 1
    seqlens: Optional[tuple] = None   # varlen (global, packed)
    Hqk: int = 1
    Hv: int = 2
    K: int = 32
    V: int = 32
    h0: bool = True
    ht: bool = True
    l2norm: bool = False
    gate: str = "logsigmoid"
    segments: object = None           # local segments (intra-rank CP)

    @property
    def world(self):
        return len(self.splits)

    def case(self) -> Case:
        if self.seqlens is not None:
            return Case(self.name, self.Hqk, self.Hv, self.K, self.V, seqlens=self.seqlens, h0=self.h0,
                        ht=self.ht, l2norm=self.l2norm, gate=self.gate)
        return Case(self.name, self.Hqk, self.Hv, self.K, self.V, B=self.B, T=sum(self.splits), h0=self.h0,
                    ht=self.ht, l2norm=self.l2norm, gate=self.gate)


CASES_2 = [
    DCase("dense_one_seq", (130, 170)),
    DCase("varlen_straddle_gva_l2norm_strong", (200, 270), seqlens=(50, 330, 90), Hqk=1, Hv=4, l2norm=True,
          gate="strong", segments=2),
    DCase("dense_b2_rank0_empty_noh0", (0, 200), B=2, h0=False),
]
CASES_3 = [
    DCase("varlen_spans_3_ranks_zero_decay", (180, 200, 290), seqlens=(40, 500, 30, 100), gate="zero",
          segments=2),
    DCase("dense_middle_empty_segments", (100, 0, 160), segments=2),
    DCase("varlen_empty_rank_no_ht", (150, 0, 170), seqlens=(120, 200), ht=False),
]


def _inputs(dc: DCase):
    x = make_inputs(dc.case(), torch.float32, seed=11)
    if dc.gate == "logsigmoid":  # one head without decay, next to decaying ones
        x["g"][..., 0] = 0.0
    return x


def _layout(dc: DCase):
    """Per rank: (token range (a, b), [(seq id, global start, length)] of its pieces)."""
    out, a = [], 0
    for n in dc.splits:
        b = a + n
        if dc.seqlens is None:
            pieces = [(s, a, n) for s in range(dc.B)]
        else:
            pieces, s0 = [], 0
            for sid, L in enumerate(dc.seqlens):
                lo, hi = max(a, s0), min(b, s0 + L)
                if hi > lo:
                    pieces.append((sid, lo, hi - lo))
                s0 += L
        out.append(((a, b), pieces))
        a = b
    return out


def _piece_dht(dc: DCase):
    """A random end-state cotangent for every piece of every rank (hand-over states included)."""
    gen = torch.Generator().manual_seed(5)
    return [[torch.randn(dc.Hv, dc.K, dc.V, generator=gen) for _ in pieces] for _, pieces in _layout(dc)]


def _local(dc: DCase, x, rank):
    (a, b), pieces = _layout(dc)[rank]
    t = {n: x[n][:, a:b] for n in ("q", "k", "v", "g", "beta", "do")}
    kw = {}
    if dc.seqlens is not None:
        cu = [0]
        for _, _, L in pieces:
            cu.append(cu[-1] + L)
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
        kw["seq_ids"] = [sid for sid, _, _ in pieces]
        h0 = x["initial_state"][[sid for sid, _, _ in pieces]] if dc.h0 else None
    else:
        h0 = x["initial_state"] if dc.h0 else None
    dht = torch.stack(_piece_dht(dc)[rank], 0) if pieces else torch.zeros(0, dc.Hv, dc.K, dc.V)
    return t, h0, kw, dht


def _worker(rank, world, port, cases, backends, outdir, dist_backend):
    try:
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.set_num_threads(1)
        import torch.distributed as dist
        from flashqla.distributed import chunk_gated_delta_rule_distributed
        dev = torch.device("cuda", rank) if dist_backend == "nccl" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=TIMEOUT_S - 30))
        results = {}
        for backend, dc in [(b, c) for b in backends for c in cases]:
            x = _inputs(dc)
            t, h0, kw, dht = _local(dc, x, rank)
            leaves = [t[n].to(dev).requires_grad_() for n in ("q", "k", "v", "g", "beta")]
            h0 = None if h0 is None else h0.to(dev).requires_grad_()
            if "cu_seqlens" in kw:
                kw["cu_seqlens"] = kw["cu_seqlens"].to(dev)
            o, ht = chunk_gated_delta_rule_distributed(*leaves, initial_state=h0, output_final_state=dc.ht,
                                                       use_qk_l2norm_in_kernel=dc.l2norm, backend=backend,
                                                       segments=dc.segments, **kw)
            outs, couts = [o], [t["do"].to(dev)]
            if dc.ht:
                outs.append(ht)
                couts.append(dht.to(dev))
            wrt = leaves + ([h0] if h0 is not None else [])
            grads = torch.autograd.grad(outs, wrt, couts, allow_unused=True)
            res = {"o": o.detach().cpu(), "ht": None if ht is None else ht.detach().cpu()}
            for n, gr, w in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, wrt):
                res[n] = (torch.zeros_like(w) if gr is None else gr).detach().cpu()
            results[(backend, dc.name)] = res
        dist.barrier()
        dist.destroy_process_group()
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        sys.exit(1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world, cases, backends, dist_backend="gloo"):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, cases, backends, outdir, dist_backend))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join(5)
        errs = []
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.err")
            if os.path.exists(path):
                errs.append(f"rank {r}:\n" + open(path).read())
        assert not hung, f"ranks {hung} still running after {TIMEOUT_S} s (killed)\n" + "\n".join(errs)
        assert not errs and all(p.exitcode == 0 for p in procs), "\n".join(errs) or \
            f"exit codes {[p.exitcode for p in procs]}"
        return [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]


def _chained(dc: DCase, x, fn, dtype):
    """The whole problem in one process, piece after piece in rank order, each piece started from the
    previous piece's end state; loss with every piece's o and end-state cotangent.  Returns per-rank
    expected results."""
    lay = _layout(dc)
    dhts = _piece_dht(dc)
    leaves = {n: x[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    h0 = x["initial_state"].detach().to(dtype).requires_grad_() if dc.h0 else None
    nseq = dc.B if dc.seqlens is None else len(dc.seqlens)
    state = [None if h0 is None else h0[s] for s in range(nseq)]
    started = [False] * nseq
    o_parts, ends, loss = [], [], 0.0
    for r, ((a, b), pieces) in enumerate(lay):
        o_rank, end_rank = [], []
        for i, (sid, s, L) in enumerate(pieces):
            bi = sid if dc.seqlens is None else 0
            sl = slice(s, s + L)
            S0 = state[sid]
            if L == 0:
                o_p = leaves["v"][bi:bi + 1, sl]
                S1 = S0 if S0 is not None else torch.zeros(dc.Hv, dc.K, dc.V, dtype=dtype)
            else:
                o_p, S1 = fn(leaves["q"][bi:bi + 1, sl], leaves["k"][bi:bi + 1, sl], leaves["v"][bi:bi + 1, sl],
                             leaves["g"][bi:bi + 1, sl], leaves["beta"][bi:bi + 1, sl],
                             initial_state=None if S0 is None else S0[None], output_final_state=True,
                             use_qk_l2norm_in_kernel=dc.l2norm)
                S1 = S1[0]
            state[sid] = S1
            started[sid] = True
            loss = loss + (o_p * x["do"][bi:bi + 1, sl].to(dtype)).sum()
            if dc.ht:
                loss = loss + (S1 * dhts[r][i].to(dtype)).sum()
            o_rank.append(o_p)
            end_rank.append(S1)
        o_parts.append(o_rank)
        ends.append(end_rank)
    wrt = list(leaves.values()) + ([h0] if h0 is not None else [])
    grads = dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), torch.autograd.grad(loss, wrt)))
    exp = []
    for r, ((a, b), pieces) in enumerate(lay):
        if not pieces:
            o_r = torch.zeros(1, 0, dc.Hv, dc.V, dtype=dtype)
        else:
            o_r = torch.cat(o_parts[r], 1 if dc.seqlens is not None else 0)
        e = {"o": o_r.detach()}
        if dc.ht:
            e["ht"] = torch.stack(ends[r], 0).detach() if pieces else torch.zeros(0, dc.Hv, dc.K, dc.V)
        for n in ("dq", "dk", "dv", "dg", "dbeta"):
            e[n] = grads[n][:, a:b]
        if h0 is not None:
            first = []
            for sid, s, L in pieces:
                continued = r > 0 and (dc.seqlens is None or _continues(dc, r, sid))
                first.append(torch.zeros_like(grads["dh0"][sid]) if continued else grads["dh0"][sid])
            e["dh0"] = torch.stack(first, 0) if first else torch.zeros(0, dc.Hv, dc.K, dc.V)
        exp.append(e)
    return exp


def _continues(dc: DCase, r: int, sid: int) -> bool:
    """Does sequence sid have tokens on a rank before r?"""
    return any(p[0] == sid for rr in range(r) for p in _layout(dc)[rr][1])


def _oracle_fn(q, k, v, g, beta, **kw):
    from flashqla.reference import recurrent_gated_delta_rule_ref
    return recurrent_gated_delta_rule_ref(q, k, v, g, beta, compute_dtype=torch.float64, **kw)


def _plain_fn(backend):
    def fn(q, k, v, g, beta, **kw):
        import flashqla
        return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, backend=backend, **kw)
    return fn


def _check(dc, got, backends):
    x = _inputs(dc)
    n0 = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        oracle = _chained(dc, x, _oracle_fn, torch.float64)
        for backend in backends:
            plain = _chained(dc, x, _plain_fn(backend), torch.float32)
            for r in range(dc.world):
                mine = got[r][(backend, dc.name)]
                for ref, what in ((oracle, "float64 oracle"), (plain, f"single-process {backend} op")):
                    errs = {n: rel_l2(mine[n], ref[r][n]) for n in ref[r] if ref[r][n].numel()}
                    bad = {n: e for n, e in errs.items() if not e <= TOL}
                    assert not bad, f"{backend} {dc.name} rank {r} vs {what}: {bad} (all {errs})"
                    for n in ref[r]:
                        assert mine[n].shape == ref[r][n].shape, (backend, dc.name, r, n)
    finally:
        torch.set_num_threads(n0)


def _backends():
    from flashqla.dispatch import get_backend
    out = ["reference"]
    if get_backend("cpu").available()[0]:
        out.append("cpu")
    return out


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (3, CASES_3)], ids=["2ranks", "3ranks"])
def test_gloo_matches_single_process(world, cases):
    backends = _backends()
    got = _launch(world, cases, backends)
    for dc in cases:
        _check(dc, got, backends)


def test_single_process_without_group_is_cp():
    """No process group: the op is single-device CP over the local pieces (world of one)."""
    dc = DCase("alone", (300,), seqlens=(100, 200), segments=[1, 3])
    x = _inputs(dc)
    t, h0, kw, dht = _local(dc, x, 0)
    from flashqla.distributed import chunk_gated_delta_rule_distributed
    leaves = [t[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    h0 = h0.clone().requires_grad_()
    o, ht = chunk_gated_delta_rule_distributed(*leaves, initial_state=h0, output_final_state=True,
                                               backend="reference", segments=dc.segments, **kw)
    grads = torch.autograd.grad([o, ht], leaves + [h0], [t["do"], dht])
    got = [{("reference", dc.name): dict(zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), [o, ht, *grads]))}]
    _check(dc, got, ["reference"])
    with pytest.raises(ValueError, match="seq_ids"):
        chunk_gated_delta_rule_distributed(*leaves, cu_seqlens=kw["cu_seqlens"], backend="reference")
    with pytest.raises(ValueError, match="increasing"):
        chunk_gated_delta_rule_distributed(*leaves, cu_seqlens=kw["cu_seqlens"], seq_ids=[1, 1],
                                           backend="reference")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA devices for NCCL")
def test_nccl_matches_single_process():
    cases = [replace(CASES_2[0], splits=(1030, 1700)), replace(CASES_2[1], splits=(600, 900),
                                                                 seqlens=(150, 1000, 350))]
    got = _launch(2, cases, ["reference"], dist_backend="nccl")
    for dc in cases:
        _check(dc, got, ["reference"])
