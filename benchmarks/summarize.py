"""Short summary of ``python -m flashqla bench`` JSON outputs.

usage: python benchmarks/summarize.py DIR_OR_JSON [...]

Per file: rows measured / in the preset, then per (backend, baseline) pair the geometric-mean
speedup (baseline ms / backend ms) with its min and max over rows, the median % of the roofline floor
per implementation, and how many (row, impl) pairs failed or were not served.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path


def _files(args):
    for a in args:
        p = Path(a)
        if p.is_dir():
            yield from sorted(p.glob("bench_*.json"))
        elif p.exists():
            yield p


def summarize(path: Path) -> str:
    doc = json.loads(path.read_text())
    meta, rows = doc["meta"], doc["rows"]
    impls = [i for i in meta["impls"] if not i.get("skipped")]
    lines = [f"{meta['preset']} ({meta['mode']}): {len(rows)}/{meta.get('rows_total', len(rows))} rows"
             + (f" [interrupted {meta['interrupted']}]" if meta.get("interrupted") else "")]
    skipped = [f"{i['name']} ({i['skipped']})" for i in meta["impls"] if i.get("skipped")]
    if skipped:
        lines.append("  skipped baselines: " + "; ".join(skipped))
    pairs = {}
    for r in rows:
        for a, d in r.get("speedup", {}).items():
            for b, x in d.items():
                pairs.setdefault((a, b), []).append(x)
    for (a, b), xs in sorted(pairs.items()):
        gm = math.exp(sum(math.log(x) for x in xs) / len(xs))
        lines.append(f"  {a} vs {b}: geomean {gm:.2f}x over {len(xs)} rows (min {min(xs):.2f}x, max {max(xs):.2f}x)")
    for im in impls:
        res = [r["results"].get(im["name"], {}) for r in rows]
        ok = [x for x in res if x.get("status") == "ok"]
        err = sum(1 for x in res if x.get("status") == "error")
        na = sum(1 for x in res if x.get("status") == "n/a")
        eager = sum(1 for x in ok if x.get("method") == "eager")
        med = statistics.median([x["pct_roofline"] for x in ok]) if ok else float("nan")
        lines.append(f"  {im['name']:<10} ok {len(ok):>3}  errors {err:>3}  n/a {na:>3}  eager {eager:>3}  "
                     f"median {med:.0f}% of roofline")
        first_err = next((x.get("error") for x in res if x.get("status") == "error"), None)
        if first_err:
            lines.append(f"    first error: {first_err[:200]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    files = list(_files(argv))
    if not files:
        print("summarize: no bench_*.json found in " + " ".join(argv))
        return 1
    for f in files:
        try:
            print(summarize(f))
        except Exception as exc:
            print(f"{f}: unreadable ({type(exc).__name__}: {exc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
