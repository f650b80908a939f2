"""A program of this repository run as N processes of 8 // N simulated CPU devices each, through
``rudax.run.launch`` (the tests of the programs on several processes share it)."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from rudax.run.launch import launch

REPO = Path(__file__).resolve().parents[1]


def repo_env() -> dict[str, str]:
    """This process's environment with the repository on ``PYTHONPATH`` (for ``-m examples``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def launch_program(
    module: str, processes: int, args: list[str], *, timeout: float
) -> tuple[int, str]:
    """``python -m module *args`` as ``processes`` processes; (exit status, their output)."""
    out = io.StringIO()
    code = launch(
        [sys.executable, "-m", module, *args],
        processes=processes,
        cpu_devices=8 // processes,
        timeout=timeout,
        env=repo_env(),
        stdout=out,
        stderr=out,
    )
    return code, out.getvalue()
