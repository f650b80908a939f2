"""A run directory's checkpoints: opened for a session that saves, and restored on ``--resume``
with errors that say what to do (a damaged checkpoint names the intact ones, each tried).

``rudax.checkpoint`` (orbax) is imported when these are called, not when ``rudax.run`` is:
the launcher (``python -m rudax.run.launch``) imports this package and needs none of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rudax.run._cli import UsageError

if TYPE_CHECKING:
    from rudax.checkpoint import Checkpointer, TrainingRecord

__all__ = ["open_checkpoints", "restore_latest"]

NEW_RUN = "start a new run (another --name or --run-dir)"


def open_checkpoints(run_dir: str | os.PathLike, *, keep: int) -> Checkpointer:
    """``run_dir/checkpoints`` opened for this session's saves, keeping the ``keep`` latest.

    Saves are meant for update boundaries, where a gradient accumulator is empty (all zeros)
    and, at step 0, so are AdamW's moments and LoRA's B: ``zeros_as_metadata`` lists such
    arrays instead of writing them (rudax reads them back as zeros).

    Raises:
      UsageError: another process (or ``Checkpointer``) has the directory open for writing.

    Example:
      >>> import tempfile
      >>> from rudax.run import open_checkpoints
      >>> checkpointer = open_checkpoints(tempfile.mkdtemp(), keep=2)
      >>> checkpointer.all_steps()
      []
      >>> checkpointer.close()
    """
    from rudax.checkpoint import Checkpointer, CheckpointLockedError

    directory = Path(run_dir) / "checkpoints"
    try:
        return Checkpointer(directory, keep=keep, zeros_as_metadata=True)
    except CheckpointLockedError as e:
        raise UsageError(f"--run-dir {run_dir}: its checkpoints are in use: {e}") from e


def restore_latest(
    checkpointer: Checkpointer,
    like: TrainingRecord,
    *,
    step: int | None = None,
    step_flag: str | None = None,
) -> TrainingRecord:
    """``--resume``: checkpoint ``step`` (None: the latest) restored into ``like``.

    Args:
      checkpointer: the run's (``open_checkpoints``), with at least one checkpoint.
      like: the record to restore into, its ``config`` this session's: a checkpoint saved
        under another configuration is refused, naming the differences.
      step: the checkpoint to restore; None for the latest.
      step_flag: the program's flag that picks a checkpoint (``"--resume-step"``), named in
        the advice for a damaged one; None where the program has none (the advice is then
        to move the damaged checkpoints aside).

    Raises:
      UsageError: the checkpoint is damaged (the message lists the intact ones, each tried
        by restoring it, and how to continue from the latest of them), or it was saved by
        another configuration (the message names the difference and what to do).
    """
    from rudax.checkpoint import CheckpointCorruptedError

    directory = Path(checkpointer.directory)
    saved = checkpointer.all_steps()
    chosen = saved[-1] if step is None else step
    try:
        return checkpointer.restore(like, step=chosen)
    except CheckpointCorruptedError as e:
        intact = [s for s in saved if s != chosen and _restores(checkpointer, like, s)]
        fix = _continue_from(intact, saved, directory, step_flag)
        raise UsageError(
            f"--resume: checkpoint {chosen} in {directory} is damaged; {fix} ({e})"
        ) from e
    except ValueError as e:  # saved under another configuration
        difference = str(e).partition("; pass strict=False")[0]
        raise UsageError(
            f"--resume: the run's config.json does not describe the run its checkpoint "
            f"{chosen} was saved by ({difference}): put back the config.json the run was "
            f"started with, or {NEW_RUN}"
        ) from e


def _continue_from(
    intact: Sequence[int], saved: Sequence[int], directory: Path, step_flag: str | None
) -> str:
    if not intact:
        return f"no other checkpoint is intact: {NEW_RUN}"
    listed = f"intact: {', '.join(map(str, intact))}"
    if step_flag is not None:
        return f"{listed}; continue from one with {step_flag} {intact[-1]}"
    later = " ".join(str(directory / str(s)) for s in saved if s > intact[-1])
    return f"{listed}; move {later} out of {directory} to resume from update {intact[-1]}"


def _restores(checkpointer: Checkpointer, like: TrainingRecord, step: int) -> bool:
    try:
        checkpointer.restore(like, step=step)
    except ValueError:  # CheckpointCorruptedError, or a step of another configuration
        return False
    return True
