"""What a run leaves behind: ``metrics.jsonl`` (one JSON object per row) and ``loss.png``.

Rows carry a ``kind``: ``"train"`` (logged updates: loss, learning rate, gradient norm,
tokens/s), ``"eval"`` (validation loss) and ``"end"`` (the summary). A resumed run first drops
the rows past its checkpoint (the interrupted session logged them, the resumed one logs them
again), so the file reads as one run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends rows to ``metrics.jsonl``, each flushed at once so a crash loses none.

    Args:
      path: the file; created if missing.
      resume_step: if given, rows of kind train/eval with ``step > resume_step`` and every
        ``end`` row are dropped first (the session being resumed logged them after its last
        checkpoint).
    """

    def __init__(self, path: str | os.PathLike, *, resume_step: int | None = None):
        self.path = Path(path)
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_rows(self.path) if _kept(r, resume_step)]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        self._file = open(self.path, "a")  # closed by close()

    def write(self, **row: Any) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _kept(row: dict[str, Any], step: int) -> bool:
    return row.get("kind") in ("train", "eval") and row["step"] <= step


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every row of a metrics.jsonl file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(rows: Iterable[dict[str, Any]], path: str | os.PathLike, *, title: str) -> None:
    """Train and validation loss against the update step, as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    rows = list(rows)
    train = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train"]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", linewidth=1.5)
    ax.set_xlabel("update step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain fixed-width table, first column left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = lambda r: "  ".join(
        str(c).ljust(w) if i == 0 else str(c).rjust(w)
        for i, (c, w) in enumerate(zip(r, widths, strict=True))
    )
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])
