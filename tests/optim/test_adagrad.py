"""Tests of rudax.optim.adagrad against torch.optim.Adagrad's rule written plainly in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rudax.optim as ro
from tests.optim._harness import assert_matches_reference, make_problem

RUNS = [
    pytest.param(True, "dict", id="jit-dict"),
    pytest.param(False, "dict", id="eager-dict"),
    pytest.param(True, "nnx_state", id="jit-nnx"),
    pytest.param(False, "nnx_state", id="eager-nnx"),
]


def halving(count):
    """0.1, halved every 2 updates; jnp only, so it runs under strict promotion."""
    return 0.1 * 0.5 ** (count // 2).astype(jnp.float32)


def adagrad_reference(
    learning_rate, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10
):
    """torch.optim.Adagrad's single-tensor loop, in float64."""

    def reference(p, grads):
        p = p.astype(np.float64)
        state_sum = np.full_like(p, initial_accumulator_value)
        out = []
        for step, g in enumerate(grads, start=1):
            lr = 0.1 * 0.5 ** ((step - 1) // 2) if learning_rate is halving else learning_rate
            g = g.astype(np.float64) + weight_decay * p
            clr = lr / (1 + (step - 1) * lr_decay)
            state_sum = state_sum + g * g
            p = p - clr * g / (np.sqrt(state_sum) + eps)
            out.append(p)
        return out

    return reference


CONFIGS = [
    pytest.param(dict(learning_rate=0.1), id="defaults"),
    pytest.param(dict(learning_rate=0.1, weight_decay=0.3), id="weight_decay"),
    pytest.param(dict(learning_rate=0.1, lr_decay=0.5), id="lr_decay"),
    pytest.param(dict(learning_rate=0.1, initial_accumulator_value=0.5, eps=0.1), id="init-eps"),
    pytest.param(dict(learning_rate=halving, lr_decay=0.2, weight_decay=0.1), id="schedule"),
]


@pytest.mark.parametrize("jit, tree_kind", RUNS)
@pytest.mark.parametrize("config", CONFIGS)
def test_adagrad_matches_reference(config, jit, tree_kind):
    assert_matches_reference(
        ro.adagrad(**config), adagrad_reference(**config), jit=jit, tree_kind=tree_kind
    )


def test_eps_is_outside_the_root():
    """torch: g / (sqrt(s) + eps); optax: g / sqrt(s + eps). Visible with a large eps."""
    p = {"w": jnp.zeros((1,), jnp.float32)}
    tx = ro.adagrad(1.0, eps=1.0)
    updates, _ = tx.update({"w": jnp.full((1,), 3.0, jnp.float32)}, tx.init(p), p)
    np.testing.assert_allclose(updates["w"], [-3.0 / (3.0 + 1.0)], rtol=1e-6)


def test_bf16_params_keep_fp32_moments():
    params, grads = make_problem(2)
    to_bf16 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), tree)
    p, g1, g2 = to_bf16(params), to_bf16(grads[0]), to_bf16(grads[1])
    config = dict(learning_rate=0.1, weight_decay=0.3, initial_accumulator_value=0.2)
    tx = ro.adagrad(**config, moment_dtype=jnp.float32)
    update = jax.jit(tx.update)
    state = tx.init(p)
    updates, state = update(g1, state, p)

    reference = adagrad_reference(**config)
    for u, p0, g in zip(
        jax.tree.leaves(updates), jax.tree.leaves(p), jax.tree.leaves(g1), strict=True
    ):
        assert u.dtype == jnp.bfloat16
        p32, g32 = np.asarray(p0, np.float32), np.asarray(g, np.float32)
        want = (reference(p32, [g32])[0] - p32).astype(jnp.bfloat16).astype(np.float32)
        # One rounding to bf16 at the end: at most one bf16 ulp (2**-7 relative) apart.
        np.testing.assert_allclose(np.asarray(u, np.float32), want, rtol=2**-7, atol=0)

    updates, state = update(g2, state, optax.apply_updates(p, updates))
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
    sums = jax.tree.leaves(state[1].sum)
    assert sums and all(x.dtype == jnp.float32 for x in sums)


def test_bf16_params_without_moment_dtype():
    p = {"w": jnp.ones((3,), jnp.bfloat16)}
    tx = ro.adagrad(0.1, lr_decay=0.1, weight_decay=0.1)
    updates, state = jax.jit(tx.update)({"w": jnp.ones((3,), jnp.bfloat16)}, tx.init(p), p)
    assert updates["w"].dtype == state[1].sum["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(learning_rate=-0.1), ValueError, r"learning_rate=-0\.1"),
        (dict(learning_rate=0.1, lr_decay=-1.0), ValueError, r"lr_decay=-1\.0"),
        (dict(learning_rate=0.1, weight_decay=-0.01), ValueError, r"weight_decay=-0\.01"),
        (
            dict(learning_rate=0.1, initial_accumulator_value=-0.1),
            ValueError,
            r"initial_accumulator_value=-0\.1",
        ),
        (dict(learning_rate=0.1, eps=-1e-10), ValueError, r"eps=-1e-10"),
        (dict(learning_rate=0.1, eps=[1e-10]), TypeError, "eps"),
        (dict(learning_rate=0.1, moment_dtype=jnp.int32), TypeError, "moment_dtype"),
    ],
)
def test_bad_hyperparameters(kwargs, error, match):
    with pytest.raises(error, match=match):
        ro.adagrad(**kwargs)
