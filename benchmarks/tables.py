"""Plain-text tables for the benchmarks' reports, with no heavy imports (the GPU check's table stage loads no
torch)."""

from __future__ import annotations


def format_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """Plain fixed-width table; `align` is one char per column ('l' or 'r'), default: first left, rest right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(r):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align, strict=True))

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)
