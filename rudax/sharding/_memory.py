"""``bytes_per_device``: what a tree of arrays costs each device, laid out as rudax shards it."""

from __future__ import annotations

import math
from typing import Any

import jax

from rudax._validation import check_positive_int

__all__ = ["bytes_per_device"]


def bytes_per_device(tree: Any, fsdp: int = 1) -> int:
    """Bytes of ``tree``'s arrays on each device, as ``ShardedParameter`` lays them out.

    Over ``fsdp > 1`` devices each leaf of rank >= 1 is split into ``ceil(size / fsdp)``
    elements (a ``ShardedParameter``'s padded flat slice, padding included); scalars and
    every leaf with ``fsdp == 1`` are whole on each device. Leaves may be arrays or
    ``jax.ShapeDtypeStruct`` (``jax.eval_shape``'s), so a plan costs no memory.

    Args:
      tree: a pytree of arrays or ShapeDtypeStructs.
      fsdp: the size of the mesh axis the leaves are sharded over; 1 for replicated.

    Returns:
      The bytes each device holds.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from rudax.sharding import bytes_per_device
      >>> w = jax.ShapeDtypeStruct((10, 3), jnp.bfloat16)
      >>> tree = {"w": w, "step": jnp.zeros((), jnp.int32)}
      >>> bytes_per_device(tree), bytes_per_device(tree, fsdp=8)   # 30 -> 4 elements each
      (64, 12)
    """
    check_positive_int("fsdp", fsdp)
    total = 0
    for leaf in jax.tree.leaves(tree):
        size = math.prod(leaf.shape)
        if fsdp > 1 and len(leaf.shape) >= 1:
            size = -(-size // fsdp)
        total += size * leaf.dtype.itemsize  # a PRNG key's dtype has one too
    return total
