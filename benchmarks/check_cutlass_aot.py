"""Probe: can the cutlass backend's kernels be compiled ahead of time and loaded by a new process?

(Session 14: yes.  The backend does this itself now, as its on-disk cache: ``flashqla/backends/cutlass``
``compile_kernel`` / ``_export_library``; its GPU test is ``test_gpu_disk_cache_serves_a_new_process``.  This
probe stays as the standalone, step-by-step version.)

CuTe DSL 4.3.5 keeps no disk cache of compiled functions (a new process compiles the cutlass kernels again;
issue #5 item 2, and the cold first call of #7 on shapes where auto picks cutlass).  Its TVM-FFI path can:
``cute.compile(..., options="--enable-tvm-ffi")`` -> ``export_to_c(obj)`` -> link a shared library against
the DSL's runtime libraries -> ``cute.runtime.load_module(so)``.  On the CPU machine (session 5) compile,
export and link worked for ``bwd_dqk`` (3.4 s); loading needs ``libcuda.so.1``, so the rest needs the GPU.

This script, for the kernels of a bf16 forward (prep, fwd) and optionally the backward:
1. compiles each with TVM-FFI, exports the object, links ``<kind>.so`` in ``--out`` (times each step);
2. with a GPU: loads each library in this process, runs ``chunk_gated_delta_rule(backend="cutlass")`` once
   with the JIT-compiled kernels and once with ``compile_kernel`` answering from the loaded libraries, and
   compares the outputs bitwise.  A calling-convention mismatch shows up as an exception here, printed.

usage: python benchmarks/check_cutlass_aot.py --out /tmp/flq_aot [--with-backward]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback


def build(kind: str, key: tuple, out: str) -> str:
    from flashqla.backends.cutlass import ARCH, _cute, _example_args, _make_kernel
    cute = _cute()
    from cutlass.cute.runtime import find_runtime_libraries

    t = time.perf_counter()
    fn = cute.compile(_make_kernel(kind, key), *_example_args(kind, key), options=f"--gpu-arch {ARCH} --enable-tvm-ffi")
    t_compile = time.perf_counter() - t
    name = "flq_" + "_".join([kind] + [str(x) for x in key]).replace(" ", "")
    obj, so = os.path.join(out, name + ".o"), os.path.join(out, name + ".so")
    t = time.perf_counter()
    fn.export_to_c(obj, name)
    libs = [p for p in find_runtime_libraries(enable_tvm_ffi=True) if os.path.exists(p)]
    rpath = ":".join(sorted({os.path.dirname(p) for p in libs}))
    r = subprocess.run(["cc", "-shared", "-o", so, obj, *libs, f"-Wl,-rpath,{rpath}"], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"link failed: {r.stderr[-2000:]}")
    print(f"{kind} {key}: compile {t_compile:.1f} s, export + link {time.perf_counter() - t:.1f} s -> {so} "
          f"({os.path.getsize(so) // 1024} KB)")
    return so, name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/flq_aot")
    ap.add_argument("--with-backward", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import torch

    kernels = [("prep", (128, 128, "bfloat16", False)), ("fwd", (128, 128, 1, 2, False)),
               ("fwd", (128, 128, 2, 2, False))]
    if args.with_backward:
        kernels += [("bwd_dqk", (128, 128))]
    libs = {}
    for kind, key in kernels:
        try:
            libs[(kind, key)] = build(kind, key, args.out)
        except Exception:
            traceback.print_exc()
    if not torch.cuda.is_available():
        print("no GPU: built only (loading needs libcuda)")
        return 0

    from cutlass.cute.runtime import load_module

    import flashqla
    from flashqla.backends import cutlass as cb
    loaded = {}
    for (kind, key), (so, name) in libs.items():
        t = time.perf_counter()
        try:
            mod = load_module(so)
            loaded[(kind, key)] = mod[name] if hasattr(mod, "__getitem__") else getattr(mod, name)
            print(f"load {kind} {key}: {time.perf_counter() - t:.3f} s")
        except Exception as exc:
            print(f"load {kind} {key} failed: {type(exc).__name__}: {str(exc)[:400]}")

    from flashqla.cli.cases import make_inputs
    x = make_inputs([300, 1, 129], 2, 4, device=torch.device("cuda"))

    def run():
        o, ht = flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True,
                                                cu_seqlens=x["cu_seqlens"], backend="cutlass")
        torch.cuda.synchronize()
        return o, ht

    o_jit, ht_jit = run()
    real = cb.compile_kernel

    def from_library(kind, key, arch=cb.ARCH, keep_dir=None):
        fn = loaded.get((kind, tuple(key)))
        if fn is None:
            raise RuntimeError(f"no AOT library for {kind} {key}")
        return fn

    cb.compile_kernel = from_library
    try:
        o_aot, ht_aot = run()
        print(f"AOT forward: o bitwise equal {torch.equal(o_aot, o_jit)}, final state bitwise equal "
              f"{torch.equal(ht_aot, ht_jit)}")
    except Exception:
        print("AOT forward failed (calling convention?):")
        traceback.print_exc()
    finally:
        cb.compile_kernel = real
    return 0


if __name__ == "__main__":
    sys.exit(main())
