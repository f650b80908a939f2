"""No save is lost silently: old steps, invalid step directories, leftovers, a second writer.

Each test here failed on rudax before issue 11: ``save`` at an old step returned without
writing, a symlinked step above the real ones turned every later save into a no-op, failed
saves' temporary directories were never removed, and two Checkpointers wrote into one
directory at once.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import rudax.checkpoint as rc
from tests.checkpoint._assertions import assert_bitwise_equal

TMP = ".orbax-checkpoint-tmp"
REPO = Path(__file__).resolve().parents[2]


def _record(value, n=8):
    return rc.TrainingRecord.capture(
        model={"w": jnp.full((n,), value, jnp.float32)},
        optimizer=(),
        state={"step": int(value)},
    )


def _leftovers(root):
    return sorted(name for name in os.listdir(root) if TMP in name)


# --- 6: a step at or below the latest one --------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("step", [2, 1, 0])
def test_saving_at_or_below_the_latest_step_is_an_error(tmp_path, step, async_save):
    old, new = _record(1.0), _record(2.0)
    with rc.Checkpointer(tmp_path, async_save=async_save) as ckpt:
        ckpt.save(2, old)
        with pytest.raises(ValueError, match=rf"step={step} .*latest saved step is 2.*overwrite"):
            ckpt.save(step, new)
        ckpt.wait()
        assert ckpt.all_steps() == [2]
        assert_bitwise_equal(ckpt.restore(old), old)
    with rc.Checkpointer(tmp_path, async_save=async_save) as ckpt:  # a restarted run, too
        with pytest.raises(ValueError, match=r"latest saved step is 2"):
            ckpt.save(2, new)
        assert_bitwise_equal(ckpt.restore(old), old)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_overwrite_replaces_the_step_and_discards_the_newer_ones(tmp_path, async_save):
    records = {s: _record(float(s)) for s in (1, 2, 3)}
    with rc.Checkpointer(tmp_path, async_save=async_save) as ckpt:
        for s, r in records.items():
            ckpt.save(s, r)
        rewound = _record(9.0)
        ckpt.save(2, rewound, overwrite=True)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
        assert_bitwise_equal(ckpt.restore(rewound), rewound)
        assert_bitwise_equal(ckpt.restore(records[1], step=1), records[1])
        ckpt.save(3, records[3], overwrite=True)  # nothing to discard: an ordinary save
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "3"]  # the lock file goes on close


# --- 7: step directories that are not checkpoints -------------------------------------------


def _invalid_step(root, tmp_path, kind):
    if kind == "symlink to a step":
        os.symlink("3", root / "99")
    elif kind == "symlink elsewhere":
        shutil.copytree(root / "3", tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", root / "99")
    else:  # a directory without rudax's meta item: a copy of a plain orbax checkpoint
        shutil.copytree(root / "3", root / "99")
        shutil.rmtree(root / "99" / "meta")


@pytest.mark.parametrize("kind", ["symlink to a step", "symlink elsewhere", "no meta item"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_invalid_step_above_the_real_ones_never_shadows_them(tmp_path, kind, async_save):
    root = tmp_path / "ckpt"
    three, four = _record(3.0), _record(4.0)
    with rc.Checkpointer(root) as ckpt:
        ckpt.save(3, three)
    _invalid_step(root, tmp_path, kind)
    with pytest.warns(RuntimeWarning, match=r"ckpt/99 is not a checkpoint step .*ignored"):
        ckpt = rc.Checkpointer(root, keep=1, async_save=async_save)
    with ckpt:
        assert ckpt.all_steps() == [3] and ckpt.latest_step() == 3
        ckpt.save(4, four)
        ckpt.wait()
        assert ckpt.all_steps() == [4]  # retention counted the real steps only
        assert_bitwise_equal(ckpt.restore(four), four)
        with pytest.raises(rc.CheckpointCorruptedError, match=r"ckpt/99: "):
            ckpt.restore(four, step=99)
        with pytest.raises(ValueError, match=r"ckpt/99 .*is not a checkpoint step.*move it away"):
            ckpt.save(99, four)
    assert os.path.lexists(root / "99")  # not rudax's to delete


# --- 8: temporary directories of failed saves ----------------------------------------------


def test_a_new_checkpointer_removes_leftover_temporary_directories(tmp_path):
    root = tmp_path / "ckpt"
    one = _record(1.0)
    with rc.Checkpointer(root) as ckpt:
        ckpt.save(1, one)
    shutil.copytree(root / "1", root / f"2{TMP}")  # what a failed save of step 2 leaves
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the checkpoint's")
    os.symlink(outside, root / f"3{TMP}")  # never followed: only the link goes
    with rc.Checkpointer(root, read_only=True) as reader:  # a reader leaves them alone
        assert reader.all_steps() == [1]
    assert _leftovers(root) == [f"2{TMP}", f"3{TMP}"]
    with rc.Checkpointer(root) as ckpt:
        assert _leftovers(root) == []
        assert (outside / "keep.txt").read_text() == "not the checkpoint's"
        assert ckpt.all_steps() == [1]
        assert_bitwise_equal(ckpt.restore(one), one)


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs mounted for the test: a real filesystem that runs out of space."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _incompressible(seed, leaves, n):
    rng = np.random.default_rng(seed)
    model = {f"w{i}": jnp.asarray(rng.standard_normal(n).astype(np.float32)) for i in range(leaves)}
    return rc.TrainingRecord.capture(model=model, optimizer=())


def _free(path):
    return os.statvfs(path).f_bavail * os.statvfs(path).f_frsize


def test_leftovers_still_being_written_by_a_failed_save_are_removed(tmp_path, monkeypatch):
    # A failed async save's other items may still be writing when the next Checkpointer
    # opens (seen in CI: rmtree met "Directory not empty"); the removal waits them out.
    leftover = tmp_path / "2.orbax-checkpoint-tmp" / "optimizer"
    leftover.mkdir(parents=True)
    (leftover / "d").write_bytes(b"x")
    real_rmtree, calls = shutil.rmtree, []

    def rmtree_racing_a_writer(path, *args, **kwargs):
        calls.append(path)
        if len(calls) <= 2:  # a file appears after rmtree listed the folder
            raise OSError(39, "Directory not empty", str(leftover))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_racing_a_writer)
    with rc.Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == []
    assert len(calls) == 3 and not (tmp_path / "2.orbax-checkpoint-tmp").exists()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_disk_full_save_fails_loudly_and_a_new_checkpointer_recovers(small_disk, async_save):
    root = small_disk / "ckpt"
    small = _incompressible(0, 1, 1000)
    big = _incompressible(1, 3, 100_000)  # 1.2 MB that zstd cannot shrink
    ckpt = rc.Checkpointer(root, async_save=async_save)
    ckpt.save(1, small)
    ckpt.wait()
    filler = small_disk / "filler"
    filler.write_bytes(b"\1" * (_free(small_disk) - 600_000))  # room for half the record
    with pytest.raises(Exception) as failed:  # orbax and tensorstore pick the type
        ckpt.save(2, big)
        ckpt.wait()
    assert "No space left on device" in "".join(
        str(e) for e in (failed.value, failed.value.__cause__, failed.value.__context__)
    )
    ckpt.close()
    assert ckpt.all_steps() == [1]
    assert _leftovers(root) == [f"2{TMP}"]  # the failed save's partial files
    filler.unlink()  # the user frees space; the leftovers still hold some
    held = _free(small_disk)
    with rc.Checkpointer(root, async_save=async_save) as ckpt:
        assert _leftovers(root) == []
        assert _free(small_disk) > held
        assert_bitwise_equal(ckpt.restore(small), small)  # the committed step is intact
        ckpt.save(2, big)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
        assert_bitwise_equal(ckpt.restore(big), big)


# --- 9: one writer per directory ---------------------------------------------------------------


def test_a_second_checkpointer_on_the_directory_is_refused_naming_the_holder(tmp_path):
    one = _record(1.0)
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, one)
        message = (
            rf"{tmp_path} is in use by another Checkpointer: pid {os.getpid()} on host "
            rf"{socket.gethostname()}, since 20\d\d-.*read_only=True"
        )
        with pytest.raises(rc.CheckpointLockedError, match=message):
            rc.Checkpointer(tmp_path)
        with rc.Checkpointer(tmp_path, read_only=True) as reader:  # readers take no lock
            assert_bitwise_equal(reader.restore(one), one)
            with pytest.raises(ValueError, match=r"read_only=True.*cannot save"):
                reader.save(2, one)
    with rc.Checkpointer(tmp_path) as ckpt:  # released by close
        ckpt.save(2, one)
        assert ckpt.all_steps() == [1, 2]


def _holder(directory):
    """A child process that opens a Checkpointer on directory and reports once it holds it."""
    code = (
        "import sys, rudax.checkpoint as rc\n"
        "ckpt = rc.Checkpointer(sys.argv[1])\n"
        "print('holding', flush=True)\n"
        "sys.stdin.readline()\n"
        "ckpt.close()\n"
        "print('closed', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("XLA_FLAGS", None)
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout.readline().strip() == "holding"
    return child


def test_the_lock_holds_across_processes_and_is_released_on_close_and_on_death(tmp_path):
    closing, dying = tmp_path / "closing", tmp_path / "dying"
    holders = {closing: _holder(closing), dying: _holder(dying)}
    try:
        for directory, child in holders.items():
            with pytest.raises(rc.CheckpointLockedError, match=rf"pid {child.pid} on host"):
                rc.Checkpointer(directory)
        child = holders[closing]
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "closed"  # alive, the lock released
        with rc.Checkpointer(closing) as ckpt:
            ckpt.save(1, _record(1.0))
        child = holders[dying]
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        with rc.Checkpointer(dying) as ckpt:  # the kernel released it with the process
            ckpt.save(1, _record(1.0))
            assert ckpt.all_steps() == [1]
    finally:
        for child in holders.values():
            if child.poll() is None:
                child.kill()
            child.wait(timeout=30)


def test_the_lock_file_says_who_holds_it(tmp_path):
    with rc.Checkpointer(tmp_path):
        text = (tmp_path / "rudax.lock").read_text()
        assert f'"pid": {os.getpid()}' in text and socket.gethostname() in text
    assert not (tmp_path / "rudax.lock").exists()  # no stale holder named after close


def test_a_read_only_checkpointer_needs_an_existing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"read_only=True.*no directory"):
        rc.Checkpointer(tmp_path / "missing", read_only=True)
    assert not (tmp_path / "missing").exists()


def test_no_warning_for_a_clean_directory(tmp_path):
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _record(1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with rc.Checkpointer(tmp_path) as ckpt:
            assert ckpt.all_steps() == [1]
