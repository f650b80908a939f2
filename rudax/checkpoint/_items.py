"""Which orbax items a step holds, and reading the parts' arrays out of them.

From meta format 4 a step holds one orbax item, ``arrays``, with ``{part: tree}`` for every
part that has an array: orbax's blocking setup of an async save grows with the number of
items. Formats 1 to 3 hold one item per part; they are read the same way, item by item.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from rudax.checkpoint._meta import ONE_ITEM_FORMAT, Meta
from rudax.checkpoint._paths import ARRAYS
from rudax.checkpoint._sharded import restore_args


def written_parts(meta: Meta) -> set[str]:
    """The parts with an array in the step's orbax item: not python-only, not all zeros."""
    zeros = meta.zeros or {}
    return {
        p
        for p in meta.parts
        if {row[0] for row in meta.layout[p] if row[1] != "python"} - set(zeros.get(p, []))
    }


def read_arrays(manager: Any, step: int, where: str, meta: Meta, read: dict[str, Any]) -> Any:
    """{part: tree} read by orbax (``manager``, a ``CheckpointManager``) for each part in
    ``read``, its restore target, from step ``step`` at ``where``."""
    if not read:
        return {}
    sharded = meta.raw.get("sharded", {})
    if meta.format < ONE_ITEM_FORMAT:  # one item per part
        items = {p: restore_args(read[p], sharded.get(p, {}), os.path.join(where, p)) for p in read}
        return manager.restore(step, args=ocp.args.Composite(**items))
    # The layout rows are keyed by paths within a part; in the one item they start at it.
    rows = {
        jax.tree_util.keystr((jax.tree_util.DictKey(p),)) + path: row
        for p in read
        for path, row in sharded.get(p, {}).items()
    }
    # A restore of some parts reads only theirs. That takes orbax's PyTree arguments
    # (StandardRestore has no partial restore), and a manager binds an item's handler to
    # the type of its first arguments: so the item is saved with PyTreeSave too.
    partial = set(read) != written_parts(meta)
    args = restore_args(read, rows, os.path.join(where, ARRAYS), partial=partial)
    return manager.restore(step, args=ocp.args.Composite(**{ARRAYS: args}))[ARRAYS]
