"""Tests of rudax.optim.adam and adamw against torch's rules written plainly in numpy."""

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


def adam_reference(
    learning_rate,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    weight_decay=None,
    amsgrad=False,
    *,
    decoupled: bool,
):
    """torch.optim.Adam / AdamW's single-tensor loop, in float64, with torch's defaults."""
    if weight_decay is None:
        weight_decay = 1e-2 if decoupled else 0.0

    def reference(p, grads):
        p = p.astype(np.float64)
        m, v, v_max = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
        out = []
        for t, g in enumerate(grads, start=1):
            lr = rate(learning_rate, t - 1)
            g = g.astype(np.float64)
            if decoupled:
                p = p * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * p
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            v_max = np.maximum(v_max, v)
            second = v_max if amsgrad else v
            denom = np.sqrt(second) / math.sqrt(1 - b2**t) + eps
            p = p - lr / (1 - b1**t) * m / denom
            out.append(p)
        return out

    return reference


ADAM_CONFIGS = [
    pytest.param(dict(learning_rate=0.1), id="defaults"),
    pytest.param(dict(learning_rate=0.1, weight_decay=0.3), id="weight_decay"),
    pytest.param(dict(learning_rate=0.1, b1=0.5, b2=0.9, eps=1e-2), id="betas-eps"),
    # b2=0.5 lets v fall between steps, so the running max differs from v.
    pytest.param(dict(learning_rate=0.1, b2=0.5, amsgrad=True), id="amsgrad"),
    pytest.param(dict(learning_rate=halving, weight_decay=0.1, amsgrad=True), id="schedule"),
]

ADAMW_CONFIGS = [
    pytest.param(dict(learning_rate=0.1), id="defaults"),
    pytest.param(dict(learning_rate=0.1, weight_decay=0.5), id="weight_decay"),
    pytest.param(dict(learning_rate=0.1, weight_decay=0.0), id="no_decay"),
    pytest.param(dict(learning_rate=0.1, b2=0.5, weight_decay=0.5, amsgrad=True), id="amsgrad"),
    # lr_t * weight_decay: the decay follows the schedule.
    pytest.param(dict(learning_rate=halving, weight_decay=0.5), id="schedule"),
]


@pytest.mark.parametrize("jit, tree_kind", RUNS)
@pytest.mark.parametrize("config", ADAM_CONFIGS)
def test_adam_matches_reference(config, jit, tree_kind):
    assert_matches_reference(
        ro.adam(**config),
        adam_reference(**config, decoupled=False),
        jit=jit,
        tree_kind=tree_kind,
    )


@pytest.mark.parametrize("jit, tree_kind", RUNS)
@pytest.mark.parametrize("config", ADAMW_CONFIGS)
def test_adamw_matches_reference(config, jit, tree_kind):
    assert_matches_reference(
        ro.adamw(**config),
        adam_reference(**config, decoupled=True),
        jit=jit,
        tree_kind=tree_kind,
    )


def test_amsgrad_config_exercises_the_maximum():
    """The amsgrad case above is not vacuous: without the maximum the trajectory differs."""
    params, grads = make_problem(6)
    with_max = run_optimizer(ro.adam(0.1, b2=0.5, amsgrad=True), params, grads, jit=True)
    without = run_optimizer(ro.adam(0.1, b2=0.5), params, grads, jit=True)
    assert not np.allclose(with_max[-1][0], without[-1][0], rtol=1e-3)


def test_amsgrad_is_torchs_not_optaxs():
    """torch bias-corrects max(v); optax takes the max of the bias-corrected v."""
    g_big, g_small = np.float32(1.0), np.float32(0.01)
    p = {"w": jnp.zeros((1,), jnp.float32)}
    tx = ro.adam(1.0, b1=0.0, b2=0.5, eps=0.0, amsgrad=True)
    state = tx.init(p)
    for g in (g_big, g_small):
        updates, state = tx.update({"w": jnp.full((1,), g)}, state, p)
    # After two steps: v1 = 0.5, v2 = 0.25 + 0.5e-4, max raw v = v1 = 0.5; bc2 = 0.75.
    torch_denominator = math.sqrt(0.5) / math.sqrt(0.75)
    optax_denominator = math.sqrt(max(0.5 / 0.5, (0.25 + 0.5e-4) / 0.75))
    np.testing.assert_allclose(-updates["w"][0], g_small / torch_denominator, rtol=1e-6)
    assert not math.isclose(-float(updates["w"][0]), g_small / optax_denominator, rel_tol=1e-3)


def test_composes_with_optax_clip_by_global_norm():
    """chain(optax.clip_by_global_norm, rudax adamw) against a reference that clips."""
    max_norm, num_steps = 1.0, 4
    params, grads = make_problem(num_steps)
    tx = optax.chain(optax.clip_by_global_norm(max_norm), ro.adamw(0.1, weight_decay=0.5))
    got = run_optimizer(tx, params, grads, jit=True)

    p = [x.astype(np.float64) for x in jax.tree.leaves(params)]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    for t, step_grads in enumerate(grads, start=1):
        g = [x.astype(np.float64) for x in jax.tree.leaves(step_grads)]
        norm = math.sqrt(sum(float(np.sum(x * x)) for x in g))
        if norm > max_norm:  # optax's rule: g * max_norm / norm above the threshold
            g = [x * max_norm / norm for x in g]
        for i in range(len(p)):
            p[i] = p[i] * (1 - 0.1 * 0.5)
            m[i] = 0.9 * m[i] + 0.1 * g[i]
            v[i] = 0.999 * v[i] + 0.001 * g[i] ** 2
            denom = np.sqrt(v[i]) / math.sqrt(1 - 0.999**t) + 1e-8
            p[i] = p[i] - 0.1 / (1 - 0.9**t) * m[i] / denom
            np.testing.assert_allclose(got[t - 1][i], p[i], rtol=1e-5, atol=1e-6)


