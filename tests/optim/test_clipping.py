"""Tests of rudax.optim's gradient clipping against plain numpy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rudax.optim as ro
from tests.optim._bad_input import rejects
from tests.optim._harness import as_tree_kind, assert_matches_reference, make_problem


def coefficient_reference(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient."""
    return min(max_norm / (norm + 1e-6), 1.0)


def global_clip_reference(grads: list[np.ndarray], max_norm: float):
    """(clipped grads, pre-clip norm), computed in float64 from the given values."""
    norm = math.sqrt(sum(float(np.sum(np.square(g.astype(np.float64)))) for g in grads))
    c = coefficient_reference(norm, max_norm)
    return [g.astype(np.float64) * c for g in grads], norm


def leaves_of(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# bf16 outputs are compared at one bf16 ulp: the reference rounds a float64 product, rudax an
# fp32 one, and those two roundings to bf16 can differ by one ulp.
TOLERANCE = {jnp.float32: dict(rtol=1e-6, atol=0.0), jnp.bfloat16: dict(rtol=2**-8, atol=0.0)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("max_norm", [0.5, 4.0, 100.0])  # clips hard, clips a little, does not
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("tree_kind", ["dict", "nnx_state"])
def test_clip_by_global_norm_matches_reference(dtype, max_norm, jit, tree_kind):
    _, grads_seq = make_problem(3, seed=1)
    tx = ro.clip_by_global_norm(max_norm)
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(as_tree_kind(grads_seq[0], tree_kind))
    for step, g in enumerate(grads_seq):
        g = jax.tree.map(lambda x: x.astype(dtype), as_tree_kind(g, tree_kind))
        clipped, state = update(g, state)
        if jit:
            assert update._cache_size() == 1, f"recompiled at update {step + 1}"
        given = [x.astype(np.float32) for x in leaves_of(g)]
        want, want_norm = global_clip_reference(given, max_norm)
        assert state.global_norm.dtype == jnp.float32
        np.testing.assert_allclose(state.global_norm, want_norm, rtol=1e-6)
        for got, w, x in zip(jax.tree.leaves(clipped), want, jax.tree.leaves(g), strict=True):
            assert got.dtype == x.dtype
            np.testing.assert_allclose(np.asarray(got, np.float32), w, **TOLERANCE[dtype])


def test_clip_by_global_norm_agrees_with_torch_rule_not_optax():
    """Above the threshold torch's 1e-6 makes the clipped norm fall just short of max_norm."""
    g = {"w": jnp.float32([3e-6, 4e-6])}  # norm 5e-6: the 1e-6 is 20% of it
    clipped, state = ro.clip_by_global_norm(1e-6).update(g, ro.clip_by_global_norm(1e-6).init(g))
    np.testing.assert_allclose(state.global_norm, 5e-6, rtol=1e-6)
    np.testing.assert_allclose(clipped["w"], np.float32([3e-6, 4e-6]) * (1e-6 / 6e-6), rtol=1e-6)


def test_unclipped_gradients_pass_through_bit_for_bit():
    g = {"a": jnp.float32([0.1, -0.2, 0.3]), "b": jnp.bfloat16([1e-3, 7.0])}
    for tx in (ro.clip_by_global_norm(10.0), ro.clip_per_parameter(10.0)):
        clipped, _ = tx.update(g, tx.init(g))
        for got, x in zip(leaves_of(clipped), leaves_of(g), strict=True):
            assert got.dtype == x.dtype
            np.testing.assert_array_equal(got, x)


def test_zero_gradients_stay_zero():
    g = {"a": jnp.zeros((2, 3)), "b": jnp.zeros(())}
    for tx in (ro.clip_by_global_norm(1.0), ro.clip_per_parameter(1.0)):
        clipped, _ = tx.update(g, tx.init(g))
        for got in leaves_of(clipped):
            np.testing.assert_array_equal(got, 0.0)


def test_norm_is_fp32_even_where_fp16_squares_overflow():
    # 300**2 overflows fp16 (max 65504); the clipped values stay fp16 normals (> 6.1e-5).
    g = {"a": jnp.full((4,), 300.0, jnp.float16), "b": jnp.full((2, 2), 0.5, jnp.float16)}
    tx = ro.clip_by_global_norm(1.0)
    clipped, state = tx.update(g, tx.init(g))
    want, want_norm = global_clip_reference(leaves_of(g), 1.0)
    np.testing.assert_allclose(state.global_norm, want_norm, rtol=1e-6)
    for got, w in zip(leaves_of(clipped), want, strict=True):
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float32), w, rtol=2**-10)  # one fp16 ulp


