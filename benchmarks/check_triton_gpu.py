"""One-shot GPU check of the triton backend: crash localisation, oracle check, forward kernel timings.

Run on the GPU machine from the repository root (about a minute; prints a short report)::

    python benchmarks/check_triton_gpu.py                       # everything, each part in its own process
    python benchmarks/check_triton_gpu.py --case crash          # only the failing case, stage by stage,
                                                                # in this process (for compute-sanitizer)
    compute-sanitizer --tool memcheck python benchmarks/check_triton_gpu.py --case crash
    python benchmarks/check_triton_gpu.py --case oracle         # bf16 case(s) vs the float64 oracle
    python benchmarks/check_triton_gpu.py --case bench          # per-kernel forward ms (do_bench)

The "crash" case is the one of ``tests/test_backend_triton.py -k diagnose``: bf16, seqlens (0, 1, 65, 300,
129) (cu_seqlens [0, 0, 1, 66, 366, 495]), Hqk/Hv 2/8, K = V = 128, fused q/k L2 norm, initial state,
forward + backward.  Every kernel launch is followed by ``torch.cuda.synchronize()`` (``ops.launch`` is
wrapped), so the first kernel that faults is named; outputs are checked for non-finite values stage by
stage.  In the default mode every part runs in a subprocess (a CUDA fault kills its context) and a failure
never stops the rest.  FLASHQLA_TRITON_TUNE is honoured (and varied by the default mode).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CRASH_SEQLENS = (0, 1, 65, 300, 129)
# --cpu-smoke (development only: checks this script's logic under TRITON_INTERPRET=1, fp32, tiny bench)
DEV, DTYPE_NAME, SMOKE = "cuda", "bfloat16", False


def _sync():
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def _wrap_launch(log: list, sync: bool):
    """Wrap ops.launch: synchronize after every kernel (naming the one that faults) and record
    (kernel name, registers, spills, shared memory) of each compiled kernel."""
    import torch

    from flashqla.backends.triton import ops

    orig = ops.launch

    def launch(kernel, grid, *args, **kwargs):
        name = getattr(getattr(kernel, "fn", None), "__name__", None) or getattr(kernel, "__name__", str(kernel))
        if sync:
            print(f"    launch {name} grid={tuple(grid)}", flush=True)
        ck = orig(kernel, grid, *args, **kwargs)
        if sync:
            try:
                _sync()
            except Exception as exc:
                raise RuntimeError(f"kernel {name} failed: {type(exc).__name__}: {exc}") from exc
        try:
            log.append((name, ck.n_regs, ck.n_spills, ck.metadata.shared))
        except Exception:
            log.append((name, None, None, None))
        return ck

    ops.launch = launch
    return orig


def _nonfinite(t) -> str:
    import torch

    if t is None:
        return "-"
    bad = ~torch.isfinite(t.float())
    n = int(bad.sum())
    return "finite" if n == 0 else f"{n} NON-FINITE of {t.numel()}"


def run_crash_case() -> int:
    """The failing case stage by stage; returns the number of failing stages."""
    import torch

    import flashqla
    from flashqla.backends.triton import ops
    from flashqla.testing import Case, make_inputs, poisoned_outputs

    log: list = []
    _wrap_launch(log, sync=True)
    dims = (2, 8, 128, 128) if not SMOKE else (1, 2, 64, 64)
    # feature bisection knobs (the default is the failing case): CHECK_L2=0 drops the fused L2 norm,
    # CHECK_DENSE=1 replaces the packed sequences by a dense batch of 2 x 300 tokens
    use_l2 = os.environ.get("CHECK_L2", "1") != "0"
    if os.environ.get("CHECK_DENSE", "0") == "1":
        case = Case("crash", *dims, B=2, T=300, l2norm=use_l2)
    else:
        case = Case("crash", *dims, seqlens=CRASH_SEQLENS, l2norm=use_l2)
    dt = getattr(torch, DTYPE_NAME)
    x = make_inputs(case, dt, DEV)
    meta = flashqla.prepare_varlen(x["cu_seqlens"]) if x["cu_seqlens"] is not None else None
    _sync()
    if meta is not None:
        print(f"  cu_seqlens={x['cu_seqlens'].tolist()} chunk_offsets={meta.chunk_offsets.tolist()} "
              f"chunk_indices={meta.chunk_indices.tolist()}", flush=True)
    scale = dims[2] ** -0.5
    q, k, v, g, beta, h0, do, dht = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "do", "dht"))
    res: dict = {}
    failures = 0

    def stage(name, fn):
        nonlocal failures
        t = time.time()
        try:
            out = fn()
            _sync()
            desc = ", ".join(f"{k_}: {_nonfinite(v_)}" for k_, v_ in out.items())
            bad = "NON-FINITE" in desc
            failures += bad
            print(f"  [{'BAD ' if bad else 'ok  '}] {name:<22} {time.time() - t:5.1f}s  {desc}", flush=True)
            res.update(out)
        except Exception as exc:
            failures += 1
            print(f"  [FAIL] {name:<22} {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            raise

    with poisoned_outputs(DEV):
        geo = ops.Geometry(q, v, meta)
        try:
            L2 = use_l2
            stage("prep(store_t)", lambda: dict(zip(("w", "u", "G", "Tm"),
                                                    ops.prep(geo, k, v, g, beta, L2, store_t=True))))
            stage("prep(fwd)", lambda: dict(zip(("w_fwd", "u_fwd", "G_fwd"),
                                                ops.prep(geo, k, v, g, beta, L2, store_t=False)[:3])))
            stage("state_fwd(unfused)", lambda: dict(zip(("h", "vn", "ht_u"), ops.state_fwd(
                geo, q, k, res["w"], res["u"], res["G"], h0, True, L2))))
            stage("output", lambda: dict(o_u=ops.output(geo, q, k, res["G"], res["h"], res["vn"], scale, L2,
                                                        dt)))
            # the two kernels that faulted on the H200 (run 6) last, the backward one first: a fault
            # leaves the CUDA context unusable, so each stage before it still reports
            stage("state_bwd", lambda: dict(zip(("dh", "dvn", "dh0"), ops.state_bwd(
                geo, q, k, res["w"], res["G"], do, dht, True, scale, L2))))
            stage("grads(dqk+wy)", lambda: dict(zip(("dq", "dk", "dv", "dbeta", "dg"), ops.grads(
                geo, q, k, v, beta, res["G"], res["Tm"], res["w"], res["u"], res["h"], [res["dh"]], res["vn"],
                res["dvn"], do, scale, L2))))
            stage("state_fwd(fused)", lambda: dict(zip(("o_f", "_", "ht_f"), ops.state_fwd(
                geo, q, k, res["w"], res["u"], res["G"], h0, True, L2, scale, fuse_output=True))))
        except Exception:
            print("  (stopped at the first failing stage: the CUDA context is unusable after a fault)")
            return max(failures, 1)
    if "o_f" in res and "o_u" in res:
        d = (res["o_f"].float() - res["o_u"].float()).abs().max().item()
        print(f"  fused vs 3-kernel o: max |diff| = {d:.3e}; w fwd==store_t: {torch.equal(res['w'], res['w_fwd'])}")
    print("  kernels (name, regs, spills, smem B): " + "; ".join(f"{n} {r}/{s}/{m}" for n, r, s, m in
                                                                 dict(((e[0], e) for e in log)).values()))
    return failures


def run_oracle() -> int:
    import math

    import torch

    import flashqla
    from flashqla.testing import Case, run_case

    bad = 0
    cases = [Case("crash", 2, 8, 128, 128, seqlens=CRASH_SEQLENS, l2norm=True),
             Case("no_len0", 2, 8, 128, 128, seqlens=(1, 65, 300, 129), l2norm=True),
             Case("dense_16_32", 16, 32, 128, 128, B=2, T=300, l2norm=True)]
    if SMOKE:
        cases = [Case("crash", 1, 2, 64, 64, seqlens=CRASH_SEQLENS, l2norm=True)]
    for case in cases:
        for dtype in (getattr(torch, DTYPE_NAME),):
            t = time.time()
            try:
                r = run_case(flashqla.chunk_gated_delta_rule, case, "triton", dtype, DEV, grads=True)
                errs = " ".join(f"{n}={e:.1e}" if math.isfinite(e) else f"{n}=NONFINITE"
                                for n, e in r.errors.items())
                bad += not r.ok
                print(f"  [{'ok  ' if r.ok else 'BAD '}] {case.name:<12} {time.time() - t:5.1f}s {errs}", flush=True)
            except Exception as exc:
                bad += 1
                print(f"  [FAIL] {case.name:<12} {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                if "illegal" in str(exc) or "CUDA error" in str(exc):
                    return bad
    return bad


def run_bench(rep_ms: int = 60) -> int:
    import torch
    import triton.testing

    import flashqla
    from flashqla.backends.triton import ops
    from flashqla.testing import Case, make_inputs

    log: list = []
    _wrap_launch(log, sync=False)
    Hqk, Hv, K, V = (16, 32, 128, 128) if not SMOKE else (1, 2, 64, 64)
    rows = (("1x32768", dict(seqlens=(32768,))), ("4x8192", dict(seqlens=(8192,) * 4))) if not SMOKE else \
        (("1x128", dict(seqlens=(128,))),)
    bad = 0
    for label, kw in rows:
        try:
            case = Case(label, Hqk, Hv, K, V, **kw)
            x = make_inputs(case, getattr(torch, DTYPE_NAME), DEV)
            meta = flashqla.prepare_varlen(x["cu_seqlens"]) if x["cu_seqlens"] is not None else None
            q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
            geo = ops.Geometry(q, v, meta)
            w, u, G, _ = ops.prep(geo, k, v, g, beta, False, store_t=False)
            h, vn, _ = ops.state_fwd(geo, q, k, w, u, G, h0, True, False)
            fns = {
                "prep": lambda: ops.prep(geo, k, v, g, beta, False, store_t=False),
                "prep(store_t)": lambda: ops.prep(geo, k, v, g, beta, False, store_t=True),
                "state+o fused": lambda: ops.state_fwd(geo, q, k, w, u, G, h0, True, False, 0.088,
                                                       fuse_output=True),
                "state unfused": lambda: ops.state_fwd(geo, q, k, w, u, G, h0, True, False),
                "output": lambda: ops.output(geo, q, k, G, h, vn, 0.088, False, q.dtype),
                "forward (auto)": lambda: ops.forward(q, k, v, g, beta, 0.088, h0, meta, True, False),
            }
            ms = {}
            for name, fn in fns.items():
                if SMOKE:
                    t = time.time()
                    fn()
                    ms[name] = (time.time() - t) * 1e3
                else:
                    ms[name] = triton.testing.do_bench(fn, warmup=10, rep=rep_ms)
            fused = ops.fuse_forward_output(geo, q.device)
            print(f"  {label:<9} " + "  ".join(f"{n}={t:.3f}" for n, t in ms.items())
                  + f"  | fused+prep={ms['prep'] + ms['state+o fused']:.3f}"
                  f" unfused+prep={ms['prep'] + ms['state unfused'] + ms['output']:.3f}  auto fuses: {fused}",
                  flush=True)
        except Exception as exc:
            bad += 1
            print(f"  [FAIL] bench {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    seen = dict(((e[0], e) for e in log)).values()
    print("  kernels (name, regs, spills, smem B): " + "; ".join(f"{n} {r}/{s}/{m}" for n, r, s, m in seen))
    print("  FLA bar (H200, same rows, 1x32768): kkt+solve 0.36 + recompute_w_u 0.34 + h 0.60 + o 0.57 = 1.93 ms")
    return bad


def _child(args: list, timeout: int, env_extra: dict | None = None) -> int:
    env = dict(os.environ, **(env_extra or {}))
    if SMOKE:
        args = [*args, "--cpu-smoke"]
    else:
        env.pop("TRITON_INTERPRET", None)
    t = time.time()
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=timeout)
        out = (p.stdout + ("\n" + p.stderr[-1500:] if p.returncode else "")).rstrip()
        rc = p.returncode
    except subprocess.TimeoutExpired as exc:
        out = ((exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")).rstrip()
        out += f"\n  TIMEOUT after {timeout}s"
        rc = 124
    print(out)
    print(f"  -> rc={rc} ({time.time() - t:.0f}s)", flush=True)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=("all", "crash", "oracle", "bench"), default="all")
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bisect-only", action="store_true",
                    help="only the crash case and its feature bisection (no oracle, no timings)")
    args = ap.parse_args()
    global DEV, DTYPE_NAME, SMOKE
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV, DTYPE_NAME, SMOKE = "cpu", "float32", True
    if args.case != "all":
        import torch

        if DEV == "cuda" and not torch.cuda.is_available():
            print("no CUDA device")
            return 2
        try:
            fn = {"crash": run_crash_case, "oracle": run_oracle, "bench": lambda: run_bench(args.rep_ms)}[args.case]
            return 1 if fn() else 0
        except Exception:
            traceback.print_exc()
            return 1

    import torch
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except Exception:
        commit = "?"
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    print(f"check_triton_gpu: {dev}, torch {torch.__version__}, triton {triton.__version__}, commit {commit}, "
          f"FLASHQLA_TRITON_TUNE={os.environ.get('FLASHQLA_TRITON_TUNE', '')!r}", flush=True)
    t0 = time.time()
    rcs = {}
    if args.bisect_only:
        for label, env in (("default", {}), ("CHECK_L2=0", {"CHECK_L2": "0"}),
                           ("CHECK_DENSE=1", {"CHECK_DENSE": "1"}),
                           ("8 warps", {"FLASHQLA_TRITON_TUNE": "fused.warps=8,bstate.warps=8"})):
            print(f"-- crash case, {label}", flush=True)
            rcs[label] = _child(["--case", "crash"], 25, env)
        print(f"== summary ({time.time() - t0:.0f}s): " + ", ".join(f"{k}: rc {v}" for k, v in rcs.items()))
        return 0
    print("== crash case, stage by stage (default tuning)", flush=True)
    rcs["crash"] = _child(["--case", "crash"], 30)
    if rcs["crash"]:
        # one pipeline stage everywhere: no prefetched loop iterations at all
        tune = "fused.stages=1,state.stages=1,bstate.stages=1,prep.stages=1,dqk.stages=1,wy.stages=1,output.stages=1"
        print(f"== crash case with FLASHQLA_TRITON_TUNE={tune}", flush=True)
        rcs["crash(stages=1)"] = _child(["--case", "crash"], 20, {"FLASHQLA_TRITON_TUNE": tune})
    print("== feature bisection of the crash case (L2 norm on/off x packed/dense)", flush=True)
    for l2, dense in (("0", "0"), ("1", "1"), ("0", "1")):
        print(f"-- CHECK_L2={l2} CHECK_DENSE={dense}", flush=True)
        rcs[f"crash(l2={l2},dense={dense})"] = _child(["--case", "crash"], 25, {"CHECK_L2": l2, "CHECK_DENSE": dense})
    print("-- 8 warps in the serial kernels", flush=True)
    rcs["crash(8 warps)"] = _child(["--case", "crash"], 25, {"FLASHQLA_TRITON_TUNE": "fused.warps=8,bstate.warps=8"})
    print("== oracle (bf16, forward + backward)", flush=True)
    rcs["oracle"] = _child(["--case", "oracle"], 25)
    print("== forward kernel timings (ms, do_bench), Hqk/Hv 16/32, K = V = 128, bf16", flush=True)
    rcs["bench"] = _child(["--case", "bench", "--rep-ms", str(args.rep_ms)], max(15, int(88 - (time.time() - t0))))
    print(f"== summary ({time.time() - t0:.0f}s): " + ", ".join(f"{k}: {'ok' if v == 0 else f'rc {v}'}"
                                                               for k, v in rcs.items()))
    return 0 if not any(rcs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
