"""Would a CUDA graph of the windowed CP passes beat FlashQLA?  A device experiment (session 8 follow-up).

Session 8 measured windowed CP at 2/8 heads, one 32768-token sequence: 0.279 ms of kernels, but 2.35 ms of
eager wall time (the host path), against FlashQLA's 0.232 / 0.513 ms.  The op cannot capture its windowed
passes itself (their structure depends on the gates), but once a plan keeps its windows the passes are the
same on every call.  This probe captures them for one row and times, per call:

* ``graph``: the captured passes alone (graph replay, CUDA events);
* ``graph+io``: copy q, k, v, g, beta into the graph's static inputs, replay, clone o and the final state;
* ``graph+io+check``: the same plus the window-length launch and its read after the replay (what the op
  would do to stay exact);
* ``eager``: the op as it runs today (``context_parallel=N``), for comparison;
* ``plain``: the plain op in a CUDA graph.

It uses the op's internals (``flashqla.cp``), not a public API.

    python benchmarks/cp_graph_probe.py --rows 2/8:1x32768,4/16:1x32768,16/32:1x32768 --segments 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _time(fn) -> float:
    """Median ms per call of ``fn``, timed eagerly with CUDA events (the bench's timer, no graph of its own)."""
    from flashqla.cli.bench import time_cuda
    return time_cuda([fn], 0.05, 50, use_graph=False)["ms"]


def probe(row: str, segments: int, backend: str) -> dict:
    import flashqla
    import flashqla.cp as cp
    from flashqla.cli.cases import make_inputs
    from flashqla.validation import validate
    heads, sl = row.split(":")
    Hqk, Hv = (int(x) for x in heads.split("/"))
    n, L = (int(x) for x in sl.split("x"))
    x = make_inputs([L] * n, Hqk, Hv, dtype=torch.bfloat16, device="cuda", seed=1)
    meta = flashqla.prepare_varlen(x["cu_seqlens"])
    args = [x[k] for k in ("q", "k", "v", "g", "beta")]

    def op(*a, cp_=segments):
        with torch.no_grad():
            return flashqla.chunk_gated_delta_rule(*a, output_final_state=True, cu_seqlens=x["cu_seqlens"],
                                                   varlen_meta=meta, backend=backend, context_parallel=cp_)

    out = {"row": row, "segments": segments, "backend": backend}
    cp.clear_window_memo()
    ref = op(*args)                       # the plan's first call: the fixed structure, keeps the windows
    op(*args)
    out["eager_ms"] = _time(lambda: op(*args))
    (mkey, used), = [(k, v) for k, v in cp._WINDOW_MEMO.items()]
    out["windows"] = str(used)[:200]
    key = mkey[0] if used == (None, None) else mkey[0] + tuple(tuple(sorted((w or {}).items())) for w in used)
    prog = cp._CACHE[(key, mkey[1])][0]
    spec, scale, _ = validate(*args, None, None, True, False, x["cu_seqlens"], meta, needs_grad=False)
    eng = cp._Engine(backend, scale, False, None, torch.float32, base_spec=spec)
    cfg = cp._CPConfig(eng, prog, tuple(args[0].shape[:2]), True, False)
    static = [a.clone() for a in args]

    def passes():
        with torch.no_grad():
            return cp._CPFunction.apply(*static, None, cfg)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        passes()
        passes()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_s, ht_s = passes()
    graph.replay()
    torch.cuda.synchronize()
    out["graph_vs_eager_rel_err"] = float((o_s.float() - ref[0].float()).norm() / ref[0].float().norm())
    out["graph_ms"] = _time(graph.replay)

    def with_io():
        for s, a in zip(static, args):
            s.copy_(a)
        graph.replay()
        return o_s.clone(), ht_s.clone()

    out["graph_io_ms"] = _time(with_io)
    starts, lens = cp._seq_bounds(args[0].shape[0], args[0].shape[1], meta)
    plan_segs = mkey[0][1]

    def with_check():
        found = cp._window_counts(cp._pack(args[1]), cp._pack(args[3]), cp._pack(args[4]), False, starts,
                                  plan_segs)
        pending = cp._start_read(found[3])
        res = with_io()
        cp._finish_read(pending)
        return res

    out["graph_io_check_ms"] = _time(with_check)
    plain_graph = torch.cuda.CUDAGraph()
    op(*args, cp_=False)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(*args, cp_=False)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(plain_graph):
        op(*args, cp_=False)
    out["plain_graph_ms"] = _time(plain_graph.replay)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="2/8:1x32768,4/16:1x32768,16/32:1x32768")
    ap.add_argument("--segments", type=int, default=16)
    ap.add_argument("--backend", default="tilelang")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    results = []
    for row in args.rows.split(","):
        try:
            results.append(probe(row, args.segments, args.backend))
        except Exception as exc:  # one row's failure must not lose the others
            import traceback
            traceback.print_exc()
            results.append({"row": row, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
