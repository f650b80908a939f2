"""Checkpointer: numbered TrainingRecord checkpoints in one directory, on orbax.

Each step is an orbax composite checkpoint, ``<directory>/<step>/``, with one orbax PyTree
item ``arrays`` (``PyTreeSave``, the files of ``StandardSave``) holding ``{part: tree}`` for
each record part that is not None and holds an array (``model``, ``optimizer``,
``accumulator``, ``state``), readable with plain ``orbax.checkpoint`` (a part without arrays
is left out, its structure comes from the template; checkpoints of meta format 3 and older
have one item per part, and still restore), and a JSON item ``meta``
(``_meta.py``): the rudax version, the step, the parts saved, each part's layout (path, shape,
dtype of every leaf), the caller state's Python leaves, the record's config and recorded
dtypes, a checksum of every array and a digest of the whole item (both detect accidents, not
tampering: see ``_meta.py``). Typed PRNG keys are stored as their key data and come back as
keys of their impl (``_keys.py``). With ``zeros_as_metadata`` a leaf whose bytes are all zero
is listed in the meta item instead of written (``_zeros.py``). The checksums are computed
from the host copies of the arrays inside orbax's commit (``_meta_handler.py``): an async save
returns once the arrays are copied to the host, and the step commits once they are hashed and
written.

Restoring checks everything it can before it reads an array: the step directory (no symlink,
nothing outside the root: ``_paths.py``), the meta item's fields, then the template against
them (parts, config, tree structure, shapes, dtypes). After reading, every array's checksum is
compared with the saved one (``_integrity.py``): orbax does not notice bytes changed inside a
data file. A step that fails any of this raises ``CheckpointCorruptedError``; a template that
does not match raises ``ValueError`` naming the first differing path and both values.

Atomicity and retention are orbax ``CheckpointManager``'s: a step is written into a temporary
directory and renamed to its final name only once every item is complete, and an unfinished
temporary directory is never listed as a step. Retention deletes the oldest steps beyond
``keep`` after a save commits, so the newest committed step is never the one deleted. orbax
deletes a step in place, file by file, so a crash in the middle would leave a listed step
that cannot be read; here retention first renames it into ``<directory>/rudax-deleting/``
(orbax ``todelete_subdir``), atomically, and that folder is emptied once no save is in flight.

Nothing is lost silently. orbax's ``save`` returns False, writing nothing, for a step at or
below its latest one; here that is a ValueError (``overwrite=True`` rewinds on purpose), and
orbax's answer is checked. Only valid step directories are steps (``_paths.py``): a symlink or
a directory without rudax's meta item named like a step is ignored with a warning, so it can
never be "the latest" that makes later saves no-ops. A writer holds the directory's lock
(``_lock.py``) from open to close, and on opening deletes what failed saves left behind.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp

from rudax._validation import check_bool, check_positive_int
from rudax.checkpoint._config import check_config, config_difference
from rudax.checkpoint._integrity import (
    CheckpointCorruptedError,
    default_algorithm,
    verify_checksums,
)
from rudax.checkpoint._items import read_arrays
from rudax.checkpoint._keys import data_template, key_data, rewrap
from rudax.checkpoint._lock import DirectoryLock, hold
from rudax.checkpoint._meta import Meta, parse_meta
from rudax.checkpoint._meta_handler import MetaHandler, MetaRestore, MetaSave, exchange_key
from rudax.checkpoint._orbax_log import without_read_only_notice
from rudax.checkpoint._paths import (
    ARRAYS,
    META,
    TRASH,
    StepFormat,
    check_step,
    committed,
    empty_trash,
    normalize_root,
    remove_leftovers,
    step_directory,
    step_problem,
    warn_invalid_steps,
)
from rudax.checkpoint._record import (
    PARTS,
    TrainingRecord,
    check_array_leaves,
    describe,
    merge_state,
    split_state,
)
from rudax.checkpoint._sharded import (
    place_unplaced,
    restore_target,
    storage_layout,
)
from rudax.checkpoint._template import (
    check_layout,
    check_parts,
    check_recorded_dtypes,
    retyped,
)
from rudax.checkpoint._zeros import check_read, with_zeros, without, zero_paths


def _template(tree: Any) -> Any:
    # Each leaf read into the template's placement, never the saved one: see _sharded.py.
    return restore_target(tree)


def _brief(e: BaseException) -> str:
    # tensorstore puts a whole JSON spec in its messages; the chained exception keeps it all.
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


class Checkpointer:
    """Saves and restores ``TrainingRecord`` checkpoints, one numbered step each.

    The rule: ``save(step, record)`` writes the record under ``step`` (atomically: temp dir +
    rename), then deletes the oldest steps beyond ``keep``; ``restore(like, step=None)``
    reads the latest (or given) step into the structure of ``like`` after checking that
    ``like``'s parts, config, tree, shapes and dtypes are those saved, and checks every array
    read against the checksum saved with it. ``restore(..., strict=False)`` reads only the
    parts ``like`` has (the model alone, say) and lets its config differ;
    ``restore_with_dtypes`` reads a ``capture_with_dtypes`` record into a template of other
    floating dtypes. A damaged, altered or unsafe step raises ``CheckpointCorruptedError``.

    One writer per directory: a Checkpointer holds ``<directory>/rudax.lock`` (an OS file
    lock) until ``close()``; opening a second one on the directory, in any process, raises
    ``CheckpointLockedError`` naming the holder's pid, host and start time. Opening deletes
    the temporary directories that failed saves left (``<step>.orbax-checkpoint-tmp``: a full
    disk stays full of them otherwise). ``read_only=True`` takes no lock and changes nothing
    on disk: it restores and lists, beside a writer if need be (a step that the writer's
    retention deletes meanwhile fails to read; read one it keeps).

    Args:
      directory: the root directory (created if missing); steps are its subdirectories
        named ``str(step)``. Kept as ``self.directory``, absolute and with symlinks resolved.
      keep: how many of the newest committed steps to keep, an int >= 1.
      async_save: True returns from ``save`` after the device-to-host copy; checksums and
        files are written in orbax's background thread. Call ``wait()`` (or ``close()``)
        before relying on the step on disk; an error in the background is raised there, or
        by the next ``save``.
      read_only: True opens an existing directory to restore only: no lock, no cleanup,
        ``save`` refused.
      zeros_as_metadata: True saves each array leaf whose bytes are all zero (fresh AdamW
        moments, an emptied ``GradientAccumulator``) as a line of the meta item instead of
        data, and restores it as zeros in the template's placement; its checksum is still
        saved and checked. Plain orbax reads such a leaf as ``None`` (orbax's empty node)
        and everything else as usual. The check costs one pass over the host copies on the
        caller's thread (about 8 ms per 100 MB on a CPU) and, in a multi-process run, an
        all-gather of one byte per leaf. False (the default) writes every leaf.

    Raises:
      CheckpointLockedError: another Checkpointer (not ``read_only``) has the directory open.

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
        self,
        directory: str | os.PathLike,
        *,
        keep: int = 3,
        async_save: bool = False,
        read_only: bool = False,
        zeros_as_metadata: bool = False,
    ) -> None:
        self.directory = normalize_root(directory)
        check_positive_int("keep", keep)
        check_bool("async_save", async_save)
        check_bool("read_only", read_only)
        check_bool("zeros_as_metadata", zeros_as_metadata)
        self._zeros_as_metadata = zeros_as_metadata
        self._async_save = async_save
        self._read_only = read_only
        self._lock: DirectoryLock | None = None
        if read_only:
            if not os.path.isdir(self.directory):
                raise FileNotFoundError(
                    f"Checkpointer(read_only=True): no directory {self.directory} to read"
                )
        else:
            self._lock = hold(self.directory, self._clean)
        try:
            if jax.process_index() == 0:
                warn_invalid_steps(self.directory)
            with without_read_only_notice():  # the options log one too
                options = ocp.CheckpointManagerOptions(
                    max_to_keep=None if read_only else keep,
                    enable_async_checkpointing=async_save,
                    create=not read_only,
                    todelete_subdir=None if read_only else TRASH,
                    read_only=read_only,
                    step_name_format=StepFormat(),  # only valid steps: see _paths.py
                )
            # The parts' handlers (StandardCheckpointHandler) orbax finds from their arguments.
            registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
            meta_handler = MetaHandler()
            registry.add(META, MetaSave, meta_handler)
            registry.add(META, MetaRestore, meta_handler)
            with without_read_only_notice():
                self._manager = ocp.CheckpointManager(
                    self.directory, options=options, handler_registry=registry
                )
        except BaseException:
            self._release()
            raise

    def _clean(self) -> None:
        # Run while holding the lock, before orbax lists anything: no save is in flight.
        remove_leftovers(self.directory)  # what failed saves left: a full disk stays full
        empty_trash(self.directory)  # what a crash interrupted retention left behind

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def save(self, step: int, record: TrainingRecord, *, overwrite: bool = False) -> None:
        """Writes record as checkpoint ``step`` (an int >= 0, larger than any saved step).

        A step at or below the latest saved one is a ValueError naming both (orbax would
        write nothing and say nothing): a run restarted in an old directory must not keep
        the old weights unnoticed. ``overwrite=True`` rewinds on purpose: the saved steps from
        ``step`` on are deleted first (each moved out atomically), then ``step`` is written,
        so it is the latest; e.g. a run resumed from an earlier step because the latest is
        damaged. orbax's ``force=True`` does not overwrite, and a step left beside newer ones
        would never be the latest, so rewinding is the only overwrite that can mean anything.

        Every array is written in its own dtype, never cast: saving is at full precision.
        Before anything is written the record is checked (its leaves storable, its config JSON
        data, its recorded ``dtypes``, if any, those of its leaves). The arrays are copied to
        the host; a checksum of each (``_integrity.py``) is computed from those copies and
        written with the meta item as part of orbax's commit (``_meta_handler.py``). With
        ``async_save``, ``save`` returns after the checks, the device-to-host copy and orbax's
        setup of the step: hashing and writing go on in the background, and the step is
        listed once committed.
        The arrays may be donated, deleted or (NumPy) overwritten as soon as ``save`` returns.
        A save still in flight is waited for first, and if it failed its error is raised here.

        Args:
          step: the step number, an int >= 0 (not a bool); its directory is ``str(step)``.
          record: the ``TrainingRecord`` to write.
          overwrite: True deletes the saved steps ``>= step`` before writing; False (the
            default) refuses a step that is not after the latest.

        Raises:
          ValueError: ``step`` is not after the latest saved step (and not ``overwrite``),
            its name is taken by an entry that is not a step, or this Checkpointer is
            ``read_only``.
        """
        if self._read_only:
            raise ValueError(
                f"save: this Checkpointer of {self.directory} was opened with read_only=True "
                "and cannot save; open one without it (it takes the directory's lock)"
            )
        step = check_step(step)
        check_bool("overwrite", overwrite)
        if not isinstance(record, TrainingRecord):
            raise TypeError(f"record must be a TrainingRecord, got {type(record).__name__}")
        config = check_config(record.config, name="record.config")
        for name in ("model", "optimizer", "accumulator"):
            check_array_leaves(name, getattr(record, name))
        arrays, python = split_state(record.state)
        if record.dtypes is not None:
            check_recorded_dtypes(record, record.dtypes)
        parts = {p: getattr(record, p) for p in PARTS} | {"state": arrays}
        present = [p for p in PARTS if getattr(record, p) is not None]
        fields = {
            "step": step,
            "parts": present,
            "layout": {p: describe(getattr(record, p)) for p in present},
            "python_state": python,
            "config": config,
            "storage_dtypes": None if record.dtypes is None else dict(record.dtypes),
            "sharded": {p: storage_layout(getattr(record, p)) for p in present},
            "checksum_algorithm": default_algorithm(),
        }
        parts = {p: key_data(parts[p]) for p in present}  # typed keys as their data
        written = parts
        if self._zeros_as_metadata:
            zeros = {p: zero_paths(parts[p]) for p in present}
            zeros = {p: paths for p, paths in zeros.items() if paths}
            if zeros:
                fields["zeros"] = zeros
                written = {p: without(parts[p], zeros.get(p, [])) for p in present}
        released = threading.Event()  # hashing starts once save() returns (_meta_handler.py)
        if not self._async_save:
            released.set()  # orbax hashes and commits inside save()
        meta = MetaSave(fields, parts, exchange_key(step), released)  # every leaf, zeros too
        # One orbax item for all arrays: orbax's blocking setup of an async save grows with
        # the number of items (9 ms for one, 28 ms for four, on 2 cores). orbax refuses an
        # item without arrays; a part's structure comes back from the template.
        stored = {p: written[p] for p in present if jax.tree.leaves(written[p])}
        items = {ARRAYS: ocp.args.PyTreeSave(stored)} if stored else {}  # see _items.py
        self._wait()  # as orbax's save would; then nothing moves
        empty_trash(self.directory)
        self._check_new_step(step, overwrite)
        try:
            saved = self._manager.save(step, args=ocp.args.Composite(**items, meta=meta))
        except BaseException:
            released.set()  # a commit future already started must not wait forever
            self._manager.reload()  # see _wait
            raise
        released.set()
        if not saved:  # the checks above leave orbax no reason to skip: never a silent no-op
            raise RuntimeError(
                f"save: orbax declined to save step {step} in {self.directory} and wrote "
                f"nothing (orbax's latest step: {self._manager.latest_step()})"
            )
        if not self._async_save:
            empty_trash(self.directory)

    def _check_new_step(self, step: int, overwrite: bool) -> None:
        """ValueError unless step can be saved as the latest; with overwrite, makes it so."""
        problem = step_problem(self.directory, step)
        if problem not in (None, "missing"):
            where = os.path.join(self.directory, str(step))
            raise ValueError(
                f"save: {where} exists but is not a checkpoint step ({problem}); move it away, "
                "or save another step"
            )
        latest = self.latest_step()
        if latest is None or step > latest:
            return
        newer = [s for s in self.all_steps() if s >= step]
        if not overwrite:
            raise ValueError(
                f"save: step={step} is not after the latest saved step in {self.directory}: "
                f"the latest saved step is {latest}, and orbax would write nothing. Save a "
                f"later step, use another directory, or pass overwrite=True to delete steps "
                f"{newer} and save this one as the latest"
            )
        for s in reversed(newer):  # newest first: a crash between leaves a consistent prefix
            self._manager.delete(s)
        empty_trash(self.directory)

    def restore(
        self, like: TrainingRecord, *, step: int | None = None, strict: bool = True
    ) -> TrainingRecord:
        """Reads checkpoint ``step`` (default: the latest) into a record shaped like ``like``.

        The template must match what was saved: its parts, its config (compared path by path,
        see ``TrainingRecord.config``), and within each part the tree structure and every
        leaf's shape and dtype. A mismatch raises ValueError naming the first differing path
        and both values. With ``strict=False`` a part that is None in ``like`` is not read
        even if it was saved (restore the model only, on purpose), and the config is not
        compared; a part in ``like`` that was not saved is an error either way, and within a
        part everything must still match.

        Args:
          like: a ``TrainingRecord`` with the saved structure, e.g. freshly initialized; its
            values are not used, only its tree structure, shapes, dtypes, config and (for a
            ``jax.Array`` or a ``jax.ShapeDtypeStruct`` with a sharding) placement. Leaves
            may be ``jax.ShapeDtypeStruct``, e.g. from ``jax.eval_shape``.
          step: the step to read, or None for the latest committed one.
          strict: False restores only the parts ``like`` has and ignores config differences.

        Returns:
          A ``TrainingRecord`` with the saved values in ``like``'s pytree containers, with
          ``like``'s config and dtypes; parts that are None in ``like`` are None.

        Raises:
          FileNotFoundError: no such committed step.
          ValueError: the template does not match the checkpoint.
          CheckpointCorruptedError: the step's files are damaged, altered or unsafe to read.
        """
        return self._restore(like, step, strict, with_dtypes=False)

    def restore_with_dtypes(
        self, like: TrainingRecord, *, step: int | None = None, strict: bool = True
    ) -> TrainingRecord:
        """``restore``, with every floating leaf in the dtype recorded at save, whatever like's.

        For a checkpoint of a record made by ``TrainingRecord.capture_with_dtypes``. The
        template may give any floating dtype for a floating leaf (typically all fp32, from
        ``jax.eval_shape`` of the model and ``tx.init``); each leaf is read back in its
        recorded storage dtype, bit for bit: mixed bf16/fp16/fp32 parameters with fp32
        masters come back as they were. Tree structure and shapes must match, and a floating
        template leaf for a saved integer leaf (or the reverse) is an error, as in
        ``restore``.

        Args:
          like: a ``TrainingRecord`` template, as for ``restore``.
          step: the step to read, or None for the latest committed one.
          strict: as for ``restore``.

        Returns:
          A ``TrainingRecord`` as ``restore`` gives, each floating leaf in its recorded dtype
          and ``dtypes`` set to the recorded dtypes of the parts read.

        Example:
          >>> import tempfile
          >>> import jax, jax.numpy as jnp
          >>> import rudax.checkpoint as rc
          >>> params = {"w": jnp.array([1.5, -2.0], jnp.bfloat16)}
          >>> record = rc.TrainingRecord.capture_with_dtypes(model=params, optimizer=())
          >>> fp32_like = rc.TrainingRecord(
          ...     model={"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, optimizer=(),
          ...     accumulator=None, state=None,
          ... )
          >>> with rc.Checkpointer(tempfile.mkdtemp()) as ckpt:
          ...     ckpt.save(0, record)
          ...     restored = ckpt.restore_with_dtypes(fp32_like)
          >>> restored.model["w"].dtype, restored.model["w"].tolist()
          (dtype(bfloat16), [1.5, -2.0])
        """
        return self._restore(like, step, strict, with_dtypes=True)

    def _restore(
        self, like: TrainingRecord, step: int | None, strict: bool, *, with_dtypes: bool
    ) -> TrainingRecord:
        if not isinstance(like, TrainingRecord):
            raise TypeError(f"like must be a TrainingRecord, got {type(like).__name__}")
        check_bool("strict", strict)
        step = self._step_to_read(step)
        where = step_directory(self.directory, step)
        meta = self._read_meta(step, where)
        present = [p for p in PARTS if getattr(like, p) is not None]
        check_parts(meta, present, strict)
        if strict:
            config = check_config(like.config, name="like.config")
            difference = config_difference(meta.config, config)
            if difference:
                raise ValueError(
                    f"restore: step {step}: {difference}; pass strict=False to restore with "
                    "another config on purpose"
                )
        recorded = meta.storage_dtypes if with_dtypes else None  # None: a plain restore
        if with_dtypes and recorded is None:
            raise ValueError(
                f"restore_with_dtypes: step {step} in {self.directory} was saved without "
                "recorded dtypes; save records made by TrainingRecord.capture_with_dtypes, "
                "or read this one with restore and a template of the saved dtypes"
            )
        for p in present:
            check_layout(p, meta.layout[p], describe(getattr(like, p)), any_float=with_dtypes)
        state_arrays, _ = split_state(like.state, template=True)
        targets = {p: getattr(like, p) for p in PARTS} | {"state": state_arrays}
        if recorded is not None:
            targets = {p: retyped(p, targets[p], recorded) for p in PARTS}
        keys, targets = targets, {p: data_template(targets[p]) for p in PARTS}  # key data
        zeros = meta.zeros or {}
        placed = {p: _template(targets[p]) for p in present}
        read = {p: without(placed[p], zeros.get(p, [])) for p in present}
        stored = [p for p in present if jax.tree.leaves(read[p])]
        try:
            restored = read_arrays(self._manager, step, where, meta, {p: read[p] for p in stored})
        except Exception as e:  # orbax and tensorstore raise many types for damaged files
            raise CheckpointCorruptedError(
                f"{where}: reading {', '.join(f'record.{p}' for p in stored)} failed, the "
                f"checkpoint's files are damaged or incomplete: {_brief(e)}"
            ) from e
        for p in stored:
            check_read(where, p, restored[p], read[p])
        arrays = [p for p in present if p in stored or p in zeros]  # read, or made as zeros
        out = {p: targets[p] for p in present}  # a part without arrays: the template's tree
        for p in arrays:
            out[p] = place_unplaced(
                with_zeros(restored[p] if p in stored else None, placed[p], zeros.get(p, [])),
                targets[p],
            )
        for p in arrays:  # after placing: what is checked is what the caller gets
            verify_checksums(where, p, meta.checksums[p], out[p], meta.checksum_algorithm)
            out[p] = rewrap(out[p], keys[p])
        if like.state is not None:
            out["state"] = merge_state(out["state"], like.state, meta.python_state)
        dtypes = like.dtypes
        if recorded is not None:
            dtypes = {k: v for k, v in recorded.items() if k.startswith(tuple(present))}
        return TrainingRecord(**{p: out.get(p) for p in PARTS}, config=like.config, dtypes=dtypes)

    def _step_to_read(self, step: int | None) -> int:
        if step is None:
            latest = self.latest_step()
            if latest is None:
                raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
            return latest
        step = check_step(step)
        if step not in self.all_steps():
            problem = step_problem(self.directory, step)
            if problem not in (None, "missing"):
                where = os.path.join(self.directory, str(step))
                raise CheckpointCorruptedError(f"{where}: {problem}")
            raise FileNotFoundError(
                f"no checkpoint for {step=} in {self.directory}; saved: {self.all_steps()}"
            )
        return step

    def _read_meta(self, step: int, where: str) -> Meta:
        args = ocp.args.Composite(meta=MetaRestore())
        try:
            raw = self._manager.restore(step, args=args)[META]
        except Exception as e:  # a missing or truncated file, text that is not JSON, ...
            raise CheckpointCorruptedError(
                f"{where}: the meta item cannot be read: {_brief(e)}"
            ) from e
        return parse_meta(raw, step=step, where=where)

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first.

        Only directories named ``str(step)`` count: a step an async save is still writing, a
        half-written one left by a crash and names such as ``00012`` or ``12.tmp`` do not.
        A ``read_only`` Checkpointer lists the directory again on each call: a writer beside
        it commits steps, and its retention deletes them, after the reader was opened.
        """
        if self._read_only:
            self._manager.reload()  # orbax lists once, when opened
        return committed(self.directory, list(self._manager.all_steps()))

    def wait(self) -> None:
        """Blocks until an async save in flight has committed; raises its error if it failed.

        A failed save leaves no step (its temporary directory is never listed) and the steps
        before it as they were: retention runs only after a commit.
        """
        self._wait()
        if not self._read_only:
            empty_trash(self.directory)

    def close(self) -> None:
        """Waits for pending saves, releases orbax's resources and the directory's lock.

        Raises a failed save's error, the first one: an error of the cleanup after it is
        added to it as a note, never raised in its place.
        """
        try:
            self._wait()
        except BaseException as e:
            try:
                self._shut()
            except BaseException as later:  # the first error is the cause: it stays raised
                e.add_note(f"rudax: closing the checkpointer then failed too: {_brief(later)}")
            raise
        self._shut()

    def _shut(self) -> None:
        try:
            self._manager.close()
            if not self._read_only:
                empty_trash(self.directory)
        finally:
            self._release()

    def _wait(self) -> None:
        try:
            self._manager.wait_until_finished()
        except BaseException:
            # orbax has dropped the failed step from its list, and with it the steps that
            # retention was to delete after the commit: they are on disk, intact. Relist.
            self._manager.reload()
            raise

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
