"""GPU check of the per-chunk backward kernels of the TileLang backend, v1 vs v2
(``FLASHQLA_TILELANG_BWD_PAR``; v2 = ``chunk_bwd_dqk_v2_sm90`` / ``chunk_bwd_wy_v2_sm90``).

Run on an H200 / H100 (sm_90), one shot, no arguments (compiles go through ``get_kernel``, so
TileLang's disk cache is reused; ~4 kernels to build the first time)::

    python benchmarks/check_bwd_par_sm90.py

1. correctness vs the float64 oracle (``flashqla.testing.oracle``) on a small packed case (K = V = 128,
   Hqk / Hv = 2 / 4, L2 norm, h0 / ht): all six gradients of ``ops.backward`` with v1 and with v2;
2. for 16 / 32 heads, 32768 tokens (1 x 32768 dense and 4 x 8192 packed), bf16: runs the forward
   (save=True) once, then ``ops.backward`` with v1 and v2, records the exact launch arguments of the
   dqk / wy kernels, compares every v2 output with v1 (rel L2; outputs are NaN-poisoned first) and the
   six gradients, and times each kernel (median of 50, torch.cuda events).

Every step is wrapped: a failing kernel prints its error and the script goes on.
"""

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def step(name, fn):
    try:
        return fn()
    except Exception:
        print(f"[FAIL] {name}:\n{traceback.format_exc()}", flush=True)
        return None


def rel(x, y):
    x, y = x.double(), y.double()
    if not torch.isfinite(x).all():
        return float("inf")
    d = y.norm().item()
    return (x - y).norm().item() / d if d else (0.0 if x.norm().item() == 0 else float("inf"))


def run_backward(variant, fwd, shape, scale, l2norm, has_h0, do, dht, record=None):
    from flashqla.backends.tilelang import ops
    os.environ["FLASHQLA_TILELANG_BWD_PAR"] = variant
    real = ops.get_kernel

    def spy(name, builder, key):
        kern = real(name, builder, key)
        if record is None or not name.startswith(("bwd_dqk", "bwd_wy")):
            return kern

        def launch(*args):
            record[name.split("_sm90")[0].replace("_v2", "")] = (kern, args)
            return kern(*args)
        return launch

    ops.get_kernel = spy
    try:
        return ops.backward(fwd.q, fwd.k, fwd.v, fwd.beta, fwd.w, fwd.G, fwd.X, fwd.h, fwd.v_new, fwd.meta,
                            shape, scale, l2norm, has_h0, do, dht)
    finally:
        ops.get_kernel = real


def setup(B, T, Hqk, Hv, K, V, seqlens, l2norm, h0, dtype=torch.bfloat16, seed=0):
    from flashqla.backends.tilelang import ops
    from flashqla.testing import Case, make_inputs
    from flashqla.varlen import prepare_varlen
    case = Case("bench", Hqk, Hv, K, V, B=B, T=T, seqlens=seqlens, h0=h0, ht=True, l2norm=l2norm)
    inp = make_inputs(case, dtype, device="cuda", seed=seed)
    varlen = prepare_varlen(inp["cu_seqlens"]) if seqlens is not None else None
    Bq, Tq = inp["q"].shape[:2]
    scale = K ** -0.5
    fwd = ops.forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, inp["initial_state"], varlen,
                      True, l2norm, save=True)
    shape = (Bq, Tq, Hqk, Hv, K, V)
    return case, inp, fwd, shape, scale


NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def oracle_check():
    from flashqla.testing import TOLERANCES, oracle
    case, inp, fwd, shape, scale = setup(1, 0, 2, 4, 128, 128, (1, 70, 300, 1000, 64), True, True)
    ref = oracle(case, inp, grads=True)
    tol = TOLERANCES["bfloat16"]
    for variant in ("v1", "v2"):
        g = run_backward(variant, fwd, shape, scale, True, True, inp["do"], inp["dht"])
        torch.cuda.synchronize()
        errs = {n: rel(t, ref[n]) for n, t in zip(NAMES, g) if t is not None and n in ref}
        ok = all(errs[n] <= tol[n] for n in errs)
        print(f"oracle {variant}: {'ok ' if ok else 'BAD'} " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()),
              flush=True)


def time_kernel(kern, args, n=50):
    ts = []
    for _ in range(5):
        kern(*args)
    torch.cuda.synchronize()
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        kern(*args)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


# outputs (positions in the launch arguments) of each kernel
OUT_POS = {"bwd_dqk": (10, 11, 12, 13), "bwd_wy": (11, 12, 13, 14)}


def bench_case(label, B, T, seqlens):
    case, inp, fwd, shape, scale = setup(B, T, 16, 32, 128, 128, seqlens, False, False)
    rec = {"v1": {}, "v2": {}}
    grads = {}
    for variant in ("v1", "v2"):
        grads[variant] = step(f"{label} backward {variant}", lambda: run_backward(
            variant, fwd, shape, scale, False, False, inp["do"], None, rec[variant]))
        torch.cuda.synchronize()
    if grads["v1"] is not None and grads["v2"] is not None:
        print(f"{label} grads v2 vs v1: " + " ".join(
            f"{n}={rel(b, a):.1e}" for n, a, b in zip(NAMES, grads["v1"], grads["v2"]) if a is not None), flush=True)
    rows = []
    for kname in ("bwd_dqk", "bwd_wy"):
        if kname not in rec["v1"] or kname not in rec["v2"]:
            print(f"{label} {kname}: not recorded")
            continue
        k1, a1 = rec["v1"][kname]
        k2, a2 = rec["v2"][kname]
        # same inputs for both: the v1 launch's arguments; v2 writes into NaN-poisoned copies
        outs2 = list(a1)
        for p in OUT_POS[kname]:
            outs2[p] = torch.full_like(a1[p], float("nan"))
        def cmp():
            k1(*a1)
            k2(*outs2)
            torch.cuda.synchronize()
            return " ".join(f"o{p}={rel(outs2[p][torch.isfinite(a1[p])], a1[p][torch.isfinite(a1[p])]):.1e}"
                            for p in OUT_POS[kname])
        msg = step(f"{label} {kname} compare", cmp)
        t1 = step(f"{label} {kname} time v1", lambda: time_kernel(k1, a1))
        t2 = step(f"{label} {kname} time v2", lambda: time_kernel(k2, outs2))
        rows.append((kname, t1, t2, msg))
    for kname, t1, t2, msg in rows:
        f = lambda t: f"{t:7.3f}" if t is not None else "   fail"
        sp = f"{t1 / t2:5.2f}x" if t1 and t2 else "  -  "
        print(f"{label:22s} {kname:8s} v1 {f(t1)} ms  v2 {f(t2)} ms  {sp}  v2-v1 rel L2: {msg}", flush=True)


def main():
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return
    t0 = time.time()
    print(torch.cuda.get_device_name(), flush=True)
    step("oracle check", oracle_check)
    step("bench dense", lambda: bench_case("16/32 1x32768", 1, 32768, None))
    step("bench varlen", lambda: bench_case("16/32 4x8192 packed", 1, 0, (8192,) * 4))
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
