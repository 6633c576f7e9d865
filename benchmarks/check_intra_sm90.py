"""GPU check of the TileLang forward stage 1 kernel (``chunk_intra_sm90.build_intra``), old vs new.

Run on an H200 / H100 (sm_90), one shot, no arguments needed (~30-60 s, most of it compiling)::

    python benchmarks/check_intra_sm90.py

It builds the current kernel (``build_intra``) and the former one (``build_intra_reference`` below, the
column-per-thread substitution this file keeps a copy of), compiling in parallel subprocesses that
fill TileLang's disk cache, then on packed varlen inputs (``cu_seqlens = [0, 1, 65, 300, 4133,
32768]``, Hqk / Hv = 16 / 32, K = V = 128, bf16, un-normalised k with the fused L2 norm):

* poisons w, u, G, X with NaN and checks that every element got written;
* compares w, u, G, X with a float64 torch computation of the same chunk math (rel L2 per output),
  and the new kernel with the old one;
* checks the padded-row contract exactly (rows past a sequence end: w = u = 0, G = G_last, X rows of
  the identity);
* times both kernels (``triton.testing.do_bench``, median; L2 flushed between runs) with and without
  the X output.

Every step is wrapped: a failing kernel prints its error and the script goes on (a CUDA fault that
poisons the context makes the later steps print errors too).  Options: ``--no-parallel`` compiles in
this process; ``--seqlens`` / ``--hqk`` / ``--hv`` change the case.
"""


import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CHUNK = 64
L2_EPS = 1e-6


# ----------------------------------------------------------------------------------------------------
# The former kernel, kept verbatim (apart from the import) as the baseline
# ----------------------------------------------------------------------------------------------------

def build_intra_reference(dtype: str, beta_dtype: str, K: int, V: int, l2norm: bool, save_x: bool,
                          threads: int = 128):
    import tilelang.language as T

    from flashqla.backends.tilelang._common import symbolic_sizes

    C = CHUNK
    acc = "float32"
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    XN = NC if save_x else T.dynamic("XN")
    XH = Hv if save_x else T.dynamic("XH")

    @T.prim_func
    def gdn_fwd_intra(
        k: T.Tensor((NT, Hqk, K), dtype),
        v: T.Tensor((NT, Hv, V), dtype),
        g: T.Tensor((NT, Hv), acc),
        beta: T.Tensor((NT, Hv), beta_dtype),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        w_out: T.Tensor((NC, Hv, C, K), dtype),
        u_out: T.Tensor((NC, Hv, C, V), dtype),
        G_out: T.Tensor((NC, Hv, C), acc),
        X_out: T.Tensor((XN, XH, C, C), acc),
        ratio: T.int32,
    ):
        with T.Kernel(NC, Hv, threads=threads) as (c, h):
            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, V), dtype)
            g_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            n_s = T.alloc_shared((C,), acc)
            At_s = T.alloc_shared((C, C), acc)
            Xw_s = T.alloc_shared((C, C), dtype)
            Xu_s = T.alloc_shared((C, C), dtype)
            w_s = T.alloc_shared((C, K), dtype)
            u_s = T.alloc_shared((C, V), dtype)
            kk_f = T.alloc_fragment((C, C), acc)
            w_f = T.alloc_fragment((C, K), acc)
            u_f = T.alloc_fragment((C, V), acc)
            bar = T.alloc_barrier(threads)

            seq = chunk_indices[c, 0]
            bos = cu_seqlens[seq] + chunk_indices[c, 1] * C
            eos = cu_seqlens[seq + 1]
            hq = h // ratio

            T.tma_copy(k[bos:bos + C, hq, :], k_s, barrier=bar)
            T.tma_copy(v[bos:bos + C, h, :], v_s, barrier=bar)
            T.mbarrier_arrive(bar)
            for r in T.Parallel(C):
                g_s[r] = T.if_then_else(bos + r < eos, g[bos + r, h], 0.0)
                b_s[r] = T.if_then_else(bos + r < eos, T.cast(beta[bos + r, h], acc), 0.0)
            T.cumsum(g_s, dim=0)
            T.mbarrier_wait_parity(bar, 0)

            T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
            if l2norm:
                for r, j in T.Parallel(C, C):
                    if r == j:
                        n_s[r] = T.rsqrt(kk_f[r, j] + L2_EPS)
                for r, j in T.Parallel(C, C):
                    At_s[j, r] = T.if_then_else(
                        r > j, kk_f[r, j] * b_s[r] * n_s[r] * n_s[j] * T.exp(g_s[r] - g_s[j]), 0.0)
            else:
                for r in T.Parallel(C):
                    n_s[r] = 1.0
                for r, j in T.Parallel(C, C):
                    At_s[j, r] = T.if_then_else(r > j, kk_f[r, j] * b_s[r] * T.exp(g_s[r] - g_s[j]), 0.0)

            tx = T.get_thread_binding()
            if tx < C:
                x = T.alloc_local((C,), acc)
                for m in T.unroll(C):
                    x[m] = T.if_then_else(m == tx, 1.0, 0.0)
                for m in T.unroll(C):
                    for r in T.unroll(m + 1, C):
                        x[r] = x[r] - At_s[m, r] * x[m]
                cw = b_s[tx] * T.exp(g_s[tx]) * n_s[tx]
                cb = b_s[tx]
                for r in T.unroll(C):
                    Xw_s[r, tx] = T.cast(x[r] * cw, dtype)
                    Xu_s[r, tx] = T.cast(x[r] * cb, dtype)
                if save_x:
                    for r in T.unroll(C):
                        X_out[c, h, r, tx] = x[r]

            T.gemm(Xw_s, k_s, w_f, clear_accum=True)
            T.gemm(Xu_s, v_s, u_f, clear_accum=True)
            T.copy(w_f, w_s)
            T.copy(u_f, u_s)
            T.copy(w_s, w_out[c, h, :, :])
            T.copy(u_s, u_out[c, h, :, :])
            T.copy(g_s, G_out[c, h, :])

    return gdn_fwd_intra


