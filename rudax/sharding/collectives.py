"""Differentiable collectives over a mesh axis, for use inside ``jax.shard_map``.

``all_gather``, ``scatter``, ``broadcast`` and ``all_reduce``. Their gradients are those of the
sum of the ranks' local losses (``rudax/sharding/_collectives.py`` spells out each transpose).
"""

from rudax.sharding._collectives import all_gather as all_gather
from rudax.sharding._collectives import all_reduce as all_reduce
from rudax.sharding._collectives import broadcast as broadcast
from rudax.sharding._collectives import scatter as scatter

__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "scatter",
]
