"""FLOP and byte counts of one GDN call, the machine's ceilings, and the roofline floor.

FLOPs (per token and value head, chunk C = 64, head dim d = K = V; multiply-add = 2 FLOPs)::

    fwd  ~ 10*C*d + 6*d^2 + (2/3)*C^2
         (intra-chunk q k^T, k k^T and A @ [k|v] products ~ 10*C*d; the state's w S, q S and k^T v
          products ~ 6*d^2; the 64x64 triangular solve ~ (2/3)*C^2)
    bwd  ~ 2.5 x fwd            (our convention; fwdbwd = 3.5 x fwd)

Counted over real tokens only (the padding of a sequence's last chunk is not counted).

Bytes (each tensor moved once; what an ideal fused kernel must read or write)::

    fwd     q, k, v, o in their dtype + g (float32) + beta, + h0 / ht (float32) when present
    fwdbwd  fwd's + do, dq, dk, dv, dg (float32), dbeta

Floor = max(FLOPs / peak matmul rate, bytes / copy bandwidth).  The two ceilings are measured once
per device (a large device-to-device copy, counting read + write; a large dense matmul on random
data in the benchmark dtype: bf16 on GPU, float32 on CPU; the best of several repetitions) and cached as JSON in
``$FLASHQLA_CACHE_DIR`` (default ``~/.cache/flashqla``).  ``% of roofline`` = floor / measured time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

CHUNK = 64
BWD_FLOP_FACTOR = 2.5

_ES = {torch.float32: 4, torch.float64: 8, torch.bfloat16: 2, torch.float16: 2}


def flops_per_token_head(d: int = 128, C: int = CHUNK) -> float:
    return 10.0 * C * d + 6.0 * d * d + (2.0 / 3.0) * C * C


def gdn_flops(tokens: int, Hv: int, K: int = 128, V: int = 128, mode: str = "fwd") -> float:
    d = (K + V) / 2.0  # the formula assumes K == V; the mean keeps it sane otherwise
    fwd = tokens * Hv * flops_per_token_head(d)
    return fwd * (1.0 + BWD_FLOP_FACTOR) if mode == "fwdbwd" else fwd


def gdn_bytes(tokens: int, Hqk: int, Hv: int, K: int = 128, V: int = 128, num_seqs: int = 1,
              dtype=torch.bfloat16, beta_dtype=None, mode: str = "fwd", h0: bool = False,
              ht: bool = False) -> float:
    es = _ES[dtype]
    eb = _ES[beta_dtype or dtype]
    per_tok = 2 * Hqk * K * es + 2 * Hv * V * es + Hv * 4 + Hv * eb   # q, k, v, o, g, beta
    state = num_seqs * Hv * K * V * 4
    total = tokens * per_tok + (state if h0 else 0) + (state if ht else 0)
    if mode == "fwdbwd":
        total += tokens * (Hv * V * es + 2 * Hqk * K * es + Hv * V * es + Hv * 4 + Hv * eb)  # do dq dk dv dg db
        total += state if h0 else 0  # dh0
    return float(total)


def floor_ms(flops: float, nbytes: float, ceil: dict) -> float:
    return 1e3 * max(flops / (ceil["matmul_tflops"] * 1e12), nbytes / (ceil["copy_gbps"] * 1e9))


# --------------------------------------------------------------------------------------------------
# ceilings


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHQLA_CACHE_DIR") or Path.home() / ".cache" / "flashqla")


def _key(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"cuda|{name}|torch {torch.__version__}"
    return f"cpu|{os.cpu_count()} cpus|torch {torch.__version__}|threads {torch.get_num_threads()}"


def _best_cuda_ms(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return min(times)  # a ceiling: the best of the repetitions


def _best_cpu_ms(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)  # a ceiling: the best of the repetitions


def measure_ceilings(device: torch.device) -> dict:
    if device.type == "cuda":
        n = 1 << 29                                  # 1 GiB of bf16, far beyond L2
        x = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
        y = torch.empty_like(x)
        ms = _best_cuda_ms(lambda: y.copy_(x), reps=20, warmup=3)
        copy_gbps = 2 * x.numel() * 2 / (ms * 1e-3) / 1e9
        del x, y
        m = 8192
        a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
        b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
        ms = _best_cuda_ms(lambda: a @ b, reps=10, warmup=3)
        tflops = 2 * m ** 3 / (ms * 1e-3) / 1e12
        del a, b
        torch.cuda.empty_cache()
        how = "cuda: 1 GiB bf16 copy_ (read+write) best of 20; 8192^3 bf16 randn matmul best of 10"
        dtype = "bfloat16"
    else:
        x = torch.randn(1 << 25)                     # 128 MiB float32
        y = torch.empty_like(x)
        ms = _best_cpu_ms(lambda: y.copy_(x), reps=10, warmup=1)
        copy_gbps = 2 * x.numel() * 4 / (ms * 1e-3) / 1e9
        m = 1024
        a, b = torch.randn(m, m), torch.randn(m, m)
        ms = _best_cpu_ms(lambda: a @ b, reps=10, warmup=1)
        tflops = 2 * m ** 3 / (ms * 1e-3) / 1e12
        how = "cpu: 128 MiB float32 copy_ (read+write) best of 10; 1024^3 float32 matmul best of 10"
        dtype = "float32"
    return {"copy_gbps": round(copy_gbps, 1), "matmul_tflops": round(tflops, 3), "matmul_dtype": dtype,
            "method": how, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}


def ceilings(device, refresh: bool = False) -> dict:
    """The device's copy bandwidth (GB/s) and matmul rate (TFLOP/s): cached, else measured and cached."""
    device = torch.device(device)
    key = _key(device)
    path = cache_dir() / "ceilings.json"
    table = {}
    try:
        table = json.loads(path.read_text())
    except Exception:
        table = {}
    if not refresh and key in table:
        return dict(table[key], key=key, cached=str(path))
    result = measure_ceilings(device)
    table[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs a re-measure next time
    return dict(result, key=key, cached=str(path), fresh=True)
