"""The top-level package: ``import rudax`` is cheap and reaches every subpackage by attribute.

Each check runs in a fresh interpreter, since this one has imported jax and every subpackage
long before a test runs.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUBPACKAGES = [
    "checkpoint",
    "kernels",
    "layers",
    "models",
    "optim",
    "post_train",
    "run",
    "sharding",
]


def run(code: str) -> str:
    """code's stdout in a fresh interpreter at the repository root; fails on a nonzero exit."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_import_rudax_imports_no_subpackage_and_no_jax():
    out = run(
        "import sys, rudax\n"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'rudax.'))))\n"
        "print(rudax.__version__)\n"
    )
    loaded, version = out.splitlines()
    assert loaded == "[]"
    assert version == "0.1.0.dev0"


def test_optim_reached_as_an_attribute():
    """The issue's line: ``import rudax; rudax.optim.adamw`` raised AttributeError."""
    out = run(
        "import optax, rudax\n"
        "tx = rudax.optim.adamw(1e-3)\n"
        "import rudax.optim as ro\n"
        "print(rudax.optim is ro, isinstance(tx, optax.GradientTransformation))\n"
    )
    assert out.strip() == "True True"


def test_every_subpackage_is_an_attribute_and_in_all():
    out = run(
        "import importlib, rudax\n"
        "for name in rudax.__all__[1:]:\n"
        "    assert getattr(rudax, name) is importlib.import_module('rudax.' + name), name\n"
        "print(rudax.__all__)\n"
    )
    assert out.strip() == str(["__version__", *SUBPACKAGES])


def test_dir_lists_the_subpackages_before_they_are_imported():
    out = run("import sys, rudax\nprint(dir(rudax))\nprint('rudax.optim' in sys.modules)\n")
    names, imported = out.splitlines()
    for name in [*SUBPACKAGES, "__version__"]:
        assert repr(name) in names, name
    assert imported == "False"  # listing them imports nothing


@pytest.mark.parametrize("name", ["optimm", "adamw", "Optim"])
def test_unknown_attribute_is_an_attribute_error_naming_it(name):
    out = run(
        "import sys, rudax\n"
        "try:\n"
        f"    rudax.{name}\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
        f"print(hasattr(rudax, {name!r}), 'jax' in sys.modules)\n"
    )
    message, flags = out.splitlines()
    assert f"module 'rudax' has no attribute {name!r}" in message
    assert "optim" in message.split(";")[1]  # it lists what there is
    assert flags == "False False"


def test_type_checkers_see_the_subpackages_and_no_other_name(tmp_path):
    """pyright resolves ``rudax.optim.adamw`` and flags ``rudax.optimm``: the module's
    ``__getattr__`` is hidden from it, so it does not accept every name."""
    pyright = shutil.which("pyright")
    if pyright is None:
        pytest.skip("pyright is not installed (it is in the test extra)")
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({"extraPaths": [str(ROOT)]}))
    (tmp_path / "use.py").write_text(
        "import rudax\n\ntx = rudax.optim.adamw(1e-3)\nreveal_type(tx)\nrudax.optimm\n"
    )
    proc = subprocess.run(
        [pyright, "--outputjson", "--pythonpath", sys.executable, "use.py"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    found = [
        (d["range"]["start"]["line"] + 1, d["severity"], d["message"])
        for d in json.loads(proc.stdout)["generalDiagnostics"]
    ]
    assert found == [
        (4, "information", 'Type of "tx" is "GradientTransformation"'),
        (5, "error", '"optimm" is not a known attribute of module "rudax"'),
    ], found
