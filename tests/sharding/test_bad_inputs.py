"""The catalog of bad inputs to rudax.sharding: each is a clear error naming what to fix.

Most mistakes with collectives show up only inside ``jax.shard_map`` (an axis that is not
bound, a root outside the axis, a dimension that does not divide), so those cases run a tiny
``shard_map`` over the 8 simulated devices that ``tests/conftest.py`` sets up.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.layers as rl
import rudax.sharding as rs
from tests._catalog import Bad, catalog

if jax.device_count() < 8:
    pytest.skip("needs the 8 simulated devices of tests/conftest.py", allow_module_level=True)

MESH = jax.make_mesh((8,), ("data",))  # Explicit axes on jax 0.10
FSDP_MESH = jax.sharding.Mesh(jax.devices(), ("fsdp",))  # Auto axes
C = rs.collectives


SHARDED = P("data")


def in_shard_map(body, out_specs=SHARDED):
    """body(x) on each device's slice of an (8,) vector sharded over "data"."""
    x = jax.device_put(jnp.ones(8), NamedSharding(MESH, SHARDED))
    return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(SHARDED,), out_specs=out_specs))(x)


def dp():
    return rs.DataParallel(MESH, "data")


CASES = [
    Bad(
        "data-parallel-mesh-is-a-name",
        lambda: rs.DataParallel("data"),
        TypeError,
        r"mesh must be a jax\.sharding\.Mesh, got mesh='data'",
    ),
    Bad(
        "data-parallel-unknown-axis",
        lambda: rs.DataParallel(MESH, "model"),
        ValueError,
        r"axis_name must be one of the mesh's axes \('data',\), got axis_name='model'",
    ),
    Bad(
        "data-parallel-reduce-outside-shard-map",
        lambda: dp().reduce({"w": jnp.ones(3)}, 1.0),
        ValueError,
        r"DataParallel\.reduce runs inside jax\.shard_map .* axis 'data'",
    ),
    Bad(
        "data-parallel-reduce-none-gradient",
        lambda: in_shard_map(lambda x: dp().reduce({"w": None, "b": x}, 1.0)["b"]),
        ValueError,
        r"gradient \['w'\] is None; pass missing=MissingGradientPolicy\.ZERO",
    ),
    Bad(
        "data-parallel-reduce-int-gradient",
        lambda: in_shard_map(lambda x: dp().reduce({"w": x.astype(jnp.int32)}, 1.0)["w"]),
        TypeError,
        r"gradient \['w'\] must have a floating dtype, got dtype=int32",
    ),
    Bad(
        "data-parallel-reduce-weight-per-token",
        lambda: in_shard_map(lambda x: dp().reduce({"w": x}, x)["w"]),
        TypeError,
        r"local_weight must be an int or float scalar, got shape \(1,\)",
    ),
    Bad(
        "data-parallel-reduce-missing-as-string",
        lambda: in_shard_map(lambda x: dp().reduce({"w": x}, 1.0, missing="zero")["w"]),
        TypeError,
        r"missing must be a MissingGradientPolicy, got missing='zero'",
    ),
    Bad(
        "data-parallel-root-outside-axis",
        lambda: dp().initialize({"w": jnp.ones(3)}, root=8),
        ValueError,
        r"root must be a rank in \[0, 8\) of axis 'data', got root=8",
    ),
    Bad(
        "data-parallel-replicas-count",
        lambda: dp().check_replicas([{"w": jnp.ones(3)}, {"w": jnp.ones(3)}]),
        ValueError,
        r"replicas must hold one tree per rank of axis 'data' \(8\), got 2",
    ),
    Bad(
        "data-parallel-replica-shape",
        lambda: dp().check_replicas([{"w": jnp.ones(3)}] * 7 + [{"w": jnp.ones(4)}]),
        ValueError,
        r"replica 7 \['w'\]: shape \(4,\), replica 0 has \(3,\)",
    ),
    Bad(
        "fsdp-unknown-axis",
        lambda: rs.ShardingContext(FSDP_MESH, "data"),
        ValueError,
        r"axis_name must be one of the mesh's axes \('fsdp',\), got axis_name='data'",
    ),
    Bad(
        "fsdp-int-parameter",
        lambda: rs.ShardingContext(FSDP_MESH).parameter(nnx.Param(jnp.ones(3, jnp.int32))),
        TypeError,
        r"p must hold a floating array, got Param",
    ),
    Bad(
        "fsdp-linear-given-a-norm",
        lambda: rs.ShardingContext(FSDP_MESH).linear(rl.RMSNorm(3, rngs=nnx.Rngs(0))),
        TypeError,
        r"l must be a rudax\.layers\.Linear, got RMSNorm",
    ),
    Bad(
        "fsdp-module-with-batch-stats",
        lambda: rs.ShardingContext(FSDP_MESH).module(nnx.BatchNorm(3, rngs=nnx.Rngs(0))),
        ValueError,
        r"BatchNorm: variable \.mean is a BatchStat; only nnx\.Param and "
        r"rudax\.layers\.Frozen are sharded",
    ),
    Bad(
        "fsdp-int-compute-dtype",
        lambda: rs.ShardingContext(FSDP_MESH).linear(
            rl.Linear(3, 3, rngs=nnx.Rngs(0)), compute_dtype=jnp.int8
        ),
        TypeError,
        r"compute_dtype must be a floating dtype, got compute_dtype=.*int8",
    ),
    Bad(
        "all-gather-outside-shard-map",
        lambda: C.all_gather(jnp.ones(3), "data"),
        ValueError,
        r"axis_name='data' is not a bound mesh axis: call the collective inside jax\.shard_map",
    ),
    Bad(
        "all-gather-dim-out-of-range",
        lambda: in_shard_map(lambda x: C.all_gather(x, "data", dim=3), out_specs=P()),
        ValueError,
        r"dim must be in \[-1, 1\) for an input of ndim=1, got dim=3",
    ),
    Bad(
        "scatter-not-divisible",
        lambda: in_shard_map(lambda x: C.scatter(jnp.ones(3), "data")),
        ValueError,
        r"scatter: x\.shape\[0\]=3 .* does not divide by the size 8 of mesh axis 'data'",
    ),
    Bad(
        "broadcast-root-outside-axis",
        lambda: in_shard_map(lambda x: C.broadcast(x, "data", root=9)),
        ValueError,
        r"root must be in \[0, 8\) for mesh axis 'data', got root=9",
    ),
    Bad(
        "all-reduce-unbound-axis",
        lambda: in_shard_map(lambda x: C.all_reduce(x, "model")),
        ValueError,
        r"axis_name='model' is not a bound mesh axis",
    ),
]

test_bad_input = catalog(CASES)
