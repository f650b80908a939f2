"""Tests of rudax.layers.Embedding and TiedProjection: lookup, tied variable, summed gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
from tests.layers._random import normal
from tests.optim._bad_input import rejects


class TiedLM(nnx.Module):
    """ids -> embedding -> tied logits: the table is used twice."""

    def __init__(self, *, bias=None, rngs):
        self.embed = rl.Embedding(7, 4, rngs=rngs)
        self.head = rl.TiedProjection(self.embed, bias=bias)

    def __call__(self, ids):
        return self.head(self.embed(ids))


def test_lookup_matches_numpy():
    embed = rl.Embedding(7, 4, rngs=nnx.Rngs(0))
    ids = jnp.array([[0, 6, 3], [3, 3, 1]])
    y = embed(ids)
    assert y.shape == (2, 3, 4) and y.dtype == jnp.float32
    np.testing.assert_array_equal(y, np.asarray(embed.embedding[...])[np.asarray(ids)])
    # Out-of-range ids give NaN rows, not a clamped row.
    assert np.isnan(embed(jnp.array([7]))).all()


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("ids_dtype", [jnp.int8, jnp.int32])
def test_every_id_outside_the_table_gives_a_nan_row(jit, ids_dtype):
    # Negative ids included: numpy-style indexing would wrap -1..-7 to valid rows.
    embed = rl.Embedding(7, 4, rngs=nnx.Rngs(0))
    ids = jnp.array([-8, -7, -1, 0, 6, 7, 100], ids_dtype)
    y = (nnx.jit(lambda m, i: m(i)) if jit else lambda m, i: m(i))(embed, ids)
    nan_rows = np.isnan(np.asarray(y)).all(axis=-1)
    np.testing.assert_array_equal(nan_rows, [True, True, True, False, False, True, True])
    table = np.asarray(embed.embedding[...])
    np.testing.assert_array_equal(y[3:5], table[[0, 6]])


def test_ids_outside_the_table_get_no_gradient():
    embed = rl.Embedding(3, 2, rngs=nnx.Rngs(0))
    ids = jnp.array([-1, 1, 3])
    grads = nnx.grad(lambda m: jnp.nansum(m(ids)))(embed)
    np.testing.assert_array_equal(grads["embedding"][...], [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])


@pytest.mark.parametrize(
    "param_dtype, dtype, out_dtype",
    [
        (jnp.float32, None, jnp.float32),
        (jnp.bfloat16, None, jnp.bfloat16),  # None: the storage dtype
        (jnp.bfloat16, jnp.float32, jnp.float32),
        (jnp.float32, jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_lookup_dtypes(param_dtype, dtype, out_dtype):
    embed = rl.Embedding(5, 3, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    ids = jnp.array([4, 0], jnp.uint8)
    y = embed(ids)
    assert y.dtype == out_dtype and embed.embedding.dtype == param_dtype
    np.testing.assert_array_equal(y, embed.embedding[...][np.array([4, 0])].astype(out_dtype))


def test_lookup_rejects_float_ids():
    embed = rl.Embedding(5, 3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"ids\.dtype=float32"):
        embed(jnp.array([1.0, 2.0]))


def test_projection_matches_numpy_and_shares_the_variable():
    model = TiedLM(bias=jnp.linspace(-1, 1, 7), rngs=nnx.Rngs(0))
    assert model.head.embedding is model.embed.embedding
    x = normal((2, 3, 4), 1)
    logits = model.head(x)
    table = np.asarray(model.embed.embedding[...], np.float64)
    expected = np.asarray(x, np.float64) @ table.T + np.linspace(-1, 1, 7)
    assert logits.shape == (2, 3, 7)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)
    # One leaf for the table in the model's state, under the path of its first owner.
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(model))
    ]
    assert len(paths) == 2 and sum("embedding" in p for p in paths) == 1
    # split / merge keeps the tie.
    merged = nnx.merge(*nnx.split(model))
    assert merged.head.embedding is merged.embed.embedding


def test_gradient_of_both_uses_is_the_sum_of_each():
    model = TiedLM(rngs=nnx.Rngs(0))
    ids = jnp.array([[1, 2, 2], [5, 0, 1]])
    targets = normal((2, 3, 7), 2)
    x_fixed = model.embed(ids)

    def loss_both(m):
        return jnp.sum((m(ids) - targets) ** 2)

    def loss_lookup_only(m):  # the projection's table held constant
        table = jax.lax.stop_gradient(m.embed.embedding[...])
        return jnp.sum((m.embed(ids) @ table.T - targets) ** 2)

    def loss_projection_only(m):  # the lookup's output held constant
        return jnp.sum((m.head(x_fixed) - targets) ** 2)

    grad = lambda f: nnx.grad(f)(model)["embed"]["embedding"][...]
    both, lookup, projection = grad(loss_both), grad(loss_lookup_only), grad(loss_projection_only)
    assert np.abs(lookup).max() > 0 and np.abs(projection).max() > 0
    np.testing.assert_allclose(both, lookup + projection, rtol=1e-5, atol=1e-6)
    # The same through jax.grad on the split state: one leaf, one summed gradient.
    graphdef, params = nnx.split(model, nnx.Param)
    pure = lambda p: loss_both(nnx.merge(graphdef, p))
    np.testing.assert_allclose(
        jax.grad(pure)(params)["embed"]["embedding"][...], both, rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize(
    "x_dtype, param_dtype, dtype, out_dtype",
    [
        (jnp.bfloat16, jnp.float32, None, jnp.bfloat16),
        (jnp.float32, jnp.bfloat16, None, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32),
    ],
)
def test_projection_dtypes(x_dtype, param_dtype, dtype, out_dtype):
    embed = rl.Embedding(6, 4, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    head = rl.TiedProjection(embed, bias=jnp.ones(6, param_dtype), dtype=dtype)
    x = normal((3, 4), 1, x_dtype)
    y = head(x)
    assert y.dtype == out_dtype and head.bias.dtype == param_dtype
    c = lambda a: a.astype(out_dtype)
    expected = c(x) @ c(embed.embedding[...]).T + c(head.bias[...])
    np.testing.assert_allclose(
        np.asarray(y, np.float32),
        np.asarray(expected, np.float32),
        rtol=1e-2 if out_dtype != jnp.float32 else 1e-6,
    )


def test_projection_bias_variable_is_shared_as_is():
    embed = rl.Embedding(6, 4, rngs=nnx.Rngs(0))
    bias = nnx.Param(jnp.zeros(6))
    head = rl.TiedProjection(embed, bias=bias)
    assert head.bias is bias
    assert rl.TiedProjection(embed).bias is None


def test_projection_rejects_bad_input():
    embed = rl.Embedding(6, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"shape \(6,\), got bias.shape=\(5,\)"):
        rl.TiedProjection(embed, bias=jnp.zeros(5))
    with pytest.raises(TypeError, match=r"bias.dtype=int32"):
        rl.TiedProjection(embed, bias=jnp.zeros(6, jnp.int32))
    with pytest.raises(TypeError, match=r"embedding must be a rudax\.layers\.Embedding"):
        rl.TiedProjection(rl.Linear(4, 6, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"x.shape=\(2, 3\)"):
        rl.TiedProjection(embed)(jnp.ones((2, 3)))


test_bad_embedding_arguments = rejects(
    rl.Embedding,
    [
        ({"num_embeddings": 0}, ValueError, "num_embeddings=0"),
        ({"features": -1}, ValueError, "features=-1"),
        ({"param_dtype": jnp.int8}, TypeError, "param_dtype="),
    ],
    num_embeddings=5,
    features=3,
    rngs=nnx.Rngs(0),
)
