"""Nsight Compute's source page (``ncu -i X.ncu-rep --page source --csv --print-source sass``) summed: HGMMA
against their waits (equal counts: ptxas serialised the wgmma), the stall samples and executed instructions per
warpgroup role, then the instructions holding the most samples with their biggest stall reasons.  Written for
the whole-V backward (``next_device_run.sh ncusrc``).

usage: python benchmarks/ncu_lines.py sass.csv [...] [--top 40]
"""

from __future__ import annotations

import argparse
import csv
import sys


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def read_rows(path: str):
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.strip()]
    # ncu prints a "Kernel Name" row (and may print "==PROF==" notes) before the header: start at the row that
    # names the sampling column
    start = next((i for i, ln in enumerate(lines) if "Warp Stall Sampling" in ln), 0)
    rows = list(csv.reader(lines[start:]))
    return rows[0], rows[1:]


def summarize(path: str, top: int) -> None:
    header, rows = read_rows(path)
    print(f"== {path}: {len(rows)} rows")
    samp = next((i for i, h in enumerate(header) if "Warp Stall Sampling (All" in h), None)
    if samp is None:
        samp = next((i for i, h in enumerate(header) if "Sampling" in h), None)
    if samp is None:
        print("   no sampling column")
        return
    stall_cols = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    text = next((i for i, h in enumerate(header) if h in ("Source", "Source Line", "Instruction")), 1)
    loc = next((i for i, h in enumerate(header) if h in ("#", "Line", "Address", "Line Number")), 0)
    total = sum(_num(r[samp]) for r in rows if len(r) > samp) or 1.0
    # per warpgroup role: the SASS lists each role's code after its setmaxnreg (USETMAXREG), so the rows between
    # two of them are one role's (their order is ptxas's, not the source's)
    roles, seg, execd = {}, 0, header.index("Instructions Executed") if "Instructions Executed" in header else None
    for r in rows:
        if "USETMAXREG" in r[text]:
            seg += 1
        acc = roles.setdefault(seg, {"samples": 0.0, "instr": 0.0, "why": {}, "name": r[text].strip()})
        acc["samples"] += _num(r[samp])
        acc["instr"] += _num(r[execd]) if execd is not None else 0.0
        for i in stall_cols:
            acc["why"][header[i]] = acc["why"].get(header[i], 0.0) + _num(r[i])
    mma = sum("HGMMA." in r[text] for r in rows)
    if mma:
        waits = sum("WARPGROUP.DEPBAR" in r[text] for r in rows)
        print(f"   {mma} HGMMA, {waits} WARPGROUP.DEPBAR" + ("  (serialised by ptxas: a wait per wgmma)" if waits >= mma
                                                             else ""))
    if len(roles) > 1:
        print("   by setmaxnreg segment (samples, executed warp instructions, top stall reasons):")
        for k, a in sorted(roles.items()):
            most = sorted(a["why"].items(), key=lambda x: -x[1])[:4]
            print(f"   {k}: {a['samples'] / total * 100:5.1f}%  {a['instr']:.3g}  {a['name'][:40]:40s}  "
                  + ", ".join(f"{h[6:]} {v / max(a['samples'], 1) * 100:.0f}%" for h, v in most if v > 0))
    ranked = sorted((r for r in rows if len(r) > samp), key=lambda r: -_num(r[samp]))
    print(f"   total samples {total:.0f}; top {top}:")
    for r in ranked[:top]:
        s = _num(r[samp])
        reasons = sorted(((_num(r[i]), header[i]) for i in stall_cols if i < len(r)), reverse=True)[:3]
        why = ", ".join(f"{h.split('(')[0].strip()}={v:.0f}" for v, h in reasons if v > 0)
        print(f"   {s / total * 100:5.1f}%  {r[loc]:>6}  {r[text].strip()[:110]}  [{why}]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    for p in args.csv:
        try:
            summarize(p, args.top)
        except (OSError, IndexError, csv.Error) as e:
            print(f"== {p}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
