"""The hottest rows of Nsight Compute's source page (``ncu -i X.ncu-rep --page source --csv --print-source
{cuda,sass}``): the columns it has, then the rows holding the most warp-stall samples, each with its share of the
kernel's samples and its biggest stall-reason columns.  Written for the whole-V backward (``next_device_run.sh
ncusrc``), where a per-line view says which phase of which role the time goes to.

usage: python benchmarks/ncu_lines.py cuda.csv [sass.csv ...] [--top 40]
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
    # ncu may print a few lines before the CSV header (e.g. "==PROF==" notes): start at the first quoted row
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"')), 0)
    rows = list(csv.reader(lines[start:]))
    return rows[0], rows[1:]


def summarize(path: str, top: int) -> None:
    header, rows = read_rows(path)
    print(f"== {path}: {len(rows)} rows; columns: {header}")
    samp = next((i for i, h in enumerate(header) if "Warp Stall Sampling (All" in h), None)
    if samp is None:
        samp = next((i for i, h in enumerate(header) if "Sampling" in h), None)
    if samp is None:
        print("   no sampling column")
        return
    stall_cols = [i for i, h in enumerate(header) if h.lower().startswith("stall") or "stall_" in h.lower()]
    text = next((i for i, h in enumerate(header) if h in ("Source", "Source Line", "Instruction")), 1)
    loc = next((i for i, h in enumerate(header) if h in ("#", "Line", "Address", "Line Number")), 0)
    total = sum(_num(r[samp]) for r in rows if len(r) > samp) or 1.0
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
