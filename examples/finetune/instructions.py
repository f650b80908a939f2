"""A small instruction set made on this machine: a standard-library function's signature as the
prompt, its docstring as the completion.

    python -m examples.finetune.instructions data/instructions     # train.jsonl + val.jsonl

The README's fine-tuning command needs data that no download provides, in the shape users
bring (prompt/completion JSON Lines). Python's own library has thousands of documented
functions; teaching a model to write the docstring that follows a signature is a real
completion task, and its held-out loss shows whether fine-tuning learned anything.

Each example is one function or method with a docstring, found by parsing (never importing)
the ``.py`` files of the running Python's standard library in sorted order::

    {"prompt": "# module json.decoder, class JSONDecoder\\ndef decode(self, s, _w=...):\\n",
     "completion": "Scan the string s for a JSON string. ..."}

A function goes to validation by a hash of ``module:qualname`` (``_is_val``), so the split is
the same on every machine and held-out completions are of functions never trained
on. Docstrings longer than ``max_chars`` are skipped rather than cut: a completion is a whole
docstring or nothing.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import io
import json
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator, Sequence
from pathlib import Path

TRAIN, VAL = "train.jsonl", "val.jsonl"
# Installed packages are not the library; test suites document tests, not functions.
_SKIPPED = ("site-packages", "dist-packages", "test", "tests")


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method at module or class level."""
    todo: list[tuple[str, ast.AST]] = [("", tree)]
    while todo:
        prefix, node = todo.pop(0)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield prefix + child.name, child
            elif isinstance(child, ast.ClassDef):
                todo.append((f"{prefix}{child.name}.", child))


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The ``def`` line as source: name, arguments, return annotation; no decorators or body."""
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{keyword} {node.name}({ast.unparse(node.args)}){returns}:"


def examples(
    root: Path | None = None, *, min_chars: int = 40, max_chars: int = 600
) -> Iterator[tuple[str, dict[str, str]]]:
    """(key, {"prompt", "completion"}) for each documented function under ``root``.

    Args:
      root: a folder of ``.py`` files; None for this Python's standard library.
      min_chars: docstrings shorter than this (after ``inspect.cleandoc``) are skipped.
      max_chars: docstrings longer than this are skipped.

    Returns:
      An iterator in a fixed order (sorted files, then source order); ``key`` is
      ``"module:qualname"``.

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> from examples.finetune.instructions import examples
      >>> root = Path(tempfile.mkdtemp())
      >>> _ = (root / "m.py").write_text(
      ...     'def add(a, b=1):\\n    "Return the sum of a and b, b defaulting to one."\\n')
      >>> [(key, ex["prompt"]) for key, ex in examples(root, min_chars=10)]
      [('m:add', '# module m\\ndef add(a, b=1):\\n')]
    """
    root = stdlib_root() if root is None else Path(root)
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if any(part in _SKIPPED for part in relative.parts):
            continue
        text, skipped = _decode(path, path.read_bytes())
        if skipped:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):  # a deliberately broken test file, a NUL byte
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        for qualname, node in _functions(tree):
            doc = ast.get_docstring(node, clean=False)
            if doc is None:
                continue
            doc = inspect.cleandoc(doc).strip()
            if not min_chars <= len(doc) <= max_chars:
                continue
            owner = qualname.rpartition(".")[0]
            where = f"# module {module}" + (f", class {owner}" if owner else "")
            prompt = f"{where}\n{_signature(node)}\n"
            yield f"{module}:{qualname}", {"prompt": prompt, "completion": doc}


def write(
    out_dir: str | os.PathLike,
    *,
    root: Path | None = None,
    val_fraction: float = 0.05,
    seed: int = 0,
    limit: int | None = None,
) -> dict[str, int]:
    """Writes ``train.jsonl`` and ``val.jsonl`` under out_dir; returns the example counts.

    Args:
      out_dir: the folder to write (created if need be).
      root: as for ``examples``.
      val_fraction: the share of functions held out, by ``is_val`` of their key.
      seed: the split's seed.
      limit: at most this many training examples (the first ones); None for all.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "val": 0}
    # Written beside, then renamed: an interrupted run never leaves a half set that a later
    # one would take for the whole (the fine-tuner makes the set only when it is missing).
    partial = {split: out / f".{name}.partial" for split, name in (("train", TRAIN), ("val", VAL))}
    with open(partial["train"], "w") as train, open(partial["val"], "w") as val:
        for key, example in examples(root):
            split = "val" if _is_val(key, seed=seed, val_fraction=val_fraction) else "train"
            if split == "train" and limit is not None and counts["train"] >= limit:
                continue
            (val if split == "val" else train).write(json.dumps(example) + "\n")
            counts[split] += 1
    os.replace(partial["val"], out / VAL)
    os.replace(partial["train"], out / TRAIN)  # last: its presence means the set is whole
    return counts


def main(argv: Sequence[str] | None = None) -> dict[str, int]:
    p = argparse.ArgumentParser(
        prog="python -m examples.finetune.instructions",
        description="Writes a prompt/completion set from the standard library's docstrings.",
    )
    p.add_argument("out_dir", help="the folder for train.jsonl and val.jsonl")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="at most this many training examples")
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    counts = write(args.out_dir, val_fraction=args.val_fraction, seed=args.seed, limit=args.limit)
    print(f"{args.out_dir}: {counts['train']} training and {counts['val']} validation examples")
    return counts


def stdlib_root() -> Path:
    """The folder of the running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_val(key: str, *, seed: int, val_fraction: float) -> bool:
    """Whether ``key`` is held out: the first 8 bytes of ``blake2b(f"{seed}/{key}")``, read as
    a little-endian integer, below ``val_fraction * 2**64``."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def _decode(path: Path, data: bytes) -> tuple[str, str]:
    """``(text, "")`` as Python reads a source (its PEP 263 coding cookie, else UTF-8), or
    ``("", reason)`` for bytes that are not text."""
    if b"\0" in data:
        return "", "binary (contains a NUL byte)"
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding), ""
    except (SyntaxError, LookupError, UnicodeDecodeError) as e:
        return "", f"does not decode as text: {type(e).__name__}: {e}"


if __name__ == "__main__":
    main()
