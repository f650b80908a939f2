"""Checkpointer: numbered TrainingRecord checkpoints in one directory, on orbax.

Each step is an orbax composite checkpoint, ``<directory>/<step>/``, with one item per record
part that is not None (``model``, ``optimizer``, ``accumulator``, ``state``: orbax
``StandardSave``, readable with plain ``orbax.checkpoint``) and a JSON item ``meta``: the rudax
version, the step, the parts saved, each part's layout (path, shape, dtype of every leaf) and
the caller state's Python leaves.

Atomicity and retention are orbax ``CheckpointManager``'s: a step is written into a temporary
directory and renamed to its final name only once every item is complete, and an unfinished
temporary directory is never listed as a step. Retention deletes the oldest steps beyond
``keep`` after a save commits, so the newest committed step is never the one deleted.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

import rudax
from rudax._validation import check_bool, check_int, check_positive_int
from rudax.checkpoint._record import (
    PARTS,
    TrainingRecord,
    describe,
    merge_state,
    split_state,
)

META = "meta"


def _template(tree: Any) -> Any:
    # orbax's StandardRestore refuses NumPy scalars as targets; shape and dtype are all it needs.
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _check_layout(part: str, saved: list[list[Any]], template: list[list[Any]]) -> None:
    """ValueError naming the first leaf where the template differs from what was saved."""
    for s, t in zip(saved, template, strict=False):
        if s[0] != t[0]:
            raise ValueError(
                f"restore: record.{part} structure differs: saved leaf record.{part}{s[0]}, "
                f"template leaf record.{part}{t[0]}"
            )
        if s[1:] != t[1:]:
            raise ValueError(f"restore: record.{part}{s[0]}: saved {_show(s)}, template {_show(t)}")
    if len(saved) != len(template):
        longer, what = (saved, "saved") if len(saved) > len(template) else (template, "template")
        first_extra = longer[min(len(saved), len(template))][0]
        raise ValueError(
            f"restore: record.{part} structure differs: record.{part}{first_extra} is only in "
            f"the {what} tree ({len(saved)} saved leaves, {len(template)} in the template)"
        )


def _show(row: list[Any]) -> str:
    if row[1] == "python":
        return f"a Python {row[2]}"
    return f"shape {tuple(row[1])} dtype {row[2]}"


class Checkpointer:
    """Saves and restores ``TrainingRecord`` checkpoints, one numbered step each.

    The rule: ``save(step, record)`` writes the record under ``step`` (atomically: temp dir +
    rename), then deletes the oldest steps beyond ``keep``; ``restore(like, step=None)``
    reads the latest (or given) step into the structure of ``like`` after checking that
    ``like``'s tree, shapes and dtypes are those saved.

    Args:
      directory: the root directory (created if missing); steps are its subdirectories.
      keep: how many of the newest committed steps to keep, an int >= 1.
      async_save: True returns from ``save`` after the device-to-host copy and writes in a
        background thread; call ``wait()`` (or ``close()``) before relying on it on disk.

    Example:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> import rudax.checkpoint as rc
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.arange(3.0)}
      >>> record = rc.TrainingRecord.capture(model=params, optimizer=ro.sgd(0.1).init(params))
      >>> with rc.Checkpointer(tempfile.mkdtemp(), keep=2) as ckpt:
      ...     ckpt.save(1, record)
      ...     restored = ckpt.restore(record)
      >>> restored.model["w"].tolist()
      [0.0, 1.0, 2.0]

    References:
      orbax-checkpoint ``CheckpointManager``, https://orbax.readthedocs.io.
    """

    def __init__(
        self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = False
    ) -> None:
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(f"directory must be a str or os.PathLike, got {directory=}")
        check_positive_int("keep", keep)
        check_bool("async_save", async_save)
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(*PARTS, META)
        )

    def save(self, step: int, record: TrainingRecord) -> None:
        """Writes record as checkpoint ``step`` (an int >= 0, larger than any saved step)."""
        check_int("step", step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step=}")
        if not isinstance(record, TrainingRecord):
            raise TypeError(f"record must be a TrainingRecord, got {type(record).__name__}")
        arrays, python = split_state(record.state)
        parts = {**record._asdict(), "state": arrays}
        present = [p for p in PARTS if getattr(record, p) is not None]
        meta = {
            "rudax_version": rudax.__version__,
            "step": int(step),
            "parts": present,
            "layout": {p: describe(getattr(record, p)) for p in present},
            "python_state": python,
        }
        items = {p: ocp.args.StandardSave(parts[p]) for p in present}
        self._manager.save(
            int(step), args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta))
        )

    def restore(self, like: TrainingRecord, *, step: int | None = None) -> TrainingRecord:
        """Reads checkpoint ``step`` (default: the latest) into a record shaped like ``like``.

        Args:
          like: a ``TrainingRecord`` with the saved structure, e.g. freshly initialized; its
            values are not used, only its tree structure, shapes and dtypes.
          step: the step to read, or None for the latest committed one.

        Returns:
          A ``TrainingRecord`` with the saved values, in ``like``'s pytree containers.
        """
        if not isinstance(like, TrainingRecord):
            raise TypeError(f"like must be a TrainingRecord, got {type(like).__name__}")
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
        check_int("step", step)
        if step not in self.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for {step=} in {self.directory}; saved: {self.all_steps()}"
            )
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            META
        ]
        present = [p for p in PARTS if getattr(like, p) is not None]
        if present != meta["parts"]:
            raise ValueError(
                f"restore: step {step} holds parts {meta['parts']}, the template {present}"
            )
        for p in present:
            _check_layout(p, meta["layout"][p], describe(getattr(like, p)))
        state_arrays, _ = split_state(like.state)
        targets = {**like._asdict(), "state": state_arrays}
        items = {p: ocp.args.StandardRestore(_template(targets[p])) for p in present}
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        out = {p: restored[p] if p in present else None for p in PARTS}
        if like.state is not None:
            out["state"] = merge_state(restored["state"], like.state, meta["python_state"])
        return TrainingRecord(**out)

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Blocks until an async save in flight has committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
