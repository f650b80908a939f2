"""Async saves: the caller waits only for the device-to-host copy; hashing and writing commit later.

Timing asserts would be flaky on a shared machine, so the structure is proven instead: the
hash function is held at a gate (a ``threading.Event``), and the tests check that ``save``
returns while it is held, that the step is neither listed nor restorable until the gate
opens, and that it then commits and restores bit for bit, with checksums equal to those of
the values the record was built from (NumPy copies kept by the test). The arrays are donated,
deleted or overwritten while the hashing is held: what is saved must not change.

``main`` is the worker of the two-process test (``tests/sharding/_multiprocess.py`` runs it).
"""

from __future__ import annotations

import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.checkpoint as rc
from rudax.checkpoint import _integrity, _meta_handler

N = 8
PATIENCE = 30.0  # seconds a held hash waits before it fails the test (never, unless broken)

pytestmark = pytest.mark.skipif(
    jax.device_count() < N,
    reason=f"needs {N} devices (tests/conftest.py simulates 8 CPU devices)",
)


def _values():
    """The record's values as NumPy: ~21 MB, so the hashing runs on the thread pool."""
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((1024, 2048), np.float32),
        "emb": rng.standard_normal((512, 1024), np.float32).astype(jnp.bfloat16),
        "b": rng.standard_normal(1024, np.float32),
        "mu": rng.standard_normal((1024, 2048), np.float32),
        "count": np.array(7, np.int32),
        "order": rng.permutation(1 << 20).astype(np.int32),
    }


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:N]), ("x",))


def _record(values, mesh):
    """Sharded rows, sharded columns, replicated, single-device and NumPy leaves."""

    def put(name, spec):
        return jax.device_put(values[name], NamedSharding(mesh, spec))

    return rc.TrainingRecord.capture(
        model={"w": put("w", P("x")), "emb": put("emb", P(None, "x")), "b": put("b", P())},
        optimizer={"mu": jnp.asarray(values["mu"]), "count": jnp.asarray(values["count"])},
        state={"order": values["order"].copy(), "epoch": 3},
    )


def _like(values, mesh):
    return _record(jax.tree.map(np.zeros_like, values), mesh)


def _bits(x):
    x = np.asarray(x)
    return x.dtype, x.shape, x.tobytes()


def _assert_restores(ckpt, values, mesh, step=None):
    restored = ckpt.restore(_like(values, mesh), step=step)  # verifies every checksum too
    got = {**restored.model, **restored.optimizer, "order": restored.state["order"]}
    assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in values.items()}
    assert restored.state["epoch"] == 3


def _saved_meta(root, step):
    with open(root / str(step) / "meta" / "metadata") as f:
        return json.load(f)


def _expected_checksums(values):
    """Computed here from the NumPy values, not from the arrays that were saved."""
    parts = {"model": ("b", "emb", "w"), "optimizer": ("count", "mu"), "state": ("order",)}
    return {
        part: _integrity.checksums({k: values[k] for k in keys}, _integrity.default_algorithm())
        for part, keys in parts.items()
    }


class _Gate:
    """Holds every save's hashing (``local_sums``, whatever the checksum) until ``release`` is
    set (at the latest on exit).

    Also notes the threads that hashed and those that took a save's host copies. Enter it
    after the checkpointer, so that a failing test opens it before closing that.
    """

    def __init__(self, monkeypatch):
        self.started = threading.Event()
        self.release = threading.Event()
        self.hashed_on, self.copied_on = set(), set()
        real_hash, real_copies = _meta_handler.local_sums, _meta_handler.host_copies

        def held(*args):
            self.hashed_on.add(threading.current_thread().name)
            self.started.set()
            if not self.release.wait(PATIENCE):
                raise AssertionError(f"hashing was held {PATIENCE} s: a caller waited for it")
            return real_hash(*args)

        def copies(tree, **kwargs):
            self.copied_on.add(threading.current_thread().name)
            return real_copies(tree, **kwargs)

        monkeypatch.setattr(_meta_handler, "local_sums", held)
        monkeypatch.setattr(_meta_handler, "host_copies", copies)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release.set()


def _wait_until_arrays_are_written(root, step):
    """Until orbax has finished the arrays item's files in the step's temporary directory.

    orbax 0.12.8 writes an item's ``_METADATA`` after its arrays; then only the meta item
    (held at the gate) stands between the step and its commit.
    """
    deadline = time.monotonic() + PATIENCE
    while not list(root.glob(f"{step}.orbax-checkpoint-tmp*/arrays*/_METADATA")):
        assert time.monotonic() < deadline, sorted(
            str(p.relative_to(root)) for p in root.rglob("*")
        )
        time.sleep(0.02)


