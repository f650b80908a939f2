"""A folder named ``rudax`` that shadows the installed package fails at import, with the cause.

Python imports a folder without ``__init__.py`` as a namespace package. Ahead of rudax's own
finder (an editable install's finder runs after the path scan), an empty ``rudax/`` in the
working directory becomes ``rudax`` while ``rudax.checkpoint`` still loads from the real tree,
so before issue 11 every import worked and the first save failed in orbax's background thread
(``rudax.__version__`` missing), the traceback ending in a ``RuntimeError`` about futures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rudax

SAVE = (
    "import jax.numpy as jnp\n"
    "import rudax.checkpoint as rc\n"
    "record = rc.TrainingRecord.capture(model={'w': jnp.ones(3)}, optimizer=())\n"
    "with rc.Checkpointer('ckpt', async_save=True) as ckpt:\n"
    "    ckpt.save(1, record)\n"
    "print('saved')\n"
)


def _run(cwd: Path, code: str, pythonpath: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_an_empty_rudax_folder_in_the_working_directory(tmp_path):
    (tmp_path / "rudax").mkdir()
    probe = _run(tmp_path, "import rudax; print(getattr(rudax, '__file__', None))", None)
    if probe.stdout.strip() != "None":
        pytest.skip(
            "this install of rudax is a regular package on sys.path, which a namespace folder "
            f"cannot shadow (import rudax gives {probe.stdout.strip() or probe.stderr[-200:]})"
        )
    done = _run(tmp_path, SAVE, None)
    assert done.returncode != 0 and "saved" not in done.stdout
    last = _last_line(done.stderr)
    assert last.startswith("ImportError: "), done.stderr[-3000:]
    assert str(tmp_path / "rudax") in last and "namespace package" in last
    assert str(Path(rudax.__file__).parent) in last  # where the real one is
    assert not (tmp_path / "ckpt").exists()  # it failed before anything was written


def test_the_same_state_made_by_hand(tmp_path):
    """Without an editable install: ``rudax`` a bare namespace module, its submodules real."""
    real = Path(rudax.__file__).parent
    code = (
        "import importlib.machinery, importlib.util, sys\n"
        f"spec = importlib.machinery.ModuleSpec('rudax', None, is_package=True)\n"
        "module = importlib.util.module_from_spec(spec)\n"
        f"module.__path__ = [{str(real)!r}]\n"
        "sys.modules['rudax'] = module\n" + SAVE
    )
    done = _run(tmp_path, code, None)
    assert done.returncode != 0 and "saved" not in done.stdout
    last = _last_line(done.stderr)
    assert last.startswith("ImportError: ") and "namespace package" in last, done.stderr[-3000:]
