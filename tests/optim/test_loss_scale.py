"""Tests of rudax.optim.dynamic_loss_scale, loss_scale and skip_nonfinite."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import rudax.optim as ro
from tests.optim._bad_input import rejects
from tests.optim._harness import assert_matches_reference

RUNS = [
    pytest.param(True, "dict", id="jit-dict"),
    pytest.param(False, "dict", id="eager-dict"),
    pytest.param(True, "nnx_state", id="jit-nnx"),
    pytest.param(False, "nnx_state", id="eager-nnx"),
]


def tree_bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def halving_schedule(count):
    """1, 1/2, 1/4, ...: jnp only, so optax.scale_by_schedule runs under strict promotion."""
    return 0.5 ** count.astype(jnp.float32)


# --- against numpy references ---------------------------------------------------------------


@pytest.mark.parametrize("jit, tree_kind", RUNS)
def test_dynamic_loss_scale_matches_numpy_reference(jit, tree_kind):
    # The scale grows every 2 finite updates: 4, 4, 8, 8, 16, 16 divide the 6 gradients.
    tx = ro.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0, growth_interval=2)

    def reference(p, grads):
        out = []
        for i, g in enumerate(grads):
            scale = np.float32(4.0 * 2 ** (i // 2))
            p = p + np.float32(-0.1) * (g / scale)
            out.append(p.copy())
        return out

    assert_matches_reference(tx, reference, jit=jit, tree_kind=tree_kind)


@pytest.mark.parametrize("jit, tree_kind", RUNS)
def test_skip_nonfinite_matches_numpy_reference(jit, tree_kind):
    def reference(p, grads):
        buf, out = np.zeros_like(p), []
        for g in grads:
            buf = g + np.float32(0.9) * buf
            p = p + np.float32(-0.1) * buf
            out.append(p.copy())
        return out

    tx = ro.skip_nonfinite(optax.sgd(0.1, momentum=0.9))
    assert_matches_reference(tx, reference, jit=jit, tree_kind=tree_kind)


# --- the loss-scale state machine -----------------------------------------------------------


def scale_machine_reference(pattern, init_scale, growth_interval, growth_factor, backoff, floor):
    """torch.amp.GradScaler's update rule plus a floor, in plain Python: (scale, good_steps)."""
    scale, good, out = np.float32(init_scale), 0, []
    for finite in pattern:
        if finite:
            good += 1
            if good == growth_interval:
                with np.errstate(over="ignore"):
                    grown = scale * np.float32(growth_factor)
                scale = grown if np.isfinite(grown) else scale
                good = 0
        else:
            scale = max(scale * np.float32(backoff), np.float32(floor))
            good = 0
        out.append((float(scale), good))
    return out


@pytest.mark.parametrize(
    "pattern, growth_interval",
    [
        ("FFFFFFF", 3),  # grows after exactly 3 good steps, twice
        ("FFNFFFF", 3),  # a non-finite step resets the count
        ("NNNNNF", 3),  # backs off down to the floor, never below
        ("FNFFNNFFFFF", 2),
        ("FFFF", 1),  # grows on every finite step
    ],
)
def test_loss_scale_state_machine(pattern, growth_interval):
    params = {"w": jnp.ones((3,), jnp.float32), "b": jnp.ones((), jnp.float32)}
    config = dict(init_scale=8.0, growth_interval=growth_interval, growth_factor=2.0)
    config.update(backoff_factor=0.5, min_scale=2.0)
    tx = ro.dynamic_loss_scale(optax.sgd(0.1), **config)
    state = tx.init(params)
    update = jax.jit(tx.update)
    want = scale_machine_reference([c == "F" for c in pattern], 8.0, growth_interval, 2.0, 0.5, 2.0)
    bad_values = iter([jnp.nan, jnp.inf, -jnp.inf] * len(pattern))
    for i, c in enumerate(pattern):
        grads = {"w": jnp.ones((3,)), "b": jnp.ones(())}
        if c == "N":
            grads["w"] = grads["w"].at[i % 3].set(next(bad_values))
        updates, state = update(grads, state, params)
        assert (float(state.scale), int(state.good_steps)) == want[i], f"after step {i + 1}"
        assert state.scale.dtype == jnp.float32 and state.good_steps.dtype == jnp.int32
        if c == "N":
            assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
        else:
            assert all(np.all(np.asarray(u) != 0) for u in jax.tree.leaves(updates))
    assert update._cache_size() == 1