# ----------------------------------------------------------------------------------------------------
# Compilation (parallel subprocesses fill TileLang's disk cache; this process then loads from it)
# ----------------------------------------------------------------------------------------------------

TARGET = {"kind": "cuda", "arch": "sm_90a"}


def _builder(which):
    if which == "new":
        from flashqla.backends.tilelang.chunk_intra_sm90 import build_intra
        return build_intra
    return build_intra_reference


def _compile(which, key):
    import tilelang
    return tilelang.compile(_builder(which)(*key), out_idx=None, target=TARGET)


def _compile_child(which, key):
    t0 = time.perf_counter()
    try:
        _compile(which, key)
        return which, key, None, time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        return which, key, f"{type(e).__name__}: {e}", time.perf_counter() - t0


def compile_all(jobs, parallel):
    if parallel and len(jobs) > 1:
        import multiprocessing as mp
        try:
            with mp.get_context("spawn").Pool(len(jobs)) as pool:
                for which, key, err, dt in pool.starmap(_compile_child, jobs):
                    print(f"  [precompile] {which:3s} save_x={key[5]!s:5s} {dt:5.1f}s "
                          f"{'ok' if err is None else 'FAILED: ' + err.splitlines()[0][:200]}")
        except Exception as e:  # noqa: BLE001
            print(f"  [precompile] parallel compile failed ({type(e).__name__}: {e}); compiling here")
    kernels = {}
    for which, key in jobs:
        t0 = time.perf_counter()
        try:
            kernels[(which, key[5])] = _compile(which, key)
            print(f"  [compile] {which:3s} save_x={key[5]!s:5s} {time.perf_counter() - t0:5.1f}s")
        except Exception:  # noqa: BLE001
            print(f"  [compile] {which} save_x={key[5]} FAILED:\n{traceback.format_exc(limit=3)}")
    return kernels


# ----------------------------------------------------------------------------------------------------
# Inputs and the float64 reference
# ----------------------------------------------------------------------------------------------------

def make_case(seqlens, Hqk, Hv, K, V, dev):
    import torch

    import flashqla
    from flashqla.cli.cases import make_inputs

    x = make_inputs(seqlens, Hqk=Hqk, Hv=Hv, K=K, V=V, dtype=torch.bfloat16, device=dev,
                    normalize_qk=False, seed=0)
    NT = sum(seqlens)
    meta = flashqla.prepare_varlen(x["cu_seqlens"])
    return dict(
        k=x["k"].reshape(NT, Hqk, K).contiguous(), v=x["v"].reshape(NT, Hv, V).contiguous(),
        g=x["g"].reshape(NT, Hv).float().contiguous(), beta=x["beta"].reshape(NT, Hv).contiguous(),
        cu=meta.cu_seqlens, ci=meta.chunk_indices, cu_host=list(meta.cu_seqlens_cpu),
        NT=NT, NC=meta.total_chunks, Hqk=Hqk, Hv=Hv, K=K, V=V)


