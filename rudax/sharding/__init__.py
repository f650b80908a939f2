"""rudax.sharding: collectives, data parallel and FSDP training over ``jax.sharding`` meshes.

Everything here runs inside ``jax.shard_map`` over a ``jax.sharding.Mesh`` (Auto axes from
``jax.sharding.Mesh(...)`` or Explicit axes from ``jax.make_mesh``) and is differentiable.
Around such a step, a training program's mesh: ``parse_mesh`` / ``mesh_text`` (the
``data=2,fsdp=4`` flag), ``make_mesh`` (every process's devices in process order),
``state_shardings`` / ``place`` / ``replicate`` (the train state on it, what each process
holds whole made global), ``batch_sharding`` / ``local_rows`` / ``put_batch`` (each process's
rows) and ``make_train_steps`` (a program's jitted steps over it).
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

# [block: mesh]
from rudax.sharding._mesh import MESH_AXES as MESH_AXES
from rudax.sharding._mesh import batch_sharding as batch_sharding
from rudax.sharding._mesh import local_rows as local_rows
from rudax.sharding._mesh import make_mesh as make_mesh
from rudax.sharding._mesh import mesh_text as mesh_text
from rudax.sharding._mesh import parse_mesh as parse_mesh
from rudax.sharding._mesh import place as place
from rudax.sharding._mesh import put_batch as put_batch
from rudax.sharding._mesh import replicate as replicate
from rudax.sharding._mesh import state_shardings as state_shardings

# [block: muon]
from rudax.sharding._muon import fsdp_muon as fsdp_muon

# [block: sharded_parameter]
from rudax.sharding._sharded_parameter import ShardedParameter as ShardedParameter

# [block: steps]
from rudax.sharding._steps import TrainSteps as TrainSteps
from rudax.sharding._steps import make_train_steps as make_train_steps

__all__ = [
    "MESH_AXES",
    "DataParallel",
    "MissingGradientPolicy",
    "ShardedModule",
    "ShardedParameter",
    "ShardingContext",
    "TrainSteps",
    "batch_sharding",
    "bytes_per_device",
    "collectives",
    "fsdp_muon",
    "local_rows",
    "make_mesh",
    "make_train_steps",
    "mesh_text",
    "parse_mesh",
    "place",
    "put_batch",
    "replicate",
    "shard_specs",
    "state_shardings",
    "vary_like",
    "varying_axes",
]
