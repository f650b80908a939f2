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


@pytest.mark.parametrize("make_mesh", ["Mesh", "make_mesh"])
@pytest.mark.parametrize("segments", [False, True], ids=["dense", "packed"])
def test_flash_attention_under_shard_map_equals_one_device(segments, make_mesh):
    """Queries sharded over the batch, keys and values replicated (a shared prefix): the
    output is per rank, and k's and v's gradients are the sums over the ranks. Both the
    Explicit axes of jax.make_mesh and the Auto axes of Mesh (see ARCHITECTURE.md)."""
    devices = jax.devices()
    if make_mesh == "Mesh":
        mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    else:
        mesh = jax.make_mesh((len(devices),), ("data",))
    n = mesh.size
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(n, 24, 4, 8)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(1, 24, 2, 8)), jnp.float32)
    seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 14], n, axis=0), jnp.int32)
    block = rk.FlashAttentionBlock(xla_q=8, xla_kv=8)

    def loss(q, k, v, seg):
        k, v = (jnp.broadcast_to(x, (q.shape[0], *x.shape[1:])) for x in (k, v))
        out = rk.flash_attention(
            q, k, v, causal=True, segment_ids=seg if segments else None, block=block
        )
        return jnp.sum(out**2)

    def per_rank(q, k, v, seg):
        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, seg)
        # k and v are replicated: their gradients arrive summed over the ranks already.
        return (jax.lax.psum(value, "data"), *grads)

    sharded = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P("data"), P(), P(), P("data")),
        out_specs=(P(), P("data"), P(), P()),
    )
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    got = jax.jit(sharded)(put(q, P("data")), put(kv, P()), put(kv, P()), put(seg, P("data")))
    want_value, want_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, kv, kv, seg)
    np.testing.assert_allclose(got[0], want_value, rtol=1e-5)
    for g, w in zip(got[1:], want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
