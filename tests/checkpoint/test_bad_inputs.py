"""The catalog of bad inputs to rudax.checkpoint, and of faults: nothing committed is lost.

Every case runs in a fresh directory holding two committed steps (1 and 2, a record with a
typed PRNG key in its caller state). The call makes the mistake and must raise the named
error; then, whatever happened, the committed steps are restored and compared bit for bit
(``_Scene.check``). A case that damages a step's files on purpose checks the other step.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.checkpoint as rc
from tests._catalog import Bad, catalog
from tests.checkpoint._assertions import assert_bitwise_equal


def _record(value: float, impl: str = "threefry2x32") -> rc.TrainingRecord:
    return rc.TrainingRecord.capture(
        model={
            "w": jnp.full((8,), value, jnp.float32),
            # 16 KB that zstd cannot shrink: the array data file is the step's largest
            "big": jax.random.normal(jax.random.key(int(value)), (64, 64)),
        },
        optimizer=(jnp.zeros((), jnp.int32),),
        state={"step": int(value), "rng": jax.random.key(int(value), impl=impl)},
        config={"lr": 0.1},
    )


def _keys_as_data(tree):
    def data(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return (jax.random.key_impl(x), np.asarray(jax.random.key_data(x)))
        return x

    return jax.tree.map(data, tree)


class _Scene:
    """A temporary checkpoint root with steps 1 and 2 committed, and the check they survive."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rudax-catalog-"))
        self.records = {1: _record(1.0), 2: _record(2.0)}
        with rc.Checkpointer(self.root) as ckpt:
            for step, record in self.records.items():
                ckpt.save(step, record)
        self.intact = [1, 2]

    def check(self) -> None:
        with warnings.catch_warnings():  # an invalid step the case made is warned about there
            warnings.simplefilter("ignore", RuntimeWarning)
            reader = rc.Checkpointer(self.root, read_only=True)
        with reader as ckpt:
            for step in self.intact:
                restored = ckpt.restore(self.records[step], step=step)
                assert_bitwise_equal(_keys_as_data(restored), _keys_as_data(self.records[step]))


def scene(mistake: Callable[[_Scene], object]) -> Callable[[], object]:
    """The case's call: makes the mistake in a fresh scene, then checks nothing was lost."""

    def call() -> object:
        s = _Scene()
        try:
            return mistake(s)
        finally:
            try:
                s.check()  # an AssertionError here replaces the expected error: the case fails
            finally:
                shutil.rmtree(s.root, ignore_errors=True)

    return call


def _reader_beside_retention(s: _Scene) -> object:
    with _open(s, read_only=True) as reader, _open(s, keep=2) as writer:
        s.records[3] = _record(3.0)
        writer.save(3, s.records[3])  # keep=2: step 1 goes
        s.intact = [2, 3]
        return reader.restore(s.records[2], step=1)


def _open(s: _Scene, **kwargs) -> rc.Checkpointer:
    return rc.Checkpointer(s.root, **kwargs)


def _with(s: _Scene, action: Callable[[rc.Checkpointer], object], **kwargs) -> object:
    with _open(s, **kwargs) as ckpt:
        return action(ckpt)


