"""Tests of rudax.optim.fp32_master: numpy references, bitwise storage exactness, bad input."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import rudax.optim as ro
from tests.optim._bad_input import rejects
from tests.optim._harness import (
    as_tree_kind,
    assert_follows_replaced_params,
    assert_matches_reference,
)

RUNS = [
    pytest.param(True, "dict", id="jit-dict"),
    pytest.param(False, "dict", id="eager-dict"),
    pytest.param(True, "nnx_state", id="jit-nnx"),
    pytest.param(False, "nnx_state", id="eager-nnx"),
]

# numpy's view of each storage dtype, and the unsigned type of the same width for bit checks.
NP_DTYPES = {
    jnp.dtype(jnp.bfloat16): (ml_dtypes.bfloat16, np.uint16),
    jnp.dtype(jnp.float16): (np.float16, np.uint16),
    jnp.dtype(jnp.float32): (np.float32, np.uint32),
}


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(NP_DTYPES[jnp.dtype(x.dtype)][1])


def sgd_momentum_reference(lr, momentum, gradient_scale=None, clip=None):
    """optax.sgd's momentum rule (buf = g + momentum * buf) on preprocessed fp32 gradients."""

    def reference(p, grads):
        buf = np.zeros_like(p)
        out = []
        for g in grads:
            if gradient_scale is not None:
                g = g / np.float32(gradient_scale)
            if clip is not None:
                norm = np.sqrt(np.sum(g * g, dtype=np.float32))
                g = g * min(np.float32(clip) / (norm + np.float32(1e-6)), np.float32(1.0))
            buf = g + np.float32(momentum) * buf
            p = p - np.float32(lr) * buf
            out.append(p.copy())
        return out

    return reference


@pytest.mark.parametrize(
    "gradient_scale, clip",
    [(None, None), (8.0, None), (None, 0.5), (4.0, 1.0)],
    ids=["plain", "scaled", "clipped", "scaled-clipped"],
)
@pytest.mark.parametrize("jit, tree_kind", RUNS)
def test_fp32_params_match_numpy_reference(gradient_scale, clip, jit, tree_kind):
    tx = ro.fp32_master(
        optax.sgd(0.1, momentum=0.9), gradient_scale=gradient_scale, clip_per_parameter=clip
    )
    reference = sgd_momentum_reference(0.1, 0.9, gradient_scale, clip)
    assert_matches_reference(tx, reference, jit=jit, tree_kind=tree_kind)


def mixed_problem(seed: int):
    """Parameters of every storage dtype in one tree, many near zero so that signs flip."""
    rng = np.random.default_rng(seed)

    def values(shape, dtype):
        magnitude = 10.0 ** rng.uniform(-4, 1, size=shape)
        return jnp.asarray((rng.normal(size=shape) * magnitude).astype(np.float32)).astype(dtype)

    return {
        "bf16": {"kernel": values((24, 16), jnp.bfloat16), "bias": values((16,), jnp.bfloat16)},
        "fp16": values((20, 8), jnp.float16),
        "fp32": values((12,), jnp.float32),
        "scale": values((), jnp.bfloat16),
    }


def random_grads(rng, params):
    # Gradients span five decades, like a real run's, and come in each parameter's dtype.
    return jax.tree.map(
        lambda p: jnp.asarray(
            (rng.normal(size=p.shape) * 10.0 ** rng.uniform(-3, 1, size=p.shape)).astype(np.float32)
        ).astype(p.dtype),
        params,
    )


