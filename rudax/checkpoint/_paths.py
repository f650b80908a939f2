"""Step directories: which names are steps, and which directories are safe to read.

A step is an int >= 0 and its directory is ``<root>/<step>`` with the step in plain decimal,
no sign and no leading zero: ``str(step)``. orbax (0.12.8) lists a root's finalized step
directories by name and already skips ``00012``, ``12.tmp``, ``-1``, ``run_7`` and
non-ASCII digits such as ``"٣"``, but it follows a step directory that is a symlink, and reads
a symlinked ``<root>/30 -> /elsewhere`` as step 30 from wherever the link points. rudax lists
only names equal to ``str(step)`` whose directory exists (a step still being written by an
async save lives under a temporary name until it commits), and refuses to read a step
directory that is a symlink, resolves outside the root, or holds a symlink anywhere inside:
orbax never writes one, so any is a path traversal or tampering.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax

from rudax._validation import check_int
from rudax.checkpoint._integrity import CheckpointCorruptedError

# Where retention moves a step before deleting it (orbax ``todelete_subdir``): a rename is
# atomic, so a crash during a deletion leaves either a whole step or no step under its name,
# never a half-deleted one that is still listed. Not a step name, so never listed itself.
TRASH = "rudax-deleting"


def empty_trash(root: str) -> None:
    """Deletes what retention moved into ``<root>/TRASH``, then the folder; primary host only.

    Call it only while no save is in flight: orbax may be moving a step in.
    """
    trash = os.path.join(root, TRASH)
    if jax.process_index() != 0 or not os.path.isdir(trash):
        return
    for name in os.listdir(trash):
        shutil.rmtree(os.path.join(trash, name), ignore_errors=True)
    try:
        os.rmdir(trash)
    except OSError:
        pass  # not empty: left for the next call


def check_step(step: Any) -> int:
    """step as an int; TypeError unless an int (not a bool), ValueError unless >= 0."""
    check_int("step", step)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step=}")
    return int(step)


def normalize_root(directory: Any) -> str:
    """The absolute, symlink-free path of a checkpoint root; TypeError/ValueError if unusable."""
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(f"directory must be a str or os.PathLike, got {directory=}")
    path = os.fspath(directory)
    if not isinstance(path, str):
        raise TypeError(f"directory must name a path as str, got {directory=}")
    if not path or "\x00" in path:
        raise ValueError(f"directory must be a non-empty path without NUL bytes, got {directory=}")
    root = os.path.realpath(os.path.abspath(path))
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"directory must be a directory, got {directory=}, which is a file")
    return root


def committed(root: str, steps: list[int]) -> list[int]:
    """The steps, oldest first, whose directory ``<root>/<step>`` exists."""
    return sorted(s for s in steps if os.path.isdir(os.path.join(root, str(s))))


def step_directory(root: str, step: int) -> str:
    """``<root>/<step>`` after checking that reading it stays inside root.

    Raises ``CheckpointCorruptedError`` naming the directory if it is a symlink, resolves
    outside root, or contains a symlink.
    """
    where = os.path.join(root, str(step))
    if os.path.islink(where) or os.path.realpath(where) != where:
        raise CheckpointCorruptedError(
            f"{where}: the step directory is a symlink to {os.path.realpath(where)}; refusing "
            "to read a checkpoint from outside the checkpoint root"
        )
    for parent, dirs, files in os.walk(where):
        for name in dirs + files:
            path = os.path.join(parent, name)
            if os.path.islink(path):
                raise CheckpointCorruptedError(
                    f"{where}: {os.path.relpath(path, where)} is a symlink to "
                    f"{os.path.realpath(path)}; orbax writes none, refusing to follow it"
                )
    return where
