"""Crash safety: a process killed with SIGKILL during saves never loses a committed checkpoint.

Each trial is one life: a process forked by ``_crash_worker.py``'s zygote (which imported JAX
and rudax once, so a life costs a fraction of a second, not an interpreter start). It opens a
``Checkpointer`` on a directory that earlier lives (and their kills) left behind and saves
records whose every value is a pure function of the step, announcing each save on stdout.
The parent kills it at a random moment after it announced the save chosen for the kill
(seeded delays: a failure names the seed and every trial's delay and outcome), then checks
the directory with a fresh ``Checkpointer``:

* only steps the child began are listed, and the newest committed ones are all there: the
  latest is the last step known committed, or the one in flight when the child died;
* every listed step restores, bit for bit, to the values of its step;
* the next life saves into the same directory, over whatever half-written step is left.

A test whose kills all landed between saves would prove nothing, so the trials count where
each kill landed (the child's last line said a save was in flight) and what it left on disk
(an unfinished temporary directory), and assert that most kills hit a save in flight.

Random kills seldom land while retention deletes the step beyond ``keep`` (an in-place
deletion once left a listed step that no longer restored), so
``test_sigkill_while_retention_deletes_an_old_step`` aims a kill at that moment on purpose.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import rudax.checkpoint as rc
from tests.checkpoint import _crash_worker as worker

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or not hasattr(signal, "SIGKILL"), reason="needs POSIX fork and SIGKILL"
)

SEED = 20240605
TRIALS_PER_MODE = 10
WORKER = Path(worker.__file__).resolve()
LIFE_TIMEOUT = 60.0  # seconds for the zygote's start-up, or a life's, on a busy machine


def _child_env() -> dict[str, str]:
    # As tests/sharding/_multiprocess.py: one CPU device, strict promotion, the repo importable.
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=1"])
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"
    # Forced, not defaulted: a BLAS thread pool started at import would make the zygote's
    # fork unsafe (the zygote checks that it is single-threaded before each fork).
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    return env


def _half_written(directory: Path) -> list[str]:
    # Unfinished steps: orbax names them "<step>.orbax-checkpoint-tmp"; any "tmp" name counts.
    return sorted(p.name for p in directory.glob("*") if "tmp" in p.name.lower())


@dataclasses.dataclass
class Life:
    """What one child did before the kill, as its stdout lines and the parent's clock say."""

    first_step: int
    target: int  # the step whose save the kill was aimed at
    delay: float  # seconds from seeing "begin target" to SIGKILL
    began: list[int] = dataclasses.field(default_factory=list)
    ended: list[int] = dataclasses.field(default_factory=list)
    save_seconds: list[float] = dataclasses.field(default_factory=list)
    in_flight: int | None = None  # the step being saved when the kill landed
    tmp_left: list[str] = dataclasses.field(default_factory=list)
    leftover_at_start: list[str] = dataclasses.field(default_factory=list)
    listed: list[int] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        return (
            f"first={self.first_step} target={self.target} delay={self.delay * 1e3:.1f}ms "
            f"began={self.began} ended={self.ended} in_flight={self.in_flight} "
            f"tmp_left={self.tmp_left} listed={self.listed}"
        )


class _Zygote:
    """The worker's zygote: forks one life per call, all its lines on one pipe."""

    def __init__(self, stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        with open(stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER)],
                env=_child_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,  # one process group with its lives: killed as one
            )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.put((time.monotonic(), raw.decode(errors="replace").strip()))
        self.lines.put((time.monotonic(), None))  # EOF: the zygote is gone

    def next_line(self, deadline: float, why: str) -> tuple[float, str]:
        try:
            seen, line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            pytest.fail(f"timed out waiting for {why}\n{self.tail()}")
        if line is None:
            pytest.fail(f"the zygote exited ({self.proc.wait()}) waiting for {why}\n{self.tail()}")
        return seen, line

    def tail(self) -> str:
        return "stderr tail:\n" + self.stderr_path.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = _Zygote(tmp_path_factory.mktemp("zygote") / "stderr.txt")
    yield z
    z.close()


