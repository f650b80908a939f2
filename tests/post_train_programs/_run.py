"""Running a post-training program as a user does: killed with SIGKILL mid-run, resumed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from tests._launch import repo_env


def rows(run_dir: Path, kind: str = "train") -> list[dict]:
    """The run's metrics.jsonl rows of ``kind``."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def kill_at(module: str, flags: list[str], run_dir: Path, step: int, cwd: Path) -> None:
    """Runs ``python -m module *flags`` and SIGKILLs it once update ``step`` is logged: no
    handler runs, nothing is saved beyond the checkpoints already written."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, *flags],
        cwd=cwd,
        env=repo_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 300
    log = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and process.poll() is None:
        if log.exists() and any(r["step"] >= step for r in rows(run_dir)):
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()[-3000:]


def resume(module: str, run_dir: Path, cwd: Path) -> None:
    """``python -m module --resume --run-dir run_dir`` in a fresh process, to the end."""
    subprocess.run(
        [sys.executable, "-m", module, "--resume", "--run-dir", str(run_dir)],
        cwd=cwd,
        env=repo_env(),
        check=True,
        capture_output=True,
        timeout=600,
    )


def assert_same_adapter(ours: Path, theirs: Path) -> None:
    """Two runs' peft adapter files hold the same tensors, bit for bit."""
    a = load_file(ours / "adapter" / "adapter_model.safetensors")
    b = load_file(theirs / "adapter" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