@pytest.mark.parametrize(
    "jit, tree_kind, num_steps",
    [(True, "dict", 200), (True, "nnx_state", 40), (False, "dict", 10)],
    ids=["jit-dict", "jit-nnx", "eager-dict"],
)
def test_stored_params_equal_rounded_master_bitwise(jit, tree_kind, num_steps):
    params = as_tree_kind(mixed_problem(seed=1), tree_kind)
    dtypes = jax.tree.map(lambda p: p.dtype, params)
    tx = ro.fp32_master(optax.sgd(0.05, momentum=0.9))
    state = tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step_fn = jax.jit(step) if jit else step
    rng = np.random.default_rng(2)
    sign_flips = 0
    for i in range(num_steps):
        grads = as_tree_kind(random_grads(rng, mixed_problem(seed=1)), tree_kind)
        new_params, state = step_fn(params, state, grads)
        assert jax.tree.map(lambda p: p.dtype, new_params) == dtypes
        for (path, p), m in zip(
            jax.tree_util.tree_flatten_with_path(new_params)[0],
            jax.tree.leaves(state.master),
            strict=True,
        ):
            assert m.dtype == jnp.float32
            np.testing.assert_array_equal(
                bits(p),
                bits(m.astype(p.dtype)),
                err_msg=f"{jax.tree_util.keystr(path)} after update {i + 1}",
            )
        sign_flips += sum(
            int(np.sum(np.signbit(np.asarray(a, np.float32)) != np.signbit(np.asarray(b))))
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new_params), strict=True)
        )
        params = new_params
        if jit and i >= 1:
            assert step_fn._cache_size() == 1
    # The hard case for exactness (a difference wider than the storage dtype) needs sign flips.
    assert sign_flips > 0


@pytest.mark.parametrize(
    "dtype, log10_range",
    [
        (jnp.bfloat16, (-30, 30)),
        (jnp.float16, (-7.5, 4.5)),  # fp16 subnormals up to overflow to inf
    ],
    ids=["bf16", "fp16"],
)
def test_one_step_matches_numpy_rounding(dtype, log10_range):
    """Every kind of step (tiny, sign flips, large shrinks and growths) against numpy."""
    np_dtype, uint = NP_DTYPES[jnp.dtype(dtype)]
    rng = np.random.default_rng(3)
    n = 20_000
    sign = rng.choice([-1.0, 1.0], n)
    p = (sign * 10.0 ** rng.uniform(*log10_range, n)).astype(np.float32).astype(np_dtype)
    p[:4] = np.array([0.0, -0.0, 1.0, -1.0], np.float32).astype(np_dtype)
    factor = rng.choice([-3.0, -2.0, -1.0, -0.7, -0.3, -1e-3, 1e-5, 1e-3, 0.5, 2.0, 1e3], n)
    g = (p.astype(np.float32) * (factor * rng.uniform(0.5, 1.5, n)).astype(np.float32)).astype(
        np.float32
    )
    g[:4] = np.array([1e-3, -1e-3, -2.0078125, 2.0078125], np.float32)

    # optax.identity() as the inner optimizer: the new master is exactly p + g in fp32.
    tx = ro.fp32_master(optax.identity())
    params = {"x": jnp.asarray(p)}
    updates, state = jax.jit(tx.update)({"x": jnp.asarray(g)}, tx.init(params), params)
    stored = optax.apply_updates(params, updates)["x"]

    master = p.astype(np.float32) + g
    with np.errstate(over="ignore"):  # fp16 targets past 65504 round to inf, as in jax
        target = master.astype(np_dtype)
        update = (-(p.astype(np.float32) - target.astype(np.float32))).astype(np_dtype)
    want_stored = (p.astype(np.float32) + update.astype(np.float32)).astype(np_dtype)
    missed = want_stored.view(uint) != target.view(uint)
    want_master = np.where(missed, want_stored.astype(np.float32), master)

    np.testing.assert_array_equal(bits(updates["x"]), update.view(uint))
    np.testing.assert_array_equal(bits(stored), want_stored.view(uint))
    np.testing.assert_array_equal(bits(state.master["x"]), want_master.view(np.uint32))
    # The master keeps full precision wherever the storage dtype could reach the target.
    assert 0.0 < missed.mean() < 0.3
    np.testing.assert_array_equal(bits(state.master["x"])[~missed], master.view(np.uint32)[~missed])


def test_bf16_values_in_fp32_subnormal_range_stay_consistent():
    # XLA on CPU flushes float32 subnormals, numpy does not; the invariant must hold anyway.
    rng = np.random.default_rng(4)
    p = (rng.choice([-1.0, 1.0], 4000) * 10.0 ** rng.uniform(-40, -36, 4000)).astype(np.float32)
    g = (p * rng.choice([-2.0, -0.5, 1e-3, 3.0], 4000).astype(np.float32)).astype(np.float32)
    params = {"x": jnp.asarray(p).astype(jnp.bfloat16)}
    tx = ro.fp32_master(optax.identity())
    updates, state = jax.jit(tx.update)({"x": jnp.asarray(g)}, tx.init(params), params)
    stored = optax.apply_updates(params, updates)["x"]
    np.testing.assert_array_equal(bits(stored), bits(state.master["x"].astype(jnp.bfloat16)))


