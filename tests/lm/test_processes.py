"""The trainer as several processes (``jax.distributed`` over gloo, on this machine's CPU).

One model over a ``data=2,fsdp=4`` mesh of 8 devices, as 1 process of 8 (this test process,
``tests/conftest.py``'s devices), 2 processes of 4 and 4 of 2, launched by
``rudax.run.launch``. Each process reads its own rows of each batch, and the global batch is a
function of the seed and the update alone, so the losses are the same bits whichever the
process count, and a run resumes on another one exactly.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from examples.lm import train
from rudax.run.launch import child_env, free_port
from tests._launch import launch_program, repo_env
from tests.lm.conftest import TINY

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

FLAGS = [
    *TINY,
    *("--steps", "9", "--eval-every", "3", "--checkpoint-every", "3"),
    *("--param-dtype", "float32", "--compute-dtype", "float32", "--optimizer", "adamw"),
    *("--mesh", "data=2,fsdp=4"),
]


def _launch(processes: int, args: list[str]) -> tuple[int, str]:
    return launch_program("examples.lm.train", processes, args, timeout=240)


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # a rate is the machine's, not the run's
        r.pop("tokens_per_s", None)
    return rows


@pytest.mark.long(1.5)  # minutes: started first (tests/conftest.py)
def test_processes_train_the_same_bits_whatever_their_count_and_resume_on_another(data, tmp_path):
    def run(name: str, processes: int, *more: str) -> str:
        code, out = _launch(processes, [*data, *FLAGS, "--run-dir", str(tmp_path / name), *more])
        assert code == 0, out
        return out

    run("one", 1)  # 1 process of 8 devices, through jax.distributed too
    # 2 processes of 4 devices to update 3, 4 of 2 to update 6, 1 of 8 to update 9
    out = run("many", 2, "--stop-at", "3")
    assert "over mesh data=2,fsdp=4 of 2 processes" in out
    # process 0 alone prints and logs: one summary line, not two
    assert out.count("stopped at update 3 of 9") == 1 and "[0] stopped at update 3" in out
    out = run("many", 4, "--resume", "--stop-at", "6")
    assert "[0] resumed" in out and "[1] resumed" not in out
    run("many", 1, "--resume")
    got, want = _rows(tmp_path / "many"), _rows(tmp_path / "one")
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    assert got == want  # every loss, validation loss and gradient norm, to the bit

    # Without jax.distributed (this process's own 8 devices) XLA sums across devices in its
    # own order, not gloo's: the same run within fp32 rounding.
    alone = _rows(
        Path(train.main([*data, *FLAGS, "--run-dir", str(tmp_path / "alone")])["run_dir"])
    )
    for g, w in zip(alone, want, strict=True):
        for key in ("loss", "val_loss", "grad_norm"):
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-6), (key, w)


def test_a_launch_without_a_name_or_mesh_is_refused_by_every_process(data, tmp_path):
    code, out = _launch(2, [*data, *TINY, "--mesh", "data=2,fsdp=4"])
    assert code == 2, out
    assert "give it a --name or --run-dir" in out
    code, out = _launch(2, [*data, *TINY, "--run-dir", str(tmp_path / "r")])
    assert code == 2, out
    assert "give --mesh" in out
    assert not (tmp_path / "r").exists()


def test_a_killed_process_ends_the_other_within_the_heartbeat_timeout(data, tmp_path):
    # No launcher here (it would stop the other at once): jax's own heartbeat must.
    port, run = free_port(), tmp_path / "killed"
    args = [*data, *FLAGS, "--steps", "100000", "--run-dir", str(run), "--heartbeat-timeout", "5"]
    env = repo_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "examples.lm.train", *args],
            env=child_env(i, processes=2, port=port, cpu_devices=4, base=env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while (
            not (run / "metrics.jsonl").exists()
            or "train" not in (run / "metrics.jsonl").read_text()
        ):
            assert time.monotonic() < deadline and procs[0].poll() is None, "no update"
            time.sleep(0.2)
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        out, _ = procs[0].communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text = out.decode(errors="replace")
    assert procs[0].returncode != 0
    assert took < 30, took  # 5 s of heartbeat, then the poll that reports it
    assert "Task 1 heartbeat timeout" in text or "stopped sending heartbeats" in text, text[-3000:]


@pytest.mark.long(1)  # minutes: started first (tests/conftest.py)
@pytest.mark.parametrize(("processes", "sig"), [(2, signal.SIGINT), (1, signal.SIGTERM)])
def test_a_signal_to_the_launcher_saves_every_process_at_one_update_and_resumes(
    data, tmp_path, processes, sig
):
    """Ctrl-C (or a preemption's SIGTERM) to ``python -m rudax.run.launch``: each process
    finishes the update it is in, they agree on one update (jax's preemption sync point, also
    for one process under jax.distributed, whose SIGTERM handler is jax's), save it and exit
    128 + the signal; the run resumes from it."""
    run = tmp_path / "signalled"
    args = [*data, *FLAGS, "--steps", "100000", "--checkpoint-every", "1000", "--run-dir", str(run)]
    devices = str(8 // processes)
    launch = [sys.executable, "-m", "rudax.run.launch", "--processes", str(processes)]
    launch += ["--cpu-devices", devices]
    launcher = subprocess.Popen(
        [*launch, "--", sys.executable, "-m", "examples.lm.train", *args],
        env=repo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        metrics = run / "metrics.jsonl"
        while not metrics.exists() or '"kind": "train"' not in metrics.read_text():
            assert time.monotonic() < deadline and launcher.poll() is None, "no update"
            time.sleep(0.2)
        launcher.send_signal(sig)
        out, _ = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + sig, out
    assert "Traceback" not in out, out
    stopped = [line for line in out.splitlines() if "stopped at update" in line]
    assert len(stopped) == 1 and stopped[0].startswith("[0] stopped at update"), out
    step = int(stopped[0].split("stopped at update ")[1].split()[0])
    name = signal.Signals(sig).name if processes > 1 else "a preemption notice"
    assert f"({name}); continue with: python -m examples.lm.train --resume" in stopped[0]
    assert (run / "checkpoints" / str(step)).is_dir()
    assert [r["step"] for r in _rows(run) if r["kind"] == "train"] == list(range(1, step + 1))
    code, out = _launch(processes, ["--resume", "--run-dir", str(run), "--stop-at", str(step + 1)])
    assert code == 0, out
    assert f"[0] resumed {run} at update {step}" in out
    assert [r["step"] for r in _rows(run) if r["kind"] == "train"][-1] == step + 1
