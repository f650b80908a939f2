"""What the FSDP LoRA and QLoRA tests share: a two-block model of dense layers (rudax's and
flax's), an 8-device mesh of either kind, and the outputs and adapter gradients of a model
sharded over it next to those of its unsharded twin on one device.

The reference is the unsharded model on one device, with the sum of the ranks' local losses
written as one loss over the whole batch."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.layers as rl
from tests.layers._random import normal

N = 8
AX = "fsdp"


def make_mesh(kind: str) -> jax.sharding.Mesh:
    """``kind`` "explicit" (jax.make_mesh's axis types) or "auto" (a plain Mesh)."""
    if kind == "explicit":
        return jax.make_mesh((N,), (AX,), devices=jax.devices()[:N])
    return jax.sharding.Mesh(np.array(jax.devices()[:N]), (AX,))


class Block(nnx.Module):
    def __init__(self, d: int, h: int, rngs: nnx.Rngs):
        self.q_proj = rl.Linear(d, d, rngs=rngs)
        self.v_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)  # flax's Linear as a base too
        self.up = rl.Linear(d, h, rngs=rngs)
        self.down = rl.Linear(h, d, rngs=rngs)

    def __call__(self, x):
        h = x + self.q_proj(x) * jax.nn.sigmoid(self.v_proj(x))
        return h + self.down(jax.nn.relu(self.up(h)))


def two_blocks(d: int, h: int) -> nnx.Dict:
    return nnx.Dict(layers=nnx.List([Block(d, h, nnx.Rngs(0)), Block(d, h, nnx.Rngs(1))]))


def forward(model: nnx.Dict, x: jax.Array) -> jax.Array:
    for block in model["layers"]:
        x = block(x)
    return x


def outputs_and_adapter_grads(
    ref: nnx.Dict, model: nnx.Dict, mesh: jax.sharding.Mesh, d: int
) -> tuple[Any, Any, dict, dict, int]:
    """``(y, y_ref, got, expected, rows)``: the sharded model's outputs and their one-device
    reference on a batch of ``rows`` rows, and each adapter's gradient by its path, the
    sharded one reduce-scattered to its shards and unsharded."""
    x = normal((2 * N, 3, d), 7)
    w = normal((2 * N, 3, d), 8)
    ref_graph, ref_adapters, ref_rest = nnx.split(ref, rl.LoRAParam, ...)

    def ref_loss(p):
        y = forward(nnx.merge(ref_graph, p, ref_rest), x)
        return jnp.sum(y * w), y

    (_, y_ref), g_ref = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(ref_adapters)

    graph, adapters, rest = nnx.split(model, rl.LoRAParam, ...)

    def local(p, r, x, w):
        y = forward(nnx.merge(graph, p, r), x)
        return jnp.sum(y * w)[None], y

    sharded = jax.shard_map(local, mesh=mesh, in_specs=P(AX), out_specs=P(AX))

    def loss(p, x, w):
        losses, y = sharded(p, rest, x, w)
        return jnp.sum(losses), y

    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AX)))
    (_, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(adapters, put(x), put(w))
    expected = {p: v.get_value() for p, v in nnx.to_flat_state(g_ref)}
    got = {}
    for (_, i, name, _, k), var in nnx.to_flat_state(g):  # layers, i, name, variables, k
        path = getattr(model["layers"][i], name).paths[k]
        got[("layers", i, name, *path)] = var.get_value().unshard()
    return y, y_ref, got, expected, x.shape[0] * x.shape[1]
