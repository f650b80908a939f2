"""A small language model built from every rudax layer, trained with rudax.optim.adamw through
a split/merge jax.jit step and through nnx.jit with nnx.Optimizer (bf16 storage, fp32 masters):
each compiles once, trains the tied table as one variable and leaves the frozen LoRA base
alone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import rudax.layers as rl
import rudax.optim as ro

VOCAB, FEATURES = 11, 8


class TinyLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = rl.Embedding(VOCAB, FEATURES, rngs=rngs)
        self.norm1 = rl.RMSNorm(FEATURES, impl="xla")
        self.proj = rl.LoRALinear(
            rl.Linear(FEATURES, FEATURES, rngs=rngs), 2, alpha=4.0, dropout=0.1, rngs=rngs
        )
        self.norm2 = rl.LayerNorm(FEATURES, impl="xla")
        self.mlp = rl.GatedMLP(FEATURES, 12, impl="xla", rngs=rngs)
        self.drop = rl.Dropout(0.1, rngs=rngs)
        self.head = rl.TiedProjection(self.embed, bias=jnp.zeros(VOCAB))
        self.seen = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, ids):
        self.seen[...] += ids.size
        h = self.embed(ids)
        h = h + self.proj(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return self.head(self.drop(h))


def loss_fn(model, ids, targets):
    logits = model(ids).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def batch():
    ids = jnp.asarray(np.random.default_rng(7).integers(0, VOCAB, (2, 5)), jnp.int32)
    return ids, jnp.roll(ids, -1, axis=1)


def test_functional_step_with_split_and_merge():
    ids, targets = batch()
    tx = ro.adamw(3e-2)

    # The functional step: trainable parameters split off, everything else carried as rest.
    model = TinyLM(nnx.Rngs(0))
    frozen_before = jax.tree.map(np.asarray, nnx.state(model, rl.Frozen))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)
    traces = []

    @jax.jit
    def step(params, rest, opt_state):
        traces.append(None)

        def loss_of(params):
            # copy=True: since flax 0.11.2 merge reuses variables by default, and mutating
            # them (dropout's RNG count, the seen counter) under jax.grad is then refused
            # (google/flax#5050).
            m = nnx.merge(graphdef, params, rest, copy=True)
            return loss_fn(m, ids, targets), nnx.state(m, nnx.Not(nnx.Param))

        (loss, rest), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    losses = []
    for _ in range(3):
        params, rest, opt_state, loss = step(params, rest, opt_state)
        losses.append(float(loss))
    assert len(traces) == 1
    assert losses[-1] < losses[0]
    trained = nnx.merge(graphdef, params, rest)

    assert trained.head.embedding is trained.embed.embedding
    assert int(trained.seen[...]) == 3 * ids.size
    for a, b in zip(
        jax.tree.leaves(nnx.state(trained, rl.Frozen)), jax.tree.leaves(frozen_before), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    # The tied table is one trainable leaf, and it moved.
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert sum("embedding" in p for p in paths) == 1
    assert not np.array_equal(trained.embed.embedding[...], model.embed.embedding[...])


def test_nnx_optimizer_step_with_bf16_storage_and_fp32_masters():
    ids, targets = batch()
    model = rl.to_dtype(TinyLM(nnx.Rngs(0)), jnp.bfloat16)
    frozen = model.proj.base.kernel[...]
    optimizer = nnx.Optimizer(model, ro.fp32_master(ro.adamw(3e-2)), wrt=nnx.Param)
    traces = []

    @nnx.jit
    def nnx_step(model, optimizer):
        traces.append(None)
        loss, grads = nnx.value_and_grad(loss_fn)(model, ids, targets)
        optimizer.update(model, grads)
        return loss

    losses = [float(nnx_step(model, optimizer)) for _ in range(3)]
    assert len(traces) == 1
    assert losses[-1] < losses[0]
    assert int(model.seen[...]) == 3 * ids.size
    assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    np.testing.assert_array_equal(model.proj.base.kernel[...], frozen)
    # The stored bf16 parameters are the fp32 masters rounded.
    masters = optimizer.opt_state.master
    np.testing.assert_array_equal(
        model.embed.embedding[...], masters["embed"]["embedding"][...].astype(jnp.bfloat16)
    )