def test_update_too_wide_for_bf16_rounds_the_master():
    # -1 + 2.0078125 = 1.0078125 is a bf16 value, but 2.0078125 is not (it needs 9 bits):
    # no bf16 update takes -1 to 1.0078125, so the step is rounded to bf16 precision.
    params = {"w": jnp.array([-1.0, 1.0], jnp.bfloat16)}
    tx = ro.fp32_master(optax.sgd(1.0))
    grads = {"w": jnp.array([-2.0078125, 2.0**-10], jnp.float32)}
    updates, state = tx.update(grads, tx.init(params), params)
    params = optax.apply_updates(params, updates)
    assert params["w"].tolist() == [1.0, 1.0]
    # The first element's master becomes the stored value; the second keeps its fp32 step.
    assert state.master["w"].tolist() == [1.0, 1.0 - 2.0**-10]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=jnp.dtype)
def test_params_replaced_after_init_are_adopted(dtype):
    # Loading weights after building the optimizer (every fine-tuning script): the masters
    # must follow them, not write the init back.
    assert_follows_replaced_params(
        lambda lr: ro.fp32_master(ro.adamw(lr, weight_decay=0.1)), jnp.dtype(dtype)
    )


def test_small_updates_accumulate_in_the_master():
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    grads = {"w": jnp.ones((3,), jnp.bfloat16)}
    plain, wrapped = optax.sgd(1e-4), ro.fp32_master(optax.sgd(1e-4))
    plain_params, plain_state = params, plain.init(params)
    master_params, master_state = params, wrapped.init(params)
    plain_step = jax.jit(plain.update)
    master_step = jax.jit(wrapped.update)
    for _ in range(50):
        u, plain_state = plain_step(grads, plain_state, plain_params)
        plain_params = optax.apply_updates(plain_params, u)
        u, master_state = master_step(grads, master_state, master_params)
        master_params = optax.apply_updates(master_params, u)
    # 1e-4 is below half of bf16's spacing at 1.0 (2**-8): plain bf16 SGD never moves.
    assert plain_params["w"].tolist() == [1.0] * 3
    want = np.float32(1.0)
    for _ in range(50):
        want = want + np.float32(-1e-4) * np.float32(1.0)
    np.testing.assert_array_equal(np.asarray(master_state.master["w"]), np.full(3, want))
    assert master_params["w"].tolist() == [float(ml_dtypes.bfloat16(want))] * 3 != [1.0] * 3


def test_unchanged_parameters_keep_their_bits():
    # A skipped inner step changes no master, so no parameter may change, -0.0 included.
    params = {"w": jnp.array([-0.0, 0.0, -1.5], jnp.bfloat16), "v": jnp.array([-0.0])}
    tx = ro.fp32_master(ro.skip_nonfinite(optax.sgd(0.1)))
    state = tx.init(params)
    grads = {"w": jnp.array([jnp.nan, 1.0, 1.0], jnp.bfloat16), "v": jnp.array([1.0])}
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new_params), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    assert bool(new_state.inner_state.last_skipped)
    unchanged = (state.master, state.inner_state.inner_state)
    changed = (new_state.master, new_state.inner_state.inner_state)
    for a, b in zip(jax.tree.leaves(unchanged), jax.tree.leaves(changed), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_inner_state_is_fp32():
    params = {"a": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.ones((3,), jnp.float16)}
    tx = ro.fp32_master(optax.sgd(0.1, momentum=0.9))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(lambda p: p.dtype, params)
    for leaf in jax.tree.leaves((state.master, state.inner_state)):
        assert leaf.dtype == jnp.float32


def test_gradient_scale_traced_inside_jit():
    params = {"w": jnp.array([1.0, 2.0], jnp.float32)}
    grads = {"w": jnp.array([8.0, -4.0], jnp.float32)}

    @jax.jit
    def update(scale, state):
        tx = ro.fp32_master(optax.sgd(1.0), gradient_scale=scale)
        return tx.update(grads, state, params)

    state = ro.fp32_master(optax.sgd(1.0)).init(params)
    updates, _ = update(jnp.float32(4.0), state)
    np.testing.assert_array_equal(np.asarray(updates["w"]), [-2.0, 1.0])


def test_donating_params_and_state_together():
    # The fp32 master must not alias an fp32 parameter, or donation would donate it twice.
    params = {"w": jnp.ones((4,), jnp.float32), "v": jnp.ones((4,), jnp.bfloat16)}
    tx = ro.fp32_master(optax.sgd(0.1))
    state = tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1))
    params, state = step(params, state, jax.tree.map(jnp.ones_like, params))
    np.testing.assert_array_equal(np.asarray(params["w"]), np.full(4, np.float32(0.9)))