def test_schedule_evaluated_once_per_update():
    counts = []

    def schedule(count):
        counts.append(int(count))
        return 0.1 * 0.5 ** (count // 2).astype(jnp.float32)

    params, grads = make_problem(3)
    run_optimizer(ro.adamw(schedule), params, grads, jit=False)
    assert counts == [0, 1, 2]


def test_inject_hyperparams():
    """optax.inject_hyperparams passes the hyperparameters as arrays (tracers under jit)."""
    tx = optax.inject_hyperparams(ro.adamw)(learning_rate=0.1, b1=0.8, weight_decay=0.5)
    reference = adam_reference(0.1, b1=0.8, weight_decay=0.5, decoupled=True)
    assert_matches_reference(tx, reference, jit=True, num_steps=3)


def test_count_saturates_instead_of_overflowing():
    p = {"w": jnp.ones((3,), jnp.float32)}
    tx = ro.adam(0.1)
    state = tx.init(p)
    top = jnp.iinfo(jnp.int32).max
    state = optax.tree_utils.tree_set(state, count=jnp.asarray(top, jnp.int32))
    updates, state = jax.jit(tx.update)({"w": jnp.ones((3,), jnp.float32)}, state, p)
    assert int(optax.tree_utils.tree_get(state, "count")) == top
    # Both bias corrections are 1 at this count: u = m / (sqrt(v) + eps).
    m, v = 0.1, 0.001
    np.testing.assert_allclose(updates["w"], -0.1 * m / (math.sqrt(v) + 1e-8), rtol=1e-5)


@pytest.mark.parametrize("factory", [ro.adam, ro.adamw])
def test_bf16_params_keep_fp32_moments(factory):
    config = dict(learning_rate=0.1, b2=0.9, weight_decay=0.3, amsgrad=True)
    # One rounding to bf16 at the end: at most one bf16 ulp (2**-7 relative) apart. The
    # buffers: exp_avg, exp_avg_sq and max_exp_avg_sq of each of the four leaves.
    assert_bf16_update(
        factory(**config, moment_dtype=jnp.float32),
        first_update(adam_reference(**config, decoupled=factory is ro.adamw)),
        buffer_dtype=jnp.float32,
        num_buffers=3 * 4,
        rtol=2**-7,
    )


def test_bf16_params_without_moment_dtype_keep_bf16_moments():
    p = {"w": jnp.ones((3,), jnp.bfloat16)}
    tx = ro.adamw(np.float32(0.1), b1=np.float32(0.9), weight_decay=0.1)
    updates, state = jax.jit(tx.update)({"w": jnp.ones((3,), jnp.bfloat16)}, tx.init(p), p)
    assert updates["w"].dtype == jnp.bfloat16
    assert state[0].exp_avg["w"].dtype == state[0].exp_avg_sq["w"].dtype == jnp.bfloat16


def test_update_without_params_when_no_weight_decay():
    g = {"w": jnp.ones((2,), jnp.float32)}
    tx = ro.adam(0.1)
    updates, _ = tx.update(g, tx.init(g))
    np.testing.assert_allclose(updates["w"], -0.1, rtol=1e-6)


def test_moment_dtype_rejects_integer_parameters_naming_the_path():
    params = {"w": jnp.ones((2,), jnp.float32), "step": jnp.zeros((), jnp.int32)}
    with pytest.raises(TypeError, match=r"\['step'\].*int32"):
        ro.adam(0.1, moment_dtype=jnp.float32).init(params)


test_bad_hyperparameters = rejects(
    [ro.adam, ro.adamw],
    [
        (dict(learning_rate=-0.1), ValueError, r"learning_rate=-0\.1"),
        (dict(learning_rate="0.1"), TypeError, "learning_rate"),
        (dict(learning_rate=0.1, eps=-1e-8), ValueError, r"eps=-1e-08"),
        (dict(learning_rate=0.1, weight_decay=-0.01), ValueError, r"weight_decay=-0\.01"),
        (dict(learning_rate=0.1, weight_decay=math.nan), ValueError, r"weight_decay=nan"),
        (dict(learning_rate=0.1, b1=1.0), ValueError, r"b1=1\.0"),
        (dict(learning_rate=0.1, b1=-0.1), ValueError, r"b1=-0\.1"),
        (dict(learning_rate=0.1, b2=1.0), ValueError, r"b2=1\.0"),
        (dict(learning_rate=0.1, amsgrad=1), TypeError, r"amsgrad=1"),
        (dict(learning_rate=0.1, moment_dtype=jnp.int32), TypeError, "moment_dtype"),
        (dict(learning_rate=0.1, moment_dtype="fp32"), TypeError, "moment_dtype"),
    ],
)
