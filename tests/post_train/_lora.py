"""What the post-training model tests share: a small Llama and the same weights with trained-
looking LoRA adapters, the adapters' gradient of a function of the model, a state's leaves
with FSDP's shards put back into their logical shapes, and one update of the adapters on one
device and over a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rudax.layers as rl
import rudax.optim as ro
import rudax.sharding as rs
from rudax.models import LlamaConfig, LlamaForCausalLM, shard

V = 64


def base_and_policy(targets=("q_proj", "v_proj", "up_proj"), seed=5):
    """(the base, the same weights with LoRA adapters on ``targets`` whose B is non-zero, as
    after training: the policy differs from its reference)."""
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    base = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    policy = nnx.clone(base)
    rl.apply_lora(policy, list(targets), rank=4, alpha=8, rngs=nnx.Rngs(1))
    for i, (_, lora) in enumerate(nnx.iter_graph(policy)):
        if isinstance(lora, rl.LoRALinear):
            key = jax.random.fold_in(jax.random.key(seed), i)
            lora.lora_b.set_value(0.3 * jax.random.normal(key, lora.lora_b.shape))
    return base, policy


def adapter_grad(policy, f):
    """``f(policy)`` and its gradient with respect to the LoRA adapters."""
    graphdef, adapters, rest = nnx.split(policy, rl.LoRAParam, ...)
    # jitted: the references run the model once per row, which eagerly dispatches op by op
    grad = jax.jit(jax.value_and_grad(lambda a, rest: f(nnx.merge(graphdef, a, rest))))
    return grad(adapters, rest)


def whole(tree):
    """The leaves of a state, FSDP's shards put back into their logical shapes."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, rs.ShardedParameter))
    return [
        np.asarray(x.local)[: x.size].reshape(x.logical_shape)
        if isinstance(x, rs.ShardedParameter)
        else np.asarray(x)
        for x in leaves
    ]


def assert_trees_close(got, want, rtol=2e-5, atol=2e-6):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def one_update_each(policy_factory, loss, batch, spec):
    """One SGD update of the adapters by ``make_train_steps`` on one device, then over a mesh
    of ``spec`` (FSDP's form where it has ``fsdp``): ``[(adapters, metrics, grad norm)] * 2``.

    SGD: the update is linear in the gradient, whose sums run in another order over a mesh.
    """
    tx = ro.sgd(1.0)
    results = []
    for mesh in (None, rs.make_mesh(spec)):
        policy = policy_factory()
        if mesh is not None and "fsdp" in mesh.axis_names:
            policy = shard(policy, rs.ShardingContext(mesh, "fsdp"))
        graphdef, adapters, rngs, rest = nnx.split(policy, rl.LoRAParam, nnx.RngState, ...)
        put = lambda b: b
        if mesh is not None:
            adapters, rngs, rest = rs.place((adapters, rngs, rest), mesh)
            put = lambda b, mesh=mesh: rs.put_batch(b, mesh, b["tokens"].shape[0])
        steps = rs.make_train_steps(graphdef, tx, loss, mesh=mesh)
        acc = ro.GradientAccumulator.init(adapters, jnp.float32)
        acc, _, metrics = steps.micro(adapters, rngs, acc, rest, put(batch))
        new, _, _, norm = steps.apply(adapters, tx.init(adapters), acc)
        results.append((whole(new), jax.device_get(metrics), float(norm)))
    return results
