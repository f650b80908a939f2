"""What a run leaves behind: ``metrics.jsonl`` (one JSON object per row), ``loss.png`` and,
optionally, the same scalars as TensorBoard event files.

Rows carry a ``kind``: ``"train"`` (logged updates: loss, learning rate, gradient norm,
tokens/s), ``"eval"`` (validation loss) and ``"end"`` (the summary). A resumed run first drops
the rows past its checkpoint (the interrupted session logged them, the resumed one logs them
again), so the file reads as one run; its event files hide the same rows from TensorBoard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "plot_losses", "read_metrics"]


class MetricsLog:
    """Appends rows to ``metrics.jsonl``, each flushed at once so a crash loses none; with
    ``tensorboard``, writes each row's numbers as TensorBoard scalars too.

    One ``write`` feeds both, so the two cannot disagree. In TensorBoard a ``train`` row's
    ``key`` is the tag ``train/<key>`` (``train/loss``, ``train/lr``, ``train/grad_norm``,
    ``train/tokens``, ``train/tokens_per_s``, ...), an ``eval`` row's ``val_<key>`` is
    ``val/<key>`` (``val/loss``), each at the row's step; a None (no tokens/s measured yet) is
    no point. The ``end`` row repeats the last train and eval rows' values, which TensorBoard
    already shows, and is not written there. Event files store float32.

    Args:
      path: the file; created if missing.
      resume_step: if given, rows of kind train/eval with ``step > resume_step`` and every
        ``end`` row are dropped first (the session being resumed logged them after its last
        checkpoint). Event files are append-only: this session's new one starts with a
        record that makes TensorBoard hide the earlier files' points past ``resume_step``
        (tensorboardX's ``purge_step``), the same rows.
      tensorboard: the folder of the event files, created if missing; None writes none (and
        does not import tensorboardX).
      writer: False for a log that reads and writes nothing, its ``write`` and ``close`` doing
        nothing: the log of a process other than 0 of a multi-process run, where process 0
        keeps the run's one log (``writer=jax.process_index() == 0``).

    Example:
      >>> import pathlib, tempfile
      >>> from rudax.run import MetricsLog, read_metrics
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
      >>> log = MetricsLog(path)
      >>> for step in (1, 2, 3):
      ...     log.write(kind="train", step=step, loss=4.0 - step)
      >>> log.close()  # interrupted after update 3; its checkpoint is of update 2
      >>> log = MetricsLog(path, resume_step=2)  # the resumed session logs 3 again
      >>> [row["step"] for row in read_metrics(path)]
      [1, 2]
      >>> log.close()
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        resume_step: int | None = None,
        tensorboard: str | os.PathLike | None = None,
        writer: bool = True,
    ):
        self.path = Path(path)
        self._events: Any = None
        self._file: Any = None
        if not writer:
            return
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if _kept(r, resume_step)]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        if tensorboard is not None:
            # Here, not at the top: importing tensorboardX imports torch where it is
            # installed, seconds of start-up a run without --tensorboard need not pay.
            from tensorboardX import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._events = SummaryWriter(str(tensorboard), purge_step=purge)
        self._file = open(self.path, "a")  # closed by close()

    def write(self, **row: Any) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._events is not None:
            for tag, value in _scalars(row).items():
                self._events.add_scalar(tag, value, global_step=row["step"])
            if row["kind"] == "eval":
                # tensorboardX writes from a queue, to disk every 2 minutes: flush at each
                # evaluation too (a few per run), not on every update.
                self._events.flush()

    def close(self) -> None:
        if self._file is None:
            return
        self._file.close()
        if self._events is not None:
            self._events.close()  # flushes the queue: a halted run's last rows are kept


_SECTIONS = {"train": ("train", ""), "eval": ("val", "val_")}  # kind: (tag prefix, key prefix)


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one row, tag: value (see ``MetricsLog``)."""
    if row["kind"] == "end":
        return {}
    section, prefix = _SECTIONS[row["kind"]]
    return {
        f"{section}/{key.removeprefix(prefix)}": float(value)
        for key, value in row.items()
        if key not in ("kind", "step") and value is not None
    }


def _kept(row: dict[str, Any], step: int) -> bool:
    return row.get("kind") in ("train", "eval") and row["step"] <= step


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every row of a metrics.jsonl file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(
    rows: Iterable[dict[str, Any]],
    path: str | os.PathLike,
    *,
    title: str,
    train_key: str = "loss",
    eval_key: str = "val_loss",
    ylabel: str = "cross-entropy (nats/token)",
) -> None:
    """Train and validation loss against the update step, as a PNG (matplotlib, Agg).

    ``train_key`` is read from the ``"train"`` rows and ``eval_key`` from the ``"eval"`` rows
    (a reward, say, with its ``ylabel``); rows without a number there are left out."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    rows = list(rows)
    series = lambda kind, key: [
        (r["step"], r[key])
        for r in rows
        if r.get("kind") == kind and isinstance(r.get(key), (int, float))
    ]
    train, val = series("train", train_key), series("eval", eval_key)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", linewidth=1.5)
    ax.set_xlabel("update step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
