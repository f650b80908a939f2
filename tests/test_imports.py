"""What imports what (ARCHITECTURE.md). The programs over the library import only rudax's
public modules and their own: a user who copies examples/lm (or examples/generate.py) needs
nothing else from this repository; one who copies examples/finetune, examples/dpo or
examples/grpo needs examples/policy too (the adapter programs' shared flags and session).

The benchmarks import the library, never an example's internals: a benchmark of a program's
step builds that step from the library (the trainer's recipe: ``benchmarks/_trainer.py``,
checked against the trainer's flags by tests/benchmarks/test_trainer_recipe.py); one that
measures a program end to end runs it as a user does (``python -m examples...`` in a
subprocess), which is not an import. Private rudax modules are named below where a benchmark
measures an internal on purpose."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = {
    "examples.lm": sorted((ROOT / "examples" / "lm").glob("*.py")),
    "examples.finetune": sorted((ROOT / "examples" / "finetune").glob("*.py")),
    "examples.generate": [ROOT / "examples" / "generate.py"],
    "examples.arithmetic": [ROOT / "examples" / "arithmetic.py"],
    "examples.policy": sorted((ROOT / "examples" / "policy").glob("*.py")),
    "examples.dpo": sorted((ROOT / "examples" / "dpo").glob("*.py")),
    "examples.grpo": sorted((ROOT / "examples" / "grpo").glob("*.py")),
}
# The adapter programs share examples/policy: a user copies it with them.
SHARED = {p: "examples.policy" for p in ("examples.finetune", "examples.dpo", "examples.grpo")}


# (benchmark, module): what it measures that has no public name.
PRIVATE = {
    # transformers' tensors into a rudax model held in memory, without a folder on disk
    ("generate.py", "rudax.models._hf_names"),
    # the KV cache generate() would allocate, by its shapes: the shared prompt's saving
    ("shared_prefix.py", "rudax.models._generate"),
    # the reference attention checks its arguments as the kernel does
    ("_blocked_attention.py", "rudax.layers._rope"),
    ("_blocked_attention.py", "rudax._validation"),
}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_a_program_imports_public_rudax_and_itself_only(program):
    bad = []
    for path in PROGRAMS[program]:
        for name in _imports(path):
            private = name.startswith("rudax.") and any(p.startswith("_") for p in name.split("."))
            own = name.startswith(program) or name.startswith(SHARED.get(program, program))
            other = name.startswith("examples") and not own
            if private or other:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad


def test_benchmarks_import_no_example_and_only_the_named_private_modules():
    bad = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for name in _imports(path):
            private = name.startswith("rudax.") and any(p.startswith("_") for p in name.split("."))
            if name.startswith("examples") or (private and (path.name, name) not in PRIVATE):
                bad.append(f"benchmarks/{path.name}: {name}")
    assert not bad, bad
