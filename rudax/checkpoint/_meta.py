"""The meta item: a checkpoint's own description, written as JSON and read back as data only.

Every step holds, beside the orbax item of its arrays, a JSON item ``meta``::

    format          4, the version of this layout: one orbax item ``arrays`` holding every
                    part ({part: tree}). Formats 1 to 3 have one item per part: 1 has no
                    checksum_algorithm, 2 has it, 3 has a ``zeros`` field too. A rudax that
                    does not know a format refuses it by this number.
    rudax_version   the rudax that wrote it
    step            the step number, equal to the directory's name
    parts           the record parts saved, in ``PARTS`` order
    layout          {part: [[path, shape, dtype] or [path, "python", type name], ...]}
    python_state    {path: value} for the caller state's bool/int/float/str leaves
    config          the record's config (JSON data) or null
    storage_dtypes  {part + path: dtype name} of each floating leaf (capture_with_dtypes),
                    or null (capture)
    checksums       {part: {path: 8 hex digits}} of every array leaf (see ``_integrity.py``)
    checksum_algorithm  "crc32c" or "fmix32-sum", the checksums' algorithm; absent in
                    format 1, whose checksums are all "fmix32-sum"
    zeros           (formats 3 and 4; in 4 only when a leaf is listed) {part: [path, ...]}
                    of array leaves saved as known zeros: not in an orbax item, made again
                    on restore (``_zeros.py``)
    digest          SHA-256 of the canonical JSON text of all the other fields: an integrity
                    check against accidents, not a signature (see below)

Reading it never runs code from the checkpoint: the file is parsed by ``json`` into dicts,
lists, strings and numbers, dtype names are looked up in a fixed table instead of being
handed to a parser, and every field is checked for its type and its agreement with the others
before any is used. A field that fails raises ``CheckpointCorruptedError`` naming the step
directory and the field; the digest then catches values changed by accident, by a disk or by
a hand-edit that did not update it. The digest (like the arrays' checksums, ``_integrity.py``)
is for integrity, not authenticity: it has no key, so anyone who edits the item can recompute
it, and a checkpoint from an untrusted source is no safer for passing it. Fields
this version does not know are kept under the digest and otherwise left alone, so a part of
rudax that adds one (e.g. sharded layouts) reads it itself.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

from rudax.checkpoint._config import check_config
from rudax.checkpoint._integrity import ALGORITHMS, LEGACY, CheckpointCorruptedError
from rudax.checkpoint._record import DTYPE_NAMES, FLOAT_DTYPE_NAMES, PARTS, PYTHON_LEAVES
from rudax.checkpoint._version import RUDAX_VERSION

FORMAT = 4
ONE_ITEM_FORMAT = 4  # from this format on, every part's arrays are in the one item "arrays"
ZEROS_FORMAT = 3  # the first format with a zeros field (required in 3, optional from 4)
# Formats this rudax reads: 1 is 2 without checksum_algorithm (every checksum fmix32-sum).
READABLE_FORMATS = (1, 2, 3, 4)
_FIELDS = (
    "format",
    "rudax_version",
    "step",
    "parts",
    "layout",
    "python_state",
    "config",
    "storage_dtypes",
    "checksums",
)
_PYTHON_TYPE_NAMES = {t.__name__: t for t in PYTHON_LEAVES}


class Meta(NamedTuple):
    """A meta item that passed every check."""

    step: int
    parts: list[str]
    layout: dict[str, list[list[Any]]]
    python_state: dict[str, Any]
    config: dict[str, Any] | None
    storage_dtypes: dict[str, str] | None
    checksums: dict[str, dict[str, str]]
    raw: dict[str, Any]  # the whole item, fields of other rudax modules included
    checksum_algorithm: str = LEGACY
    zeros: dict[str, list[str]] | None = None  # {part: paths} saved as known zeros, if any
    format: int = FORMAT  # below ONE_ITEM_FORMAT, one orbax item per part


def _digest(fields: dict[str, Any]) -> str:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def build_meta(
    *,
    step: int,
    parts: list[str],
    layout: dict[str, list[list[Any]]],
    python_state: dict[str, Any],
    config: dict[str, Any] | None,
    storage_dtypes: dict[str, str] | None,
    checksums: dict[str, dict[str, str]],
    **extra: Any,
) -> dict[str, Any]:
    """The meta item's JSON data, digest included; ``extra`` fields are written as given."""
    if "zeros" in extra and not extra["zeros"]:
        raise ValueError("build_meta: zeros, when given, must list a leaf (omit it otherwise)")
    fields = {
        "format": FORMAT,
        "rudax_version": RUDAX_VERSION,
        "step": step,
        "parts": parts,
        "layout": layout,
        "python_state": python_state,
        "config": config,
        "storage_dtypes": storage_dtypes,
        "checksums": checksums,
        **extra,
    }
    return {**fields, "digest": _digest(fields)}


def _fail(where: str, field: str, problem: str, value: Any) -> CheckpointCorruptedError:
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return CheckpointCorruptedError(f"{where}: meta field {field} {problem}, got {shown}")


def _is_int(value: Any) -> bool:
    return type(value) is int


def _check_row(where: str, field: str, row: Any) -> None:
    if not (type(row) is list and len(row) >= 3 and type(row[0]) is str and type(row[2]) is str):
        raise _fail(where, field, "must hold rows [path, shape, dtype, ...]", row)
    if row[1] == "python":
        if row[2] not in _PYTHON_TYPE_NAMES:
            raise _fail(where, field, f"has a Python leaf of unknown type {row[2]!r}", row)
        return
    if not (type(row[1]) is list and all(_is_int(d) and d >= 0 for d in row[1])):
        raise _fail(where, field, "has a shape that is not a list of ints >= 0", row)
    if row[2] not in DTYPE_NAMES:
        raise _fail(where, field, "has an unknown dtype name", row)


def parse_meta(raw: Any, *, step: int, where: str) -> Meta:
    """Checks the meta item read from step directory ``where``; a ``Meta`` of its fields.

    Raises ``CheckpointCorruptedError`` naming ``where`` and the field for a missing field, a
    field of the wrong type, fields that disagree, or a digest that does not match.
    """
    if type(raw) is not dict:
        raise _fail(where, "<root>", "must be a JSON object", raw)
    for field in (*_FIELDS, "digest"):
        if field not in raw:
            raise CheckpointCorruptedError(
                f"{where}: the meta item has no field {field!r} (fields: {sorted(raw)})"
            )
    if not _is_int(raw["format"]) or raw["format"] not in READABLE_FORMATS:
        raise _fail(
            where,
            "format",
            f"must be one of {READABLE_FORMATS}, the formats this rudax reads",
            raw["format"],
        )
    algorithm = raw.get("checksum_algorithm", LEGACY) if raw["format"] >= 2 else LEGACY
    if raw["format"] >= 2 and "checksum_algorithm" not in raw:
        raise CheckpointCorruptedError(
            f"{where}: the meta item has no field 'checksum_algorithm' (fields: {sorted(raw)})"
        )
    if algorithm not in ALGORITHMS:
        raise _fail(where, "checksum_algorithm", f"must be one of {ALGORITHMS}", algorithm)
    if type(raw["rudax_version"]) is not str:
        raise _fail(where, "rudax_version", "must be a str", raw["rudax_version"])
    if not _is_int(raw["step"]) or raw["step"] != step:
        raise _fail(where, "step", f"must be {step}, the directory's step", raw["step"])
    parts = raw["parts"]
    if not (
        type(parts) is list
        and all(type(p) is str and p in PARTS for p in parts)
        and parts == [p for p in PARTS if p in parts]
    ):
        raise _fail(where, "parts", f"must list distinct names from {PARTS} in that order", parts)
    layout = raw["layout"]
    if type(layout) is not dict or sorted(layout) != sorted(parts):
        raise _fail(where, "layout", f"must have one entry per saved part {parts}", layout)
    for part in parts:
        if type(layout[part]) is not list:
            raise _fail(where, f"layout.{part}", "must be a list of rows", layout[part])
        for row in layout[part]:
            _check_row(where, f"layout.{part}", row)
    python_state = raw["python_state"]
    python_rows = {r[0]: r[2] for r in layout.get("state", []) if r[1] == "python"}
    if type(python_state) is not dict or sorted(python_state) != sorted(python_rows):
        raise _fail(
            where,
            "python_state",
            f"must hold the state's Python leaves {sorted(python_rows)}",
            python_state,
        )
    for path, value in python_state.items():
        if type(value) is not _PYTHON_TYPE_NAMES[python_rows[path]]:
            raise _fail(
                where, f"python_state[{path!r}]", f"must be of type {python_rows[path]}", value
            )
    try:
        config = check_config(raw["config"])
    except (TypeError, ValueError) as e:
        raise _fail(where, "config", f"is not JSON data ({e})", raw["config"]) from e
    storage_dtypes = raw["storage_dtypes"]
    if storage_dtypes is not None:
        dtypes_of = {
            f"{part}{row[0]}": row[2]
            for part in parts
            for row in layout[part]
            if row[1] != "python" and row[2] in FLOAT_DTYPE_NAMES
        }
        if type(storage_dtypes) is not dict or storage_dtypes != dtypes_of:
            raise _fail(
                where,
                "storage_dtypes",
                "must give each floating leaf its layout dtype",
                storage_dtypes,
            )
    checks = raw["checksums"]
    if type(checks) is not dict or sorted(checks) != sorted(parts):
        raise _fail(where, "checksums", f"must have one entry per saved part {parts}", checks)
    for part, table in checks.items():
        ok = type(table) is dict and all(
            type(v) is str and len(v) == 8 and all(c in "0123456789abcdef" for c in v)
            for v in table.values()
        )
        if not ok:
            raise _fail(where, f"checksums.{part}", "must map paths to 8 hex digits", table)
    zeros = _check_zeros(where, raw, layout, checks)
    fields = {k: v for k, v in raw.items() if k != "digest"}
    if raw["digest"] != _digest(fields):
        raise CheckpointCorruptedError(
            f"{where}: the meta item's digest does not match its contents: it was changed "
            "after it was written"
        )
    return Meta(
        step=step,
        parts=parts,
        layout=layout,
        python_state=python_state,
        config=config,
        storage_dtypes=storage_dtypes,
        checksums=checks,
        raw=raw,
        checksum_algorithm=algorithm,
        zeros=zeros,
        format=raw["format"],
    )


def _check_zeros(
    where: str,
    raw: dict[str, Any],
    layout: dict[str, list[list[Any]]],
    checks: dict[str, dict[str, str]],
) -> dict[str, list[str]] | None:
    """The zeros field (required in format 3, optional from 4): array leaves, checksum zero."""
    if raw["format"] < ZEROS_FORMAT or (raw["format"] > ZEROS_FORMAT and "zeros" not in raw):
        return None
    zeros = raw.get("zeros")
    if type(zeros) is not dict or not zeros or not set(zeros) <= set(layout):
        raise _fail(where, "zeros", f"must map saved parts {sorted(layout)} to paths", zeros)
    for part, paths in zeros.items():
        arrays = {row[0] for row in layout[part] if row[1] != "python"}
        if not (type(paths) is list and paths and len(set(paths)) == len(paths)):
            raise _fail(where, f"zeros.{part}", "must be a list of distinct paths", paths)
        for path in paths:
            if type(path) is not str or path not in arrays:
                raise _fail(where, f"zeros.{part}", "must list array leaves of the part", path)
            # An all-zero leaf's checksum is 0 under both algorithms: a cheap consistency check.
            if checks[part].get(path) != "00000000":
                raise _fail(
                    where, f"zeros.{part}", f"lists {path}, whose checksum is not zero", path
                )
    return zeros