def test_async_save_returns_before_the_hashing_and_commits_after_it(tmp_path, monkeypatch):
    values, mesh = _values(), _mesh()
    record = _record(values, mesh)
    gate = _Gate(monkeypatch)
    with rc.Checkpointer(tmp_path, async_save=True) as ckpt, gate:
        ckpt.save(1, record)  # returns although no hash can finish
        assert gate.copied_on == {threading.current_thread().name}  # the host copies: here
        assert gate.started.wait(PATIENCE)  # the hashing runs meanwhile, in the background
        assert threading.current_thread().name not in gate.hashed_on
        _wait_until_arrays_are_written(tmp_path, 1)
        assert not gate.release.is_set()
        assert ckpt.all_steps() == [] and ckpt.latest_step() is None
        assert not (tmp_path / "1").exists()
        assert not list(tmp_path.glob("1.orbax-checkpoint-tmp*/meta*/metadata"))
        like = _like(values, mesh)
        with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
            ckpt.restore(like)
        with pytest.raises(FileNotFoundError, match=r"no checkpoint for step=1 .*saved: \[\]"):
            ckpt.restore(like, step=1)

        gate.release.set()
        ckpt.wait()
        assert ckpt.all_steps() == [1]
        _assert_restores(ckpt, values, mesh)
    assert _saved_meta(tmp_path, 1)["checksums"] == _expected_checksums(values)


def test_the_hashing_waits_until_save_returns(tmp_path, monkeypatch):
    # Hashing in the background while orbax still sets the step up on the caller's thread
    # competes with it for the cores: on 2 cores it multiplied the blocking time by 2-5.
    # Here orbax's save is made to linger after its work; no hash may start before it ends.
    values, mesh = _values(), _mesh()
    events = []
    real_sums = _meta_handler.local_sums

    def sums(flat, algorithm):
        events.append("hashed")
        return real_sums(flat, algorithm)

    monkeypatch.setattr(_meta_handler, "local_sums", sums)
    with rc.Checkpointer(tmp_path, async_save=True) as ckpt:
        real_save = ckpt._manager.save

        def lingering_save(*args, **kwargs):
            saved = real_save(*args, **kwargs)
            time.sleep(0.5)  # a background thread that started hashing would have by now
            events.append("orbax returned")
            return saved

        monkeypatch.setattr(ckpt._manager, "save", lingering_save)
        ckpt.save(1, _record(values, mesh))
        ckpt.wait()
        assert events == ["orbax returned", "hashed"]
        _assert_restores(ckpt, values, mesh)


def test_arrays_donated_deleted_or_overwritten_after_save_returns(tmp_path, monkeypatch):
    values, mesh = _values(), _mesh()
    record = _record(values, mesh)
    gate = _Gate(monkeypatch)
    overwrite = jax.jit(lambda x: jnp.full_like(x, -1), donate_argnums=0)
    with rc.Checkpointer(tmp_path, async_save=True) as ckpt, gate:
        ckpt.save(1, record)
        # What a train step may do at once: donate the sharded and single-device arrays to
        # a step that writes other values, drop others, write into the NumPy leaf.
        donated = [overwrite(record.model["w"]), overwrite(record.optimizer["mu"])]
        record.model["emb"].delete()
        record.model["b"].delete()
        record.state["order"][:] = -7
        assert gate.started.wait(PATIENCE) and not gate.release.is_set()
        # Fresh buffers of the same sizes, to take any memory that was freed.
        churn = [jnp.full(v.shape, 3, v.dtype) for v in values.values()]
        jax.block_until_ready((donated, churn))
        gate.release.set()
        ckpt.wait()
        _assert_restores(ckpt, values, mesh)
    assert _saved_meta(tmp_path, 1)["checksums"] == _expected_checksums(values)
    assert all(bool((np.asarray(d) == -1).all()) for d in donated)


class _Boom(RuntimeError):
    pass


def _failing_hash(monkeypatch):
    def fail(*args):
        raise _Boom("injected hashing failure")

    monkeypatch.setattr(_meta_handler, "local_sums", fail)


