"""The programs over the library import only rudax's public modules and their own: a user who
copies examples/lm, examples/finetune (or examples/generate.py) needs nothing else from this
repository; one who copies examples/dpo or examples/grpo needs examples/policy too. One
exception, named below: the memory planner compiles the fine-tuning program's own steps to
read XLA's accounting of them."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = {
    "examples.lm": sorted((ROOT / "examples" / "lm").glob("*.py")),
    "examples.finetune": sorted((ROOT / "examples" / "finetune").glob("*.py")),
    "examples.generate": [ROOT / "examples" / "generate.py"],
    "examples.arithmetic": [ROOT / "examples" / "arithmetic.py"],
    "examples.policy": sorted((ROOT / "examples" / "policy").glob("*.py")),
    "examples.dpo": sorted((ROOT / "examples" / "dpo").glob("*.py")),
    "examples.grpo": sorted((ROOT / "examples" / "grpo").glob("*.py")),
}
# The post-training programs share examples/policy: a user copies it with them.
SHARED = {"examples.dpo": "examples.policy", "examples.grpo": "examples.policy"}


# (file, module): python -m examples.lm.plan --finetune ... --xla compiles examples.finetune's
# steps as the program builds them, not a copy that could drift from them.
ALLOWED = {("examples/lm/plan_xla.py", "examples.finetune.train")}


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
            allowed = (str(path.relative_to(ROOT)), name) in ALLOWED
            if (private or other) and not allowed:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad
