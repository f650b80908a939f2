"""Checking a restore template against a checkpoint, and retyping it for restore_with_dtypes.

Everything here runs before any array is read: a template that does not match what was saved
raises ValueError naming the first differing path and both values (``record.model['w']: saved
shape (4, 3) dtype bfloat16, template shape (4, 4) dtype bfloat16``), and the rows compared are
``describe``'s, the same the meta item stores.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rudax.checkpoint._meta import Meta
from rudax.checkpoint._record import FLOAT_DTYPE_NAMES, TrainingRecord, floating_dtypes


def check_layout(
    part: str, saved: list[list[Any]], template: list[list[Any]], *, any_float: bool = False
) -> None:
    """ValueError naming the first leaf where the template differs from what was saved.

    ``any_float`` (restore_with_dtypes) lets a floating template leaf stand for a saved
    floating leaf of another dtype; shapes, structure and non-floating dtypes still match.
    """
    for s, t in zip(saved, template, strict=False):
        if s[0] != t[0]:
            raise ValueError(
                f"restore: record.{part} structure differs: saved leaf record.{part}{s[0]}, "
                f"template leaf record.{part}{t[0]}"
            )
        if any_float and s[1] != "python" and t[1] != "python":
            if s[2] in FLOAT_DTYPE_NAMES and t[2] in FLOAT_DTYPE_NAMES:
                t = [*t[:2], s[2], *t[3:]]
        if s[1:] != t[1:]:
            raise ValueError(f"restore: record.{part}{s[0]}: saved {_show(s)}, template {_show(t)}")
    if len(saved) != len(template):
        longer, what = (saved, "saved") if len(saved) > len(template) else (template, "template")
        first_extra = longer[min(len(saved), len(template))][0]
        raise ValueError(
            f"restore: record.{part} structure differs: record.{part}{first_extra} is only in "
            f"the {what} tree ({len(saved)} saved leaves, {len(template)} in the template)"
        )


def check_parts(meta: Meta, present: list[str], strict: bool) -> None:
    """ValueError unless the template's parts are those saved (a subset if not strict)."""
    missing = [p for p in present if p not in meta.parts]
    if missing:
        raise ValueError(
            f"restore: step {meta.step} holds parts {meta.parts}; the template's "
            f"{', '.join(f'record.{p}' for p in missing)} was not saved"
        )
    if strict and present != meta.parts:
        raise ValueError(
            f"restore: step {meta.step} holds parts {meta.parts}, the template {present}; pass "
            "strict=False to restore only the template's parts"
        )


def check_recorded_dtypes(record: TrainingRecord, recorded: dict[str, str]) -> None:
    """ValueError naming the first leaf whose dtype is not the one ``record.dtypes`` gives it."""
    now = floating_dtypes(record)
    for path in sorted(set(now) | set(recorded)):
        if now.get(path) != recorded.get(path):
            raise ValueError(
                f"save: record.dtypes records record.{path} as {recorded.get(path)}, but "
                f"the leaf is {now.get(path)}: the record changed after capture_with_dtypes, "
                "capture it again (saving never casts)"
            )


def retyped(part: str, tree: Any, dtypes: dict[str, str]) -> Any:
    """tree with each floating leaf's dtype replaced by the one recorded for its path."""

    def retype(path: Any, leaf: Any) -> Any:
        name = dtypes.get(f"{part}{jax.tree_util.keystr(path)}")
        if name is None or str(np.dtype(leaf.dtype)) == name:
            return leaf
        dtype = jnp.dtype(name)  # a name from the fixed table the meta item was checked against
        if isinstance(leaf, np.ndarray | np.generic):
            return np.empty(np.shape(leaf), dtype)
        # An uncommitted array names no placement: it stays so (_sharded.place_unplaced).
        sharding = leaf.sharding if getattr(leaf, "committed", True) else None
        return jax.ShapeDtypeStruct(np.shape(leaf), dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(retype, tree)


def _show(row: list[Any]) -> str:
    if row[1] == "python":
        return f"a Python {row[2]}"
    return f"shape {tuple(row[1])} dtype {row[2]}"
