"""Print aligned, markdown-style tables (shared by the benchmarks in this folder).

    >>> print_table(["method", "s"], [["spawn", 3.2], ["launch", 0.15]])
    | method |    s |
    |--------|------|
    | spawn  | 3.20 |
    | launch | 0.15 |

The output pastes straight into a markdown file such as ``bench/README.md``.
"""
from __future__ import annotations

from typing import Sequence


def _cell(value, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence], digits: int = 2) -> str:
    """The table as a string: text columns aligned left, numeric columns right."""
    cells = [[_cell(v, digits) for v in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"every row needs {len(headers)} cells (one per header), "
                             f"got {len(row)}: {row}")
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    # A column is numeric if every value in it is a number (or missing): align it right.
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) and rows
               for i in range(len(headers))]

    def line(values):
        return "| " + " | ".join(v.rjust(w) if num else v.ljust(w)
                                 for v, w, num in zip(values, widths, numeric)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def print_table(headers: Sequence[str], rows: Sequence[Sequence], digits: int = 2,
                title: str | None = None) -> None:
    """Print :func:`format_table`, after an optional title line."""
    if title:
        print(f"\n{title}\n")
    print(format_table(headers, rows, digits))