def test_gradients_are_checked_after_unscaling():
    # With a scale below 1, a finite scaled gradient can overflow float32 once unscaled.
    params = {"w": jnp.ones((2,))}
    tx = ro.dynamic_loss_scale(optax.sgd(0.1), init_scale=0.5, min_scale=0.25)
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.array([3e38, 1.0])}, state, params)
    assert updates["w"].tolist() == [0.0, 0.0]
    assert float(state.scale) == 0.25


@pytest.mark.parametrize("init_scale, growth_factor", [(2.0**127, 2.0), (3e38, 1.5)])
def test_loss_scale_never_grows_past_float32(init_scale, growth_factor):
    params = {"w": jnp.ones((2,))}
    tx = ro.dynamic_loss_scale(
        optax.sgd(0.1), init_scale=init_scale, growth_interval=1, growth_factor=growth_factor
    )
    state = tx.init(params)
    for _ in range(2):
        _, state = tx.update({"w": jnp.ones((2,))}, state, params)
        assert float(state.scale) == float(np.float32(init_scale))
        assert int(state.good_steps) == 0


def test_fp16_overflow_backs_off_until_the_gradients_fit():
    """A real fp16 step: the scaled gradient 10 * scale overflows until scale <= 4096."""
    x = jnp.full((4,), 10.0, jnp.float16)
    params = {"w": jnp.ones((4,), jnp.float16)}
    tx = ro.dynamic_loss_scale(ro.fp32_master(optax.sgd(0.01)), init_scale=2.0**15)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        def scaled_loss(params):
            loss = jnp.sum(params["w"] * x)
            return loss.astype(jnp.float32) * ro.loss_scale(state)

        grads = jax.grad(scaled_loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    scales = []
    for _ in range(4):
        params, state = step(params, state)
        scales.append(float(ro.loss_scale(state)))
    assert scales == [2.0**14, 2.0**13, 2.0**12, 2.0**12]
    # Only the fourth step applied: w = 1 - 0.01 * 10, the gradient exactly unscaled.
    want = np.float16(np.float32(1.0) + np.float32(-0.01) * np.float32(10.0))
    np.testing.assert_array_equal(np.asarray(params["w"]), np.full(4, want))


# --- skipped steps leave the inner state alone ----------------------------------------------


WRAPPERS = {
    "dynamic_loss_scale": lambda inner: ro.dynamic_loss_scale(inner, init_scale=4.0),
    "skip_nonfinite": ro.skip_nonfinite,
}


@pytest.mark.parametrize("wrapper", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_skipped_step_leaves_inner_state_bitwise_unchanged(wrapper):
    inner = optax.chain(optax.sgd(0.1, momentum=0.9), optax.scale_by_schedule(halving_schedule))
    tx = wrapper(inner)
    params = {"w": jnp.array([1.0, -0.0, 2.0]), "b": jnp.zeros((2, 2))}
    state = tx.init(params)
    update = jax.jit(tx.update)
    finite = {"w": jnp.array([0.5, 1.0, -1.0]), "b": jnp.ones((2, 2))}
    nonfinite = {"w": jnp.array([0.5, jnp.nan, -1.0]), "b": jnp.ones((2, 2))}
    _, state = update(finite, state, params)
    for bad in ({"w": nonfinite["w"], "b": finite["b"]}, {"w": finite["w"], "b": -finite["b"] / 0}):
        before = state.inner_state
        updates, state = update(bad, state, params)
        assert tree_bits(state.inner_state) == tree_bits(before)
        # -0.0 updates: apply_updates leaves every parameter's bits alone, -0.0 included.
        assert tree_bits(optax.apply_updates(params, updates)) == tree_bits(params)
    _, state = update(finite, state, params)
    schedule_state = state.inner_state[1]
    assert int(schedule_state.count) == 2  # two applied updates; the schedule skipped the rest


def test_skip_nonfinite_counts_skips():
    params = {"w": jnp.ones((2,))}
    tx = ro.skip_nonfinite(optax.sgd(0.1))
    state = tx.init(params)
    update = jax.jit(tx.update)
    seen = []
    for g in ([1.0, 1.0], [jnp.inf, 1.0], [1.0, jnp.nan], [1.0, 2.0]):
        _, state = update({"w": jnp.array(g)}, state, params)
        seen.append((bool(state.last_skipped), int(state.num_skipped)))
    assert seen == [(False, 0), (True, 1), (True, 2), (False, 2)]


@pytest.mark.standard_promotion  # optax.adamw's bias correction needs standard promotion
def test_canonical_composition_with_fp32_master():
    """dynamic_loss_scale(fp32_master(adamw)): skipped steps change nothing, masters included."""
    tx = ro.dynamic_loss_scale(
        ro.fp32_master(optax.adamw(1e-2, weight_decay=0.1)), init_scale=2.0**10
    )
    reference = ro.fp32_master(optax.adamw(1e-2, weight_decay=0.1))
    params = {
        "w": jnp.array([[0.5, -0.0], [1.5, -2.0]], jnp.bfloat16),
        "b": jnp.array([0.25, -0.125, 0.0], jnp.float16),
    }
    state, ref_state = tx.init(params), reference.init(params)
    step, ref_step = jax.jit(tx.update), jax.jit(reference.update)
    rng = np.random.default_rng(0)
    for i in range(6):
        scale = ro.loss_scale(state)
        grads = jax.tree.map(
            lambda p, scale=scale: (
                jnp.asarray(rng.normal(size=p.shape), jnp.float32) * scale
            ).astype(p.dtype),
            params,
        )
        if i in (2, 3):
            grads["b"] = grads["b"].at[1].set(jnp.inf if i == 2 else jnp.nan)
        before = state
        updates, state = step(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        if i in (2, 3):
            assert tree_bits(state.inner_state) == tree_bits(before.inner_state)
            assert tree_bits(new_params) == tree_bits(params)
            assert float(state.scale) == float(before.scale) / 2
        else:
            unscaled = jax.tree.map(lambda g, s=scale: g.astype(jnp.float32) / s, grads)
            ref_updates, ref_state = ref_step(unscaled, ref_state, params)
            assert tree_bits(updates) == tree_bits(ref_updates)
            assert tree_bits(state.inner_state) == tree_bits(ref_state)
        for p, m in zip(
            jax.tree.leaves(new_params), jax.tree.leaves(state.inner_state.master), strict=True
        ):
            assert np.asarray(p).tobytes() == np.asarray(m.astype(p.dtype)).tobytes()
        params = new_params
    assert int(state.inner_state.inner_state[0].count) == 4  # adam's count: 4 applied updates


# --- hypothesis: the skip path on random trees with random non-finite entries --------------

STRUCTURES = [
    {"a": (3,), "b": (2, 2)},
    {"layer": {"kernel": (2, 3), "bias": (3,)}, "gain": ()},
]
TINY_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # the promotion-mode fixture
)


@st.composite
def poisoned_grads(draw):
    """A structure, fp32 gradients in it, and NaN/inf/huge values at random positions."""
    structure = draw(st.sampled_from(STRUCTURES))
    leaves, treedef = jax.tree.flatten(structure, is_leaf=lambda x: isinstance(x, tuple))
    finite = st.floats(-1e3, 1e3, width=32)
    arrays = [draw(hnp.arrays(np.float32, shape, elements=finite)) for shape in leaves]
    poison = st.sampled_from([np.nan, np.inf, -np.inf, 3e38])  # 3e38 overflows once unscaled
    for _ in range(draw(st.integers(0, 3))):
        leaf = draw(st.integers(0, len(arrays) - 1))
        if arrays[leaf].size:
            flat = arrays[leaf].reshape(-1)
            flat[draw(st.integers(0, flat.size - 1))] = draw(poison)
    return jax.tree.unflatten(treedef, arrays)


def params_like(grads):
    return jax.tree.map(lambda g: jnp.linspace(-1.0, 1.0, g.size).reshape(g.shape), grads)


INNER = optax.sgd(0.1, momentum=0.9)
_JITTED = {}


def jitted(key, fn):
    """One compilation per (function, structure) across all hypothesis examples."""
    return _JITTED.setdefault(key, jax.jit(fn))


@given(grads=poisoned_grads(), scale=st.sampled_from([0.5, 1.0, 2.0**10]))
@TINY_SETTINGS
def test_dynamic_loss_scale_skips_exactly_when_unscaled_grads_are_not_finite(grads, scale):
    params = params_like(grads)
    tx = ro.dynamic_loss_scale(INNER, init_scale=scale, growth_interval=100, min_scale=0.5)
    structure = jax.tree.structure(grads)
    update = jitted(("dls", scale, structure), tx.update)
    inner_update = jitted(("inner", structure), INNER.update)
    warm = jax.tree.map(jnp.ones_like, params)
    _, state = update(warm, tx.init(params), params)  # momentum buffers are non-zero now

    updates, new_state = update(jax.tree.map(jnp.asarray, grads), state, params)
    with np.errstate(over="ignore", invalid="ignore"):
        unscaled = jax.tree.map(lambda g: g / np.float32(scale), grads)
    skip = not all(np.all(np.isfinite(g)) for g in jax.tree.leaves(unscaled))
    if skip:
        for u in jax.tree.leaves(updates):
            assert np.all(np.asarray(u) == 0) and np.all(np.signbit(np.asarray(u)))
        assert tree_bits(new_state.inner_state) == tree_bits(state.inner_state)
        assert float(new_state.scale) == max(scale * 0.5, 0.5)
        assert int(new_state.good_steps) == 0
    else:
        want, want_state = inner_update(unscaled, state.inner_state, params)
        for u, w in zip(jax.tree.leaves(updates), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(u), np.asarray(w), rtol=1e-6, atol=0)
        for s, w in zip(
            jax.tree.leaves(new_state.inner_state), jax.tree.leaves(want_state), strict=True
        ):
            np.testing.assert_allclose(np.asarray(s), np.asarray(w), rtol=1e-6, atol=0)
        assert float(new_state.scale) == scale and int(new_state.good_steps) == 2


@given(grads=poisoned_grads())
@TINY_SETTINGS
def test_skip_nonfinite_skips_exactly_when_grads_are_not_finite(grads):
    params = params_like(grads)
    tx = ro.skip_nonfinite(INNER)
    structure = jax.tree.structure(grads)
    update = jitted(("skip", structure), tx.update)
    inner_update = jitted(("inner", structure), INNER.update)
    _, state = update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)

    updates, new_state = update(jax.tree.map(jnp.asarray, grads), state, params)
    skip = not all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert bool(new_state.last_skipped) == skip
    assert int(new_state.num_skipped) == int(skip)
    if skip:
        assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
        assert tree_bits(new_state.inner_state) == tree_bits(state.inner_state)
    else:
        want, want_state = inner_update(grads, state.inner_state, params)
        assert tree_bits(updates) == tree_bits(want)
        assert tree_bits(new_state.inner_state) == tree_bits(want_state)


# --- loss_scale finds the state anywhere ----------------------------------------------------


def test_loss_scale_finds_the_state_in_nested_states():
    params = {"w": jnp.zeros((2,), jnp.bfloat16)}
    chained = optax.chain(optax.clip(1.0), ro.dynamic_loss_scale(optax.sgd(0.1), 64.0))
    nested = ro.fp32_master(ro.dynamic_loss_scale(optax.sgd(0.1), 128.0))
    assert float(ro.loss_scale(chained.init(params))) == 64.0
    state = nested.init(params)
    assert float(ro.loss_scale(state)) == 128.0
    assert float(jax.jit(ro.loss_scale)(state)) == 128.0
    assert ro.loss_scale(state).dtype == jnp.float32


def test_loss_scale_without_or_with_several_states():
    params = {"w": jnp.zeros((2,))}
    with pytest.raises(ValueError, match="no DynamicLossScaleState"):
        ro.loss_scale(optax.adam(1e-3).init(params))
    two = optax.chain(ro.dynamic_loss_scale(optax.sgd(0.1)), ro.dynamic_loss_scale(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"several.*\[0\].*\[1\]"):
        ro.loss_scale(two.init(params))
    nested = ro.dynamic_loss_scale(ro.dynamic_loss_scale(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"several.*inner_state"):
        ro.loss_scale(nested.init(params))


def test_extra_args_reach_the_inner_transformation():
    def update(updates, state, params=None, *, shift):
        return jax.tree.map(lambda g: g + shift, updates), state

    inner = optax.GradientTransformationExtraArgs(optax.init_empty_state, update)
    params, grads = {"w": jnp.zeros((2,))}, {"w": jnp.full((2,), 2.0)}
    for tx, want in (
        (ro.dynamic_loss_scale(inner, init_scale=2.0), 2.0),
        (ro.skip_nonfinite(inner), 3.0),
    ):
        updates, _ = tx.update(grads, tx.init(params), params, shift=1.0)
        assert updates["w"].tolist() == [want, want]


# --- bad input ------------------------------------------------------------------------------


test_dynamic_loss_scale_bad_input = rejects(
    ro.dynamic_loss_scale,
    [
        (dict(init_scale=0.0), ValueError, "init_scale"),
        (dict(init_scale=-1.0), ValueError, "init_scale"),
        (dict(init_scale=math.nan), ValueError, "init_scale"),
        (dict(init_scale=math.inf), ValueError, "init_scale"),
        (dict(init_scale="big"), TypeError, "init_scale"),
        (dict(growth_interval=0), ValueError, "growth_interval"),
        (dict(growth_interval=-5), ValueError, "growth_interval"),
        (dict(growth_interval=2.5), TypeError, "growth_interval"),
        (dict(growth_interval=True), TypeError, "growth_interval"),
        (dict(growth_factor=1.0), ValueError, "growth_factor"),
        (dict(growth_factor=0.5), ValueError, "growth_factor"),
        (dict(growth_factor=math.inf), ValueError, "growth_factor"),
        (dict(backoff_factor=0.0), ValueError, "backoff_factor"),
        (dict(backoff_factor=1.0), ValueError, "backoff_factor"),
        (dict(backoff_factor=1.5), ValueError, "backoff_factor"),
        (dict(min_scale=0.0), ValueError, "min_scale"),
        (dict(min_scale=-2.0), ValueError, "min_scale"),
        (dict(min_scale=math.nan), ValueError, "min_scale"),
        (dict(init_scale=4.0, min_scale=8.0), ValueError, "min_scale"),
    ],
    inner=optax.sgd(0.1),
)

test_inner_must_be_a_transformation = rejects(
    [ro.dynamic_loss_scale, ro.skip_nonfinite], [(dict(inner=optax.sgd), TypeError, "inner")]
)
