"""Known zeros: array leaves whose bytes are all zero, recorded in the meta item, not written.

A step-0 checkpoint holds AdamW's moments fresh from ``tx.init`` and every checkpoint taken at
an accumulation window's end holds an emptied ``GradientAccumulator``: all zeros, up to 4 of
every 18 bytes of the state for the accumulator alone. zstd makes writing them cheap, but
reading them back still costs decompressing, allocating and placing them. Measured with
``python -m benchmarks.checkpoint --gb 1.0 --rounds 3`` (its step-0 arms: 571 MB of zero
moments in a 1 GB state, CPU machine): restore 1.71 s written, 1.25 s listed; save 0.83 s
and 0.95 s, the same within the disk's spread (zstd level 1 writes zeros at memory speed).

With ``Checkpointer(..., zeros_as_metadata=True)`` a save lists such leaves in the meta
item's ``zeros`` field (formats 3 and 4) and hands orbax ``None`` in their place; a restore makes
them again, as zeros in the template's placement. Their checksums are saved and checked like
every other leaf's. "All zero" is bitwise: ``-0.0`` is not zero here, and a leaf counts only
if it is zero in every process.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rudax.checkpoint._integrity import CheckpointCorruptedError, host_copies


def _all_zero(blocks: list[tuple[np.ndarray, tuple[int, ...]]]) -> bool:
    return not any(np.reshape(b, -1).view(np.uint8).any() for b, _ in blocks)


def zero_paths(tree: Any) -> list[str]:
    """The keystr paths of tree's array leaves (of at least one element) that are all zero.

    Read from this process's host shards (``host_copies``, the copies a save takes anyway).
    In a multi-process run the answers are combined by an all-gather, so every process hands
    orbax the same tree; like ``save`` itself, every process must call it.
    """
    copies = host_copies(tree, copy_numpy=False)
    paths = [p for p, c in copies.items() if int(np.prod(c.shape)) > 0]
    zero = np.array([_all_zero(copies[p].blocks) for p in paths], np.uint8)
    if jax.process_count() > 1 and len(paths):
        from jax.experimental import multihost_utils

        zero = np.asarray(multihost_utils.process_allgather(zero)).min(axis=0)
    return [p for p, z in zip(paths, zero, strict=True) if z]


def without(tree: Any, paths: list[str]) -> Any:
    """tree with the leaves at ``paths`` replaced by None (an empty node to orbax)."""
    drop = set(paths)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: None if jax.tree_util.keystr(path) in drop else x, tree
    )


def _zeros(target: Any) -> Any:
    """Zeros placed as an orbax restore target says (``_sharded.restore_target``'s leaves)."""
    if isinstance(target, np.ndarray):
        return np.zeros(target.shape, target.dtype)

    # Each process makes only its own shards, from host zeros (calloc: untouched pages).
    def shard(index: tuple[slice, ...] | None) -> np.ndarray:
        if index is None:  # what make_array_from_callback passes for a 0-d array
            index = ()
        shape = [len(range(*s.indices(n))) for s, n in zip(index, target.shape, strict=True)]
        return np.zeros(shape, target.dtype)

    return jax.make_array_from_callback(target.shape, target.sharding, shard)


def with_zeros(restored: Any, target: Any, paths: list[str]) -> Any:
    """target's tree, orbax's leaves from ``restored`` (``without(target, paths)`` read) and
    zeros at ``paths``."""
    if not paths:
        return restored
    drop, read = set(paths), iter(jax.tree.leaves(restored))
    out = jax.tree_util.tree_map_with_path(
        lambda path, t: _zeros(t) if jax.tree_util.keystr(path) in drop else next(read), target
    )
    if next(read, None) is not None:
        raise ValueError("restore: orbax returned more leaves than the template has")
    return out


def _leaf_paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def check_read(where: str, part: str, restored: Any, target: Any) -> None:
    """CheckpointCorruptedError naming the first leaf the restore wanted and orbax lacked.

    orbax returns what it stored where the target has a leaf it stored as None (an empty
    node): a meta item whose ``zeros`` field lost a leaf must not pass as a shorter tree.
    """
    got, want = _leaf_paths(restored), _leaf_paths(target)
    if got != want:
        missing = sorted(set(want) - set(got)) or sorted(set(got) - set(want)) or want
        raise CheckpointCorruptedError(
            f"{where}: record.{part}{missing[0]} is neither in the part's orbax item nor "
            f"listed as zeros: orbax read {len(got)} arrays, the restore expects {len(want)}"
        )
