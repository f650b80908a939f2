"""Checkpointer: bitwise round trips, exact resume, retention, template validation, plain orbax."""

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import rudax.checkpoint as rc
import rudax.optim as ro
from tests.checkpoint._assertions import assert_bitwise_equal


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "dense": {"w": jax.random.normal(k1, (3, 2)), "b": jnp.zeros(2)},
        "scale": jax.random.normal(k2, (2,)).astype(jnp.bfloat16),
    }


def _record(params=None, step_seed=0, pos=5):
    params = _params() if params is None else params
    tx = ro.adamw(1e-2)
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    _, opt_state = tx.update(grads, opt_state, params)  # count == 1, nonzero moments
    acc = ro.GradientAccumulator.init(params, dtype=jnp.float32).add(grads, weight=3)
    state = {
        "rng": jax.random.key_data(jax.random.key(step_seed)),
        "data_position": pos,
        "run": "exp-1",
        "loss_sum": np.float32(1.25),
    }
    return rc.TrainingRecord.capture(
        model=params, optimizer=opt_state, accumulator=acc, state=state
    )


def _fresh_like(record):
    return jax.tree.map(lambda x: jnp.zeros_like(x) if isinstance(x, jax.Array) else x, record)


def test_round_trip_is_bitwise(tmp_path):
    record = _record()
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, record)
        restored = ckpt.restore(_fresh_like(record))
    assert int(restored.optimizer[0].count) == 1
    assert int(restored.accumulator.count) == 1
    assert restored.state["data_position"] == 5 and restored.state["run"] == "exp-1"
    assert_bitwise_equal(restored, record)


def test_a_read_only_restore_logs_no_warning_and_other_absl_warnings_pass(tmp_path):
    # orbax logs "Given directory is read only" for every read-only manager, and
    # "CheckpointManagerOptions.read_only=True, setting save_interval_steps=0." for its
    # options: noise to a user who asked for exactly that. Only those lines are dropped.
    record = _record()
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, record)
    seen = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append(r.getMessage())
    absl = logging.getLogger("absl")
    absl.addHandler(handler)
    try:
        with rc.Checkpointer(tmp_path, read_only=True) as reader:
            assert_bitwise_equal(reader.restore(_fresh_like(record)), record)
        absl.warning("another warning")
    finally:
        absl.removeHandler(handler)
    assert not [m for m in seen if "read only" in m or "read_only" in m], seen
    assert "another warning" in seen


def test_round_trip_without_optional_parts(tmp_path):
    params = _params()
    record = rc.TrainingRecord.capture(model=params, optimizer=ro.sgd(0.1).init(params))
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, record)
        restored = ckpt.restore(record)
    assert restored.accumulator is None and restored.state is None
    assert_bitwise_equal(restored, record)


def test_resume_mid_window_matches_a_straight_run(tmp_path):
    x = jax.random.normal(jax.random.key(1), (6, 4, 3))
    y = jax.random.normal(jax.random.key(2), (6, 4, 2))
    tx = ro.adamw(1e-2, weight_decay=0.1)

    def loss_fn(params, xb, yb):
        pred = xb @ params["dense"]["w"] + params["dense"]["b"]
        return jnp.mean((pred - yb) ** 2)

    @jax.jit
    def micro(record, i):
        loss, grads = jax.value_and_grad(loss_fn)(record.model, x[i], y[i])
        acc = record.accumulator.add(grads)
        return record._replace(accumulator=acc), loss

    @jax.jit
    def apply(record):
        grads, acc = record.accumulator.pop(normalize=True)
        updates, opt_state = tx.update(grads, record.optimizer, record.model)
        params = jax.tree.map(lambda p, u: p + u, record.model, updates)
        return rc.TrainingRecord(params, opt_state, acc, record.state)

    def run(record, start, stop):
        losses = []
        for i in range(start, stop):
            record, loss = micro(record, i)
            losses.append(np.asarray(loss))
            if i % 2 == 1:  # windows of two microbatches
                record = apply(record)
        return record, losses

    params = {"dense": _params()["dense"]}
    init = rc.TrainingRecord.capture(
        model=params,
        optimizer=tx.init(params),
        accumulator=ro.GradientAccumulator.init(params),
        state={"rng": jax.random.key_data(jax.random.key(3))},
    )
    straight, straight_losses = run(init, 0, 6)

    first, losses = run(init, 0, 3)  # stops after one microbatch of the second window
    assert int(first.accumulator.count) == 1
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, first)
    with rc.Checkpointer(tmp_path) as ckpt:  # a fresh checkpointer, as after a restart
        resumed = ckpt.restore(_fresh_like(init))
    resumed, more = run(resumed, 3, 6)

    assert_bitwise_equal(resumed.model, straight.model)
    assert_bitwise_equal(resumed.optimizer, straight.optimizer)
    assert_bitwise_equal(resumed.accumulator, straight.accumulator)
    assert [loss.tobytes() for loss in losses + more] == [
        loss.tobytes() for loss in straight_losses
    ]


def test_retention_keeps_the_newest(tmp_path):
    record = _record()
    with rc.Checkpointer(tmp_path, keep=2) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        for step in (1, 2, 5):
            ckpt.save(step, record)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 5]
        assert ckpt.latest_step() == 5
    assert sorted(os.listdir(tmp_path)) == ["2", "5"]
    with rc.Checkpointer(tmp_path, keep=2) as ckpt:  # steps are found again after a restart
        assert ckpt.all_steps() == [2, 5]
        assert_bitwise_equal(ckpt.restore(record, step=2), record)


