"""rudax.run.open_checkpoints / restore_latest: a run's checkpoints opened once for writing
(a second writer refused, naming the holder); --resume restores the latest (or a chosen)
checkpoint bit for bit; a damaged one names the intact ones, each tried, with the program's
flag or the folders to move aside, and the advice works; a checkpoint of another
configuration names the difference."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import rudax.checkpoint as rc
from rudax.run import UsageError, open_checkpoints, restore_latest


def _record(value, lr=0.1):
    return rc.TrainingRecord.capture(
        model={"w": np.full((64, 64), value, np.float32)},
        optimizer=None,
        accumulator=None,
        state={"step": int(value)},
        config={"lr": lr},
    )


def _run(tmp_path, steps=(1, 2, 3)):
    run_dir = tmp_path / "run"
    checkpointer = open_checkpoints(run_dir, keep=5)
    for s in steps:
        checkpointer.save(s, _record(float(s)))
    checkpointer.close()
    return run_dir


def _damage(run_dir, step):
    files = [p for p in (run_dir / "checkpoints" / str(step)).rglob("*") if p.is_file()]
    path = max(files, key=lambda p: p.stat().st_size)  # the array data
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def test_the_latest_or_a_chosen_checkpoint_is_restored(tmp_path):
    run_dir = _run(tmp_path)
    checkpointer = open_checkpoints(run_dir, keep=5)
    try:
        with pytest.raises(UsageError, match=r"--run-dir \S+run: its checkpoints are in use"):
            open_checkpoints(run_dir, keep=5)
        assert restore_latest(checkpointer, _record(0.0)).state == {"step": 3}
        restored = restore_latest(checkpointer, _record(0.0), step=2)
        np.testing.assert_array_equal(restored.model["w"], np.full((64, 64), 2.0, np.float32))
    finally:
        checkpointer.close()


@pytest.mark.parametrize("flag", [None, "--resume-step"])
def test_a_damaged_checkpoint_names_the_intact_ones_and_the_advice_works(tmp_path, flag):
    run_dir = _run(tmp_path)
    _damage(run_dir, 3)
    _damage(run_dir, 2)
    checkpointer = open_checkpoints(run_dir, keep=5)
    try:
        with pytest.raises(UsageError) as raised:
            restore_latest(checkpointer, _record(0.0), step_flag=flag)
    finally:
        checkpointer.close()
    message = str(raised.value)
    directory = run_dir / "checkpoints"
    assert f"--resume: checkpoint 3 in {directory} is damaged; intact: 1;" in message
    if flag:
        assert "continue from one with --resume-step 1" in message
        return
    assert f"move {directory / '2'} {directory / '3'} out of {directory}" in message
    assert "to resume from update 1" in message
    for s in (2, 3):  # the advice, followed
        shutil.move(directory / str(s), tmp_path / f"aside-{s}")
    checkpointer = open_checkpoints(run_dir, keep=5)
    try:
        assert restore_latest(checkpointer, _record(0.0)).state == {"step": 1}
    finally:
        checkpointer.close()


def test_nothing_intact_and_another_configuration_say_what_to_do(tmp_path):
    run_dir = _run(tmp_path, steps=(1,))
    checkpointer = open_checkpoints(run_dir, keep=5)
    try:
        with pytest.raises(UsageError, match=r"config\['lr'\]: saved 0\.1, template 0\.2.*put back "
                           r"the config\.json the run was started with"):  # fmt: skip
            restore_latest(checkpointer, _record(0.0, lr=0.2))
    finally:
        checkpointer.close()
    _damage(run_dir, 1)
    checkpointer = open_checkpoints(run_dir, keep=5)
    try:
        with pytest.raises(UsageError, match="no other checkpoint is intact: start a new run"):
            restore_latest(checkpointer, _record(0.0))
    finally:
        checkpointer.close()
