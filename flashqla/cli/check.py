"""``python -m flashqla check``: every available backend against the float64 oracle.

The cases are the shared suite's (:func:`flashqla.testing.standard_cases`: varlen with length 0 / 1 /
odd sequences, GVA grids, initial / final state on and off, the fused L2 norm, strong and zero decay),
run through the public op ``flashqla.chunk_gated_delta_rule(..., backend=NAME)`` with fresh outputs
poisoned with NaN, and compared with :func:`flashqla.reference.recurrent_gated_delta_rule_ref` in
float64 (computed once per case).  The table shows the relative L2 error of ``o``, ``ht`` (the final
state) and of each gradient when the backend has a backward; a ``!`` marks a value over its tolerance
(:mod:`flashqla.cli.tolerances`).

A backend that ``decide()`` says cannot serve a case is listed as skipped with its reason (served
forward-only when it only lacks the backward).  Exit status: 0 all ran cases passed, 1 a case failed
or raised, 2 nothing could be checked.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from .table import text_table

COLUMNS = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _fmt(err: float, tol: float) -> str:
    if err is None:
        return "-"
    s = "inf" if math.isinf(err) else ("nan" if math.isnan(err) else f"{err:.1e}")
    return s + ("!" if not (err <= tol) else "")


def _decide(case, inputs, name: str, grads: bool):
    """(can serve with grads, can serve forward-only, reason) per flashqla.explain."""
    import flashqla

    def ask(ng):
        d = flashqla.explain(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], scale=case.scale,
                             initial_state=inputs["initial_state"], output_final_state=case.ht,
                             use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=inputs["cu_seqlens"], backend=name,
                             needs_grad=ng)
        why = next((c.reason for c in d.candidates if c.name == name), "")
        return d.chosen == name, why

    if grads:
        ok, why = ask(True)
        if ok:
            return True, True, why
        ok2, why2 = ask(False)
        return False, ok2, why if ok2 else why2
    ok, why = ask(False)
    return False, ok, why


def run_check(args) -> int:
    import flashqla
    from flashqla import testing

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    dtype = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    d = args.head_dim or (128 if device.type == "cuda" else 64)
    cases = testing.standard_cases(d, d, long=(device.type == "cuda" and not args.short))
    if args.cases:
        want = [c for c in args.cases.split(",") if c]
        unknown = set(want) - {c.name for c in cases}
        if unknown:
            print(f"check: unknown case(s) {', '.join(sorted(unknown))}; cases: "
                  f"{', '.join(c.name for c in cases)}", file=sys.stderr)
            return 2
        cases = [c for c in cases if c.name in want]
    if args.backend:
        names = args.backend
    else:  # every backend that declares a priority for this device (named ones are checked regardless)
        from flashqla.dispatch import detect, priority_of
        info = detect(device)
        names = [n for n in flashqla.list_backends()
                 if priority_of(flashqla.get_backend(n), info.arch, info.capability) is not None]
    exact = device.type == "cpu"

    rows, records, refs = [], [], {}
    n_pass = n_fail = n_skip = 0
    t_start = time.perf_counter()
    interrupted = False
    try:
        for name in names:
            try:
                be = flashqla.get_backend(name)
            except ValueError as exc:
                print(f"check: {exc}", file=sys.stderr)
                return 2
            try:
                ok, why = be.available()
            except Exception as exc:
                ok, why = False, f"available() raised {type(exc).__name__}: {exc}"
            if not ok:
                rows.append([name, "-", "-", "unavailable"] + ["-"] * len(COLUMNS) + [why])
                records.append({"backend": name, "status": "unavailable", "reason": why})
                n_skip += 1
                continue
            for case in cases:
                inputs = testing.make_inputs(case, dtype, device, seed=args.seed)
                want_grads = bool(be.has_backward) and not args.no_grad
                try:
                    with_grads, fwd_ok, why = _decide(case, inputs, name, want_grads)
                except Exception as exc:
                    with_grads, fwd_ok, why = False, False, f"explain raised {type(exc).__name__}: {exc}"
                key = testing.tolerance_key(dtype, device.type, exact)
                if not fwd_ok:
                    rows.append([name, case.name, key, "skip"] + ["-"] * len(COLUMNS) + [why])
                    records.append({"backend": name, "case": case.name, "status": "skip", "reason": why})
                    n_skip += 1
                    continue
                note = "" if with_grads or not want_grads else f"forward only ({why})"
                if not be.has_backward:
                    note = "forward only (no backward)"
                try:
                    if case.name not in refs:
                        refs[case.name] = testing.oracle(case, inputs)  # float64, on the checked device
                    t0 = time.perf_counter()  # the backend's time, not the oracle's
                    res = testing.run_case(flashqla.chunk_gated_delta_rule, case, name, dtype, device,
                                           grads=with_grads, exact_fp32=exact, seed=args.seed, ref=refs[case.name])
                except Exception as exc:
                    msg = f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
                    rows.append([name, case.name, key, "ERROR"] + ["-"] * len(COLUMNS) + [msg])
                    records.append({"backend": name, "case": case.name, "status": "error", "reason": msg})
                    n_fail += 1
                    continue
                dt = time.perf_counter() - t0
                status = "pass" if res.ok else "FAIL"
                n_pass += res.ok
                n_fail += not res.ok
                cells = [_fmt(res.errors.get(c), res.tolerances.get(c, 0.0)) for c in COLUMNS]
                if not res.ok:
                    bad = ", ".join(f"{k} {e:.2e} > {t:g}" for k, (e, t) in res.failures.items())
                    note = (note + "; " if note else "") + bad
                rows.append([name, case.name, key, status] + cells + [(f"{dt:.1f}s " + note).strip()])
                print(f"check: {name} {case.name}: {status} ({dt:.1f}s)", file=sys.stderr, flush=True)
                records.append({"backend": name, "case": case.name, "dtype": key, "status": status.lower(),
                                "errors": res.errors, "tolerances": res.tolerances, "seconds": dt, "note": note})
    except KeyboardInterrupt:  # SIGINT (e.g. `timeout -s INT`): report what was checked
        interrupted = True

    headers = ["backend", "case", "dtype", "status"] + list(COLUMNS) + ["note"]
    align = [False, False, False, False] + [True] * len(COLUMNS) + [False]
    print(f"flashqla check on {device.type} ({str(dtype).replace('torch.', '')}, K=V={d}): relative L2 error vs "
          f"the float64 oracle; ht = final state; ! = over tolerance")
    print(text_table(headers, rows, align_right=align))
    print(f"\n{n_pass} passed, {n_fail} failed, {n_skip} skipped ({time.perf_counter() - t_start:.1f}s)"
          + (" [interrupted]" if interrupted else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": device.type, "dtype": str(dtype), "head_dim": d, "results": records}, fh,
                      indent=1, default=str)
    if n_fail:
        return 1
    if interrupted:
        return 130
    if n_pass == 0:
        print("check: nothing was checked (no requested backend could serve any case)", file=sys.stderr)
        return 2
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="correctness of every available backend vs the float64 oracle",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", action="append", nargs="+", default=None, metavar="NAME",
                   help="backend(s) to check (repeatable; default: every one with a priority for the device)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when present")
    p.add_argument("--dtype", choices=["float64", "float32", "bfloat16", "float16"], default=None,
                   help="q/k/v dtype (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--head-dim", type=int, default=None, help="K = V (default 128 on cuda, 64 on cpu)")
    p.add_argument("--cases", default=None, help="comma list of case names (default: all)")
    p.add_argument("--short", action="store_true", help="the short sequence lengths on cuda too")
    p.add_argument("--no-grad", action="store_true", help="forward only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=_entry)


def _entry(args) -> int:
    if args.backend:
        args.backend = [b for group in args.backend for item in group for b in item.split(",") if b]
    return run_check(args)