def test_async_save_round_trips(tmp_path):
    record = _record()
    with rc.Checkpointer(tmp_path, async_save=True) as ckpt:
        ckpt.save(1, record)
        ckpt.wait()
        assert_bitwise_equal(ckpt.restore(record), record)


def _reshaped(record):
    model = dict(record.model, scale=jnp.zeros(3, jnp.bfloat16))
    return record._replace(model=model)


def _retyped(record):
    model = dict(record.model, scale=jnp.zeros(2, jnp.float32))
    return record._replace(model=model)


def _restructured(record):
    model = dict(record.model, extra=jnp.zeros(1))
    return record._replace(model=model)


def _restated(record):
    return record._replace(state=dict(record.state, data_position="five"))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            _reshaped,
            r"record\.model\['scale'\]: saved shape \(2,\) dtype bfloat16, "
            r"template shape \(3,\)",
        ),
        (
            _retyped,
            r"record\.model\['scale'\]: saved shape \(2,\) dtype bfloat16, "
            r"template shape \(2,\) dtype float32",
        ),
        (_restructured, r"record\.model structure differs.*\['extra'\]"),
        (_restated, r"record\.state\['data_position'\]: saved a Python int, template a Python str"),
    ],
)
def test_mismatched_template_names_the_path(tmp_path, change, message):
    record = _record()
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        with pytest.raises(ValueError, match=message):
            ckpt.restore(change(record))


def test_missing_part_is_refused(tmp_path):
    record = _record()
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        with pytest.raises(ValueError, match="parts"):
            ckpt.restore(record._replace(accumulator=None))


def test_readable_with_plain_orbax(tmp_path):
    record = _record()
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(4, record)
    with ocp.StandardCheckpointer() as plain:
        arrays = plain.restore(tmp_path / "4" / "arrays")  # every part's arrays, one item
    assert_bitwise_equal(arrays["model"], record.model)
    with open(tmp_path / "4" / "meta" / "metadata") as f:  # orbax JsonSave's file name
        meta = json.load(f)
    assert meta["step"] == 4 and meta["python_state"]["['run']"] == "exp-1"


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"keep": 0}, ValueError),
        ({"keep": 1.5}, TypeError),
        ({"async_save": "yes"}, TypeError),
    ],
)
def test_bad_options_are_refused(tmp_path, kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        rc.Checkpointer(tmp_path, **kwargs)


def test_bad_steps_are_refused(tmp_path):
    record = _record()
    with rc.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match="step=-1"):
            ckpt.save(-1, record)
        with pytest.raises(TypeError, match="step"):
            ckpt.save("1", record)
        with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
            ckpt.restore(record)
        ckpt.save(1, record)
        with pytest.raises(FileNotFoundError, match="step=2"):
            ckpt.restore(record, step=2)


def test_retention_moves_a_step_away_before_deleting_it(tmp_path, monkeypatch):
    record = _record()
    moved = []
    real_rmtree = shutil.rmtree

    def watching_rmtree(path, *args, **kwargs):
        # What a crash at this moment would leave: the step is already out of the listing.
        moved.append((os.fspath(path), sorted(os.listdir(tmp_path))))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", watching_rmtree)
    with rc.Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, record)
        ckpt.save(2, record)
        assert ckpt.all_steps() == [2]
    held = ["2", "rudax-deleting", "rudax.lock"]  # the lock file lives while ckpt is open
    assert moved == [(os.fspath(tmp_path / "rudax-deleting" / "1"), held)]
    assert sorted(os.listdir(tmp_path)) == ["2"]
    # Leftovers of a crash in the middle of a deletion are never a step, and are cleared.
    shutil.copytree(tmp_path / "2", tmp_path / "rudax-deleting" / "1" / "half")
    with rc.Checkpointer(tmp_path, keep=1) as ckpt:
        assert ckpt.all_steps() == [2]
        assert_bitwise_equal(ckpt.restore(record), record)
    assert sorted(os.listdir(tmp_path)) == ["2"]


def test_a_reader_beside_a_writer_sees_the_steps_the_writer_commits_and_deletes(tmp_path):
    """read_only=True lists the directory on each call: it sees steps committed after it was
    opened, and no longer names the steps the writer's retention (keep=2) deleted (issue 29:
    it used to report no committed checkpoint while steps 3 and 4 existed)."""
    records = {s: _record(step_seed=s, pos=s) for s in (1, 2, 3, 4)}
    with rc.Checkpointer(tmp_path, keep=2) as writer:
        writer.save(1, records[1])
        writer.save(2, records[2])
        writer.wait()
        with rc.Checkpointer(tmp_path, read_only=True) as reader:
            assert reader.all_steps() == [1, 2]
            writer.save(3, records[3])
            writer.save(4, records[4])
            writer.wait()
            assert reader.all_steps() == [3, 4] and reader.latest_step() == 4
            restored = reader.restore(_fresh_like(records[4]))  # the latest: step 4
            assert restored.state["data_position"] == 4
            assert_bitwise_equal(restored, records[4])
            with pytest.raises(FileNotFoundError, match=r"no checkpoint for step=1 .* \[3, 4\]"):
                reader.restore(_fresh_like(records[1]), step=1)