def _largest_file(directory: Path) -> Path:
    # The largest array data file (the meta item's JSON is larger than these tiny arrays).
    files = [p for p in directory.rglob("*") if p.is_file() and "ocdbt" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(s: _Scene) -> object:
    path = _largest_file(s.root / "2")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    s.intact = [1]
    return _with(s, lambda c: c.restore(s.records[2]))


def _flip(s: _Scene) -> object:
    path = _largest_file(s.root / "2")
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    path.write_bytes(bytes(data))
    s.intact = [1]
    return _with(s, lambda c: c.restore(s.records[2]))


def _edit_meta(s: _Scene) -> object:
    path = s.root / "2" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["python_state"]["['step']"] = 7  # well-formed, but not what was written
    path.write_text(json.dumps(meta))
    s.intact = [1]
    return _with(s, lambda c: c.restore(s.records[2]))


def _second_writer(s: _Scene) -> object:
    with _open(s) as first:
        first.save(3, _record(3.0))
        s.records[3] = _record(3.0)
        s.intact = [1, 2, 3]
        return _open(s)


def _symlinked_step(s: _Scene, action: Callable[[rc.Checkpointer], object]) -> object:
    os.symlink("2", s.root / "99")
    with pytest.warns(RuntimeWarning, match=r"/99 is not a checkpoint step"):
        ckpt = _open(s)
    with ckpt:
        return action(ckpt)


def _model(s: _Scene, **model) -> rc.TrainingRecord:
    return s.records[2]._replace(model=dict(s.records[2].model, **model))


def _leftover_then_old_step(s: _Scene) -> object:
    shutil.copytree(s.root / "2", s.root / "3.orbax-checkpoint-tmp")  # a failed save's
    return _with(s, lambda c: (c.save(2, _record(9.0)), c.all_steps()))


CASES = [
    Bad(
        "save-negative-step",
        scene(lambda s: _with(s, lambda c: c.save(-1, _record(0.0)))),
        ValueError,
        r"step must be >= 0, got step=-1",
    ),
    Bad(
        "save-bool-step",
        scene(lambda s: _with(s, lambda c: c.save(True, _record(0.0)))),
        TypeError,
        r"step must be an int, got step=True",
    ),
    Bad(
        "save-old-step-after-restart",
        scene(lambda s: _with(s, lambda c: c.save(1, _record(5.0)))),
        ValueError,
        r"step=1 is not after the latest saved step .*latest saved step is 2.*overwrite=True",
    ),
    Bad(
        "save-same-step-async",
        scene(lambda s: _with(s, lambda c: c.save(2, _record(5.0)), async_save=True)),
        ValueError,
        r"step=2 is not after the latest saved step .*latest saved step is 2",
    ),
    Bad(
        "save-overwrite-not-a-bool",
        scene(lambda s: _with(s, lambda c: c.save(3, _record(3.0), overwrite="yes"))),
        TypeError,
        r"overwrite",
    ),
    Bad(
        "save-not-a-record",
        scene(lambda s: _with(s, lambda c: c.save(3, {"w": jnp.ones(2)}))),
        TypeError,
        r"record must be a TrainingRecord, got dict",
    ),
    Bad(
        "save-under-a-symlinked-step-name",
        scene(lambda s: _symlinked_step(s, lambda c: c.save(99, _record(3.0)))),
        ValueError,
        r"/99 exists but is not a checkpoint step \(the step directory is a symlink.*move it",
    ),
    Bad(
        "save-old-step-with-a-leftover-tmp-dir",
        scene(_leftover_then_old_step),
        ValueError,
        r"step=2 is not after the latest saved step",
    ),
    Bad(
        "restore-a-symlinked-step",
        scene(lambda s: _symlinked_step(s, lambda c: c.restore(s.records[2], step=99))),
        rc.CheckpointCorruptedError,
        r"/99: the step directory is a symlink to .*/2",
    ),
    Bad(
        "second-writer-on-the-directory",
        scene(_second_writer),
        rc.CheckpointLockedError,
        rf"is in use by another Checkpointer: pid {os.getpid()} on host .* read_only=True",
    ),
    Bad(
        "save-with-a-read-only-checkpointer",
        scene(lambda s: _with(s, lambda c: c.save(3, _record(3.0)), read_only=True)),
        ValueError,
        r"opened with read_only=True and cannot save",
    ),
    Bad(
        "read-only-on-a-missing-directory",
        scene(lambda s: rc.Checkpointer(s.root / "nope", read_only=True)),
        FileNotFoundError,
        r"read_only=True\): no directory .*/nope",
    ),
    Bad(
        # issue 29: a reader listed the steps once, when opened, and then named step 1 as
        # saved after the writer's retention had deleted it (and never saw step 3)
        "reader-asks-for-a-step-the-writers-retention-deleted",
        scene(_reader_beside_retention),
        FileNotFoundError,
        r"no checkpoint for step=1 .*saved: \[2, 3\]",
    ),
    Bad(
        "restore-a-step-never-saved",
        scene(lambda s: _with(s, lambda c: c.restore(s.records[2], step=7))),
        FileNotFoundError,
        r"no checkpoint for step=7 .*saved: \[1, 2\]",
    ),
    Bad(
        "restore-template-of-another-shape",
        scene(lambda s: _with(s, lambda c: c.restore(_model(s, w=jnp.zeros(9))))),
        ValueError,
        r"record\.model\['w'\]: saved shape \(8,\) dtype float32, template shape \(9,\)",
    ),
    Bad(
        "restore-template-of-another-dtype",
        scene(lambda s: _with(s, lambda c: c.restore(_model(s, w=jnp.zeros(8, jnp.bfloat16))))),
        ValueError,
        r"record\.model\['w'\]: saved shape \(8,\) dtype float32, template .* dtype bfloat16",
    ),
    Bad(
        "restore-template-with-an-extra-leaf",
        scene(lambda s: _with(s, lambda c: c.restore(_model(s, w=jnp.zeros(8), b=jnp.zeros(1))))),
        ValueError,
        r"record\.model structure differs.*\['b'\]",
    ),
    Bad(
        "restore-key-of-another-impl",
        scene(lambda s: _with(s, lambda c: c.restore(_record(2.0, impl="rbg")))),
        ValueError,
        r"record\.state\['rng'\]: saved shape \(\) dtype key<fry>, template .* dtype key<rbg>",
    ),
    Bad(
        "restore-with-another-config",
        scene(lambda s: _with(s, lambda c: c.restore(s.records[2]._replace(config={"lr": 0.2})))),
        ValueError,
        r"config\['lr'\]: saved 0\.1, template 0\.2; pass strict=False",
    ),
    Bad(
        "restore-not-a-record",
        scene(lambda s: _with(s, lambda c: c.restore({"w": jnp.zeros(8)}))),
        TypeError,
        r"like must be a TrainingRecord, got dict",
    ),
    Bad(
        "restore-with-dtypes-of-a-plain-capture",
        scene(lambda s: _with(s, lambda c: c.restore_with_dtypes(s.records[2]))),
        ValueError,
        r"step 2 .* was saved without recorded dtypes",
    ),
    Bad(
        "damaged-truncated-data-file",
        scene(_truncate),
        rc.CheckpointCorruptedError,
        r"/2: reading record\.(model|optimizer|state).* failed",
    ),
    Bad(
        "damaged-flipped-bytes",
        scene(_flip),
        rc.CheckpointCorruptedError,
        r"/2: (reading record|record\..* was read back with checksum)",
    ),
    Bad(
        "damaged-meta-item-edited-by-hand",
        scene(_edit_meta),
        rc.CheckpointCorruptedError,
        r"/2: the meta item's digest does not match its contents",
    ),
    Bad(
        "keep-zero",
        scene(lambda s: rc.Checkpointer(s.root, keep=0)),
        ValueError,
        r"keep",
    ),
    Bad(
        "directory-is-a-file",
        scene(lambda s: rc.Checkpointer(s.root / "2" / "meta" / "metadata")),
        ValueError,
        r"directory must be a directory, got directory=.*metadata.*which is a file",
    ),
    Bad(
        "state-leaf-of-no-storable-type",
        scene(lambda s: _with(s, lambda c: c.save(3, s.records[2]._replace(state={"f": print})))),
        TypeError,
        r"state\['f'\] must be an array or a bool/int/float/str",
    ),
]

test_bad_input = catalog(CASES)