def test_extra_args_reach_the_inner_transformation():
    def update(updates, state, params=None, *, shift):
        return jax.tree.map(lambda g: g + shift, updates), state

    inner = optax.GradientTransformationExtraArgs(optax.init_empty_state, update)
    params = {"w": jnp.zeros((2,), jnp.float32)}
    tx = ro.fp32_master(inner)
    updates, _ = tx.update({"w": jnp.ones((2,))}, tx.init(params), params, shift=2.0)
    assert updates["w"].tolist() == [3.0, 3.0]


@pytest.mark.parametrize(
    "leaf, dtype_text",
    [
        (jnp.zeros((2,), jnp.int32), "int32"),
        (jnp.zeros((2,), ml_dtypes.float8_e4m3fn), "float8_e4m3fn"),
    ],
)
def test_unsupported_leaf_dtype_names_the_path(leaf, dtype_text):
    params = {"ok": jnp.zeros((2,), jnp.bfloat16), "buffers": {"step": leaf}}
    tx = ro.fp32_master(optax.sgd(0.1))
    with pytest.raises(TypeError, match=rf"\['buffers'\]\['step'\].*{dtype_text}"):
        tx.init(params)
    state = tx.init({"ok": params["ok"]})
    with pytest.raises(TypeError, match=r"\['buffers'\]\['step'\]"):
        tx.update(jax.tree.map(jnp.zeros_like, params), state, params)


@pytest.mark.parametrize(
    "grad, dtype_text",
    [
        (jnp.ones((2,), jnp.int32), "int32"),
        (jnp.ones((2,), jnp.complex64) * (1 + 2j), "complex64"),
    ],
    ids=["int", "complex"],
)
def test_non_floating_gradient_names_the_path(grad, dtype_text):
    # A cast to fp32 would accept an int gradient and drop a complex one's imaginary part.
    params = {"ok": jnp.zeros((2,), jnp.bfloat16), "w": jnp.zeros((2,), jnp.bfloat16)}
    tx = ro.fp32_master(optax.sgd(0.1))
    grads = {"ok": jnp.ones((2,), jnp.bfloat16), "w": grad}
    with pytest.raises(TypeError, match=rf"gradient \['w'\] .*dtype={dtype_text}"):
        tx.update(grads, tx.init(params), params)


test_bad_gradient_scale = rejects(
    ro.fp32_master,
    [
        (dict(gradient_scale=value), ValueError, "gradient_scale")
        for value in (0.0, -1.0, float("nan"), float("inf"))
    ],
    inner=optax.sgd(0.1),
)

test_bad_clip_per_parameter = rejects(
    ro.fp32_master,
    [
        (dict(clip_per_parameter=value), ValueError, "clip_per_parameter")
        for value in (0.0, -0.5, float("nan"), float("inf"))
    ],
    inner=optax.sgd(0.1),
)


def test_bad_types():
    with pytest.raises(TypeError, match="gradient_scale"):
        ro.fp32_master(optax.sgd(0.1), gradient_scale="8")
    with pytest.raises(TypeError, match="inner"):
        ro.fp32_master(optax.sgd)
    with pytest.raises(TypeError):
        ro.fp32_master(optax.sgd(0.1), 8.0)  # options are keyword-only


def test_update_without_params_is_an_error():
    params = {"w": jnp.zeros((2,), jnp.bfloat16)}
    tx = ro.fp32_master(optax.sgd(0.1))
    with pytest.raises(ValueError, match="params"):
        tx.update(params, tx.init(params))
