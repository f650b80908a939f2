"""Tests of rudax.optim.GradientAccumulator against full-batch gradients and numpy sums."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import rudax.optim as ro

# A tiny linear regression: y = x @ w + b with a nested parameter tree.
IN, OUT = 3, 2


def make_params(tree_kind: str = "dict"):
    rng = np.random.default_rng(0)
    params = {
        "dense": {"w": jnp.asarray(rng.normal(size=(IN, OUT)), jnp.float32)},
        "b": jnp.asarray(rng.normal(size=(OUT,)), jnp.float32),
    }
    return nnx.State(params) if tree_kind == "nnx_state" else params


def make_data(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, IN)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(n, OUT)), jnp.float32)
    return x, y


def loss_sum(params, x, y):
    """Sum over tokens (rows) of the squared error."""
    residual = x @ params["dense"]["w"] + params["b"] - y
    return jnp.sum(residual * residual)


def assert_trees_close(got, want, **tol):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path_got, w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        path, g = path_got
        np.testing.assert_allclose(g, w, err_msg=jax.tree_util.keystr(path), **tol)


def assert_trees_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("tree_kind", ["dict", "nnx_state"])
@pytest.mark.parametrize("jit", [False, True])
def test_equal_microbatches_sum_to_full_batch_gradient(tree_kind, jit):
    """(a) k microbatches, grads of mean_loss / k, summed == the full-batch mean-loss grad."""
    k, n = 4, 16
    params = make_params(tree_kind)
    x, y = make_data(n)
    mean_over_k = lambda p, xb, yb: loss_sum(p, xb, yb) / xb.shape[0] / k

    def micro_step(acc, xb, yb):
        return acc.add(jax.grad(mean_over_k)(params, xb, yb))

    micro_step = jax.jit(micro_step) if jit else micro_step
    acc = ro.GradientAccumulator.init(params)
    for i in range(k):
        sl = slice(i * n // k, (i + 1) * n // k)
        acc = micro_step(acc, x[sl], y[sl])
    assert int(acc.count) == k and float(acc.total_weight) == k
    grads, acc = acc.pop()
    want = jax.grad(lambda p: loss_sum(p, x, y) / n)(params)
    assert_trees_close(grads, want, rtol=1e-5, atol=1e-6)
    if jit:
        assert micro_step._cache_size() == 1


@pytest.mark.parametrize("weight_kind", ["python_int", "python_float", "traced_int32"])
def test_token_weighted_microbatches_give_global_token_mean_gradient(weight_kind):
    """(b) unequal microbatches: grads of loss sums, weight=tokens, pop(normalize=True)."""
    sizes = [1, 5, 2, 8]
    params = make_params()
    x, y = make_data(sum(sizes), seed=2)
    add_traced = jax.jit(lambda acc, g, w: acc.add(g, weight=w))

    acc = ro.GradientAccumulator.init(params)
    start = 0
    for size in sizes:
        g = jax.grad(loss_sum)(params, x[start : start + size], y[start : start + size])
        start += size
        if weight_kind == "python_int":
            acc = acc.add(g, weight=size)
        elif weight_kind == "python_float":
            acc = acc.add(g, weight=float(size))
        else:
            acc = add_traced(acc, g, jnp.int32(size))
    assert float(acc.total_weight) == sum(sizes) and int(acc.count) == len(sizes)
    grads, _ = acc.pop(normalize=True)
    want = jax.grad(lambda p: loss_sum(p, x, y) / sum(sizes))(params)
    assert_trees_close(grads, want, rtol=1e-5, atol=1e-6)


def test_bf16_gradients_accumulate_in_fp32():
    """(c) dtype=float32: each bf16 gradient is converted before it is added."""
    params = {"w": jnp.zeros((4, 8), jnp.bfloat16), "b": jnp.zeros((8,), jnp.bfloat16)}
    rng = np.random.default_rng(3)
    grads_seq = [
        {k: (rng.normal(size=v.shape) * 10.0 ** rng.integers(-3, 3)).astype(ml_dtypes.bfloat16)
         for k, v in params.items()}
        for _ in range(6)
    ]  # fmt: skip
    acc = ro.GradientAccumulator.init(params, dtype=jnp.float32)
    bf16_acc = ro.GradientAccumulator.init(params)
    add = jax.jit(lambda acc, g: acc.add(g))
    for g in grads_seq:
        g = jax.tree.map(jnp.asarray, g)
        acc, bf16_acc = add(acc, g), add(bf16_acc, g)
    for key in params:
        fp32_sum = np.zeros(params[key].shape, np.float32)
        bf16_sum = np.zeros(params[key].shape, ml_dtypes.bfloat16)
        for g in grads_seq:
            fp32_sum = fp32_sum + g[key].astype(np.float32)
            bf16_sum = bf16_sum + g[key]
        assert acc.sums[key].dtype == jnp.float32
        np.testing.assert_array_equal(acc.sums[key], fp32_sum)
        assert bf16_acc.sums[key].dtype == jnp.bfloat16
        np.testing.assert_array_equal(bf16_acc.sums[key], bf16_sum)
        # The fp32 result must be distinguishable from a bf16 sum for this test to mean much.
        assert np.any(fp32_sum != bf16_sum.astype(np.float32))
    grads, _ = acc.pop()
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_normalize_rounds_once_to_the_accumulator_dtype():
    acc = ro.GradientAccumulator.init({"w": jnp.zeros((5,), jnp.bfloat16)})
    g = jnp.asarray(np.float32([1.0, 2.0, 3.0, 100.0, -7.0]), jnp.bfloat16)
    grads, _ = acc.add({"w": g}, weight=3).pop(normalize=True)
    want = (np.asarray(g).astype(np.float32) / np.float32(3)).astype(ml_dtypes.bfloat16)
    assert grads["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(grads["w"], want)


@pytest.mark.parametrize("jit", [False, True])
def test_resume_mid_window_continues_exactly(jit):
    """(d) a restored accumulator (leaves through numpy, as from a checkpoint) is bitwise equal."""
    params = make_params("nnx_state")
    x, y = make_data(10, seed=4)
    add = jax.jit(lambda acc, g, w: acc.add(g, weight=w)) if jit else (lambda a, g, w: a.add(g, w))
    grads = [jax.grad(loss_sum)(params, x[i : i + 2], y[i : i + 2]) for i in range(0, 10, 2)]

    straight = ro.GradientAccumulator.init(params, dtype=jnp.float32)
    for i, g in enumerate(grads):
        straight = add(straight, g, i + 1)

    resumed = ro.GradientAccumulator.init(params, dtype=jnp.float32)
    for i, g in enumerate(grads[:2]):
        resumed = add(resumed, g, i + 1)
    leaves, treedef = jax.tree.flatten(resumed)
    assert len(leaves) == 4  # two sums, count, total_weight
    resumed = jax.tree.unflatten(treedef, [jnp.asarray(np.array(leaf)) for leaf in leaves])
    assert isinstance(resumed, ro.GradientAccumulator) and int(resumed.count) == 2
    for i, g in enumerate(grads[2:], start=2):
        resumed = add(resumed, g, i + 1)

    assert_trees_equal(resumed, straight)
    assert_trees_equal(resumed.pop(normalize=True), straight.pop(normalize=True))


@pytest.mark.parametrize("tree_kind", ["dict", "nnx_state"])
def test_jitted_train_state_and_schedule_advances_per_update(tree_kind):
    """(e) the accumulator in a jitted train state compiles once; (f) the schedule's count
    moves once per tx.update, never per add, so the second window uses the halved rate."""
    k, windows, lr = 3, 2, 0.1
    tx = optax.scale_by_learning_rate(ro.step_schedule(lr, step_size=1, gamma=0.5))
    params = make_params(tree_kind)
    x, y = make_data(k * windows * 2, seed=5)
    state = {
        "params": params,
        "opt_state": tx.init(params),
        "acc": ro.GradientAccumulator.init(params),
    }

    @jax.jit
    def micro_step(state, xb, yb):
        loss, g = jax.value_and_grad(loss_sum)(state["params"], xb, yb)
        return {**state, "acc": state["acc"].add(g, weight=xb.shape[0])}, loss

    @jax.jit
    def apply(state):
        grads, acc = state["acc"].pop(normalize=True)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "acc": acc,
        }

    want = jax.tree.map(np.asarray, dict(params))
    for window in range(windows):
        for i in range(k):
            rows = slice((window * k + i) * 2, (window * k + i + 1) * 2)
            state, _ = micro_step(state, x[rows], y[rows])
            assert int(state["opt_state"].count) == window, "add moved the optimizer's count"
        state = apply(state)
        assert int(state["acc"].count) == 0 and float(state["acc"].total_weight) == 0.0
        rows = slice(window * k * 2, (window + 1) * k * 2)
        xw, yw, rate = x[rows], y[rows], lr * 0.5**window
        g = jax.grad(loss_sum)(jax.tree.map(jnp.asarray, want), xw, yw)
        want = jax.tree.map(lambda p, g, r=rate: p - r * np.asarray(g) / (2 * k), want, g)
    assert int(state["opt_state"].count) == windows
    assert_trees_close(dict(state["params"]), want, rtol=1e-5, atol=1e-6)
    assert micro_step._cache_size() == 1 and apply._cache_size() == 1


def test_pop_empties_and_keeps_the_structure():
    params = make_params()
    acc = ro.GradientAccumulator.init(params, dtype=jnp.float32)
    grads, emptied = acc.add(jax.tree.map(jnp.ones_like, params), weight=2).pop()
    assert_trees_equal(grads, jax.tree.map(jnp.ones_like, params))
    assert_trees_equal(emptied, acc)  # zeros, count 0, weight 0, same dtypes and treedef


@pytest.mark.parametrize("weights", [[], [0, 0]])
def test_normalizing_zero_total_weight_gives_zeros_not_nan(weights):
    params = make_params()
    acc = ro.GradientAccumulator.init(params)
    for w in weights:
        acc = acc.add(jax.tree.map(jnp.zeros_like, params), weight=w)
    grads, _ = jax.jit(lambda a: a.pop(normalize=True))(acc)
    assert int(acc.count) == len(weights)
    for g in jax.tree.leaves(grads):
        np.testing.assert_array_equal(g, 0.0)


def test_unweighted_add_counts_as_weight_one():
    acc = ro.GradientAccumulator.init({"w": jnp.zeros(2)})
    acc = acc.add({"w": jnp.float32([4.0, 8.0])}).add({"w": jnp.float32([2.0, 0.0])}, weight=3)
    assert float(acc.total_weight) == 4.0
    grads, _ = acc.pop(normalize=True)
    np.testing.assert_array_equal(grads["w"], np.float32([1.5, 2.0]))


def test_large_token_count_weight():
    acc = ro.GradientAccumulator.init({"w": jnp.zeros(1)}).add({"w": jnp.ones(1)}, weight=2**40)
    assert float(acc.total_weight) == 2.0**40


def test_works_on_abstract_params():
    abstract = jax.eval_shape(make_params)
    acc = ro.GradientAccumulator.init(abstract, dtype=jnp.float32)
    assert_trees_equal(acc.sums, jax.tree.map(jnp.zeros_like, make_params()))


@pytest.mark.parametrize(
    "params, dtype, error, match",
    [
        ({"w": jnp.zeros(2)}, jnp.int32, TypeError, "dtype"),
        ({"w": jnp.zeros(2)}, "not-a-dtype", TypeError, "dtype='not-a-dtype'"),
        ({"a": {"step": jnp.zeros((), jnp.int32)}}, None, TypeError, r"\['a'\]\['step'\].*int32"),
    ],
)
def test_bad_init_raises(params, dtype, error, match):
    with pytest.raises(error, match=match):
        ro.GradientAccumulator.init(params, dtype=dtype)


def _grads(w_shape=(IN, OUT), b=None, **extra):
    return {"dense": {"w": jnp.zeros(w_shape), **extra}, "b": jnp.zeros(OUT) if b is None else b}


@pytest.mark.parametrize(
    "grads, error, match",
    [
        ({"dense": {"w": jnp.zeros((IN, OUT))}}, ValueError, r"missing leaves \[\"\['b'\]\"\]"),
        (_grads(v=jnp.zeros(1)), ValueError, r"unexpected leaves .*\['dense'\]\['v'\]"),
        (_grads(w_shape=(OUT, IN)), ValueError, r"\['dense'\]\['w'\] has shape \(2, 3\)"),
        (_grads(b=jnp.zeros(OUT, jnp.int32)), TypeError, r"\['b'\] has dtype=int32"),
        (nnx.State(_grads()), ValueError, "different containers"),
    ],
)
def test_mismatched_grads_raise_naming_path(grads, error, match):
    acc = ro.GradientAccumulator.init(make_params())
    with pytest.raises(error, match=match):
        acc.add(grads)


@pytest.mark.parametrize(
    "weight, error, match",
    [
        (-1, ValueError, "weight=-1"),
        (math.nan, ValueError, "weight=nan"),
        (math.inf, ValueError, "weight=inf"),
        (True, TypeError, "weight=True"),
        ("3", TypeError, "weight='3'"),
        (jnp.ones(2), TypeError, "weight"),
    ],
)
def test_bad_weight_raises(weight, error, match):
    acc = ro.GradientAccumulator.init({"w": jnp.zeros(2)})
    with pytest.raises(error, match=match):
        acc.add({"w": jnp.ones(2)}, weight=weight)


def test_bad_traced_weight_raises():
    acc = ro.GradientAccumulator.init({"w": jnp.zeros(2)})
    with pytest.raises(TypeError, match="weight must be a scalar"):
        jax.jit(lambda a, w: a.add({"w": jnp.ones(2)}, weight=w))(acc, jnp.ones(2))
    with pytest.raises(TypeError, match="bool"):
        jax.jit(lambda a, w: a.add({"w": jnp.ones(2)}, weight=w))(acc, jnp.bool_(True))


def test_bad_normalize_raises():
    acc = ro.GradientAccumulator.init({"w": jnp.zeros(2)})
    with pytest.raises(TypeError, match="normalize='yes'"):
        acc.pop(normalize="yes")
