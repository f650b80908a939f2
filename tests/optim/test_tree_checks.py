"""Every transform checks, at trace time, that gradients, parameters and state are alike.

A (1, 3) gradient for a (4, 3) parameter would otherwise broadcast its one row over all four
(or a (1, 3) moment over the gradient), and a transposed one fail with jax's bare broadcasting
message. One helper (``rudax/optim/_validation.py``) raises a ValueError naming "gradients" or
"state", the pytree path and both shapes. The second half checks that the checks leave optax's
composition alone: chain, MultiSteps, masked (MaskedNode leaves), inject_hyperparams, None
leaves, flax.nnx.Optimizer.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import rudax.optim as ro
import rudax.optim._validation

PARAMS = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}

# name -> (factory, whether its state holds trees shaped like the parameters)
TRANSFORMS = {
    "adamw": (lambda: ro.adamw(0.1), True),
    "adam": (lambda: ro.adam(0.1, weight_decay=0.1, amsgrad=True), True),
    "sgd": (lambda: ro.sgd(0.1, momentum=0.9), True),
    "sgd-plain": (lambda: ro.sgd(0.1, weight_decay=0.1), False),
    "muon": (lambda: ro.muon(0.1, ns_dtype=jnp.float32), True),
    "adan": (lambda: ro.adan(0.1, weight_decay=0.1), True),
    "rmsprop": (lambda: ro.rmsprop(0.1, momentum=0.9, centered=True), True),
    "adagrad": (lambda: ro.adagrad(0.1), True),
    "lbfgs": (lambda: ro.lbfgs(line_search=None), True),
    "fp32_master": (lambda: ro.fp32_master(ro.sgd(0.1)), True),
    "fused_adamw-xla": (lambda: ro.fused_adamw(0.1, impl="xla"), True),
    "fused_adamw-pallas": (lambda: ro.fused_adamw(0.1, impl="pallas", interpret=True), True),
    "clip_by_global_norm": (lambda: ro.clip_by_global_norm(1.0), False),
    "clip_per_parameter": (lambda: ro.clip_per_parameter(1.0), False),
    "skip_nonfinite": (lambda: ro.skip_nonfinite(ro.sgd(0.1)), False),
    "dynamic_loss_scale": (lambda: ro.dynamic_loss_scale(ro.sgd(0.1)), False),
}
WITH_STATE = [name for name, (_, has_state) in TRANSFORMS.items() if has_state]

# What the gradients get wrong, and what the error must say.
MISTAKES = {
    "broadcastable": (
        {"w": jnp.ones((1, 3)), "b": jnp.ones((3,))},
        r"gradients\['w'\] has shape \(1, 3\), params\['w'\] has shape \(4, 3\)",
    ),
    "transposed": (
        {"w": jnp.ones((3, 4)), "b": jnp.ones((3,))},
        r"gradients\['w'\] has shape \(3, 4\), params\['w'\] has shape \(4, 3\)",
    ),
    "missing-leaf": ({"w": jnp.ones((4, 3))}, r"gradients.*missing leaves .*\['b'\]"),
    "extra-leaf": (
        {**PARAMS, "c": jnp.ones((2,))},
        r"gradients.*unexpected leaves .*\['c'\]",
    ),
    "scalar-for-vector": (
        {"w": jnp.ones((4, 3)), "b": jnp.ones(())},
        r"gradients\['b'\] has shape \(\), params\['b'\] has shape \(3,\)",
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES)
@pytest.mark.parametrize("name", TRANSFORMS)
def test_gradients_unlike_params_raise_naming_path_and_shapes(name, mistake):
    tx = TRANSFORMS[name][0]()
    grads, match = MISTAKES[mistake]
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=match):
        tx.update(grads, state, PARAMS)
    with pytest.raises(ValueError, match=match):  # the same at trace time under jit
        jax.jit(tx.update)(grads, state, PARAMS)


@pytest.mark.parametrize("name", WITH_STATE)
def test_state_unlike_params_raises_naming_state(name):
    # A state built on other parameters (a stale checkpoint, a wrong init) broadcasts too.
    tx = TRANSFORMS[name][0]()
    state = tx.init({"w": jnp.ones((1, 3)), "b": jnp.ones((3,))})
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    with pytest.raises(ValueError, match=r"state.*\['w'\] has shape \(1, 3\).*\(4, 3\)"):
        tx.update(grads, state, PARAMS)


@pytest.mark.parametrize(
    "tx",
    [
        ro.scale_by_muon(ns_dtype=jnp.float32),
        ro.scale_by_adan(),
        optax.chain(ro.clip_by_global_norm(1.0), ro.scale_by_adan()),
    ],
    ids=["scale_by_muon", "scale_by_adan", "chain"],
)
def test_gradients_only_transforms_check_state_against_gradients(tx):
    state = tx.init({"w": jnp.ones((1, 3))})
    with pytest.raises(ValueError, match=r"state.*\['w'\] has shape \(1, 3\), gradients"):
        tx.update({"w": jnp.ones((4, 3))}, state)


@pytest.mark.parametrize("name", ["adamw", "muon", "fp32_master", "fused_adamw-xla"])
def test_checks_cost_nothing_in_the_compiled_step(name, monkeypatch):
    # Shapes are static: a checked update lowers to the same program as one whose checks
    # are switched off.
    tx = TRANSFORMS[name][0]()
    state = tx.init(PARAMS)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    checked = jax.jit(tx.update).lower(grads, state, PARAMS).as_text()
    monkeypatch.setattr(rudax.optim._validation, "tree_mismatch", lambda *a, **k: None)
    bad = {"w": jnp.ones((1, 3)), "b": jnp.ones((3,))}
    rudax.optim._validation.check_tree_like("x", "gradients", bad, "params", PARAMS)  # off
    unchecked = jax.jit(tx.update).lower(grads, state, PARAMS).as_text()
    assert checked == unchecked


# --- composition: the checks must not get in optax's way ------------------------------------


def _run(tx, params, grads, *, num_steps=3):
    state = tx.init(params)
    step = jax.jit(tx.update)
    for _ in range(num_steps):
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


COMPOSABLE = {
    name: factory
    for name, (factory, _) in TRANSFORMS.items()
    if name not in ("lbfgs",)  # lbfgs's memory is of full parameter steps; tested on its own
}


@pytest.mark.standard_promotion  # optax.MultiSteps and optax.masked run optax's own arithmetic
@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda tx: optax.chain(optax.identity(), tx), id="chain"),
        pytest.param(lambda tx: optax.MultiSteps(tx, every_k_schedule=2), id="MultiSteps"),
        pytest.param(lambda tx: optax.masked(tx, {"w": True, "b": False}), id="masked-MaskedNode"),
    ],
)
@pytest.mark.parametrize("name", COMPOSABLE)
def test_composes_with_optax(name, wrap):
    tx = wrap(COMPOSABLE[name]())
    out = _run(tx, PARAMS, jax.tree.map(lambda p: jnp.full_like(p, 0.5), PARAMS))
    assert jax.tree.map(jnp.shape, out) == jax.tree.map(jnp.shape, PARAMS)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))


@pytest.mark.parametrize("name", COMPOSABLE)
def test_none_leaves_in_params(name):
    params = {**PARAMS, "frozen": None}
    grads = {**jax.tree.map(lambda p: jnp.full_like(p, 0.5), PARAMS), "frozen": None}
    out = _run(COMPOSABLE[name](), params, grads)
    assert out["frozen"] is None and out["w"].shape == (4, 3)


def test_inject_hyperparams():
    tx = optax.inject_hyperparams(ro.adamw)(learning_rate=0.1, weight_decay=0.5)
    out = _run(tx, PARAMS, jax.tree.map(jnp.ones_like, PARAMS))
    assert out["w"].shape == (4, 3)
    bad = {"w": jnp.ones((1, 3)), "b": jnp.ones((3,))}
    with pytest.raises(ValueError, match=r"gradients\['w'\] has shape \(1, 3\)"):
        tx.update(bad, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("name", ["adamw", "muon", "fp32_master", "fused_adamw-xla"])
def test_flax_nnx_optimizer(name):
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TRANSFORMS[name][0](), wrt=nnx.Param)
    x = jnp.ones((2, 3))

    @nnx.jit
    def step(model, optimizer):
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        optimizer.update(model, grads)

    before = model.kernel[...]
    for _ in range(2):
        step(model, optimizer)
    assert model.kernel[...].shape == (3, 4)
    assert not bool(jnp.all(model.kernel[...] == before))
