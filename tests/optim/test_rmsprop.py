"""Tests of rudax.optim.rmsprop against torch.optim.RMSprop's rule written plainly in numpy."""

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
    rate,
)


def rmsprop_reference(
    learning_rate, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False
):
    """torch.optim.RMSprop's single-tensor loop, in float64."""

    def reference(p, grads):
        p = p.astype(np.float64)
        square_avg, grad_avg, buf = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
        out = []
        for count, g in enumerate(grads):
            lr = rate(learning_rate, count)
            g = g.astype(np.float64) + weight_decay * p
            square_avg = alpha * square_avg + (1 - alpha) * g * g
            if centered:
                grad_avg = alpha * grad_avg + (1 - alpha) * g
                avg = np.sqrt(square_avg - grad_avg * grad_avg) + eps
            else:
                avg = np.sqrt(square_avg) + eps
            if momentum > 0:
                buf = momentum * buf + g / avg
                p = p - lr * buf
            else:
                p = p - lr * g / avg
            out.append(p)
        return out

    return reference


CONFIGS = [
    pytest.param(dict(learning_rate=0.01), id="defaults"),
    pytest.param(dict(learning_rate=0.01, alpha=0.9, eps=0.1, weight_decay=0.3), id="wd-eps"),
    pytest.param(dict(learning_rate=0.01, momentum=0.9), id="momentum"),
    pytest.param(dict(learning_rate=0.01, alpha=0.8, centered=True), id="centered"),
    # Momentum before the learning rate: a schedule scales the whole buffer, not each step.
    pytest.param(
        dict(learning_rate=halving, momentum=0.5, centered=True, weight_decay=0.1),
        id="schedule",
    ),
]


@pytest.mark.parametrize("jit, tree_kind", RUNS)
@pytest.mark.parametrize("config", CONFIGS)
def test_rmsprop_matches_reference(config, jit, tree_kind):
    assert_matches_reference(
        ro.rmsprop(**config), rmsprop_reference(**config), jit=jit, tree_kind=tree_kind
    )


def test_eps_is_outside_the_root():
    """torch: g / (sqrt(v) + eps); optax's default: g / sqrt(v + eps). Visible with a large eps."""
    p = {"w": jnp.zeros((1,), jnp.float32)}
    tx = ro.rmsprop(1.0, alpha=0.75, eps=1.0)
    updates, _ = tx.update({"w": jnp.full((1,), 2.0, jnp.float32)}, tx.init(p), p)
    np.testing.assert_allclose(updates["w"], [-2.0 / (1.0 + 1.0)], rtol=1e-6)


def test_centered_variance_below_zero_is_clamped():
    """Rounding can leave v < a**2 (never so in exact arithmetic): torch's root gives NaN."""
    p = {"w": jnp.zeros((1,), jnp.float32)}
    tx = ro.rmsprop(1.0, alpha=0.5, eps=1e-3, centered=True)
    # v = a**2 - 1e-4 stands for such a rounding; with g = a the new v - a**2 is -5e-5.
    state = optax.tree_utils.tree_set(
        tx.init(p),
        square_avg={"w": jnp.full((1,), 0.0099, jnp.float32)},
        grad_avg={"w": jnp.full((1,), 0.1, jnp.float32)},
    )
    g = {"w": jnp.full((1,), 0.1, jnp.float32)}
    updates, _ = tx.update(g, state, p)
    np.testing.assert_allclose(updates["w"], [-0.1 / (0.0 + 1e-3)], rtol=1e-5)


def test_bf16_params_keep_fp32_moments():
    config = dict(learning_rate=0.01, momentum=0.9, centered=True, weight_decay=0.3)
    # One rounding to bf16 at the end: at most one bf16 ulp (2**-7 relative) apart. The
    # buffers: square_avg, grad_avg and the momentum buffer of each of the four leaves.
    assert_bf16_update(
        ro.rmsprop(**config, moment_dtype=jnp.float32),
        first_update(rmsprop_reference(**config)),
        buffer_dtype=jnp.float32,
        num_buffers=3 * 4,
        rtol=2**-7,
    )


test_bad_hyperparameters = rejects(
    ro.rmsprop,
    [
        (dict(learning_rate=-0.1), ValueError, r"learning_rate=-0\.1"),
        (dict(learning_rate=0.1, alpha=1.0), ValueError, r"alpha=1\.0"),
        (dict(learning_rate=0.1, alpha=-0.1), ValueError, r"alpha=-0\.1"),
        (dict(learning_rate=0.1, eps=-1e-8), ValueError, r"eps=-1e-08"),
        (dict(learning_rate=0.1, weight_decay=-0.01), ValueError, r"weight_decay=-0\.01"),
        (dict(learning_rate=0.1, momentum=-0.9), ValueError, r"momentum=-0\.9"),
        (dict(learning_rate=0.1, momentum=1.5), ValueError, r"momentum=1\.5"),
        (dict(learning_rate=0.1, centered=0), TypeError, "centered=0"),
        (dict(learning_rate=0.1, moment_dtype=jnp.uint8), TypeError, "moment_dtype"),
    ],
)
