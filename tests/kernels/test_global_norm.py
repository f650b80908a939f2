"""Tests of rudax.kernels.global_norm_and_finite: every layout and path against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.kernels as rk
from rudax.kernels import _global_norm
from tests.kernels._lowering import assert_lowers_for_gpu

# Pallas runs compiled on a GPU (benchmarks/gpu_check.sh), interpreted elsewhere.
INTERPRET = jax.default_backend() != "gpu"

# With 4-element loads and at most 2 partials per leaf: the 15-element leaf is 2 programs of
# 8 (two loads each, the last overhanging), the 7-element leaf 2 programs of 4, the scalar 1.
BLOCK = rk.GlobalNormBlock(size=4, max_partials=2)

PATHS = [
    pytest.param(False, "xla", id="flat-xla"),
    pytest.param(False, "pallas", id="flat-pallas"),
    pytest.param(True, "xla", id="hierarchical-xla"),
    pytest.param(True, "pallas", id="hierarchical-pallas"),
]


def grads(seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))
    return {"w": normal((3, 5)), "b": normal((7,)).astype(jnp.bfloat16), "s": normal(())}


def stats(tree, hierarchical, impl):
    return rk.global_norm_and_finite(
        tree, hierarchical=hierarchical, impl=impl, interpret=INTERPRET, block=BLOCK
    )


@pytest.mark.parametrize("hierarchical, impl", PATHS)
def test_matches_reference(hierarchical, impl):
    tree = grads()
    norm, finite = stats(tree, hierarchical, impl)
    want_norm, want_finite = rk.global_norm_and_finite_reference(tree)
    assert norm.dtype == jnp.float32 and finite.dtype == jnp.bool_
    np.testing.assert_allclose(float(norm), float(want_norm), rtol=1e-6)
    assert bool(finite) and bool(want_finite)
    # and the reference against numpy in float64
    flat = np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(tree)])
    np.testing.assert_allclose(float(want_norm), np.sqrt(np.sum(flat**2)), rtol=1e-6)


@pytest.mark.parametrize("hierarchical, impl", PATHS)
@pytest.mark.parametrize(
    "where, value, want_norm, want_finite",
    [
        ("w", np.inf, np.inf, False),
        ("b", -np.inf, np.inf, False),
        ("s", np.nan, np.nan, False),
        # Finite, but its square overflows fp32: the norm is inf and the tree is finite.
        ("w", 1e30, np.inf, True),
    ],
    ids=["inf", "-inf-bf16", "nan-scalar", "overflowing-square"],
)
def test_nonfinite(hierarchical, impl, where, value, want_norm, want_finite):
    tree = grads()
    leaf = tree[where]
    tree[where] = leaf.at[(-1,) * leaf.ndim].set(jnp.asarray(value, leaf.dtype))
    norm, finite = stats(tree, hierarchical, impl)
    ref_norm, ref_finite = rk.global_norm_and_finite_reference(tree)
    assert bool(finite) is want_finite is bool(ref_finite)
    np.testing.assert_array_equal(float(norm), want_norm)
    np.testing.assert_array_equal(float(ref_norm), want_norm)


@pytest.mark.parametrize("hierarchical, impl", PATHS)
def test_empty_trees_and_leaves(hierarchical, impl):
    for tree in ({}, {"z": jnp.zeros((0, 4))}):
        norm, finite = stats(tree, hierarchical, impl)
        assert float(norm) == 0.0 and bool(finite)


def test_partial_buffer_is_bounded():
    block = rk.GlobalNormBlock(size=8, max_partials=4)
    for n in [1, 7, 8, 9, 31, 32, 33, 1000, 2**20 + 1, 2**31 - 1]:
        programs, chunk, sub = _global_norm._chunking(n, block)
        assert programs <= 4 and programs * chunk >= n and chunk % sub == 0, n
    # and a leaf of many chunks runs through them all
    x = {"x": jnp.arange(1000, dtype=jnp.float32) / 1000}
    norm, _ = rk.global_norm_and_finite(
        x, hierarchical=True, impl="pallas", interpret=INTERPRET, block=block
    )
    np.testing.assert_allclose(float(norm), float(rk.global_norm_and_finite_reference(x)[0]))


def test_jit_compiles_once():
    fn = jax.jit(lambda t: stats(t, True, "pallas"))
    for seed in range(3):
        fn(grads(seed))
    assert fn._cache_size() == 1


def test_lowers_for_gpu():
    S = jax.ShapeDtypeStruct
    assert_lowers_for_gpu(
        lambda a, b: rk.global_norm_and_finite([a, b], hierarchical=True, impl="pallas"),
        S((1000, 3), jnp.bfloat16),
        S((), jnp.float32),
        kernels=["global_norm_partials"],
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"grads": {"a": {"n": jnp.zeros(2, jnp.int32)}}}, TypeError, r"\['a'\]\['n'\]"),
        ({"hierarchical": 1}, TypeError, "hierarchical=1"),
        ({"impl": "tpu"}, ValueError, "impl='tpu'"),
        ({"block": rk.AdamWBlock()}, TypeError, "block=AdamWBlock"),
    ],
    ids=["int-leaf", "hierarchical", "impl", "block"],
)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        rk.global_norm_and_finite(**{"grads": grads(), **kwargs})


def test_bad_block():
    with pytest.raises(ValueError, match="max_partials=3"):
        rk.GlobalNormBlock(max_partials=3)
