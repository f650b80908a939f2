"""rudax type-checks clean and says so: pyright and mypy report no error over rudax/, and the
wheel ships ``rudax/py.typed`` (PEP 561), so a user's checker reads rudax's inline hints
(and the one data file the package reads, ``rudax/kernels/auto_table.json``).

Both checkers run as ``pyproject.toml`` configures them (pyright in basic mode, mypy with
``warn_unused_ignores``), in a subprocess at the repository root, on the interpreter running
the tests. pyright comes with the ``test`` extra, so it runs in CI; mypy is in the ``dev``
extra only, and its check skips where mypy is not installed.
"""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Every module of the package: a checker that skipped one (an exclude, a missed include) would
# report fewer errors than there are.
SOURCES = sorted((ROOT / "rudax").rglob("*.py"))


def run(args: list[str]) -> subprocess.CompletedProcess:
    # pyright's pip wrapper uses its bundled pyright, and with --outputjson asks PyPI for no
    # newer version; the variable silences that check for other invocations too.
    env = {**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"}
    return subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env, check=False
    )


def test_pyright_reports_no_errors():
    if importlib.util.find_spec("pyright") is None:
        pytest.fail("pyright is not installed; it is in the test extra: pip install -e '.[test]'")
    # --pythonpath: resolve imports (jax, flax, optax, orbax) in this interpreter's packages.
    proc = run([sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", sys.executable])
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright gave no report (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    listing = "\n".join(
        f"{pathlib.Path(d['file']).relative_to(ROOT)}:{d['range']['start']['line'] + 1}: "
        f"{d['message']} ({d.get('rule', '')})"
        for d in errors
    )
    assert not errors, f"pyright {report['version']}: {len(errors)} errors\n{listing}"
    assert report["summary"]["errorCount"] == 0, proc.stdout
    assert report["summary"]["filesAnalyzed"] == len(SOURCES), report["summary"]


def test_mypy_reports_no_errors():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is in the dev extra, not the test extra: pip install -e '.[dev]'")
    proc = run([sys.executable, "-m", "mypy"])  # files and options from pyproject.toml
    assert proc.returncode == 0, f"mypy (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
    checked = re.search(r"Success: no issues found in (\d+) source files", proc.stdout)
    assert checked, proc.stdout
    assert int(checked[1]) == len(SOURCES), proc.stdout


def test_wheel_ships_py_typed(tmp_path):
    # Built from a copy, so no build/ or egg-info lands in the work tree; without build
    # isolation, so setuptools comes from this environment instead of the network.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "rudax", src / "rudax", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*pip, "--wheel-dir", str(tmp_path / "wheel"), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "wheel").glob("rudax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "rudax/py.typed" in names
    # impl="auto"'s measured table, read at import by rudax.kernels._auto
    assert "rudax/kernels/auto_table.json" in names