def reference(case, l2norm=True):
    """float64 w, u, G, X of every (chunk, head), with the kernel's tile semantics (rows past the
    sequence end: g = beta = 0; rows past the tensor: zero k / v)."""
    import torch

    f64 = torch.float64
    NT, Hv, Hqk = case["NT"], case["Hv"], case["Hqk"]
    ratio = Hv // Hqk
    cu, ci = case["cu"].long(), case["ci"].long()
    bos = cu[ci[:, 0]] + ci[:, 1] * CHUNK
    eos = cu[ci[:, 0] + 1]
    rows = bos[:, None] + torch.arange(CHUNK, device=cu.device)          # [NC, 64]
    valid, inb = rows < eos[:, None], rows < NT
    rc = rows.clamp(max=NT - 1)
    kk = torch.where(inb[:, :, None, None], case["k"][rc].to(f64), 0.)    # [NC, 64, Hqk, K]
    kk = kk.repeat_interleave(ratio, dim=2).permute(0, 2, 1, 3)          # [NC, Hv, 64, K]
    vv = torch.where(inb[:, :, None, None], case["v"][rc].to(f64), 0.).permute(0, 2, 1, 3)
    g = torch.where(valid[:, :, None], case["g"][rc].to(f64), 0.).transpose(1, 2)      # [NC, Hv, 64]
    b = torch.where(valid[:, :, None], case["beta"][rc].to(f64), 0.).transpose(1, 2)
    G = g.cumsum(-1)
    KK = kk @ kk.transpose(-1, -2)
    n = torch.rsqrt(torch.diagonal(KK, dim1=-2, dim2=-1) + L2_EPS) if l2norm else torch.ones_like(G)
    idx = torch.arange(CHUNK, device=cu.device)
    strict = idx[:, None] > idx[None, :]
    D = torch.where(strict, G[..., :, None] - G[..., None, :], 0.)
    A = torch.where(strict, KK * b[..., :, None] * n[..., :, None] * n[..., None, :] * torch.exp(D), 0.)
    eye = torch.eye(CHUNK, dtype=f64, device=cu.device)
    X = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    w = (X * (b * torch.exp(G) * n)[..., None, :]) @ kk
    u = (X * b[..., None, :]) @ vv
    nvalid = (eos - bos).clamp(max=CHUNK)                                # valid rows per chunk
    return dict(w=w, u=u, G=G, X=X, nvalid=nvalid)


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------

