"""Sharded leaves in a checkpoint: written shard by shard, read back where the template puts them.

Saving needs nothing from rudax. orbax writes a ``jax.Array`` one shard at a time: each process
copies to host only its addressable shards of replica 0 and writes each as its own chunk into
its own OCDBT database (``<item>/ocdbt.process_<i>``), and the primary process merges the
indices at commit. No process ever holds a whole array, so an FSDP state (``P("fsdp")``) or a
replicated one (``P()``) saves as it lies, across processes too (orbax-checkpoint 0.12:
``ArrayHandler.serialize`` -> ``replica_slices.get_replica_slices``).

Restoring places each leaf as its template leaf says: a ``jax.Array`` committed to a sharding
or a ``jax.ShapeDtypeStruct`` with one is read into that sharding, each device reading only the
slice of the stored array its shard covers; a leaf that names no placement (an uncommitted
array, as ``jnp.zeros`` and ``tx.init`` make, or a ``ShapeDtypeStruct`` without a sharding)
comes back as such an array would be made, uncommitted on the default device; a NumPy leaf
comes back as NumPy. The placement the checkpoint was saved with is never used, so a record
saved on 8 devices restores onto 4, onto 1, or onto another process layout.

A ``ShardedParameter`` is stored as what it holds, the flat vector of its logical values
followed by zero padding up to ``num_shards * shard_size`` (see
``rudax/sharding/_sharded_parameter.py``); storing that vector is what keeps the save free of
gathers. Its layout row reports its *logical* shape, so a template with another ``num_shards``
passes the layout check, and the meta item records each one's ``logical_shape``,
``flat_length``, ``num_shards``, ``axis_name`` and, for layers stored stacked, ``stack``
(``[L]``: the storage is ``(L, flat_length)``, each row padded on its own). Restoring into
another padded length is
"read the first ``size`` elements, pad with zeros": exactly what orbax's restore does with
``strict=False`` (``ArrayRestoreArgs``; ``serialization._read_shard`` fills the requested
domain with zeros and copies in its intersection with the stored one). That option covers a
whole orbax item, so it is used only for an item holding such a parameter, and only after
every stored shape of that item has been checked against the layout the template expects:
nothing else can be padded or cut.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from rudax.checkpoint._compat import default_device, uncommitted
from rudax.sharding import ShardedParameter


def is_sharded_parameter(x: Any) -> bool:
    """True for a ``rudax.sharding.ShardedParameter`` holding storage (an ``is_leaf``).

    One whose ``local`` is None holds nothing: ``fused_adamw`` keeps no master for an fp32
    parameter, so its state mirrors the parameters with None leaves. Walked into, it has no
    leaves, exactly like a plain None.
    """
    return isinstance(x, ShardedParameter) and x.local is not None


def _storage_path(path: tuple[Any, ...]) -> str:
    # The path of the parameter's only pytree leaf: what orbax stores and the rows are keyed by.
    return jax.tree_util.keystr((*path, jax.tree_util.GetAttrKey("local")))


def _check_storage(where: str, p: ShardedParameter) -> int:
    """The flat length of p's storage (of each of a stack's parameters); ValueError unless it
    is ``num_shards * shard_size``, as a vector or as rows of a stack ``(L, length)``."""
    length = p.num_shards * p.shard_size
    shape = tuple(np.shape(p.local))
    if shape[-1:] != (length,) or len(shape) > 2:
        raise ValueError(
            f"{where}: a ShardedParameter of logical_shape={p.logical_shape} over "
            f"num_shards={p.num_shards} must store a flat vector of {length} elements (or a "
            f"stack of them), got local of shape {shape}"
        )
    return length


def _stack(p: ShardedParameter) -> list[int]:
    """``[L]`` for a stack of L parameters (layers stored stacked), ``[]`` for one."""
    return list(np.shape(p.local)[:-1])


def layout_row(path: tuple[Any, ...], p: ShardedParameter) -> list[Any]:
    """[storage path, logical shape, dtype]: the row ``describe`` reports for a parameter.

    The logical shape, not the padded one, so that restoring onto another number of shards
    passes the layout check while another logical shape is still an error.
    """
    where = _storage_path(path)
    _check_storage(where, p)
    return [where, _stack(p) + list(p.logical_shape), str(np.dtype(p.local.dtype))]


def storage_layout(tree: Any) -> dict[str, dict[str, Any]]:
    """{storage path: its logical shape, flat length, shards and axis} for each parameter.

    Written into the meta item, so the stored flat vectors can be read back as the logical
    tensors without rudax (the first ``prod(logical_shape)`` elements, reshaped).
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded_parameter)[0]:
        if is_sharded_parameter(leaf):
            where = _storage_path(path)
            out[where] = {
                "logical_shape": list(leaf.logical_shape),
                "flat_length": _check_storage(where, leaf),
                "num_shards": leaf.num_shards,
                "axis_name": leaf.axis_name,
            }
            if _stack(leaf):  # layers stored stacked; a plain parameter's row as before
                out[where]["stack"] = _stack(leaf)
    return out


def _unplaced(x: Any) -> bool:
    """True for a leaf that names no placement: an uncommitted array, an unsharded struct."""
    if isinstance(x, jax.Array):
        return not x.committed
    return isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None


def _target(x: Any, device: Any) -> Any:  # device: a jax.Device
    # Typed PRNG keys never get here: the checkpointer restores their key data (_keys.py).
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        # A leaf that names no placement is read onto the default device, as jnp.asarray
        # would put it, and uncommitted afterwards (place_unplaced) without another copy.
        sharding = jax.sharding.SingleDeviceSharding(device) if _unplaced(x) else x.sharding
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    # A NumPy leaf is read on the host. orbax takes a 0-d array as a target but not a NumPy
    # scalar, and np.empty only reserves address space: orbax reads into arrays of its own.
    return np.empty(np.shape(x), np.dtype(x.dtype))


