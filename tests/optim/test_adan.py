"""rudax.optim.adan against a plain numpy Adan loop written from the authors' adan.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rudax.optim as ro
from tests.optim._bad_input import rejects
from tests.optim._harness import assert_matches_reference, make_problem, run_optimizer
from tests.optim._injection import assert_bf16_keeps_fp32_hyperparameters, assert_injectable


def adan_reference(p, grads, *, lr, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, wd=0.0):
    """sail-sg/Adan's _single_tensor_adan with no_prox=False and no clipping.

    ``lr`` is a float or a function of the 0-based update count.
    """
    m, v, n = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
    prev = None
    out = []
    for t, g in enumerate(grads, start=1):
        d = g - (g if prev is None else prev)  # the first step's previous gradient is g
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * d
        n = b3 * n + (1 - b3) * (g + b2 * d) ** 2
        denom = np.sqrt(n) / np.sqrt(1 - b3**t) + eps
        lr_t = lr(t - 1) if callable(lr) else lr
        p = p - lr_t / (1 - b1**t) * m / denom - lr_t * b2 / (1 - b2**t) * v / denom
        p = p / (1 + lr_t * wd)
        prev = g
        out.append(p)
    return out


@pytest.mark.parametrize("tree_kind", ["dict", "nnx_state"])
@pytest.mark.parametrize("jit", [True, False])
def test_matches_reference_with_proximal_decay(jit, tree_kind):
    tx = ro.adan(0.05, weight_decay=0.1)
    ref = functools.partial(adan_reference, lr=0.05, wd=0.1)
    assert_matches_reference(tx, ref, num_steps=5, jit=jit, tree_kind=tree_kind)


def test_matches_reference_other_betas_and_schedule():
    # A halving schedule checks the lr advances once per update, in the step and the decay.
    schedule = lambda count: 0.1 * 0.5 ** count.astype(jnp.float32)
    tx = ro.adan(schedule, b1=0.9, b2=0.7, b3=0.95, eps=1e-6, weight_decay=0.3)
    ref = functools.partial(
        adan_reference, lr=lambda t: 0.1 * 0.5**t, b1=0.9, b2=0.7, b3=0.95, eps=1e-6, wd=0.3
    )
    assert_matches_reference(tx, ref, num_steps=5, seed=3)


def test_first_update_is_sign_of_gradient():
    # d_1 = 0 and every bias-corrected moment equals g (or g**2): u_1 = g / (|g| + eps).
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    grads = {"w": jnp.array([0.5, -4.0, 1e-3])}
    tx = ro.adan(0.1)
    updates, state = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * np.sign(grads["w"]), rtol=1e-5)
    np.testing.assert_array_equal(state[0].v["w"], np.zeros(3, np.float32))
    np.testing.assert_array_equal(state[0].prev_grad["w"], grads["w"])


def test_weight_decay_is_proximal_not_multiplicative():
    # With zero gradients the moments stay 0: only the decay acts, p / (1 + lr wd).
    params = {"w": jnp.array([1.0, -2.0, 4.0])}
    tx = ro.adan(0.5, weight_decay=0.2)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    new = optax.apply_updates(params, updates)["w"]
    np.testing.assert_allclose(new, np.array([1.0, -2.0, 4.0]) / 1.1, rtol=1e-6)
    assert not np.allclose(new, np.array([1.0, -2.0, 4.0]) * 0.9)


@pytest.mark.standard_promotion  # optax.adan's own code needs standard promotion
def test_equals_optax_adan_where_the_docstring_says():
    # optax weights the difference term by 1 - b2 where the official code uses b2; at
    # b2 = 0.5 these coincide, and eps_root=0, weight_decay=0 remove the other differences.
    params, grads = make_problem(5, seed=1)
    got = run_optimizer(ro.adan(0.05, b2=0.5), params, grads, jit=True)
    want = run_optimizer(optax.adan(0.05, b2=0.5, eps_root=0.0), params, grads, jit=True)
    for step_got, step_want in zip(got, want, strict=True):
        for a, b in zip(step_got, step_want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_params_keep_fp32_moments():
    params = {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]], jnp.bfloat16), "b": jnp.ones(3)}
    grads = [
        jax.tree.map(lambda x, k=k: jnp.sin(jnp.ones_like(x) * (k + 1)), params) for k in range(3)
    ]
    tx = ro.adan(0.01, weight_decay=0.1, moment_dtype=jnp.float32)
    state = tx.init(params)
    assert {x.dtype for x in jax.tree.leaves(state[0][1:])} == {jnp.dtype(jnp.float32)}
    step = jax.jit(tx.update)
    p = params
    for g in grads:
        updates, state = step(g, state, p)
        p = optax.apply_updates(p, updates)
    assert p["w"].dtype == jnp.bfloat16 and updates["w"].dtype == jnp.bfloat16
    # The fp32 moments hold the fp32 sums of the exact bf16 gradients.
    g32 = [np.asarray(g["w"], np.float32) for g in grads]
    m = 0.0
    for g in g32:
        m = 0.98 * m + 0.02 * g
    np.testing.assert_allclose(state[0].m["w"], m, rtol=1e-6)


test_bad_hyperparameters = rejects(
    ro.adan,
    [
        ({"learning_rate": -1e-3}, ValueError, "learning_rate=-0.001"),
        ({"learning_rate": "1e-3"}, TypeError, "learning_rate"),
        ({"b1": 1.0}, ValueError, "b1=1.0"),
        ({"b2": -0.1}, ValueError, "b2=-0.1"),
        ({"b3": 1.5}, ValueError, "b3=1.5"),
        ({"eps": -1e-8}, ValueError, "eps=-1e-08"),
        ({"weight_decay": float("nan")}, ValueError, "weight_decay=nan"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay=-0.1"),
        ({"moment_dtype": jnp.int32}, TypeError, "moment_dtype"),
    ],
    learning_rate=1e-3,
)


def test_weight_decay_needs_params():
    tx = ro.adan(1e-3, weight_decay=0.1)
    g = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="needs params"):
        tx.update(g, tx.init(g))


# ---------------------------------------------------------------------------------------------
# mask=: the decay on some leaves only, as a parameter group with weight_decay=0.

MASK_PARAMS, MASK_GRADS = make_problem(
    4, seed=5, shapes={"dense": {"kernel": (5, 3), "bias": (3,)}, "norm": {"scale": (3,)}}
)
# Decay the kernel only: the biases and norms form torch's weight_decay=0 group.
KERNEL_ONLY = {"dense": {"kernel": True, "bias": False}, "norm": False}  # a prefix at "norm"


@pytest.mark.parametrize(
    "mask",
    [
        pytest.param(KERNEL_ONLY, id="prefix-tree"),
        pytest.param(lambda p: jax.tree.map(lambda x: x.ndim == 2, p), id="callable"),
    ],
)
@pytest.mark.parametrize("jit", [True, False])
def test_mask_spares_biases_and_norms_from_the_decay(mask, jit):
    config = dict(lr=0.05, b1=0.9, b2=0.7, b3=0.95, eps=1e-6)
    tx = ro.adan(0.05, b1=0.9, b2=0.7, b3=0.95, eps=1e-6, weight_decay=0.3, mask=mask)
    got = run_optimizer(tx, MASK_PARAMS, MASK_GRADS, jit=jit)
    grads = [jax.tree.leaves(g) for g in MASK_GRADS]
    for i, (path, p0) in enumerate(jax.tree_util.tree_flatten_with_path(MASK_PARAMS)[0]):
        wd = 0.3 if jax.tree_util.keystr(path) == "['dense']['kernel']" else 0.0
        want = adan_reference(p0, [g[i] for g in grads], **config, wd=wd)
        for step in range(len(MASK_GRADS)):
            np.testing.assert_allclose(
                got[step][i], want[step], rtol=1e-5, atol=1e-6, err_msg=f"{path} {step}"
            )


def test_masked_leaves_step_exactly_as_without_decay():
    # A spared leaf is not decayed by 0: its updates are weight_decay=0's, bit for bit.
    run = lambda tx: run_optimizer(tx, MASK_PARAMS, MASK_GRADS, jit=True)
    masked = run(ro.adan(0.05, weight_decay=0.3, mask=KERNEL_ONLY))
    no_decay, decayed = run(ro.adan(0.05)), run(ro.adan(0.05, weight_decay=0.3))
    paths = [
        jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(MASK_PARAMS)[0]
    ]
    kernel = paths.index("['dense']['kernel']")
    for step, got in enumerate(masked):
        for i, leaf in enumerate(got):
            want = (decayed if i == kernel else no_decay)[step][i]
            np.testing.assert_array_equal(leaf, want, err_msg=f"{paths[i]} {step}")


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        ({"dense": {"kernel": 1, "bias": False}, "norm": False}, TypeError, r"mask\['dense'\]"),
        ({"dense": True}, ValueError, "mask must have the parameters' tree structure"),
        (lambda p: {"dense": True}, ValueError, "adan: mask must have"),
    ],
)
def test_bad_mask(mask, error, match):
    params = jax.tree.map(jnp.asarray, MASK_PARAMS)
    with pytest.raises(error, match=match):
        tx = ro.adan(0.05, weight_decay=0.3, mask=mask)
        tx.update(params, tx.init(params), params)


# ---------------------------------------------------------------------------------------------
# inject_hyperparams: every float hyperparameter in the state, the plain optimizer's updates.

INJECT_PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.array([0.5, -0.25])}
# Dyadic values: 1 - b, lr * weight_decay and every other expression of hyperparameters alone
# is exact in float32 as in float64, so the plain optimizer (Python floats, such expressions
# folded in float64) and the injected one (float32 arrays) compute the same float32 numbers.
INJECT_KWARGS = dict(
    learning_rate=0.0625, b1=0.875, b2=0.75, b3=0.9375, eps=2.0**-10, weight_decay=0.25
)
NEW_VALUES = dict(learning_rate=0.125, b1=0.5, b2=0.25, b3=0.625, eps=0.5, weight_decay=0.75)


@pytest.mark.parametrize("mask", [None, {"w": True, "b": False}], ids=["all", "mask"])
def test_inject_hyperparams(mask):
    # Bit for bit: each hyperparameter meets the arrays as a weakly typed float32 scalar,
    # exactly as the plain optimizer's Python float does.
    assert_injectable(
        ro.adan,
        {**INJECT_KWARGS, "mask": mask},
        INJECT_PARAMS,
        optax_static_args=("moment_dtype", "mask"),
        new_values=NEW_VALUES,
    )


def test_inject_hyperparams_rounding():
    # Other values: the plain optimizer folds 1 - b1 (and 1 - b2, 1 - b3, lr * weight_decay)
    # in float64 and rounds once, 0.1 for b1 = 0.9; the injected one computes it from float32
    # arrays, 1 - float32(0.9) = 0.100000024: a relative difference of about 2**-23 in a
    # coefficient. The update u = (m / c1 + b2 v / c2) / denom is a difference of larger terms
    # where v and m disagree in sign, which amplifies it: measured 1.4e-6 of max|u| at the
    # third update from b2 alone, 1.2e-6 from b3 (0 from the learning rate, eps and the
    # decay, whose values are rounded the same way in both).
    assert_injectable(
        ro.adan,
        dict(learning_rate=0.05, b1=0.9, b2=0.8, b3=0.95, eps=1e-3, weight_decay=0.2),
        INJECT_PARAMS,
        optax_static_args=("moment_dtype", "mask"),
        new_values=dict(learning_rate=0.02, b1=0.5, b2=0.3, b3=0.6, eps=0.5, weight_decay=0.9),
        rtol=5e-6,
    )


@pytest.mark.parametrize("moment_dtype", [None, jnp.float32])
def test_inject_hyperparams_bf16_params_keep_fp32_hyperparameters(moment_dtype):
    assert_bf16_keeps_fp32_hyperparameters(
        ro.adan, {**INJECT_KWARGS, "moment_dtype": moment_dtype}, INJECT_PARAMS
    )


def test_count_is_the_update_count():
    # optax.tree.get(state, "count") finds one count: the update count of scale_by_adan.
    params = jax.tree.map(jnp.asarray, MASK_PARAMS)
    for learning_rate in (0.05, lambda count: 0.05 * 0.5 ** count.astype(jnp.float32)):
        tx = ro.adan(learning_rate, weight_decay=0.1)
        state = tx.init(params)
        assert int(optax.tree_utils.tree_get(state, "count")) == 0
        for _ in range(3):
            _, state = jax.jit(tx.update)(params, state, params)
        assert int(optax.tree_utils.tree_get(state, "count")) == 3
        injected = ro.inject_hyperparams(ro.adan)(learning_rate, weight_decay=0.1)
        assert int(optax.tree_utils.tree_get(injected.init(params).inner_state, "count")) == 0


# ---------------------------------------------------------------------------------------------
# Complex parameters: torch's real view, elementwise on the real and imaginary parts.


def _real_view(tree):
    return jax.tree.map(lambda z: jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1), tree)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("moment_dtype", [None, jnp.float32])
@pytest.mark.parametrize("mask", [None, {"w": True, "b": False}], ids=["all", "mask"])
def test_complex_params_are_their_real_view(mask, moment_dtype, jit):
    rng = np.random.default_rng(7)
    shapes = {"w": (3, 2), "b": (4,)}
    z = lambda s: (rng.normal(size=s) + 1j * rng.normal(size=s)).astype(np.complex64)
    params = {k: jnp.asarray(z(s)) for k, s in shapes.items()}
    grads = [{k: jnp.asarray(z(s)) for k, s in shapes.items()} for _ in range(4)]
    tx = ro.adan(0.05, b2=0.7, weight_decay=0.3, mask=mask, moment_dtype=moment_dtype)
    got = run_optimizer(tx, params, grads, jit=jit)
    want = run_optimizer(tx, _real_view(params), [_real_view(g) for g in grads], jit=jit)
    for step in range(len(grads)):
        for a, b in zip(got[step], want[step], strict=True):
            assert a.dtype == np.complex64
            a = np.stack([a.real, a.imag], axis=-1)
            if jit:
                # The same operations, compiled as two programs of different shapes: LLVM may
                # fuse a multiply and an add into one FMA in one and not the other (with
                # --xla_backend_optimization_level=0 the two agree bit for bit here too).
                np.testing.assert_allclose(a, b, rtol=2**-21, atol=0)
            else:
                np.testing.assert_array_equal(a, b)
    # And the real view is Adan on each real number (the numpy reference).
    for i, p0 in enumerate(jax.tree.leaves(_real_view(params))):
        wd = 0.0 if mask is not None and i == 0 else 0.3  # leaves in key order: b, w
        g = [np.asarray(jax.tree.leaves(_real_view(x))[i]) for x in grads]
        ref = adan_reference(np.asarray(p0), g, lr=0.05, b2=0.7, wd=wd)
        for step in range(len(grads)):
            np.testing.assert_allclose(want[step][i], ref[step], rtol=1e-5, atol=1e-6)
    buffers = jax.tree.leaves(tx.init(params)[0][1:])  # m, v, n, prev_grad
    assert {x.dtype for x in buffers} == {jnp.dtype(jnp.complex64)}
