"""rudax.sharding: collectives, data parallel and FSDP training over ``jax.sharding`` meshes.

Everything here runs inside ``jax.shard_map`` over a ``jax.sharding.Mesh`` (Auto axes from
``jax.sharding.Mesh(...)`` or Explicit axes from ``jax.make_mesh``) and is differentiable.
"""

# Public names, re-exported one per line (``from rudax.sharding._x import a as a``), each in
# its block below, and listed again, sorted, in __all__.

# [block: collectives]
from rudax.sharding import collectives as collectives

# [block: compat]
from rudax.sharding._compat import vary_like as vary_like
from rudax.sharding._compat import varying_axes as varying_axes

# [block: data_parallel]
from rudax.sharding._data_parallel import DataParallel as DataParallel
from rudax.sharding._data_parallel import MissingGradientPolicy as MissingGradientPolicy

# [block: fsdp]
from rudax.sharding._fsdp import ShardedModule as ShardedModule
from rudax.sharding._fsdp import ShardingContext as ShardingContext
from rudax.sharding._fsdp import shard_specs as shard_specs

# [block: memory]
from rudax.sharding._memory import bytes_per_device as bytes_per_device

# [block: muon]
from rudax.sharding._muon import fsdp_muon as fsdp_muon

# [block: sharded_parameter]
from rudax.sharding._sharded_parameter import ShardedParameter as ShardedParameter

__all__ = [
    "DataParallel",
    "MissingGradientPolicy",
    "ShardedModule",
    "ShardedParameter",
    "ShardingContext",
    "bytes_per_device",
    "collectives",
    "fsdp_muon",
    "shard_specs",
    "vary_like",
    "varying_axes",
]
