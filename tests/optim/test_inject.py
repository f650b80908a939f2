"""rudax.optim.inject_hyperparams and optax.inject_hyperparams over rudax's optimizers.

What must hold (issue 12): every float hyperparameter can be injected and read back; the
structural ones stay static; the injected optimizer has the plain one's state layout and
computes its updates; changing the learning rate between updates does not recompile; with
bf16 parameters the hyperparameters stay float32.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rudax.optim as ro
from rudax.optim._inject import declared_static_arguments

# Each optimizer with every float hyperparameter set away from its default, so that reading
# back a default by mistake is caught, and every term of its rule active.
CONFIGS = {
    "sgd": (ro.sgd, dict(learning_rate=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01)),
    "adam": (ro.adam, dict(learning_rate=0.1, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.01)),
    "adamw": (ro.adamw, dict(learning_rate=0.1, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)),
    "adagrad": (
        ro.adagrad,
        dict(
            learning_rate=0.1,
            lr_decay=0.01,
            weight_decay=0.01,
            initial_accumulator_value=0.1,
            eps=1e-8,
        ),
    ),
    "rmsprop": (
        ro.rmsprop,
        dict(learning_rate=0.1, alpha=0.9, eps=1e-6, weight_decay=0.01, momentum=0.5),
    ),
}

ALL_FACTORIES = [
    ro.sgd,
    ro.adam,
    ro.adamw,
    ro.adagrad,
    ro.rmsprop,
    ro.adan,
    ro.muon,
    ro.lbfgs,
    ro.fused_adamw,
]


def _params(dtype=jnp.float32):
    return {"w": jnp.linspace(-1.0, 1.0, 12, dtype=dtype).reshape(3, 4), "b": jnp.ones((4,), dtype)}


def _grads(params, step):
    return jax.tree.map(lambda p: (jnp.cos(p * (step + 1)) * 0.5).astype(p.dtype), params)


def _run(tx, params, steps=3):
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t in range(steps):
        updates, state = update(_grads(params, t), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("name", CONFIGS)
def test_injected_optimizer_is_the_plain_one(name):
    """Same state layout as the plain optimizer and the same parameters after 3 updates.

    Bit for bit where the rule uses the hyperparameters as they are (sgd, adagrad). Where it
    derives scalars from them (``1 - alpha``, ``log(b1)`` in Adam's bias corrections), a
    Python float derives them in float64 at trace time and an injected float32 array in
    float32: ``1 - 0.9`` is 0.1 rounded once in one and 0.100000024 in the other, a relative
    2.4e-7 that three updates carry to about 2e-6.
    """
    factory, config = CONFIGS[name]
    plain, injected = factory(**config), ro.inject_hyperparams(factory)(**config)
    params = _params()
    assert jax.tree.structure(plain.init(params)) == jax.tree.structure(
        injected.init(params).inner_state
    )
    (expected, _), (got, state) = _run(plain, params), _run(injected, params)
    rtol = 1e-5 if name in ("adam", "adamw", "rmsprop") else 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol), got, expected)
    assert set(state.hyperparams) == set(config)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_float_hyperparameter_reads_back(name):
    factory, config = CONFIGS[name]
    state = ro.inject_hyperparams(factory)(**config).init(_params(jnp.bfloat16))
    for key, value in config.items():
        assert state.hyperparams[key].dtype == jnp.float32, key
        assert float(state.hyperparams[key]) == np.float32(value), key


@pytest.mark.parametrize("name", CONFIGS)
def test_bf16_parameters_keep_fp32_hyperparameters(name):
    """With bf16 parameters optax would round b2=0.999 to 1.0; here it stays 0.999 in fp32,
    and the update equals the plain optimizer's, whose Python floats enter the arithmetic
    weakly typed, as the injected ones do."""
    factory, config = CONFIGS[name]
    params = _params(jnp.bfloat16)
    (expected, _), (got, _) = (
        _run(factory(**config), params),
        _run(ro.inject_hyperparams(factory)(**config), params),
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-7
        ),
        got,
        expected,
    )
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))


@pytest.mark.standard_promotion  # optax's own inject_hyperparams casts under standard rules
@pytest.mark.parametrize("jit_init", [False, True], ids=["eager-init", "jit-init"])
def test_optax_inject_with_bf16_params_names_the_fix(jit_init):
    """Plain optax casts b2=0.999 to bf16 (1.0): refused with the fix, also under jax.jit,
    where the rounded b2 is a tracer whose value no range check can read (its dtype says it)."""
    tx = optax.inject_hyperparams(ro.adamw)(learning_rate=0.1)
    init = jax.jit(tx.init) if jit_init else tx.init
    with pytest.raises(TypeError, match=r"is a bfloat16 scalar.*hyperparam_dtype=jnp\.float32"):
        init(_params(jnp.bfloat16))


@pytest.mark.parametrize("name", CONFIGS)
def test_changing_the_learning_rate_does_not_recompile(name):
    factory, config = CONFIGS[name]
    tx = ro.inject_hyperparams(factory)(**config)
    params = _params()
    state = tx.init(params)
    traces = []

    @jax.jit
    def step(params, state):
        traces.append(None)
        updates, state = tx.update(_grads(params, 0), state, params)
        return optax.apply_updates(params, updates), state

    first, state = step(params, state)
    state.hyperparams["learning_rate"] = jnp.asarray(0.0, jnp.float32)
    second, state = step(first, state)
    assert len(traces) == 1
    # And the new value is the one used: a learning rate of 0 leaves the parameters alone.
    jax.tree.map(np.testing.assert_array_equal, second, first)


def test_a_schedule_is_injected_and_evaluated_per_update():
    tx = ro.inject_hyperparams(ro.sgd)(learning_rate=lambda count: 0.5 ** (count + 1))
    params = {"w": jnp.zeros((2,))}
    state = tx.init(params)
    lrs = []
    for _ in range(3):
        _, state = tx.update({"w": jnp.ones((2,))}, state, params)
        lrs.append(float(state.hyperparams["learning_rate"]))
    assert lrs == [0.5, 0.25, 0.125]


def test_mask_and_moment_dtype_stay_static():
    """A callable mask and a dtype are callables, which optax would take for schedules."""
    tx = ro.inject_hyperparams(ro.adamw)(
        learning_rate=0.1, moment_dtype=jnp.float32, mask=lambda p: {"w": True, "b": False}
    )
    params = _params(jnp.bfloat16)
    state = tx.init(params)
    assert set(state.hyperparams) == {"learning_rate", "b1", "b2", "eps", "weight_decay"}
    assert all(
        x.dtype == jnp.float32 for x in jax.tree.leaves(state.inner_state) if x.shape == (3, 4)
    )
    _run(tx, params)


@pytest.mark.parametrize("jit_init", [False, True], ids=["eager-init", "jit-init"])
@pytest.mark.parametrize("name", ["sgd", "rmsprop"])
def test_momentum_injected_as_zero_allocates_no_buffer(name, jit_init):
    """A momentum of 0 stays static, so no buffer even when init runs under jax.jit."""
    factory, config = CONFIGS[name]
    tx = ro.inject_hyperparams(factory)(**{**config, "momentum": 0.0})
    params = _params()
    state = jax.jit(tx.init)(params) if jit_init else tx.init(params)
    assert "momentum" not in state.hyperparams
    momentum = [
        s
        for s in jax.tree.leaves(state.inner_state, is_leaf=lambda x: hasattr(x, "momentum_buffer"))
        if hasattr(s, "momentum_buffer")
    ]
    assert [s.momentum_buffer for s in momentum] == [None]
    plain = factory(**{**config, "momentum": 0.0})
    assert jax.tree.structure(plain.init(params)) == jax.tree.structure(state.inner_state)
    _run(tx, params)


@pytest.mark.parametrize("factory", ALL_FACTORIES, ids=lambda f: f.__name__)
def test_everything_not_declared_static_is_a_float_hyperparameter(factory):
    """The declaration matches the signature: the declared names exist, and each argument not
    declared is a number, a schedule or None (an optional float); an int, bool, str, tuple or
    dtype default left undeclared would be injected as an array."""
    signature = inspect.signature(factory)
    static = declared_static_arguments(factory)
    assert static, f"{factory.__name__} declares no static arguments"
    assert set(static) <= set(signature.parameters)
    for name, parameter in signature.parameters.items():
        if name in static:
            continue
        default = parameter.default
        assert default is inspect.Parameter.empty or default is None or type(default) is float, (
            f"{factory.__name__}: {name}={default!r} is not declared static"
        )
