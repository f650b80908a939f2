"""rudax.optim.adan against a plain numpy Adan loop written from the authors' adan.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rudax.optim as ro
from tests.optim._bad_input import rejects
from tests.optim._harness import assert_matches_reference, make_problem, run_optimizer


def adan_reference(p, grads, *, lr, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, wd=0.0):
    """sail-sg/Adan's _single_tensor_adan with no_prox=False and no clipping.

    ``lr`` is a float or a function of the 0-based update count.
    """
    m, v, n = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
    prev = None
    out = []
    for t, g in enumerate(grads, start=1):
        d = g - (g if prev is None else prev)  # the first step's previous gradient is g
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * d
        n = b3 * n + (1 - b3) * (g + b2 * d) ** 2
        denom = np.sqrt(n) / np.sqrt(1 - b3**t) + eps
        lr_t = lr(t - 1) if callable(lr) else lr
        p = p - lr_t / (1 - b1**t) * m / denom - lr_t * b2 / (1 - b2**t) * v / denom
        p = p / (1 + lr_t * wd)
        prev = g
        out.append(p)
    return out


@pytest.mark.parametrize("tree_kind", ["dict", "nnx_state"])
@pytest.mark.parametrize("jit", [True, False])
def test_matches_reference_with_proximal_decay(jit, tree_kind):
    tx = ro.adan(0.05, weight_decay=0.1)
    ref = functools.partial(adan_reference, lr=0.05, wd=0.1)
    assert_matches_reference(tx, ref, num_steps=5, jit=jit, tree_kind=tree_kind)


def test_matches_reference_other_betas_and_schedule():
    # A halving schedule checks the lr advances once per update, in the step and the decay.
    schedule = lambda count: 0.1 * 0.5 ** count.astype(jnp.float32)
    tx = ro.adan(schedule, b1=0.9, b2=0.7, b3=0.95, eps=1e-6, weight_decay=0.3)
    ref = functools.partial(
        adan_reference, lr=lambda t: 0.1 * 0.5**t, b1=0.9, b2=0.7, b3=0.95, eps=1e-6, wd=0.3
    )
    assert_matches_reference(tx, ref, num_steps=5, seed=3)


def test_first_update_is_sign_of_gradient():
    # d_1 = 0 and every bias-corrected moment equals g (or g**2): u_1 = g / (|g| + eps).
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    grads = {"w": jnp.array([0.5, -4.0, 1e-3])}
    tx = ro.adan(0.1)
    updates, state = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * np.sign(grads["w"]), rtol=1e-5)
    np.testing.assert_array_equal(state[0].v["w"], np.zeros(3, np.float32))
    np.testing.assert_array_equal(state[0].prev_grad["w"], grads["w"])


def test_weight_decay_is_proximal_not_multiplicative():
    # With zero gradients the moments stay 0: only the decay acts, p / (1 + lr wd).
    params = {"w": jnp.array([1.0, -2.0, 4.0])}
    tx = ro.adan(0.5, weight_decay=0.2)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    new = optax.apply_updates(params, updates)["w"]
    np.testing.assert_allclose(new, np.array([1.0, -2.0, 4.0]) / 1.1, rtol=1e-6)
    assert not np.allclose(new, np.array([1.0, -2.0, 4.0]) * 0.9)


@pytest.mark.standard_promotion  # optax.adan's own code needs standard promotion
def test_equals_optax_adan_where_the_docstring_says():
    # optax weights the difference term by 1 - b2 where the official code uses b2; at
    # b2 = 0.5 these coincide, and eps_root=0, weight_decay=0 remove the other differences.
    params, grads = make_problem(5, seed=1)
    got = run_optimizer(ro.adan(0.05, b2=0.5), params, grads, jit=True)
    want = run_optimizer(optax.adan(0.05, b2=0.5, eps_root=0.0), params, grads, jit=True)
    for step_got, step_want in zip(got, want, strict=True):
        for a, b in zip(step_got, step_want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_params_keep_fp32_moments():
    params = {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]], jnp.bfloat16), "b": jnp.ones(3)}
    grads = [
        jax.tree.map(lambda x, k=k: jnp.sin(jnp.ones_like(x) * (k + 1)), params) for k in range(3)
    ]
    tx = ro.adan(0.01, weight_decay=0.1, moment_dtype=jnp.float32)
    state = tx.init(params)
    assert {x.dtype for x in jax.tree.leaves(state[0][1:])} == {jnp.dtype(jnp.float32)}
    step = jax.jit(tx.update)
    p = params
    for g in grads:
        updates, state = step(g, state, p)
        p = optax.apply_updates(p, updates)
    assert p["w"].dtype == jnp.bfloat16 and updates["w"].dtype == jnp.bfloat16
    # The fp32 moments hold the fp32 sums of the exact bf16 gradients.
    g32 = [np.asarray(g["w"], np.float32) for g in grads]
    m = 0.0
    for g in g32:
        m = 0.98 * m + 0.02 * g
    np.testing.assert_allclose(state[0].m["w"], m, rtol=1e-6)


test_bad_hyperparameters = rejects(
    ro.adan,
    [
        ({"learning_rate": -1e-3}, ValueError, "learning_rate=-0.001"),
        ({"learning_rate": "1e-3"}, TypeError, "learning_rate"),
        ({"b1": 1.0}, ValueError, "b1=1.0"),
        ({"b2": -0.1}, ValueError, "b2=-0.1"),
        ({"b3": 1.5}, ValueError, "b3=1.5"),
        ({"eps": -1e-8}, ValueError, "eps=-1e-08"),
        ({"weight_decay": float("nan")}, ValueError, "weight_decay=nan"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay=-0.1"),
        ({"moment_dtype": jnp.int32}, TypeError, "moment_dtype"),
    ],
    learning_rate=1e-3,
)


def test_weight_decay_needs_params():
    tx = ro.adan(1e-3, weight_decay=0.1)
    g = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="needs params"):
        tx.update(g, tx.init(g))
