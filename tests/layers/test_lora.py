"""Tests of rudax.layers.LoRALinear: the formula, frozen base, trainable filter, dropout, dtypes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import rudax.layers as rl
from tests.layers._random import normal, uniform
from tests.optim._bad_input import rejects


def make(rank=2, *, in_features=6, out_features=4, **kwargs):
    base = rl.Linear(in_features, out_features, rngs=nnx.Rngs(0))
    base.bias[...] = jnp.linspace(-1, 1, out_features)
    return rl.LoRALinear(base, rank, rngs=nnx.Rngs(1), **{"alpha": 4.0, **kwargs})


def test_base_is_frozen_in_place_without_copies():
    base = rl.Linear(6, 4, rngs=nnx.Rngs(0))
    kernel = base.kernel[...]
    lora = rl.LoRALinear(base, 2, alpha=1.0, rngs=nnx.Rngs(1))
    assert lora.base is base
    assert type(base.kernel) is rl.Frozen and type(base.bias) is rl.Frozen
    assert not isinstance(base.kernel, nnx.Param)
    assert base.kernel[...] is kernel
    assert sorted(nnx.state(lora, nnx.Param).keys()) == ["lora_a", "lora_b"]
    assert sorted(nnx.state(lora, rl.Frozen)["base"].keys()) == ["bias", "kernel"]


def test_init_a_uniform_b_zero_output_equals_base():
    lora = make(rank=64, in_features=16, out_features=4)
    a = np.asarray(lora.lora_a[...])
    assert lora.lora_a.shape == (16, 64) and lora.lora_b.shape == (64, 4)
    bound = 1 / math.sqrt(16)  # peft: kaiming_uniform_(a=sqrt(5)) = U(±1/sqrt(in))
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound
    np.testing.assert_allclose(np.var(a), bound**2 / 3, rtol=0.1)
    np.testing.assert_array_equal(lora.lora_b[...], 0)
    x = normal((3, 16), 2)
    np.testing.assert_array_equal(lora(x), lora.base(x))


@pytest.mark.parametrize(
    "scale_rule, scale", [("alpha/rank", 4.0 / 4), ("alpha/sqrt(rank)", 4.0 / 2)]
)
def test_matches_numpy(scale_rule, scale):
    lora = make(rank=4, scale_rule=scale_rule)
    lora.lora_b[...] = normal((4, 4), 3)
    assert lora.scale == scale
    x = normal((2, 3, 6), 2)
    f64 = lambda v: np.asarray(v[...], np.float64)
    xs = np.asarray(x, np.float64)
    expected = xs @ f64(lora.base.kernel) + f64(lora.base.bias)
    expected = expected + scale * xs @ f64(lora.lora_a) @ f64(lora.lora_b)
    np.testing.assert_allclose(lora(x), expected, rtol=1e-5, atol=1e-5)


def test_dropout_on_the_adapter_input_only():
    # A and B identities make the adapter's output scale * dropout(x) itself.
    lora = make(rank=6, in_features=6, out_features=6, alpha=6.0, dropout=0.5)
    lora.lora_a[...] = jnp.eye(6)
    lora.lora_b[...] = jnp.eye(6)
    x = uniform((200, 6), 1.0, 2.0, 2)
    adapter = np.asarray(lora(x) - lora.base(x))
    dropped = np.isclose(adapter, 0, atol=1e-5)
    np.testing.assert_allclose(adapter[~dropped], 2 * np.asarray(x)[~dropped], rtol=1e-5)
    assert 0.4 < dropped.mean() < 0.6
    lora.eval()
    np.testing.assert_allclose(lora(x) - lora.base(x), x, rtol=1e-5)
    lora.train()
    np.testing.assert_allclose(lora(x, deterministic=True) - lora.base(x), x, rtol=1e-5)


def test_no_base_gradient_and_an_optax_step_changes_only_the_adapter():
    lora = make()
    lora.lora_b[...] = jnp.ones((2, 4))
    x = normal((3, 6), 2)
    loss = lambda m: jnp.sum(m(x) ** 2)
    grads = nnx.grad(loss)(lora)  # wrt=nnx.Param by default
    assert sorted(grads.keys()) == ["lora_a", "lora_b"]
    before = jax.tree.map(np.asarray, nnx.state(lora))
    # The functional way: split the trainable parameters off, step them with optax.
    graphdef, params, rest = nnx.split(lora, nnx.Param, ...)
    tx = optax.sgd(0.1)
    opt_state = tx.init(params)
    g = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest)))(params)
    updates, opt_state = tx.update(g, opt_state, params)
    nnx.update(lora, optax.apply_updates(params, updates))
    after = nnx.state(lora)
    for name in ("kernel", "bias"):
        np.testing.assert_array_equal(after["base"][name][...], before["base"][name][...])
    for name in ("lora_a", "lora_b"):
        assert not np.array_equal(after[name][...], before[name][...])


@pytest.mark.parametrize(
    "x_dtype, dtype, out_dtype",
    [(jnp.bfloat16, None, jnp.bfloat16), (jnp.bfloat16, jnp.float32, jnp.float32)],
)
def test_dtypes(x_dtype, dtype, out_dtype):
    lora = make(dtype=dtype, param_dtype=jnp.bfloat16)
    assert lora.lora_a.dtype == jnp.bfloat16 and lora.base.kernel.dtype == jnp.float32
    y = lora(jnp.ones((2, 6), x_dtype))
    assert y.dtype == out_dtype


def test_call_rejects_wrong_features():
    with pytest.raises(ValueError, match=r"x.shape=\(2, 5\)"):
        make()(jnp.ones((2, 5)))


def _lora(**kwargs):
    return rl.LoRALinear(rl.Linear(4, 3, rngs=nnx.Rngs(0)), **kwargs)


test_bad_arguments = rejects(
    _lora,
    [
        ({"rank": 0}, ValueError, "rank=0"),
        ({"rank": 2.0}, TypeError, "rank=2.0"),
        ({"alpha": 0.0}, ValueError, "alpha=0.0"),
        ({"alpha": -1}, ValueError, "alpha=-1"),
        ({"dropout": 1.0}, ValueError, "dropout=1.0"),
        ({"scale_rule": "rank"}, ValueError, "scale_rule='rank'"),
        ({"param_dtype": jnp.int32}, TypeError, "param_dtype="),
    ],
    rank=2,
    alpha=1.0,
    rngs=nnx.Rngs(1),
)


def test_rejects_a_base_that_is_not_a_linear():
    with pytest.raises(TypeError, match=r"base must be a rudax\.layers\.Linear or a flax"):
        rl.LoRALinear(rl.RMSNorm(4, rngs=nnx.Rngs(0)), 2, alpha=1.0, rngs=nnx.Rngs(1))


def test_adapters_are_lora_params_and_alpha_and_rule_are_kept():
    lora = make(rank=4, scale_rule="alpha/sqrt(rank)")
    assert type(lora.lora_a) is rl.LoRAParam and type(lora.lora_b) is rl.LoRAParam
    assert isinstance(lora.lora_a, nnx.Param)  # still trained by nnx.Param's filters
    assert (lora.alpha, lora.scale_rule, lora.scale) == (4.0, "alpha/sqrt(rank)", 2.0)
    _, adapters, rest = nnx.split(lora, rl.LoRAParam, ...)
    assert sorted(adapters.keys()) == ["lora_a", "lora_b"]
    assert [type(v) for _, v in nnx.to_flat_state(rest)] == [rl.Frozen, rl.Frozen]


def test_a_flax_nnx_linear_base_matches_numpy():
    base = nnx.Linear(6, 4, rngs=nnx.Rngs(0))
    base.bias[...] = jnp.linspace(-1, 1, 4)
    lora = rl.LoRALinear(base, 3, alpha=6.0, rngs=nnx.Rngs(1))
    assert type(base.kernel) is rl.Frozen and type(base.bias) is rl.Frozen
    assert sorted(nnx.state(lora, nnx.Param).keys()) == ["lora_a", "lora_b"]
    lora.lora_b[...] = normal((3, 4), 3)
    x = normal((5, 6), 2)
    f64 = lambda v: np.asarray(v[...], np.float64)
    xs = np.asarray(x, np.float64)
    adapter = 2.0 * xs @ f64(lora.lora_a) @ f64(lora.lora_b)  # scale = alpha / rank = 2
    expected = xs @ f64(base.kernel) + f64(base.bias) + adapter
    np.testing.assert_allclose(lora(x), expected, rtol=1e-5, atol=1e-5)


def test_a_failed_construction_leaves_the_base_trainable():
    base = rl.Linear(4, 3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"rngs must be an nnx\.Rngs, got int"):
        rl.LoRALinear(base, 2, alpha=1.0, rngs=0)
    with pytest.raises(TypeError, match=r"param_dtype="):
        rl.LoRALinear(base, 2, alpha=1.0, param_dtype=jnp.int32, rngs=nnx.Rngs(1))
    assert type(base.kernel) is nnx.Param and type(base.bias) is nnx.Param