def restore_target(tree: Any) -> Any:
    """tree as orbax restore targets, each leaf carrying the placement it will be read into.

    A ``jax.Array`` committed to a sharding, or a ``ShapeDtypeStruct`` with one, keeps it
    (each device reads only its slice). A leaf that names no placement, an uncommitted array
    (what ``jnp.zeros`` or ``tx.init`` make) or a ``ShapeDtypeStruct`` without a sharding, is
    read onto the default device (``place_unplaced`` uncommits it); a NumPy leaf is read on
    the host. A ``ShardedParameter`` keeps its static fields (the output has the template's
    ``num_shards`` and ``axis_name``), its storage placed the same way.
    """
    device = default_device()

    def target(x: Any) -> Any:
        if is_sharded_parameter(x):
            return dataclasses.replace(x, local=_target(x.local, device))
        return _target(x, device)

    return jax.tree.map(target, tree, is_leaf=is_sharded_parameter)


def place_unplaced(restored: Any, template: Any) -> Any:
    """restored, with each leaf whose template named no placement made an uncommitted array.

    Such a leaf comes back as a fresh ``jnp`` array would be: on the default device and
    uncommitted, so ``jax.jit`` moves it next to the committed arguments it meets (the update
    count of ``tx.init`` beside parameters on a mesh). Committed to one device, it would make
    the first step fail with "incompatible devices". orbax read it onto the default device
    (``restore_target``); it is uncommitted there, its buffer kept (``_compat.uncommitted``).
    """
    flat, treedef = jax.tree_util.tree_flatten(restored)
    like = jax.tree.leaves(template)
    if len(like) != len(flat):
        raise ValueError(f"restore: {len(flat)} leaves read, the template has {len(like)}")
    out = [uncommitted(r) if _unplaced(t) else r for r, t in zip(flat, like, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, out)


def repadded(template: Any, saved: dict[str, dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """{storage path: (saved, template) flat length} for each parameter stored at a new length.

    Args:
      template: a record part holding ``ShardedParameter`` leaves.
      saved: the part's ``storage_layout`` as the meta item recorded it.
    """
    now = storage_layout(template)
    out = {}
    for where, layout in now.items():
        if where not in saved:
            # The layout rows matched, so the saved leaf is a plain array at this path.
            raise ValueError(
                f"restore: {where} is a ShardedParameter in the template but was saved as a "
                "plain array; restore it into an array and build the parameter from it"
            )
        if saved[where]["flat_length"] != layout["flat_length"]:
            out[where] = (saved[where]["flat_length"], layout["flat_length"])
    return out


def check_stored_shapes(
    item_dir: str | os.PathLike, target: Any, lengths: dict[str, tuple[int, int]]
) -> None:
    """ValueError unless each array orbax stored has the shape the restore expects.

    Run before a restore with ``strict=False``, which would otherwise pad or cut any array
    whose stored shape differs from the target's: every leaf must be stored at its target
    shape except the re-padded parameters, stored at their recorded flat length.
    """
    metadata = ocp.StandardCheckpointHandler().metadata(epath.Path(item_dir)).tree
    stored = {m.name: tuple(m.shape) for m in jax.tree.leaves(metadata) if hasattr(m, "shape")}
    names = jax.tree.leaves(ocp.tree.get_param_names(target, include_empty_nodes=False))
    for (path, leaf), name in zip(
        jax.tree_util.tree_flatten_with_path(target)[0], names, strict=True
    ):
        where = jax.tree_util.keystr(path)
        shape = tuple(np.shape(leaf))
        want = (*shape[:-1], lengths[where][0]) if where in lengths else shape
        if stored.get(name) != want:
            raise ValueError(
                f"restore: {where} is stored in {os.fspath(item_dir)} with shape "
                f"{stored.get(name)}, the checkpoint's layout says {want}: the checkpoint is "
                "inconsistent, refusing to pad or cut it"
            )


def restore_args(
    target: Any,
    saved: dict[str, dict[str, Any]],
    item_dir: str | os.PathLike,
    *,
    partial: bool = False,
) -> ocp.args.PyTreeRestore:
    """orbax's restore arguments for one item, re-padding parameters where needed.

    Args:
      target: the item's ``restore_target`` (leaves placed, ``ShardedParameter`` nodes kept).
      saved: the item's ``storage_layout`` rows from the meta item (empty if it holds none),
        keyed by paths within ``target``.
      item_dir: the item's directory in the step, read only when a parameter is re-padded.
      partial: True when ``target`` holds only some of the item's subtrees (a model-only
        restore of a training checkpoint): orbax then reads only the arrays it names.

    Returns:
      ``PyTreeRestore(target)``, with ``strict=False`` only on the arrays of an item where a
      parameter is stored at another flat length than the target's, and then only after
      ``check_stored_shapes``. (``StandardRestore`` builds the same arguments but cannot
      restore part of an item.)
    """
    lengths = repadded(target, saved)
    args = ocp.checkpoint_utils.construct_restore_args(target)
    if lengths:
        check_stored_shapes(item_dir, target, lengths)
        args = jax.tree.map(
            lambda a: (
                dataclasses.replace(a, strict=False) if isinstance(a, ocp.ArrayRestoreArgs) else a
            ),
            args,
        )
    return ocp.args.PyTreeRestore(target, restore_args=args, partial_restore=partial)
