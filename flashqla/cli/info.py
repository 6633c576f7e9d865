"""``python -m flashqla info``: versions, the device, the backends and what ``backend="auto"`` picks.

The dispatch decision is ``flashqla.explain`` on small dummy tensors shaped like a typical call on this
device (bfloat16, K = V = 128, Hqk/Hv = 16/32, two packed sequences on CUDA; float32 on the CPU), once
for inference (final state out, no gradients) and once for training (gradients).  ``--fake-arch sm_90``
shows the decision for another architecture without having it (``flashqla.fake_device``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata as md
import json
import os
import platform
import sys

import torch

from .table import text_table

# (what, distribution names to ask for a version, import name)
FRAMEWORKS = [
    ("triton", ("triton",), "triton"),
    ("tilelang", ("tilelang",), "tilelang"),
    ("cutlass DSL", ("nvidia-cutlass-dsl",), "cutlass"),
    ("fla (baseline)", ("flash-linear-attention", "fla-core"), "fla"),
    ("flash_qla (baseline)", ("flash-qla", "flash_qla"), "flash_qla"),
    ("matplotlib (bench plots)", ("matplotlib",), "matplotlib"),
    ("tqdm (progress bar)", ("tqdm",), "tqdm"),
]


def _dist_version(names) -> str:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
        except Exception:
            continue
    return ""


def frameworks() -> list:
    """[(what, version or '', where or reason)] without importing the heavy frameworks."""
    out = []
    for what, dists, mod in FRAMEWORKS:
        ver = _dist_version(dists)
        try:
            spec = importlib.util.find_spec(mod)
        except Exception:
            spec = None
        if spec is None:
            out.append((what, ver, "not installed" if not ver else "installed but not importable"))
        else:
            out.append((what, ver or "?", os.path.dirname(spec.origin or "") if spec.origin else "namespace"))
    out.append(native_module())
    return out


def native_module():
    """The cpu backend's C++ module: built (importable) or why not."""
    try:
        mod = importlib.import_module("flashqla.backends.cpu._native")
        ver = str(getattr(mod, "__version__", "") or "built")
        return ("native cpu module", ver, getattr(mod, "__file__", ""))
    except Exception as exc:
        return ("native cpu module", "", f"not built ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})")


def device_info(device: torch.device) -> dict:
    d = {"type": device.type}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        d.update(name=p.name, capability=f"{p.major}.{p.minor}", arch=f"sm_{p.major}{p.minor}",
                 sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2 ** 30, 1),
                 l2_mib=round(getattr(p, "L2_cache_size", 0) / 2 ** 20, 1), cuda=torch.version.cuda)
    else:
        d.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                 cuda_available=torch.cuda.is_available())
    return d


def dummy_call(device: torch.device, dtype=None, Hqk: int = 16, Hv: int = 32, K: int = 128, V: int = 128,
               seqlens=(4096, 1000)):
    """Tensors shaped like a typical call; their values are never read by explain()."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    T = sum(seqlens)
    cu = torch.tensor([0] + [sum(seqlens[: i + 1]) for i in range(len(seqlens))], dtype=torch.int32,
                      device=device)
    return dict(q=torch.empty(1, T, Hqk, K, dtype=dtype, device=device),
                k=torch.empty(1, T, Hqk, K, dtype=dtype, device=device),
                v=torch.empty(1, T, Hv, V, dtype=dtype, device=device),
                g=torch.empty(1, T, Hv, dtype=torch.float32, device=device),
                beta=torch.empty(1, T, Hv, dtype=dtype, device=device), cu_seqlens=cu)


def decisions(device: torch.device, fake_arch=None, dtype=None) -> list:
    import flashqla
    ctx = contextlib.nullcontext()
    if fake_arch:
        if fake_arch == "cpu":
            ctx = flashqla.fake_device("cpu", None, name="fake cpu")
        else:
            cap = (int(fake_arch[3:-1]), int(fake_arch[-1]))
            ctx = flashqla.fake_device("cuda", cap, name=f"fake {fake_arch}")
            dtype = dtype or torch.bfloat16
    x = dummy_call(device, dtype)
    out = []
    with ctx:
        for label, kw in (("inference (final state out, no grad)", dict(output_final_state=True, needs_grad=False)),
                          ("training (needs grad)", dict(output_final_state=False, needs_grad=True))):
            out.append((label, flashqla.explain(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                cu_seqlens=x["cu_seqlens"], **kw)))
    return out


def decode_decision(device: torch.device) -> dict:
    """What ``gated_delta_rule_decode(impl="auto")`` picks for a typical serving step on this device (batch 8,
    one token, 16/32 heads, K = V = 128, fp32 pool), with every implementation's verdict."""
    from flashqla.decode import choose_decode_impl, decode_implementations
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.empty(8, 1, 16, 128, dtype=dt, device=device)
    v = torch.empty(8, 1, 32, 128, dtype=dt, device=device)
    g = torch.empty(8, 1, 32, dtype=torch.float32, device=device)
    pool = torch.empty(8, 32, 128, 128, dtype=torch.float32, device=device)
    try:
        chosen, verdicts = choose_decode_impl(q, v, g, g.to(dt), pool)
    except Exception as exc:  # the listing must not break info
        chosen, verdicts = None, {"error": f"{type(exc).__name__}: {exc}"}
    avail = decode_implementations()
    order = [{"name": n, "available": ok, "verdict": verdicts.get(n, why if not ok else "not tried")}
             for n, (ok, why) in avail.items()]
    return {"call": f"{device.type} {str(dt).replace('torch.', '')} B=8 T=1 Hqk/Hv=16/32 K=V=128 fp32 pool",
            "chosen": chosen, "order": order}


