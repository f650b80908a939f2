"""rudax.layers.lookup: the sorted segment-sum backward against autodiff's scatter-add and a
float64 numpy reference, and its CUDA lowering free of scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
from tests.kernels._lowering import export


def _grads(table, ids, g, backward):
    _, vjp = jax.vjp(lambda t: rl.lookup(t, ids, backward=backward), table)
    return vjp(g)[0]


def _reference(table, ids, g):
    """float64: each row's cotangents added into the row its id names; bad ids dropped."""
    out = np.zeros(table.shape, np.float64)
    flat_ids = np.asarray(ids).reshape(-1)
    flat_g = np.asarray(g, np.float64).reshape(flat_ids.size, -1)
    keep = (flat_ids >= 0) & (flat_ids < table.shape[0])
    np.add.at(out, flat_ids[keep], flat_g[keep])
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sorted_backward_equals_scatter_to_fp32_rounding(dtype):
    vocab, features = 50, 16
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    table = jax.random.normal(k1, (vocab, features), dtype)
    # Zipf-like ids: a few rows named many times, some never; and ids out of range.
    ids = jnp.minimum(jax.random.geometric(k2, 0.15, (4, 64)) - 1, vocab + 3)
    ids = ids.at[0, :3].set(jnp.array([-1, vocab, -vocab]))
    g = jax.random.normal(k3, (*ids.shape, features), dtype)

    sorted_ = _grads(table, ids, g, "sorted")
    scatter = _grads(table, ids, g, "scatter")
    ref = _reference(table, ids, g)
    assert sorted_.dtype == scatter.dtype == dtype
    # Each is a sum of at most n terms: fp32 summation in any order is within
    # (n - 1) * u * sum|terms| of the exact sum; then one rounding to the table's dtype.
    counts = np.bincount(np.clip(np.asarray(ids).reshape(-1), 0, vocab), minlength=vocab + 1)
    n = counts[:vocab, None]
    abs_sum = _reference(table, ids, jnp.abs(g.astype(jnp.float32)))
    u32, u_out = 2.0**-24, 2.0**-24 if dtype == jnp.float32 else 2.0**-8
    bound = np.maximum(n - 1, 0) * u32 * abs_sum + u_out * np.abs(ref)
    assert np.all(np.abs(np.asarray(sorted_, np.float64) - ref) <= bound)
    if dtype == jnp.float32:
        assert np.all(np.abs(np.asarray(scatter, np.float64) - ref) <= bound)
    # Rows no id names are exactly zero; out-of-range ids add nothing anywhere.
    np.testing.assert_array_equal(np.asarray(sorted_)[counts[:vocab] == 0], 0)


def test_sorted_backward_is_exact_for_distinct_ids():
    """One term per row: no rounding, so both backwards give the cotangent's bits."""
    table = jnp.zeros((10, 3), jnp.float32)
    ids = jnp.array([7, 2, 9, 0])
    g = jax.random.normal(jax.random.key(1), (4, 3), jnp.float32)
    np.testing.assert_array_equal(_grads(table, ids, g, "sorted"), _grads(table, ids, g, "scatter"))


def test_forward_is_the_same_gather():
    table = jnp.arange(12.0).reshape(4, 3)
    ids = jnp.array([[3, -1], [4, 0]])
    for backward in ("scatter", "sorted"):
        rows = rl.lookup(table, ids, backward=backward)
        np.testing.assert_array_equal(rows[0, 0], table[3])
        assert np.all(np.isnan(rows[0, 1])) and np.all(np.isnan(rows[1, 0]))


def test_empty_ids():
    table = jnp.ones((5, 2))
    g = _grads(table, jnp.zeros((0,), jnp.int32), jnp.zeros((0, 2)), "sorted")
    np.testing.assert_array_equal(g, np.zeros((5, 2)))


def _cuda_hlo(backward):
    table = jax.ShapeDtypeStruct((1000, 64), jnp.float32)
    ids = jax.ShapeDtypeStruct((8, 128), jnp.int32)

    def loss(t, i):
        return jnp.sum(rl.lookup(t, i, backward=backward) ** 2)

    return export(jax.grad(loss), table, ids).mlir_module()


def test_sorted_backward_lowers_for_cuda_without_scatter():
    assert "stablehlo.scatter" in _cuda_hlo("scatter")  # the control: autodiff scatters
    text = _cuda_hlo("sorted")
    assert "stablehlo.scatter" not in text
    assert "stablehlo.sort" in text


def test_embedding_takes_the_backward():
    embed = rl.Embedding(20, 4, backward="sorted", rngs=nnx.Rngs(0))
    assert embed.backward == "sorted"
    ids = jnp.array([[1, 1, 5]])

    def grad(module):
        return nnx.grad(lambda m: jnp.sum(m(ids) ** 2))(module).embedding[...]

    sorted_grad = grad(embed)
    embed.backward = "scatter"
    np.testing.assert_allclose(grad(embed), sorted_grad, rtol=2e-7)
    with pytest.raises(ValueError, match=r'backward must be "scatter" or "sorted", got '):
        rl.Embedding(20, 4, backward="atomic", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"backward="):
        rl.lookup(jnp.ones((2, 2)), jnp.array([0]), backward="onehot")