def _live_and_die(zygote: _Zygote, directory: Path, mode: str, life: Life, *, wait=None) -> None:
    """Runs one life until it announces ``life.target``, then kills it with SIGKILL.

    The kill comes ``life.delay`` seconds after the announcement, or, with ``wait``, when
    ``wait()`` returns.
    """
    command = [str(directory), mode, life.first_step, worker.KEEP]
    zygote.proc.stdin.write((json.dumps(command) + "\n").encode())
    zygote.proc.stdin.flush()
    deadline = time.monotonic() + LIFE_TIMEOUT
    pid, events = None, []
    while pid is None or not events or events[-1][1] != f"begin {life.target}":
        seen, line = zygote.next_line(deadline, f"'begin {life.target}': {life.summary()}")
        if line.startswith("pid "):
            pid = int(line.split()[1])
        elif line.startswith("exit "):
            pytest.fail(
                f"the life ended before its kill ({line}): {life.summary()}\n{zygote.tail()}"
            )
        else:
            events.append((seen, line))
    wait() if wait is not None else time.sleep(life.delay)
    os.kill(pid, signal.SIGKILL)
    while True:  # every line written before the kill is still in the pipe, then the exit
        seen, line = zygote.next_line(deadline + LIFE_TIMEOUT, f"the exit of {pid}")
        if line.startswith(f"exit {pid} "):
            break
        events.append((seen, line))
    began_at = {}
    for seen, line in events:
        kind, _, step = line.partition(" ")
        if kind == "begin":
            life.began.append(int(step))
            began_at[int(step)] = seen
            life.in_flight = int(step)
        elif kind == "end":
            life.ended.append(int(step))
            life.save_seconds.append(seen - began_at[int(step)])
            life.in_flight = None


def _assert_bitwise_equal(restored, expected, where: str) -> None:
    paths_r, tree_r = jax.tree_util.tree_flatten_with_path(restored)
    paths_e, tree_e = jax.tree_util.tree_flatten_with_path(expected)
    assert tree_r == tree_e, f"{where}: tree structure differs"
    for (path, r), (_, e) in zip(paths_r, paths_e, strict=True):
        at = f"{where}{jax.tree_util.keystr(path)}"
        if isinstance(e, str | int | float | bool):
            assert type(r) is type(e) and r == e, f"{at}: restored {r!r}, saved {e!r}"
            continue
        r, e = np.asarray(r), np.asarray(e)
        assert (r.dtype, r.shape) == (e.dtype, e.shape), f"{at}: {r.dtype}{r.shape} vs {e.dtype}"
        assert r.tobytes() == e.tobytes(), f"{at}: restored bytes differ from the saved step's"