def run_info(args) -> int:
    import flashqla
    from flashqla.dispatch import priority_of

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("info: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    dev = device_info(device)
    fw = frameworks()
    decs = decisions(device, args.fake_arch)
    dec_step = decode_decision(device)
    spec = decs[0][1].spec
    backends = []
    for name in flashqla.list_backends():
        be = flashqla.get_backend(name)
        try:
            ok, why = be.available()
        except Exception as exc:
            ok, why = False, f"available() raised {type(exc).__name__}: {exc}"
        try:
            ver = be.version() if ok else ""
        except Exception:
            ver = ""
        backends.append({"name": name, "priority": priority_of(be, spec), "available": ok, "reason": why,
                         "version": ver, "has_backward": bool(be.has_backward),
                         "description": getattr(be, "description", "")})

    if args.json:
        print(json.dumps({
            "flashqla": flashqla.__version__, "location": os.path.dirname(flashqla.__file__),
            "python": platform.python_version(), "torch": torch.__version__, "device": dev,
            "frameworks": [{"name": a, "version": b, "where": c} for a, b, c in fw], "backends": backends,
            "decisions": [{"call": label, "spec": d.spec.summary(), "chosen": d.chosen,
                           "order": [{"name": c.name, "priority": c.priority, "verdict": c.verdict,
                                      "reason": c.reason} for c in d.candidates]} for label, d in decs],
            "decode": dec_step,
        }, indent=1, default=str))
        return 0

    print(f"flashqla {flashqla.__version__} ({os.path.dirname(flashqla.__file__)})")
    print(f"python {platform.python_version()}, torch {torch.__version__}"
          + (f", CUDA {torch.version.cuda}" if torch.version.cuda else ", no CUDA build"))
    if device.type == "cuda":
        print(f"device: cuda:{torch.cuda.current_device()} {dev['name']}, capability {dev['capability']} "
              f"({dev['arch']}), {dev['sm_count']} SMs, {dev['memory_gib']} GiB, L2 {dev['l2_mib']} MiB")
    else:
        print(f"device: cpu ({dev['name']}, {dev['threads']} torch threads)"
              + ("" if dev["cuda_available"] else "; no CUDA device"))
    print("\nframeworks:")
    print(text_table(["framework", "version", "where / status"], fw, align_right=[False, False, False]))
    print("\nbackends (registry; priority on this device, higher tried first):")
    print(text_table(["backend", "priority", "available", "backward", "version", "reason / description"],
                     [[b["name"], "-" if b["priority"] is None else b["priority"], "yes" if b["available"] else "no",
                       "yes" if b["has_backward"] else "no", b["version"],
                       b["reason"] if not b["available"] else (b["description"] or b["reason"])] for b in backends],
                     align_right=[False, True, False, False, False, False]))
    for label, d in decs:
        print(f"\nbackend=\"auto\" for a typical {label} call: {d.spec.summary()}")
        print(f"  chosen: {d.chosen or 'none'}" + (f"  ({d.note})" if d.note else ""))
        print("  order tried, with each verdict:")
        for i, c in enumerate(d.candidates, 1):
            prio = "-" if c.priority is None else str(c.priority)
            print(f"    {i}. {c.name:<10} prio {prio:>4}  {c.verdict:<19} {c.reason}")
    print(f"\ngated_delta_rule_decode(impl=\"auto\") for a typical step: {dec_step['call']}")
    print(f"  chosen: {dec_step['chosen'] or 'none'}")
    for i, r in enumerate(dec_step["order"], 1):
        print(f"    {i}. {r['name']:<10} {'available' if r['available'] else 'unavailable':<12} {r['verdict']}")
    env = {k: os.environ[k] for k in ("FLASHQLA_BACKEND", "FLASHQLA_DISABLE", "FLASHQLA_CACHE_DIR",
                                      "FLASHQLA_DECODE_IMPL") if k in os.environ}
    if env:
        print("\nenvironment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="versions, device, backends and the backend=\"auto\" order",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--fake-arch", default=None, metavar="ARCH",
                   help="decide as if on this architecture, e.g. sm_90 or cpu (flashqla.fake_device)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_info)
