"""rudax.sharding.bytes_per_device against the bytes a ShardedParameter really holds."""

import jax
import jax.numpy as jnp
import pytest

import rudax.sharding as rs


def test_matches_the_arrays_and_the_padded_shards():
    tree = {
        "w": jnp.ones((10, 3), jnp.bfloat16),
        "b": jnp.ones((7,), jnp.float32),
        "step": jnp.zeros((), jnp.int32),
        "key": jax.random.key(0),
    }
    assert rs.bytes_per_device(tree) == sum(x.nbytes for x in jax.tree.leaves(tree))
    # fsdp=4: 30 bf16 -> 8 each (16 bytes), 7 fp32 -> 2 each (8 bytes); scalars whole
    scalars = tree["step"].nbytes + rs.bytes_per_device({"key": tree["key"]})
    assert rs.bytes_per_device(tree, fsdp=4) == 16 + 8 + scalars
    abstract = jax.eval_shape(lambda: tree)
    assert rs.bytes_per_device(abstract, fsdp=4) == rs.bytes_per_device(tree, fsdp=4)


@pytest.mark.parametrize("fsdp", [0, -2, 1.5])
def test_bad_fsdp_is_named(fsdp):
    with pytest.raises((TypeError, ValueError), match="fsdp"):
        rs.bytes_per_device({"w": jnp.ones(3)}, fsdp=fsdp)
