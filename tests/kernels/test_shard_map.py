"""The kernels inside jax.shard_map: a replicated scale (or bias, or one silu_mul operand)
meets per-rank activations. Its gradient must be the sum over ranks, as on one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.kernels as rk

INTERPRET = jax.default_backend() != "gpu"
# Interpreted Pallas inside shard_map(check_vma=True) fails in jax 0.10.2's interpreter
# itself ("Primitive gather requires varying manual axes to match"), after rudax gives the
# outputs their manual-axis type; the compiled GPU path is not checked here (no GPU).
INTERPRETER_VMA = pytest.mark.xfail(
    INTERPRET,
    reason="jax 0.10.2 and 0.11.2 Pallas interpreter under shard_map(check_vma=True): "
    "'Primitive gather requires varying manual axes to match'",
    raises=ValueError,
    strict=True,
)
IMPLS = [
    pytest.param({"impl": "xla"}, id="xla"),
    pytest.param({"impl": "pallas", "interpret": INTERPRET}, id="pallas", marks=INTERPRETER_VMA),
]
OPS = {
    "rms_norm": lambda x, w, kw: rk.rms_norm(x, w, epsilon=1e-6, **kw),
    "layer_norm": lambda x, w, kw: rk.layer_norm(x, w, 0.5 * w, epsilon=1e-5, **kw),
    "silu_mul": lambda x, w, kw: rk.silu_mul(x, jnp.broadcast_to(w, x.shape), **kw),
}


@pytest.mark.parametrize("kwargs", IMPLS)
@pytest.mark.parametrize("name", OPS)
def test_gradient_of_a_replicated_operand_is_summed_over_ranks(name, kwargs):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    n = mesh.size
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2 * n, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    op = functools.partial(OPS[name], kw=kwargs)

    def loss(w, x):
        return jnp.sum(op(x, w) ** 2)

    sharded = jax.shard_map(
        jax.grad(loss),
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P(),
    )
    got = jax.jit(sharded)(w, jax.device_put(x, NamedSharding(mesh, P("data"))))
    want = jax.grad(loss)(w, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
