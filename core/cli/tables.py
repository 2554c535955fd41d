"""Plain fixed-width text tables for the command line and reports."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["format_table"]


def _numeric(cell: str) -> bool:
    return cell.lstrip("-").replace(".", "", 1).replace("e-", "").replace("e+", "").isdigit()


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """``header`` and ``rows`` as aligned columns (numbers right-aligned) under a rule."""
    cells = [[str(h) for h in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])
