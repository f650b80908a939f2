"""LoRA from rudax.layers.apply_lora under FSDP: ShardingContext.module(lora_linear) on 8
simulated devices computes the one-device outputs and adapter gradients.

The reference is the unsharded model on one device, with the sum of the ranks' local losses
written as one loss over the whole batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.layers as rl
import rudax.sharding as rs
from tests.layers._random import normal

N = 8
AX = "fsdp"
D, H = 6, 10

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")


def _mesh(kind):
    if kind == "explicit":
        return jax.make_mesh((N,), (AX,), devices=jax.devices()[:N])
    return jax.sharding.Mesh(np.array(jax.devices()[:N]), (AX,))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = rl.Linear(D, D, rngs=rngs)
        self.v_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)  # flax's Linear as a base too
        self.up = rl.Linear(D, H, rngs=rngs)
        self.down = rl.Linear(H, D, rngs=rngs)

    def __call__(self, x):
        h = x + self.q_proj(x) * jax.nn.sigmoid(self.v_proj(x))
        return h + self.down(jax.nn.relu(self.up(h)))


def _model():
    model = nnx.Dict(layers=nnx.List([Block(nnx.Rngs(0)), Block(nnx.Rngs(1))]))
    names = rl.apply_lora(model, ["q_proj", "v_proj", "down"], rank=2, alpha=4.0, rngs=nnx.Rngs(2))
    assert len(names) == 6
    for i, (_, lora) in enumerate(sorted(_loras(model).items())):  # B as after training
        lora.lora_b[...] = normal(lora.lora_b.shape, i)
    return model


def _loras(model):
    return {p: m for p, m in nnx.iter_graph(model) if isinstance(m, rl.LoRALinear)}


def _forward(model, x):
    for block in model["layers"]:
        x = block(x)
    return x


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_sharded_lora_layers_give_the_one_device_outputs_and_adapter_gradients(kind):
    mesh = _mesh(kind)
    ref = _model()
    model = _model()
    ctx = rs.ShardingContext(mesh, AX)
    for block in model["layers"]:
        for name in ("q_proj", "v_proj", "down"):
            setattr(block, name, ctx.module(getattr(block, name)))
        block.up = ctx.linear(block.up)
    # The variable types survive sharding: LoRAParam still selects exactly the adapters.
    _, adapters, _ = nnx.split(model, rl.LoRAParam, ...)
    flat = [v for _, v in nnx.to_flat_state(adapters)]
    assert len(flat) == 12 and {type(v) for v in flat} == {rl.LoRAParam}
    assert all(isinstance(v.get_value(), rs.ShardedParameter) for v in flat)

    x = normal((2 * N, 3, D), 7)
    w = normal((2 * N, 3, D), 8)
    ref_graph, ref_adapters, ref_rest = nnx.split(ref, rl.LoRAParam, ...)

    def ref_loss(p):
        y = _forward(nnx.merge(ref_graph, p, ref_rest), x)
        return jnp.sum(y * w), y

    (_, y_ref), g_ref = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(ref_adapters)

    graph, adapters, rest = nnx.split(model, rl.LoRAParam, ...)

    def local(p, r, x, w):
        y = _forward(nnx.merge(graph, p, r), x)
        return jnp.sum(y * w)[None], y

    sharded = jax.shard_map(local, mesh=mesh, in_specs=P(AX), out_specs=P(AX))

    def loss(p, x, w):
        losses, y = sharded(p, rest, x, w)
        return jnp.sum(losses), y

    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AX)))
    (_, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(adapters, put(x), put(w))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)

    # Each adapter's gradient, reduce-scattered to its shards, unshards to the one-device one.
    expected = {p: v.get_value() for p, v in nnx.to_flat_state(g_ref)}
    got = {}
    for (_, i, name, _, k), var in nnx.to_flat_state(g):  # layers, i, name, variables, k
        sharded_module = getattr(model["layers"][i], name)
        path = sharded_module.paths[k]
        got[("layers", i, name, *path)] = var.get_value().unshard()
    assert sorted(got) == sorted(expected)
    for path, value in expected.items():
        scale = np.abs(np.asarray(value)).max()
        assert scale > 0, path  # B non-zero, so A learns too
        # fp32 sums over the batch's 2N*3 = 48 rows of terms of size ~scale, taken in another
        # order (per rank, then the reduce-scatter): each side is within n*u*sum|terms| of the
        # exact sum (u = 2**-24), so the two within 2*n*u*scale, relative to the terms and not
        # to a cancelling result. Measured: up to 2.1e-6 * scale, on an AVX-512 CPU whose
        # XLA dots sum in yet another order (the bound: 5.7e-6).
        rows = x.shape[0] * x.shape[1]
        np.testing.assert_allclose(
            got[path], value, rtol=1e-5, atol=2 * rows * 2**-24 * scale, err_msg=str(path)
        )