def launch(kern, case, save_x, outs):
    kern(case["k"], case["v"], case["g"], case["beta"], case["cu"], case["ci"],
         outs["w"], outs["u"], outs["G"], outs["X"], case["Hv"] // case["Hqk"])


def alloc_outputs(case, save_x, fill):
    import torch
    dev = case["k"].device
    NC, Hv, K, V = case["NC"], case["Hv"], case["K"], case["V"]
    o = dict(w=torch.empty(NC, Hv, CHUNK, K, dtype=torch.bfloat16, device=dev),
             u=torch.empty(NC, Hv, CHUNK, V, dtype=torch.bfloat16, device=dev),
             G=torch.empty(NC, Hv, CHUNK, dtype=torch.float32, device=dev),
             X=torch.empty((NC, Hv, CHUNK, CHUNK) if save_x else (1, 1, CHUNK, CHUNK),
                           dtype=torch.float32, device=dev))
    for t in o.values():
        t.fill_(fill)
    return o


def check_outputs(name, outs, ref, save_x):
    """Prints the unwritten-element counts, rel L2 vs float64, and the padded-row contract."""
    import torch
    res = {}
    names = ["w", "u", "G"] + (["X"] if save_x else [])
    for key in names:
        t = outs[key]
        nan = int(torch.isnan(t).sum())
        e = rel_l2(t, ref[key])
        res[key] = (nan, e)
    # padded rows of partial chunks
    nv = ref["nvalid"]
    bad = []
    for c in torch.nonzero(nv < CHUNK).flatten().tolist():
        m = int(nv[c])
        if outs["w"][c, :, m:].abs().max() != 0 or outs["u"][c, :, m:].abs().max() != 0:
            bad.append(f"chunk {c}: w/u not zero past row {m}")
        Gc = outs["G"][c]
        # (equal up to the scan's association order: the kernel's cumsum is a parallel scan)
        if m > 0 and not torch.allclose(Gc[:, m:], Gc[:, m - 1:m].expand(-1, CHUNK - m), rtol=1e-6, atol=1e-6):
            bad.append(f"chunk {c}: G != G_last past row {m}")
        if save_x:
            eye = torch.eye(CHUNK, device=Gc.device)[m:]
            if not torch.equal(outs["X"][c, :, m:], eye.expand(Gc.shape[0], -1, -1)):
                bad.append(f"chunk {c}: X rows past {m} are not identity rows")
    return res, bad


TOL = {"w": 8e-3, "u": 8e-3, "G": 1e-5, "X": 1e-5}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlens", default="1,64,235,3833,28635",
                    help="comma-separated sequence lengths (default: cu_seqlens [0,1,65,300,4133,32768])")
    ap.add_argument("--hqk", type=int, default=16)
    ap.add_argument("--hv", type=int, default=32)
    ap.add_argument("--no-parallel", action="store_true", help="compile in this process only")
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()

    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    cap = torch.cuda.get_device_capability()
    print(f"device: {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}")
    K = V = 128
    t_start = time.perf_counter()
    jobs = [(w, ("bfloat16", "bfloat16", K, V, True, s)) for w in ("new", "old") for s in (True, False)]
    kernels = compile_all(jobs, not args.no_parallel)
    print(f"  compiled {len(kernels)}/{len(jobs)} kernels in {time.perf_counter() - t_start:.1f}s")

    seqlens = [int(s) for s in args.seqlens.split(",")]
    dev = torch.device("cuda")
    case = make_case(seqlens, args.hqk, args.hv, K, V, dev)
    print(f"case: cu_seqlens {case['cu_host']}  Hqk/Hv {args.hqk}/{args.hv}  K=V={K}  bf16  "
          f"chunks {case['NC']}  grid {case['NC']}x{args.hv}")
    ref = reference(case)
    torch.cuda.synchronize()

    results = {}
    status = 0
    for which in ("new", "old"):
        for save_x in (True, False):
            kern = kernels.get((which, save_x))
            if kern is None:
                print(f"{which:3s} save_x={save_x!s:5s}: not compiled")
                status = 1
                continue
            try:
                outs = alloc_outputs(case, save_x, float("nan"))
                launch(kern, case, save_x, outs)
                torch.cuda.synchronize()
                res, bad = check_outputs(which, outs, ref, save_x)
                results[(which, save_x)] = outs
                line = "  ".join(f"{k}: rel {e:.2e} nan {n}" for k, (n, e) in res.items())
                ok = all(n == 0 and e < TOL[k] for k, (n, e) in res.items()) and not bad
                print(f"{which:3s} save_x={save_x!s:5s} vs float64: {line}  "
                      f"padded rows {'ok' if not bad else 'BAD'}  -> {'PASS' if ok else 'FAIL'}")
                for b in bad[:5]:
                    print("    " + b)
                if which == "new" and not ok:
                    status = 1
            except Exception:  # noqa: BLE001
                status = 1
                print(f"{which:3s} save_x={save_x!s:5s}: kernel FAILED\n{traceback.format_exc(limit=4)}")

    for save_x in (True, False):
        a, b = results.get(("new", save_x)), results.get(("old", save_x))
        if a is not None and b is not None:
            keys = ["w", "u", "G"] + (["X"] if save_x else [])
            print(f"new vs old (save_x={save_x!s:5s}): " +
                  "  ".join(f"{k}: rel {rel_l2(a[k], b[k]):.2e}" for k in keys))

    if not args.no_timing:
        try:
            from triton.testing import do_bench
        except Exception:  # noqa: BLE001
            do_bench = None
        NT, NC, Hv, Hqk = case["NT"], case["NC"], case["Hv"], case["Hqk"]
        print(f"\n{'kernel':8s}{'save_x':>8s}{'median ms':>12s}{'GB/s':>9s}")
        for save_x in (False, True):
            nbytes = (NT * Hqk * K * 2 + NT * Hv * V * 2 + NT * Hv * 8          # k, v, g, beta in
                      + NC * Hv * CHUNK * (K + V) * 2 + NC * Hv * CHUNK * 4     # w, u, G out
                      + (NC * Hv * CHUNK * CHUNK * 4 if save_x else 0))       # X out
            for which in ("old", "new"):
                kern = kernels.get((which, save_x))
                if kern is None:
                    continue
                try:
                    outs = alloc_outputs(case, save_x, 0.0)
                    fn = lambda: launch(kern, case, save_x, outs)  # noqa: E731
                    if do_bench is not None:
                        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
                    else:
                        for _ in range(5):
                            fn()
                        ts = []
                        for _ in range(50):
                            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
                            s.record(); fn(); e.record(); torch.cuda.synchronize()
                            ts.append(s.elapsed_time(e))
                        ms = sorted(ts)[len(ts) // 2]
                    print(f"{which:8s}{save_x!s:>8s}{ms:12.4f}{nbytes / ms / 1e6:9.0f}")
                except Exception:  # noqa: BLE001
                    status = 1
                    print(f"{which:8s}{save_x!s:>8s}  timing FAILED: {traceback.format_exc(limit=2)}")
    print(f"total {time.perf_counter() - t_start:.1f}s; {'OK' if status == 0 else 'PROBLEMS (see above)'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
