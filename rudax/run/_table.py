"""``format_table``: the fixed-width tables a program's timing report prints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["format_table"]


def format_table(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table, first column left-aligned, the others right-aligned.

    Args:
      header: the column names.
      rows: the rows, each as long as ``header``; cells are printed with ``str``.

    Returns:
      The table's lines joined by newlines: the header, a rule of dashes, the rows.

    Example:
      >>> from rudax.run import format_table
      >>> print(format_table(["phase", "ms"], [["forward", 12.5], ["backward", "31.0"]]))
      phase       ms
      --------  ----
      forward   12.5
      backward  31.0
    """
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(
                f"rows[{i}] has {len(row)} cells, the header {len(header)}: {list(row)!r}"
            )
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = lambda r: "  ".join(
        str(c).ljust(w) if i == 0 else str(c).rjust(w)
        for i, (c, w) in enumerate(zip(r, widths, strict=True))
    )
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])
