"""Tests of rudax.optim.sgd against torch.optim.SGD's rule written plainly in numpy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rudax.optim as ro
from tests.optim._bad_input import rejects
from tests.optim._harness import (
    RUNS,
    assert_bf16_update,
    assert_matches_reference,
    first_update,
    halving,
    make_problem,
    rate,
    run_optimizer,
)


def sgd_reference(learning_rate, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
    """torch.optim.SGD's single-tensor loop, in float64."""

    def reference(p, grads):
        p = p.astype(np.float64)
        buf = None
        out = []
        for count, g in enumerate(grads):
            lr = rate(learning_rate, count)
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
    config = dict(learning_rate=0.1, momentum=0.9, dampening=0.2, weight_decay=0.3)
    # One rounding to bf16 at the end: at most one bf16 ulp (2**-7 relative) apart.
    assert_bf16_update(
        ro.sgd(**config, moment_dtype=jnp.float32),
        first_update(sgd_reference(**config)),
        buffer_dtype=jnp.float32,
        num_buffers=4,
        rtol=2**-7,
    )


def test_matches_optax_sgd_without_dampening():
    """torch and optax agree when dampening == 0 (optax's trace starts its buffer at 0)."""
    params, grads = make_problem(4)
    ours = run_optimizer(ro.sgd(0.1, momentum=0.9, nesterov=True), params, grads, jit=True)
    theirs = run_optimizer(optax.sgd(0.1, momentum=0.9, nesterov=True), params, grads, jit=True)
    for a, b in zip(ours[-1], theirs[-1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


test_bad_hyperparameters = rejects(
    ro.sgd,
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
