"""A JSONL file's rows, each a JSON object, a bad line named ``file:line``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class DataError(ValueError):
    """A data file's line that cannot be used; the message starts ``file:line:``."""


def read_rows(path: Path, parse: Callable[[dict[str, Any]], T]) -> list[T]:
    """``parse`` of each non-blank line's JSON object, in the file's order.

    Raises:
      DataError: a line is not JSON, not an object, or ``parse`` raises ValueError on it:
        ``file:line: why``. A file of no rows too.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{number}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: a JSON {type(row).__name__}, not an object")
            try:
                out.append(parse(row))
            except ValueError as e:
                raise DataError(f"{path}:{number}: {e}") from None
    if not out:
        raise DataError(f"{path}: no rows")
    return out


def sha256(path: Path) -> str:
    """The file's SHA-256: what a resumed run checks its data against."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
