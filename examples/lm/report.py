"""``format_table``: the fixed-width tables the trainer's timing report prints."""

from __future__ import annotations


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain fixed-width table, first column left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = lambda r: "  ".join(
        str(c).ljust(w) if i == 0 else str(c).rjust(w)
        for i, (c, w) in enumerate(zip(r, widths, strict=True))
    )
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])
