"""Tests of rudax.layers.Dropout: the mask's values and rate, modes, fresh masks, bad input."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
from tests.optim._bad_input import rejects


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_keeps_with_probability_one_minus_rate_and_rescales(dtype):
    drop = rl.Dropout(0.25, rngs=nnx.Rngs(dropout=0))
    x = jnp.full((4000,), 3.0, dtype)
    y = np.asarray(drop(x), np.float32)
    assert drop(x).dtype == dtype
    kept = y != 0
    np.testing.assert_array_equal(y[kept], np.float32(jnp.asarray(3.0 / 0.75, dtype)))
    # 4000 Bernoulli(0.75) draws: std of the kept fraction is ~0.007.
    assert abs(kept.mean() - 0.75) < 0.03


def test_fresh_mask_every_call_also_under_jit():
    drop = rl.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
    x = jnp.ones((64,))
    a, b = drop(x), drop(x)
    assert not np.array_equal(a, b)
    step = nnx.jit(lambda m, x: m(x))
    c, d = step(drop, x), step(drop, x)
    assert not np.array_equal(c, d)


def test_modes():
    x = jnp.arange(1.0, 9.0)
    drop = rl.Dropout(0.5, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(drop(x, deterministic=True), x)
    model = nnx.List([drop])
    model.eval()
    assert drop.deterministic
    np.testing.assert_array_equal(drop(x), x)
    assert not np.array_equal(drop(x, deterministic=False), x)  # the call's flag wins
    model.train()
    assert not drop.deterministic
    assert nnx.view(drop, deterministic=True).deterministic
    np.testing.assert_array_equal(rl.Dropout(0.0)(x), x)  # rate 0 needs no rngs


def test_without_rngs_only_deterministic():
    drop = rl.Dropout(0.5, deterministic=True)
    np.testing.assert_array_equal(drop(jnp.ones(3)), jnp.ones(3))
    with pytest.raises(ValueError, match="rngs=None"):
        drop(jnp.ones(3), deterministic=False)


test_bad_arguments = rejects(
    rl.Dropout,
    [
        ({"rate": 1.0}, ValueError, r"rate must be in \[0, 1\), got rate=1.0"),
        ({"rate": -0.1}, ValueError, "rate=-0.1"),
        ({"rate": "0.1"}, TypeError, "rate='0.1'"),
        ({"deterministic": None}, TypeError, "deterministic=None"),
        ({"rngs": 0}, TypeError, "rngs=0"),
    ],
    rate=0.1,
)
