"""examples/finetune/instructions.py: the locally made prompt/completion set."""

from __future__ import annotations

import ast
import json

from examples.finetune import instructions
from examples.lm.corpus import is_val

SOURCE = '''
def documented(a, *, b: int = 2) -> int:
    """Add a and b, returning the sum of the two numbers."""
    return a + b


def undocumented(x):
    return x


async def fetch(url):
    """Fetch the page at url and return its bytes, or None."""


class Box:
    def open(self, force=False):
        """Open the box, forcing the lid when force is true."""

    def short(self):
        """Too short."""

    class Inner:
        def deep(self):
            """A method of a nested class, which is found too."""
'''


def test_examples_are_each_documented_function_with_its_whole_docstring(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(SOURCE)
    (tmp_path / "tests").mkdir()  # test folders are skipped
    (tmp_path / "tests" / "test_x.py").write_text(SOURCE)
    (tmp_path / "broken.py").write_text("def f(:\n")  # unparsable: skipped, not fatal
    found = dict(instructions.examples(tmp_path, min_chars=20, max_chars=60))
    # An independent reading of the same source: every def with a docstring of 20..60 chars.
    expected = {}
    tree = ast.parse(SOURCE)

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(child)
                if doc and 20 <= len(doc) <= 60:
                    expected[f"pkg.mod:{prefix}{child.name}"] = doc

    walk(tree, "")
    assert {k: v["completion"] for k, v in found.items()} == expected
    assert sorted(expected) == [
        "pkg.mod:Box.Inner.deep",
        "pkg.mod:Box.open",
        "pkg.mod:documented",
        "pkg.mod:fetch",
    ]
    assert found["pkg.mod:documented"]["prompt"] == (
        "# module pkg.mod\ndef documented(a, *, b: int=2) -> int:\n"
    )
    assert found["pkg.mod:Box.open"]["prompt"] == (
        "# module pkg.mod, class Box\ndef open(self, force=False):\n"
    )
    assert found["pkg.mod:fetch"]["prompt"].endswith("async def fetch(url):\n")


def test_write_splits_by_key_and_limits(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    funcs = "".join(
        f'def f{i}(x):\n    """Return x times {i}, a documented function number {i}."""\n'
        for i in range(60)
    )
    (src / "many.py").write_text(funcs)
    counts = instructions.write(tmp_path / "out", root=src, val_fraction=0.3, seed=1)
    lines = {
        split: [json.loads(row) for row in (tmp_path / "out" / f"{split}.jsonl").open()]
        for split in ("train", "val")
    }
    assert counts == {split: len(rows) for split, rows in lines.items()}
    val_names = {r["prompt"].split("def ")[1].split("(")[0] for r in lines["val"]}
    held_out = {f"f{i}" for i in range(60) if is_val(f"many:f{i}", seed=1, val_fraction=0.3)}
    assert val_names == held_out
    assert 0 < len(val_names) < 60
    limited = instructions.write(tmp_path / "lim", root=src, val_fraction=0.3, seed=1, limit=5)
    assert limited == {"train": 5, "val": counts["val"]}
    assert all(set(r) == {"prompt", "completion"} for rows in lines.values() for r in rows)
