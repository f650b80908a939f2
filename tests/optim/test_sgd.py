"""Tests of rudax.optim.sgd against torch.optim.SGD's rule written plainly in numpy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rudax.optim as ro
from tests.optim._harness import assert_matches_reference, make_problem, run_optimizer

RUNS = [
    pytest.param(True, "dict", id="jit-dict"),
    pytest.param(False, "dict", id="eager-dict"),
    pytest.param(True, "nnx_state", id="jit-nnx"),
    pytest.param(False, "nnx_state", id="eager-nnx"),
]


def halving(count):
    """0.1, halved every 2 updates; jnp only, so it runs under strict promotion."""
    return 0.1 * 0.5 ** (count // 2).astype(jnp.float32)


def sgd_reference(learning_rate, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
    """torch.optim.SGD's single-tensor loop, in float64."""

    def reference(p, grads):
        p = p.astype(np.float64)
        buf = None
        out = []
        for count, g in enumerate(grads):
            lr = 0.1 * 0.5 ** (count // 2) if learning_rate is halving else learning_rate
            g = g.astype(np.float64) + weight_decay * p
            if momentum != 0:
                buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
                g = g + momentum * buf if nesterov else buf
            p = p - lr * g
            out.append(p)
        return out

    return reference


CONFIGS = [
    pytest.param(dict(learning_rate=0.1), id="defaults"),
    pytest.param(dict(learning_rate=0.1, weight_decay=0.3), id="weight_decay"),
    pytest.param(dict(learning_rate=0.1, momentum=0.9), id="momentum"),
    # The first step takes the whole gradient, later ones (1 - dampening) of it.
    pytest.param(dict(learning_rate=0.1, momentum=0.9, dampening=0.5), id="dampening"),
    pytest.param(dict(learning_rate=0.1, momentum=0.8, nesterov=True), id="nesterov"),
    pytest.param(
        dict(learning_rate=halving, momentum=0.9, nesterov=True, weight_decay=0.1),
        id="schedule",
    ),
]


@pytest.mark.parametrize("jit, tree_kind", RUNS)
@pytest.mark.parametrize("config", CONFIGS)
def test_sgd_matches_reference(config, jit, tree_kind):
    assert_matches_reference(
        ro.sgd(**config), sgd_reference(**config), jit=jit, tree_kind=tree_kind
    )


def test_first_step_is_not_dampened():
    p = {"w": jnp.zeros((2,), jnp.float32)}
    tx = ro.sgd(1.0, momentum=0.9, dampening=0.5)
    state = tx.init(p)
    g = {"w": jnp.array([1.0, -2.0], jnp.float32)}
    first, state = tx.update(g, state, p)
    second, _ = tx.update(g, state, p)
    np.testing.assert_allclose(first["w"], [-1.0, 2.0], rtol=1e-7)  # b = g
    np.testing.assert_allclose(second["w"], [-1.4, 2.8], rtol=1e-6)  # b = 0.9 b + 0.5 g


def test_no_buffer_without_momentum():
    p = {"w": jnp.zeros((1000,), jnp.float32)}
    assert not any(x.size > 1 for x in jax.tree.leaves(ro.sgd(0.1).init(p)))


def test_bf16_params_keep_fp32_moments():
    params, grads = make_problem(2)
    to_bf16 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), tree)
    p, g1, g2 = to_bf16(params), to_bf16(grads[0]), to_bf16(grads[1])
    config = dict(learning_rate=0.1, momentum=0.9, dampening=0.2, weight_decay=0.3)
    tx = ro.sgd(**config, moment_dtype=jnp.float32)
    update = jax.jit(tx.update)
    state = tx.init(p)
    updates, state = update(g1, state, p)

    reference = sgd_reference(**config)
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
    buffers = jax.tree.leaves(state[1].momentum_buffer)
    assert buffers and all(x.dtype == jnp.float32 for x in buffers)


def test_bf16_params_without_moment_dtype():
    p = {"w": jnp.ones((3,), jnp.bfloat16)}
    tx = ro.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1)
    updates, state = jax.jit(tx.update)({"w": jnp.ones((3,), jnp.bfloat16)}, tx.init(p), p)
    assert updates["w"].dtype == state[1].momentum_buffer["w"].dtype == jnp.bfloat16


def test_matches_optax_sgd_without_dampening():
    """torch and optax agree when dampening == 0 (optax's trace starts its buffer at 0)."""
    params, grads = make_problem(4)
    ours = run_optimizer(ro.sgd(0.1, momentum=0.9, nesterov=True), params, grads, jit=True)
    theirs = run_optimizer(optax.sgd(0.1, momentum=0.9, nesterov=True), params, grads, jit=True)
    for a, b in zip(ours[-1], theirs[-1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(learning_rate=-0.1), ValueError, r"learning_rate=-0\.1"),
        (dict(learning_rate=None), TypeError, "learning_rate"),
        (dict(learning_rate=0.1, weight_decay=-0.01), ValueError, r"weight_decay=-0\.01"),
        (dict(learning_rate=0.1, momentum=-0.5), ValueError, r"momentum=-0\.5"),
        (dict(learning_rate=0.1, momentum=1.0), ValueError, r"momentum=1\.0"),
        (dict(learning_rate=0.1, momentum=math.inf), ValueError, r"momentum=inf"),
        (dict(learning_rate=0.1, momentum=0.9, dampening=1.5), ValueError, r"dampening=1\.5"),
        (dict(learning_rate=0.1, nesterov=True), ValueError, r"momentum > 0.*momentum=0\.0"),
        (
            dict(learning_rate=0.1, momentum=0.9, dampening=0.1, nesterov=True),
            ValueError,
            r"dampening == 0.*dampening=0\.1",
        ),
        (dict(learning_rate=0.1, nesterov="yes"), TypeError, "nesterov='yes'"),
        (dict(learning_rate=0.1, moment_dtype=jnp.int8), TypeError, "moment_dtype"),
    ],
)
def test_bad_hyperparameters(kwargs, error, match):
    with pytest.raises(error, match=match):
        ro.sgd(**kwargs)