@pytest.mark.parametrize("surfaces_at", ["wait", "save", "close"])
def test_a_background_failure_surfaces_and_leaves_the_earlier_step(
    tmp_path, monkeypatch, surfaces_at
):
    values, mesh = _values(), _mesh()
    record = _record(values, mesh)
    ckpt = rc.Checkpointer(tmp_path, keep=1, async_save=True)
    ckpt.save(1, record)
    ckpt.wait()
    returned = False
    with monkeypatch.context() as patch, pytest.raises(_Boom, match="injected") as raised:
        _failing_hash(patch)
        ckpt.save(2, record)
        returned = True  # the failure is in the background
        if surfaces_at == "wait":
            ckpt.wait()
        elif surfaces_at == "save":
            ckpt.save(3, record)  # raises before it takes its own copies
        else:
            ckpt.close()
    assert returned
    assert any("step 2 was not committed" in note for note in raised.value.__notes__)
    # Retention ran for no commit: step 1 stays, listed and whole; step 2 never appears.
    if surfaces_at == "close":
        ckpt = rc.Checkpointer(tmp_path, keep=1, async_save=True)
    assert ckpt.all_steps() == [1]
    assert not (tmp_path / "2").exists()
    _assert_restores(ckpt, values, mesh)
    ckpt.save(4, record)  # the checkpointer goes on
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir() if "tmp" not in p.name) == ["4"]


def test_a_sync_save_raises_the_failure_itself(tmp_path, monkeypatch):
    values, mesh = _values(), _mesh()
    record = _record(values, mesh)
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        with monkeypatch.context() as patch:
            _failing_hash(patch)
            with pytest.raises(_Boom, match="injected"):
                ckpt.save(2, record)
        assert ckpt.all_steps() == [1]
        _assert_restores(ckpt, values, mesh)


def test_sync_and_async_saves_write_the_same_meta_item(tmp_path):
    values, mesh = _values(), _mesh()
    record = _record(values, mesh)
    for mode in ("sync", "async"):
        with rc.Checkpointer(tmp_path / mode, async_save=mode == "async") as ckpt:
            ckpt.save(5, record)
    texts = {m: (tmp_path / m / "5" / "meta" / "metadata").read_text() for m in ("sync", "async")}
    assert texts["sync"] == texts["async"]
    # The step's metadata names orbax's own JSON handler for the item, so plain orbax
    # restores it without being told how.
    step_meta = json.loads((tmp_path / "async" / "5" / "_CHECKPOINT_METADATA").read_text())
    assert step_meta["item_handlers"]["meta"] == ocp.handlers.JsonCheckpointHandler.typestr()
    with ocp.CheckpointManager(tmp_path / "async") as plain:
        assert plain.restore(5)["meta"] == json.loads(texts["async"])


# ------------------------------------------------------------------ 2 processes x 2 devices


def _process_values():
    rng = np.random.default_rng(1)
    return {
        "w": rng.standard_normal((8, 1024), np.float32),  # rows sharded over 4 devices
        "b": rng.standard_normal(256, np.float32),  # replicated on both processes
        "order": np.arange(1000, dtype=np.int32),  # NumPy: whole in each process
    }


def main(directory):
    """One process of the two-process test: an async save, then a sync one."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    values = _process_values()
    mine = [r for r, d in enumerate(devices) if d.process_index == jax.process_index()]
    rows = values["w"].reshape(4, 2, -1)[mine].reshape(-1, values["w"].shape[1])
    model = {
        "w": jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("x")), rows, values["w"].shape
        ),
        "b": jax.make_array_from_process_local_data(
            NamedSharding(mesh, P()), values["b"], values["b"].shape
        ),
    }
    record = rc.TrainingRecord.capture(model=model, optimizer=(), state={"order": values["order"]})
    with rc.Checkpointer(directory, async_save=True) as ckpt:
        ckpt.save(1, record)
        ckpt.wait()
    with rc.Checkpointer(directory) as ckpt:
        ckpt.save(2, record)
        return ckpt.all_steps()


def test_two_processes_add_their_sums_in_the_background(tmp_path):
    from tests.sharding._multiprocess import run_processes

    assert run_processes(__file__, 2, 2, timeout=90, args=[str(tmp_path)]) == [[1, 2], [1, 2]]
    values = _process_values()
    zeros = jax.tree.map(np.zeros_like, values)
    like = rc.TrainingRecord.capture(
        model={"w": zeros["w"], "b": zeros["b"]}, optimizer=(), state={"order": zeros["order"]}
    )
    with rc.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            restored = ckpt.restore(like, step=step)  # checksums verified against the sums
            got = {**restored.model, "order": restored.state["order"]}
            assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in values.items()}
    assert _saved_meta(tmp_path, 1)["checksums"]["model"] == _integrity.checksums(
        {"b": values["b"], "w": values["w"]}, _integrity.default_algorithm()
    )
