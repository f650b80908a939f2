"""Tests of rudax.optim.adagrad against torch.optim.Adagrad's rule written plainly in numpy."""

import jax.numpy as jnp
import numpy as np
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


def adagrad_reference(
    learning_rate, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10
):
    """torch.optim.Adagrad's single-tensor loop, in float64."""

    def reference(p, grads):
        p = p.astype(np.float64)
        state_sum = np.full_like(p, initial_accumulator_value)
        out = []
        for step, g in enumerate(grads, start=1):
            lr = rate(learning_rate, step - 1)
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
    config = dict(learning_rate=0.1, weight_decay=0.3, initial_accumulator_value=0.2)
    # One rounding to bf16 at the end: at most one bf16 ulp (2**-7 relative) apart.
    assert_bf16_update(
        ro.adagrad(**config, moment_dtype=jnp.float32),
        first_update(adagrad_reference(**config)),
        buffer_dtype=jnp.float32,
        num_buffers=4,
        rtol=2**-7,
    )


test_bad_hyperparameters = rejects(
    ro.adagrad,
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
