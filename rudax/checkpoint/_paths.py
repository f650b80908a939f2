"""Step directories: which names are steps, which are valid, and which are safe to read.

A step is an int >= 0 and its directory is ``<root>/<step>`` with the step in plain decimal,
no sign and no leading zero: ``str(step)``. orbax (0.12.8) lists a root's finalized step
directories by name and already skips ``00012``, ``12.tmp``, ``-1``, ``run_7`` and
non-ASCII digits such as ``"٣"``, but it lists anything else of such a name: a symlinked
``<root>/99 -> 3`` or ``-> /elsewhere``, a copy of a plain orbax checkpoint. Listed, an entry
above the real steps is "the latest", and orbax then skips every save at a lower step
(``should_save`` is False) without a word. So a step is *valid* only if ``<root>/<step>`` is
a real directory (not a symlink) that orbax finalized and that holds rudax's meta item
(``meta/metadata``, written last inside orbax's commit): ``step_problem``. orbax itself is
given ``StepFormat``, which lists only valid steps, so its latest step, its retention and its
save decisions never see another entry; a Checkpointer warns once about each one it ignores,
refuses to save under its name, and names the problem if it is asked to restore it.

Reading a valid step still refuses a directory that resolves outside the root or holds a
symlink anywhere inside: orbax never writes one, so any is a path traversal or tampering.

A save that fails (a full disk, a crash) leaves ``<step>.orbax-checkpoint-tmp``, never listed
as a step but holding its partial files: ``remove_leftovers`` deletes them, on the primary
process, when a writing Checkpointer opens (it holds the directory's lock, so no save of
another process can be in flight).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp

from rudax._validation import check_int
from rudax.checkpoint._integrity import CheckpointCorruptedError
from rudax.checkpoint._meta_handler import FILENAME

# The meta item's name in a step: its file ``<step>/meta/metadata`` marks a rudax step.
META = "meta"
# The orbax item holding every part's arrays, {part: tree} (meta format 4 on; see _meta.py).
ARRAYS = "arrays"
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")
_TMP_SUFFIX = ocp.path.atomicity_types.TMP_DIR_SUFFIX  # orbax names a step in progress so
_LEFTOVER = re.compile(r"(0|[1-9][0-9]*)" + re.escape(_TMP_SUFFIX) + ".*")

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


def step_problem(root: str, step: int) -> str | None:
    """Why ``<root>/<step>`` is not a valid step (see the module docstring); None if it is.

    ``"missing"`` when nothing of that name exists (a step not saved, or still in flight).
    """
    where = os.path.join(root, str(step))
    if os.path.islink(where):
        return (
            f"the step directory is a symlink to {os.path.realpath(where)}; orbax writes none, "
            "and rudax follows none: it could lead anywhere"
        )
    if not os.path.lexists(where):
        return "missing"
    if not os.path.isdir(where):
        return "not a directory"
    meta = os.path.join(where, META, FILENAME)
    if os.path.islink(os.path.join(where, META)) or os.path.islink(meta):
        return f"its meta item is a symlink to {os.path.realpath(meta)}"
    if not os.path.isfile(meta):
        return (
            f"the meta item cannot be read: FileNotFoundError: no {META}/{FILENAME}, so not "
            "a complete rudax checkpoint"
        )
    return None


def committed(root: str, steps: list[int]) -> list[int]:
    """The valid steps among steps, oldest first (a step in flight is not yet valid)."""
    return sorted(s for s in steps if step_problem(root, s) is None)


def warn_invalid_steps(root: str) -> None:
    """A RuntimeWarning for each entry of root named like a step that is not a valid one."""
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        if _STEP_NAME.fullmatch(name):
            problem = step_problem(root, int(name))
            if problem is not None:
                warnings.warn(
                    f"{os.path.join(root, name)} is not a checkpoint step ({problem}); it is "
                    "ignored: never listed, restored, counted by retention or deleted",
                    RuntimeWarning,
                    stacklevel=3,
                )


def remove_leftovers(root: str) -> None:
    """Deletes the temporary directories of saves that failed; primary process only.

    Call it only while holding the directory's lock, with no save in flight. A symlink of
    such a name is unlinked, never followed.
    """
    if jax.process_index() != 0 or not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if not _LEFTOVER.fullmatch(name):
            continue
        path = os.path.join(root, name)
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            _remove_tree(path)


def _remove_tree(path: str, *, attempts: int = 20, pause_s: float = 0.1) -> None:
    """shutil.rmtree, retried while a file still appears in it; the last failure is raised.

    The lock rules out another writer, but not orbax's own threads of a save that failed in
    this process: when one item of an async save fails (its hashing, say), orbax reports it
    while the other items' tensorstore writes may still be finishing, after the failed
    Checkpointer closed. Those writes end within moments; rmtree meets them as "Directory not
    empty" (a file created after it listed the folder).
    """
    for attempt in range(attempts):
        try:
            shutil.rmtree(path)
            return
        except OSError as e:
            if not os.path.lexists(path):
                return
            if e.errno not in (errno.ENOTEMPTY, errno.ENOENT) or attempt == attempts - 1:
                raise
            time.sleep(pause_s)


@dataclasses.dataclass(frozen=True)
class StepFormat(ocp.path.step.NameFormat):
    """orbax's standard step names (``str(step)``), listing only valid steps.

    Given to ``CheckpointManagerOptions.step_name_format``: orbax's latest step, retention and
    save decisions then see the steps rudax restores and nothing else.
    """

    inner: Any = dataclasses.field(default_factory=ocp.path.step.standard_name_format)

    def build_name(self, step: int) -> str:
        return self.inner.build_name(step)

    def find_all(self, base_path: Any) -> Iterator[Any]:
        root = os.fspath(base_path)
        return (m for m in self.inner.find_all(base_path) if step_problem(root, m.step) is None)

    def find_step(self, base_path: Any, step: int) -> Any:
        found = self.inner.find_step(base_path, step)
        problem = step_problem(os.fspath(base_path), step)
        if problem is not None:
            raise ValueError(f"{os.path.join(os.fspath(base_path), str(step))}: {problem}")
        return found


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