@pytest.mark.parametrize("bad, norm_is", [(math.nan, "nan"), (math.inf, "inf")])
def test_non_finite_norm_propagates(bad, norm_is):
    g = {"a": jnp.float32([1.0, bad]), "b": jnp.float32([2.0, 3.0])}
    tx = ro.clip_by_global_norm(1.0)
    clipped, state = tx.update(g, tx.init(g))
    assert np.isnan(state.global_norm) if norm_is == "nan" else np.isinf(state.global_norm)
    # NaN poisons every leaf; an infinite norm zeroes the finite entries and NaNs the infinite.
    assert np.isnan(clipped["a"][1])
    if norm_is == "nan":
        assert np.all(np.isnan(clipped["b"]))
    else:
        np.testing.assert_array_equal(clipped["b"], 0.0)

    per_leaf, _ = ro.clip_per_parameter(1.0).update(g, optax.EmptyState())
    assert np.isnan(per_leaf["a"][1])
    np.testing.assert_allclose(per_leaf["b"], np.float32([2.0, 3.0]) / (math.sqrt(13) + 1e-6))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("tree_kind", ["dict", "nnx_state"])
def test_clip_per_parameter_in_chain_matches_reference(jit, tree_kind):
    max_norm, lr = 1.5, 0.1  # the harness's N(0, 1) grads: big leaves clip, the scalar rarely

    def reference(p, grads):
        out = []
        for g in grads:
            c = coefficient_reference(float(np.linalg.norm(g.astype(np.float64))), max_norm)
            p = p - lr * (g.astype(np.float64) * c)
            out.append(p)
        return out

    tx = optax.chain(ro.clip_per_parameter(max_norm), optax.scale(-lr))
    assert_matches_reference(tx, reference, num_steps=4, jit=jit, tree_kind=tree_kind)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_clip_per_parameter_bf16(dtype):
    _, (g,) = make_problem(1, seed=3)
    g = jax.tree.map(lambda x: jnp.asarray(x, dtype) * 2, g)
    clipped, _ = jax.jit(ro.clip_per_parameter(1.0).update)(g, optax.EmptyState())
    for got, x in zip(leaves_of(clipped), leaves_of(g), strict=True):
        x64 = x.astype(np.float64)
        want = x64 * coefficient_reference(float(np.linalg.norm(x64)), 1.0)
        assert got.dtype == x.dtype
        np.testing.assert_allclose(got.astype(np.float32), want, **TOLERANCE[dtype])


def test_clip_by_global_norm_composes_and_exposes_norm():
    params = {"w": jnp.float32([[1.0, 2.0], [3.0, 4.0]]), "b": jnp.float32([0.5, -0.5])}
    grads = {"w": jnp.float32([[3.0, 0.0], [0.0, 4.0]]), "b": jnp.float32([0.0, 0.0])}
    tx = optax.chain(ro.clip_by_global_norm(1.0), optax.scale(-0.5))
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    state = tx.init(params)
    np.testing.assert_array_equal(state[0].global_norm, 0.0)
    updates, state = step(params, state, grads)
    np.testing.assert_allclose(state[0].global_norm, 5.0, rtol=1e-6)
    c = 1.0 / (5.0 + 1e-6)
    np.testing.assert_allclose(updates["w"], -0.5 * c * np.float32([[3, 0], [0, 4]]), rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], 0.0)


test_bad_max_norm_raises = rejects(
    [ro.clip_by_global_norm, ro.clip_per_parameter],
    [
        ({"max_norm": 0.0}, ValueError, "max_norm=0.0"),
        ({"max_norm": -1.0}, ValueError, "max_norm=-1.0"),
        ({"max_norm": math.nan}, ValueError, "max_norm=nan"),
        ({"max_norm": math.inf}, ValueError, "max_norm=inf"),
        ({"max_norm": "1.0"}, TypeError, "max_norm='1.0'"),
        ({"max_norm": True}, TypeError, "max_norm=True"),
        ({"max_norm": np.ones(2)}, TypeError, "max_norm"),
    ],
)


@pytest.mark.parametrize("factory", [ro.clip_by_global_norm, ro.clip_per_parameter])
def test_integer_gradient_raises_naming_path(factory):
    g = {"layer": {"w": jnp.ones(2), "step": jnp.ones(2, jnp.int32)}}
    tx = factory(1.0)
    with pytest.raises(TypeError, match=r"\['layer'\]\['step'\].*int32"):
        tx.update(g, tx.init(g))
