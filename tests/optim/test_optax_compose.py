"""The README's claim that a rudax optimizer "composes with every optax transform", tested.

Each optax wrapper a user reaches for (chain, multi_transform/partition, MultiSteps,
apply_if_finite, lookahead, reduce_on_plateau, flax's nnx.Optimizer) and a plain orbax
checkpoint of the state, around rudax optimizers, against what the wrapper promises: the same
parameters as the unwrapped optimizer where the wrapper is the identity, the wrapper's own
rule where it is not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import rudax.optim as ro

OPTIMIZERS = {
    "adamw": lambda: ro.adamw(0.05, weight_decay=0.1),
    "sgd": lambda: ro.sgd(0.05, momentum=0.9, weight_decay=0.01),
    "adan": lambda: ro.adan(0.05, weight_decay=0.01),
    "muon": lambda: ro.muon(0.05, adamw_learning_rate=0.01),
    "fused_adamw": lambda: ro.fused_adamw(0.05, max_grad_norm=1.0),
}

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones((4,))}


def _grads(params, t):
    return jax.tree.map(lambda p: jnp.cos(p * (t + 1)) * 0.5, params)


def _run(tx, params=PARAMS, steps=4, grads=_grads, **extra):
    state = tx.init(params)
    update = jax.jit(lambda g, s, p: tx.update(g, s, p, **extra))
    for t in range(steps):
        updates, state = update(grads(params, t), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _assert_same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def _assert_close(a, b):
    # Two different jitted programs (the wrapper's and the plain one) may fuse multiply-adds
    # differently on CPU: equal to float32 rounding, not always bitwise.
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_chain_with_optax_clipping(name):
    """optax's own clip in front: the rudax optimizer sees the clipped gradients."""
    clip = 0.1
    clipped = lambda p, t: optax.clip_by_global_norm(clip).update(_grads(p, t), None)[0]
    _assert_close(
        _run(optax.chain(optax.clip_by_global_norm(clip), OPTIMIZERS[name]()))[0],
        _run(OPTIMIZERS[name](), grads=clipped)[0],
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_partition_routes_each_leaf(name):
    """optax.partition: the rudax optimizer on "w", a frozen "b" (set_to_zero)."""
    labels = {"w": "train", "b": "frozen"}
    tx = optax.partition({"train": OPTIMIZERS[name](), "frozen": optax.set_to_zero()}, labels)
    params, _ = _run(tx)
    np.testing.assert_array_equal(params["b"], PARAMS["b"])
    expected, _ = _run(OPTIMIZERS[name](), params={"w": PARAMS["w"]})
    _assert_close(params["w"], expected["w"])


@pytest.mark.standard_promotion  # optax's MultiSteps mixes its int32 counter with floats
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_multisteps_averages_k_microbatches(name):
    """MultiSteps(k=2) on gradients g, g' equals one update on their mean."""
    k = 2
    tx = optax.MultiSteps(OPTIMIZERS[name](), every_k_schedule=k)
    state = tx.init(PARAMS)
    params = PARAMS
    for t in range(k):
        updates, state = jax.jit(tx.update)(_grads(PARAMS, t), state, params)
        params = optax.apply_updates(params, updates)
    mean = jax.tree.map(lambda *g: sum(g) / k, *[_grads(PARAMS, t) for t in range(k)])
    expected, _ = _run(OPTIMIZERS[name](), steps=1, grads=lambda p, t: mean)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), params, expected)


@pytest.mark.standard_promotion  # optax's apply_if_finite counts in int32 with float updates
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_apply_if_finite_skips_a_nan_step(name):
    tx = optax.apply_if_finite(OPTIMIZERS[name](), max_consecutive_errors=3)
    nan_at_2 = lambda p, t: jax.tree.map(lambda g: g * jnp.nan if t == 2 else g, _grads(p, t))
    params, state = _run(tx, steps=3, grads=nan_at_2)
    expected, _ = _run(OPTIMIZERS[name](), steps=2)
    _assert_close(params, expected)
    assert int(state.total_notfinite) == 1


@pytest.mark.standard_promotion  # optax's lookahead interpolates with a Python float
def test_lookahead_over_a_rudax_fast_optimizer():
    """Lookahead(sync_period=2, alpha=0.5): after 2 fast steps the slow weights move halfway."""
    tx = optax.lookahead(ro.adamw(0.05), sync_period=2, slow_step_size=0.5)
    params = optax.LookaheadParams.init_synced(PARAMS)
    state = tx.init(params)
    for t in range(2):
        updates, state = jax.jit(tx.update)(_grads(params.fast, t), state, params)
        params = optax.apply_updates(params, updates)
    fast, _ = _run(ro.adamw(0.05), steps=2)
    slow = jax.tree.map(lambda p, f: p + 0.5 * (f - p), PARAMS, fast)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), params.slow, slow)


@pytest.mark.standard_promotion  # optax's reduce_on_plateau compares float scales
def test_reduce_on_plateau_scales_the_rudax_step():
    """A loss that never improves halves the step after each patience window, exactly as it
    scales optax's own sgd (the same rule as rudax's without momentum)."""

    def steps(tx):
        state = tx.init(PARAMS)
        grads = jax.tree.map(jnp.ones_like, PARAMS)
        out = []
        for _ in range(5):
            updates, state = tx.update(grads, state, PARAMS, value=jnp.asarray(1.0))
            out.append(float(updates["b"][0]))
        return out

    plateau = lambda: optax.contrib.reduce_on_plateau(factor=0.5, patience=1)
    ours = steps(optax.chain(ro.sgd(0.1), plateau()))
    assert ours == steps(optax.chain(optax.sgd(0.1), plateau()))
    assert ours[0] == pytest.approx(-0.1) and abs(ours[-1]) < abs(ours[0]) / 4  # it reduced


@pytest.mark.parametrize("name", ["adamw", "muon", "fused_adamw"])
def test_nnx_optimizer_equals_the_functional_step(name):
    """flax's nnx.Optimizer(model, rudax_tx, wrt=nnx.Param) updates as tx.update does."""
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    # A copy: nnx.state's variables are the model's, which nnx.Optimizer updates in place.
    params = jax.tree.map(jnp.array, nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, OPTIMIZERS[name](), wrt=nnx.Param)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    loss = lambda m: jnp.sum(m(x) ** 2)
    for _ in range(3):
        optimizer.update(model, nnx.grad(loss)(model))
    tx = OPTIMIZERS[name]()
    state = tx.init(params)
    graphdef = nnx.graphdef(model)
    for _ in range(3):
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p)))(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    _assert_close(nnx.state(model, nnx.Param), params)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_plain_orbax_round_trip_resumes_bit_for_bit(name, tmp_path):
    """An optimizer state saved with orbax's StandardCheckpointer (no rudax.checkpoint)
    restores bitwise and continues as if never interrupted."""
    params, state = _run(OPTIMIZERS[name](), steps=2)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", {"params": params, "opt": state})
        ckpt.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": state})
        restored = ckpt.restore(tmp_path / "state", abstract)
    _assert_same(restored, {"params": params, "opt": state})
    tx = OPTIMIZERS[name]()
    resumed = restored["params"], restored["opt"]
    p, s = resumed
    for t in range(2, 4):
        updates, s = jax.jit(tx.update)(_grads(p, t), s, p)
        p = optax.apply_updates(p, updates)
    _assert_same(p, _run(OPTIMIZERS[name](), steps=4)[0])