def _check_directory(directory: Path, lives: list[Life], like: rc.TrainingRecord) -> int | None:
    """Every guarantee after a kill; returns the latest committed step."""
    life = lives[-1]
    began = {s for lf in lives for s in lf.began}
    # Known committed: seen committed by a child, or listed after an earlier kill (a step
    # can commit after the child's last line, before the kill).
    committed = sorted({s for lf in lives for s in (*lf.ended, *lf.listed)})
    ckpt = rc.Checkpointer(directory, keep=worker.KEEP)  # a fresh one, as after a restart
    try:
        # Opening removed what the kill left half-written (issue 11: kept forever before).
        assert _half_written(directory) == [], "a half-written step survived a writer's open"
        life.listed = ckpt.all_steps()
        latest = ckpt.latest_step()
        assert set(life.listed) <= began, "a step that was never saved is listed"
        # Retention keeps KEEP steps; if the step in flight committed, it may have deleted one.
        must_have = committed[-(worker.KEEP - 1) :]
        assert set(must_have) <= set(life.listed), f"committed steps {must_have} lost"
        if committed:
            allowed = {committed[-1], life.in_flight} - {None}
            assert latest in allowed, f"latest {latest}, expected one of {allowed}"
        for step in life.listed:
            try:
                restored = ckpt.restore(like, step=step)
            except Exception as e:
                raise AssertionError(f"listed step {step} does not restore: {e!r}") from e
            _assert_bitwise_equal(restored, worker.record(step), f"step {step}: record")
        if latest is not None:
            _assert_bitwise_equal(ckpt.restore(like), worker.record(latest), "latest: record")
    finally:
        ckpt.close()
    return latest


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_during_saves_keeps_committed_checkpoints(tmp_path, mode, zygote):
    rng = random.Random(f"{SEED}-{mode}")
    directory = tmp_path / "ckpt"
    like = worker.record(0)
    lives: list[Life] = []
    first_step = 0
    save_seconds = [0.15]  # until the first measured save: a few MB take ~0.1-0.3 s here

    def report() -> str:
        rows = "\n".join(f"  life {i}: {lf.summary()}" for i, lf in enumerate(lives))
        return f"seed {SEED}, mode {mode}:\n{rows}"

    for trial in range(TRIALS_PER_MODE):
        # What the last kill left half-written (the check's Checkpointer has removed it since).
        leftover = lives[-1].tmp_left if lives else []
        # A life after a kill that left a half-written step first saves that step again,
        # then is killed during the next save.
        target = first_step + (1 if leftover else rng.randrange(2))
        # Uniform over a little more than one save: most kills land inside a save, at any
        # moment of it (writing the items, renaming, deleting beyond `keep`).
        delay = rng.uniform(0.0, 1.2 * statistics.median(save_seconds[-8:]))
        life = Life(first_step, target, delay, leftover_at_start=leftover)
        lives.append(life)
        _live_and_die(zygote, directory, mode, life)
        save_seconds += life.save_seconds
        life.tmp_left = _half_written(directory)
        try:
            latest = _check_directory(directory, lives, like)
        except AssertionError as e:
            raise AssertionError(f"after life {trial}: {e}\n{report()}") from e
        first_step = 0 if latest is None else latest + 1

    # After the last kill too, a fresh checkpointer saves into the directory and reads back.
    with rc.Checkpointer(directory, keep=worker.KEEP) as ckpt:
        ckpt.save(first_step, worker.record(first_step))
        _assert_bitwise_equal(ckpt.restore(like), worker.record(first_step), "after the crashes")
        assert ckpt.latest_step() == first_step

    mid_save = sum(lf.in_flight is not None for lf in lives)
    with_tmp = sum(bool(lf.tmp_left) for lf in lives)
    found = [lf for lf in lives if lf.leftover_at_start]
    resaved = [lf for lf in found if lf.first_step in lf.ended]
    print(f"{mode}: {mid_save}/{len(lives)} kills mid-save, {with_tmp} left a half-written step")
    assert mid_save >= TRIALS_PER_MODE // 2, f"too few kills landed mid-save\n{report()}"
    assert with_tmp >= 1, f"no kill left a half-written step behind\n{report()}"
    # Every life that found a half-written step committed that very step over it.
    assert len(resaved) == len(found) >= 1, report()


def _file_count(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def _files_not_in(directory: Path, steps: range) -> int:
    """Files under directory outside the given steps' directories and half-written ones."""
    skip = {str(s) for s in steps}
    entries = [p for p in directory.iterdir() if p.name not in skip and "tmp" not in p.name]
    return sum(_file_count(p) if p.is_dir() else 1 for p in entries)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_while_retention_deletes_an_old_step(tmp_path, mode, zygote):
    # Once saving step KEEP commits, retention deletes step 0, in place or after moving it
    # aside. The parent counts the files outside the steps 1..KEEP and the half-written step,
    # which is step 0's files wherever they are, and kills the child when half of step 0's
    # files are gone: in the middle of the deletion, inside save() (sync) or before wait()
    # returns (async), a moment as legitimate as any other. Every step still listed
    # afterwards must restore; a half-deleted step must not be listed.
    directory = tmp_path / "ckpt"
    kept = range(1, worker.KEEP + 1)
    counts = []

    def half_of_step_0_deleted() -> None:
        step_0 = _file_count(directory / "0")  # committed long ago: its files are all there
        counts.extend([step_0, _files_not_in(directory, kept)])
        deadline, below = time.monotonic() + LIFE_TIMEOUT, 0
        while below < 2:  # twice in a row: a count taken mid-rename can miss moved files
            below = below + 1 if _files_not_in(directory, kept) <= counts[1] - step_0 // 2 else 0
            if time.monotonic() > deadline:
                pytest.fail(f"retention never deleted step 0: {sorted(os.listdir(directory))}")
            time.sleep(0.0002)

    life = Life(first_step=0, target=worker.KEEP, delay=0.0)
    _live_and_die(zygote, directory, mode, life, wait=half_of_step_0_deleted)
    life.tmp_left = _half_written(directory)
    try:
        latest = _check_directory(directory, [life], worker.record(0))
    except AssertionError as e:
        raise AssertionError(
            f"killed with half of step 0's {counts[0]} files deleted: {e}\n{life.summary()}\n"
            f"left: {sorted(os.listdir(directory))}"
        ) from e
    assert latest is not None and latest >= worker.KEEP
