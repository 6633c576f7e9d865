"""Plain-text and markdown tables (no dependencies)."""

from __future__ import annotations


def _cells(rows):
    return [["" if c is None else str(c) for c in r] for r in rows]


def text_table(headers, rows, align_right=None) -> str:
    rows = _cells(rows)
    headers = [str(h) for h in headers]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    right = align_right or [False] + [True] * (len(headers) - 1)

    def fmt(r):
        return "  ".join(c.rjust(w) if right[i] else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def markdown_table(headers, rows) -> str:
    rows = _cells(rows)
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)
