"""Tests of rudax.layers.to_dtype: storage converted in place, ties, frozen flags, buffers kept."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl


class Model(nnx.Module):
    def __init__(self, rngs):
        self.embed = rl.Embedding(8, 4, rngs=rngs)
        self.lora = rl.LoRALinear(rl.Linear(4, 4, rngs=rngs), 2, alpha=2.0, rngs=rngs)
        self.drop = rl.Dropout(0.1, rngs=rngs)
        self.head = rl.TiedProjection(self.embed, bias=jnp.zeros(8))
        self.steps = nnx.Variable(jnp.array([3, 4], jnp.int32))
        self.seen = nnx.Variable(jnp.array([True, False]))
        self.stat = nnx.BatchStat(jnp.full((2,), 0.1, jnp.float32))

    def __call__(self, ids):
        return self.head(self.drop(self.lora(self.embed(ids))))


def variables(model):
    """Every variable object in the graph with its value, by path."""
    return {
        path: (node, node.get_value())
        for path, node in nnx.graph.iter_graph(model)
        if isinstance(node, nnx.Variable)
    }


def test_converts_in_place_and_keeps_the_graph():
    dtype = jnp.bfloat16
    model = Model(nnx.Rngs(0))
    before = variables(model)
    out = rl.to_dtype(model, dtype)
    assert out is model
    after = variables(model)
    assert after.keys() == before.keys()
    for path, (var, old) in before.items():
        new_var, new = after[path]
        assert new_var is var, path  # the same variable objects: references stay valid
        converted = isinstance(var, nnx.Param | rl.Frozen) and jnp.issubdtype(
            old.dtype, jnp.floating
        )
        if converted:
            assert new.dtype == dtype, path
            np.testing.assert_array_equal(np.asarray(new), np.asarray(old.astype(dtype)))
        else:  # integer and bool buffers, RNG keys and counts, the BatchStat: untouched
            assert new is old, path
    assert model.head.embedding is model.embed.embedding
    assert model.head.embedding.dtype == dtype
    assert type(model.lora.base.kernel) is rl.Frozen
    assert sorted(nnx.state(model.lora, nnx.Param).keys()) == ["lora_a", "lora_b"]
    assert model.stat.dtype == jnp.float32  # not a parameter: outside the default filter
    assert model.steps.dtype == jnp.int32 and model.seen.dtype == jnp.bool_
    # Still one leaf for the tied table, and the model still runs and differentiates.
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    assert sum("embedding" in jax.tree_util.keystr(p) for p, _ in leaves) == 1
    model.eval()
    logits = model(jnp.array([1, 2]))
    assert logits.dtype == dtype
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.array([1, 2])).astype(jnp.float32)))(model)
    assert grads["embed"]["embedding"].dtype == dtype


def test_round_trip_to_fp32_is_exact_and_filter_selects():
    model = Model(nnx.Rngs(0))
    rl.to_dtype(model, jnp.float16)
    assert model.lora.base.kernel.dtype == jnp.float16 and model.steps.dtype == jnp.int32
    low = np.asarray(model.embed.embedding[...])
    rl.to_dtype(model, jnp.float32)
    np.testing.assert_array_equal(model.embed.embedding[...], low.astype(np.float32))
    rl.to_dtype(model, jnp.bfloat16, only=nnx.BatchStat)
    assert model.stat.dtype == jnp.bfloat16 and model.embed.embedding.dtype == jnp.float32


def test_refuses_traced_values():
    model = Model(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\['embed'\]\['embedding'\].*traced"):
        nnx.jit(lambda m: rl.to_dtype(m, jnp.bfloat16))(model)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float64, "not-a-dtype"])
def test_rejects_other_dtypes(dtype):
    with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32"):
        rl.to_dtype(Model(nnx.Rngs(0)), dtype)


def test_rejects_a_non_module():
    with pytest.raises(TypeError, match=r"model must be an nnx\.Module"):
        rl.to_dtype({"w": jnp.ones(2)}, jnp.bfloat16)
