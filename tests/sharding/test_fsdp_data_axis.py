"""FSDP beside a data axis: a gathered weight's gradient is reduce-scattered over fsdp, then
only its shard is summed over data (``ShardedParameter.gather`` types the gathered weight as
varying over every mesh axis). Typed invariant over data, the transpose summed the whole
gradient over data first: an all-reduce 4x the shard's bytes on data=2,fsdp=4
(``benchmarks/fsdp_comm.py`` measured 5.6x on the trainer's step).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import rudax.sharding as rs

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def _all_reduce_elements(hlo: str) -> list[int]:
    """The element count of each all-reduce's result in a compiled module's text."""
    sizes = []
    for line in hlo.splitlines():
        if " all-reduce(" not in line and " all-reduce-start(" not in line:
            continue
        shape = line.split("=", 1)[1].split("all-reduce", 1)[0]
        for dims in re.findall(r"\[([\d,]*)\]", shape):
            sizes.append(int(np.prod([int(d) for d in dims.split(",") if d])))
    return sizes


def test_the_data_axis_sums_only_the_gradients_shard():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    w_full = jax.random.normal(jax.random.key(0), (64, 48), jnp.float32)
    w = rs.ShardedParameter.from_full(w_full, mesh, "fsdp")
    x = jax.random.normal(jax.random.key(1), (16, 64), jnp.float32)

    def local(w, x):
        return jnp.sum(jnp.tanh(x @ w.gather()))[None]

    def loss(w, x):
        per_device = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P("fsdp"), P(("data", "fsdp"))),
            out_specs=P(("data", "fsdp")),
        )
        return jnp.sum(per_device(w, x))

    grad = jax.jit(jax.grad(loss))
    got = grad(w, x).unshard()
    want = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w_full)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    hlo = grad.lower(w, x).compile().as_text()
    shard = w.shard_size
    sizes = _all_reduce_elements(hlo)
    assert sizes, "the data axis's sum is an all-reduce"
    assert max(sizes) <= shard, (sizes, shard, w_full.size)
