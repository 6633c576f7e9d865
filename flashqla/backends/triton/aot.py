"""Compile-only checks of the Triton kernels for a GPU target, on a machine without a GPU.

``python -m flashqla.backends.triton.aot [--arch 90 80] [--dtype bfloat16] [--head-dim 128]``
compiles every kernel of this backend with its default launch configuration (``ops.tune``) through
Triton's ahead-of-time path and ptxas (both ship in the triton wheel), and prints registers, local
memory (stack: spills) and shared memory per kernel.  Exit status 1 when a kernel fails to compile or
needs more shared memory than the smallest GPU of that arch family offers.

Must run with TRITON_INTERPRET unset (interpreted kernels cannot be compiled); the tests call it in a
subprocess.  This is a development tool: nothing at run time depends on it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

# the smallest shared memory per block of each family we claim (bytes): sm_8x includes sm_86/89
SMEM_LIMIT = {80: 99 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_PTR_FP32 = {"g_ptr", "beta_ptr", "G_ptr", "h0_ptr", "ht_ptr", "dht_ptr", "dh0_ptr", "dq_ptr", "dk_ptr", "dka_ptr",
             "dGa_ptr", "dbeta_ptr", "dg_ptr"}
_PTR_I32 = {"cu_ptr", "cidx_ptr", "coff_ptr", "ord_ptr", "seg_ptr", "walk_ptr"}
_SCALAR_F32 = {"scale"}
_DT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _signature(fn, consts: dict, dt: str) -> tuple[dict, dict]:
    missing = [p.name for p in getattr(fn, "params", ()) if getattr(p, "is_constexpr", False) and p.name not in consts]
    if missing:
        # a constexpr left out would become a runtime i32 argument (and compile another kernel, or fail)
        raise ValueError(f"{fn.__name__}: constexprs not given: {missing}")
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name in _PTR_FP32 else "*i32" if name in _PTR_I32 else f"*{dt}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in _SCALAR_F32 else "i32"
    return sig, attrs


def _variants(K: int, V: int, ieee: bool, arch: int = 90):
    """(label, kernel, constexprs, launch config) for every kernel with all features on, as launched on
    ``sm_<arch>`` (the three-stage state gradient only where a block gets >= 160 KB, as ops._bstate_cfg decides;
    the smallest sm_8x GPUs give 99 KB)."""
    from . import chunk_bwd_grads, chunk_bwd_state, chunk_output, chunk_prep, chunk_state, ops

    feat = dict(K=K, V=V, IS_VARLEN=True, USE_L2=True, IEEE=ieee)

    def cfg(name, bv_default=None):
        c = dict(ops.tune(name))
        bv = c.get("bv") or bv_default or V
        warps = c.get("warps") or (4 if bv <= 32 else 8)
        return min(bv, V), dict(num_warps=warps, num_stages=1 if ieee else (c.get("stages") or 2))

    prep_launch = dict(cfg("prep")[1], num_warps=ops.tune("prep")["warps"] or (8 if ieee else 4))
    prep_bw = min(ops.tune("prep")["bv"], K, V)
    # (every constexpr given: one left out would be compiled as a runtime i32 argument)
    out = [("prep", chunk_prep.chunk_prep_kernel,
            dict(feat, STORE_T=True, BW=prep_bw, TB_ONLY=False, LOAD_T=False, DV_LOCAL=False), prep_launch),
           ("prep (Tb only)", chunk_prep.chunk_prep_kernel,
            dict(feat, STORE_T=False, BW=prep_bw, TB_ONLY=True, LOAD_T=False, DV_LOCAL=False), prep_launch),
           ("prep (w, u from the kept inverse)", chunk_prep.chunk_prep_kernel,
            dict(feat, STORE_T=False, BW=prep_bw, TB_ONLY=False, LOAD_T=True, DV_LOCAL=False), prep_launch),
           ("prep (kept inverse + local dv)", chunk_prep.chunk_prep_kernel,
            dict(feat, STORE_T=False, BW=prep_bw, TB_ONLY=False, LOAD_T=True, DV_LOCAL=True), prep_launch)]
    bv, launch = cfg("fused")
    # FROM_TB: the inference forward's recurrence (ops.use_tb_forward), fused and unfused
    for tb in (False, True):
        out.append(("state+output (fused" + (", Tb)" if tb else ")"), chunk_state.chunk_state_fwd_kernel,
                    dict(feat, BV=bv, HAS_H0=True, STORE_HT=True, STORE_H=False, FUSE_OUTPUT=True, TRANSPOSED=False,
                         FROM_TB=tb, ORDERED=False, HALO=False),
                    launch))
    # the walk in segments with a halo (ops.segment_split, serial.seg), fused Tb and unfused
    out.append(("state+output (fused, Tb, halo)", chunk_state.chunk_state_fwd_kernel,
                dict(feat, BV=bv, HAS_H0=True, STORE_HT=True, STORE_H=False, FUSE_OUTPUT=True, TRANSPOSED=False,
                     FROM_TB=True, ORDERED=False, HALO=True), launch))
    for bv_state in (16, 32, 64):     # 16: the Tb form on the fewest programs (ops._state_bv)
        bv, launch = cfg("state", bv_state)
        # 2 stages, and the 3 that ops._state_stages picks at bv 32 when the programs fit one per SM
        for stages in sorted({launch["num_stages"]} | ({3} if bv <= 32 and not ieee else set())):
            for tb in (False, True):
                out.append((f"state ({'Tb, ' if tb else ''}bv={bv}, stages={stages})",
                            chunk_state.chunk_state_fwd_kernel,
                            dict(feat, BV=bv, HAS_H0=True, STORE_HT=True, STORE_H=True, FUSE_OUTPUT=False,
                                 TRANSPOSED=False, FROM_TB=tb, ORDERED=False, HALO=False),
                            dict(launch, num_stages=stages)))
    bv, launch = cfg("state", 32)
    out.append(("state (halo)", chunk_state.chunk_state_fwd_kernel,
                dict(feat, BV=bv, HAS_H0=True, STORE_HT=True, STORE_H=True, FUSE_OUTPUT=False, TRANSPOSED=False,
                     FROM_TB=False, ORDERED=False, HALO=True), launch))
    bv, launch = cfg("output", 64 if ieee else V)
    out.append(("output", chunk_output.chunk_output_kernel, dict(feat, BV=bv), launch))
    # the state gradient as ops._bstate_cfg launches it: BV 16 / 32 on 4 warps with 2 or 3 stages, BV 64 on 8 warps;
    # and without the local dv (a backward that recomputes the inverse)
    for label, bv, warps, stages, ldv in (("", 32, 4, 2, False), (" (local dv)", 32, 4, 2, True),
                                          (" (local dv, 3 stages)", 32, 4, 3, True),
                                          (" (local dv, bv=16)", 16, 4, 2, True),
                                          (" (local dv, bv=16, 3 stages)", 16, 4, 3, True),
                                          (" (local dv, bv=64)", 64, 8, 2, True)):
        if stages == 3 and arch < 90:
            continue
        out.append(("bwd state" + label, chunk_bwd_state.chunk_state_bwd_kernel,
                    dict(feat, BV=min(bv, V), HAS_DHT=True, STORE_DH0=True, TRANSPOSED=False, LOCAL_DV=ldv,
                         ORDERED=False, HALO=False),
                    dict(num_warps=warps, num_stages=1 if ieee else stages)))
    # its walk in segments with a halo past each one's end (ops.segment_split with backward, serial.bseg)
    for bv, warps in ((32, 4), (64, 8)):
        out.append((f"bwd state (local dv, halo, bv={bv})", chunk_bwd_state.chunk_state_bwd_kernel,
                    dict(feat, BV=min(bv, V), HAS_DHT=True, STORE_DH0=True, TRANSPOSED=False, LOCAL_DV=True,
                         ORDERED=False, HALO=True),
                    dict(num_warps=warps, num_stages=1 if ieee else 2)))
    # the longest-first launch order (ops._serial_grid, serial.order=1): both serial kernels once
    bv, launch = cfg("state", 32)
    out.append(("state (longest first)", chunk_state.chunk_state_fwd_kernel,
                dict(feat, BV=bv, HAS_H0=True, STORE_HT=True, STORE_H=True, FUSE_OUTPUT=False, TRANSPOSED=False,
                     FROM_TB=False, ORDERED=True, HALO=False), launch))
    out.append(("bwd state (longest first)", chunk_bwd_state.chunk_state_bwd_kernel,
                dict(feat, BV=min(32, V), HAS_DHT=True, STORE_DH0=True, TRANSPOSED=False, LOCAL_DV=True,
                     ORDERED=True, HALO=False), dict(num_warps=4, num_stages=1 if ieee else 2)))
    for name, kern in (("dqk", chunk_bwd_grads.chunk_bwd_dqk_kernel), ("wy", chunk_bwd_grads.chunk_bwd_wy_kernel)):
        bv, launch = cfg(name)
        for warps in (4, 8):       # ops._grads_warps: 4 on sm_90 for 16-bit inputs, 8 elsewhere
            out.append((f"bwd {name} (warps={warps})", kern, dict(feat, BV=bv, GRAD_PER_VHEAD=True),
                        dict(launch, num_warps=warps)))
    return out


def _resources(cubin: bytes) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    get = lambda key: int(m.group(1)) if (m := re.search(rf"{key}:(\d+)", out)) else -1  # noqa: E731
    return dict(regs=get("REG"), stack=get("STACK"))


def _ones(fn, consts: dict) -> dict:
    """Every integer scalar Triton would specialize, set to 1: a launch with that argument equal to 1 (one value
    head, say) gets a kernel where it is a Python int, not a tensor, so ``Hv.to(...)`` fails to compile there
    while the interpreter, which wraps every argument, never notices."""
    keep = set(getattr(fn, "do_not_specialize", ()) or ())
    keep |= {fn.arg_names[i] for i in keep if isinstance(i, int)}
    ones = {name: 1 for name in fn.arg_names
            if name not in consts and not name.endswith("_ptr") and name not in _SCALAR_F32 and name not in keep}
    return {**consts, **ones}


def compile_all(arch: int, dtype: str = "bfloat16", K: int = 128, V: int = 128, ones: bool = False) -> list[dict]:
    """Compile every kernel for ``sm_<arch>``; one dict per kernel (label, ok, regs, stack, smem, error).
    ``ones``: with every specializable integer argument equal to 1 (``_ones``)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dt = _DT[dtype]
    rows = []
    for label, kern, consts, launch in _variants(K, V, dtype == "float32", arch):
        fn = kern  # the JITFunction itself: ASTSource wants it
        # a constexpr left at its default is still a constexpr (else _signature would make it an i32 argument)
        consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
        if ones:
            consts = _ones(fn, consts)
        sig, attrs = _signature(fn, consts, dt)
        row = dict(label=label, launch=launch)
        try:
            src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
            ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch)
            row.update(ok=True, smem=int(ck.metadata.shared), **_resources(ck.asm["cubin"]))
        except Exception as exc:  # report, do not stop at the first
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DT))
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--ones", action="store_true",
                    help="every specializable integer argument equal to 1, as Triton compiles a launch with one head")
    args = ap.parse_args(argv)
    bad = 0
    for arch in args.arch:
        limit = SMEM_LIMIT.get(arch, 99 * 1024)
        for row in compile_all(arch, args.dtype, args.head_dim, args.head_dim, args.ones):
            if not row["ok"]:
                bad += 1
                print(f"sm_{arch} {row['label']:<30} FAILED {row['error']}")
                continue
            over = row["smem"] > limit
            bad += over
            print(f"sm_{arch} {row['label']:<30} warps={row['launch']['num_warps']} "
                  f"stages={row['launch']['num_stages']}"
                  f"  regs={row['regs']:>3} stack={row['stack']:>5} B  smem={row['smem'] // 1024:>3} KB"
                  + ("  OVER the shared-memory limit" if over else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
