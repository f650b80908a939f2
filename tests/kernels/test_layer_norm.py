"""rudax.kernels.layer_norm against layer_norm_reference and jax.grad of it.

The Pallas kernels run compiled on a GPU and in interpret mode elsewhere (about 1 ms per grid
step there), with small blocks (``RowBlock(rows=2, programs=2)``): (5, 96) is three row blocks,
the last one ragged, and the backward's two programs loop twice. Feature sizes 8, 96 and 100
are padded to 8, 128 and 128 inside the kernels and masked; x has a mean of 3 so that a padded
zero counted in the variance (it would deviate by -3) shows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import rudax.kernels as rk
from rudax.kernels import _layer_norm
from tests.kernels._lowering import assert_lowers_for_gpu

SMALL = rk.RowBlock(rows=2, programs=2)
# Compiled on a GPU (benchmarks/gpu_check.sh runs this file there), interpreted elsewhere.
INTERPRET = jax.default_backend() != "gpu"

# fp32: forward and backward are fp32 expressions of the same terms as the reference and its
# autodiff, summed in another order: a few ulps apart. bf16: every result is an fp32 value
# rounded once, so op and reference agree to one bf16 ulp (2**-7 relative).
TOLERANCES = {
    jnp.float32: dict(rtol=1e-5, atol=1e-6),
    jnp.bfloat16: dict(rtol=2**-7, atol=1e-5),
}

IMPLS = [
    pytest.param({"impl": "pallas", "interpret": INTERPRET, "block": SMALL}, id="pallas"),
    pytest.param({"impl": "xla"}, id="xla"),
]


def _operands(shape, dtype, scale_dtype, bias_dtype, seed=0):
    kx, ks, kb, kg = jax.random.split(jax.random.key(seed), 4)
    x = (3.0 + 2.0 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    scale = (1.0 + 0.5 * jax.random.normal(ks, shape[-1:], jnp.float32)).astype(scale_dtype)
    bias = None
    if bias_dtype is not None:
        bias = (0.5 * jax.random.normal(kb, shape[-1:], jnp.float32)).astype(bias_dtype)
    dy = jax.random.normal(kg, shape, jnp.float32).astype(dtype)
    return x, scale, bias, dy


@functools.partial(jax.jit, static_argnums=0)
def _value_and_vjp(fn, x, scale, bias, dy):
    """(fn(x, scale, bias), dx, dscale, dbias) in one compilation; dbias is None for no bias."""
    y, vjp = jax.vjp(fn, x, scale, bias)
    return (y, *vjp(dy))


def _assert_matches_reference(kwargs, x, scale, bias, dy, tol):
    op = functools.partial(rk.layer_norm, epsilon=1e-5, **kwargs)
    ref = functools.partial(rk.layer_norm_reference, epsilon=1e-5)
    got = _value_and_vjp(op, x, scale, bias, dy)
    want = _value_and_vjp(ref, x, scale, bias, dy)
    assert (got[3] is None) == (bias is None)
    for name, g, w in zip(("y", "dx", "dscale", "dbias"), got, want, strict=True):
        if w is None:
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=name, **tol
        )


@pytest.mark.parametrize("kwargs", IMPLS)
@pytest.mark.parametrize(
    ("shape", "bias_dtype"),
    [((3, 8), None), ((5, 96), jnp.float32), ((2, 3, 100), jnp.float32)],
)
def test_fp32_matches_reference(kwargs, shape, bias_dtype):
    x, scale, bias, dy = _operands(shape, jnp.float32, jnp.float32, bias_dtype)
    _assert_matches_reference(kwargs, x, scale, bias, dy, TOLERANCES[jnp.float32])


@pytest.mark.parametrize("kwargs", IMPLS)
@pytest.mark.parametrize(
    ("shape", "scale_dtype", "bias_dtype"),
    [((5, 96), jnp.bfloat16, jnp.bfloat16), ((2, 3, 100), jnp.float32, jnp.bfloat16)],
)
def test_bf16_matches_reference(kwargs, shape, scale_dtype, bias_dtype):
    x, scale, bias, dy = _operands(shape, jnp.bfloat16, scale_dtype, bias_dtype)
    _assert_matches_reference(kwargs, x, scale, bias, dy, TOLERANCES[jnp.bfloat16])


@pytest.mark.parametrize("kwargs", IMPLS)
def test_vmap(kwargs):
    """vmap of the op and of its gradient (per-example gradients) match the reference's."""
    x, scale, bias, dy = _operands((3, 5, 96), jnp.float32, jnp.float32, jnp.float32)
    op = functools.partial(rk.layer_norm, **kwargs)

    def per_example(fn):
        return jax.jit(jax.vmap(lambda x, dy: _value_and_vjp(fn, x, scale, bias, dy)))(x, dy)

    got, want = per_example(op), per_example(rk.layer_norm_reference)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOLERANCES[jnp.float32])


@pytest.mark.parametrize("kwargs", IMPLS)
def test_non_finite_stays_in_its_row(kwargs):
    x, scale, bias, dy = _operands((5, 96), jnp.float32, jnp.float32, jnp.float32)
    x = x.at[1, 7].set(jnp.nan).at[3, 95].set(-jnp.inf)
    got = _value_and_vjp(functools.partial(rk.layer_norm, **kwargs), x, scale, bias, dy)
    want = _value_and_vjp(rk.layer_norm_reference, x, scale, bias, dy)
    clean = np.array([0, 2, 4])
    for g, w in zip(got[:2], want[:2], strict=True):  # y and dx are per row
        g = np.asarray(g)
        assert np.isfinite(g[clean]).all()
        assert not np.isfinite(g[[1, 3]]).any()  # the mean spreads NaN/inf to the whole row
        np.testing.assert_allclose(g, w, **TOLERANCES[jnp.float32])  # NaN where it has NaN
    assert not np.isfinite(got[2]).all()  # dscale sums over rows
    np.testing.assert_allclose(got[3], want[3], **TOLERANCES[jnp.float32])  # dbias: g only


@pytest.mark.parametrize("kwargs", IMPLS)
def test_residuals_are_inputs_and_fp32_row_statistics(kwargs, capsys):
    """What the backward keeps: x (bf16), the scale, fp32 mean and rstd per row; no fp32 copy."""
    x, scale, bias, _ = _operands((2, 3, 100), jnp.bfloat16, jnp.float32, jnp.bfloat16)
    print_saved_residuals(functools.partial(rk.layer_norm, **kwargs), x, scale, bias)
    lines = sorted(capsys.readouterr().out.strip().splitlines())
    kept = [line.split()[0] for line in lines]
    assert kept == ["bf16[6,100]", "f32[100]", "f32[6]", "f32[6]"], lines

    print_saved_residuals(rk.layer_norm_reference, x, scale, bias)  # the reference keeps copies
    assert "f32[2,3,100]" in capsys.readouterr().out


def test_no_recompilation_on_second_call():
    x, scale, bias, dy = _operands((5, 96), jnp.float32, jnp.float32, jnp.float32)
    op = functools.partial(rk.layer_norm, impl="pallas", interpret=INTERPRET, block=SMALL)
    step = jax.jit(lambda x, s, b, dy: _value_and_vjp(op, x, s, b, dy))
    compiled = _layer_norm._layer_norm_jit._cache_size()
    rk.layer_norm(x, scale, bias)
    rk.layer_norm(x + 1, scale * 2, bias)
    assert _layer_norm._layer_norm_jit._cache_size() == compiled + 1
    step(x, scale, bias, dy)
    step(x + 1, scale, bias, dy)
    assert step._cache_size() == 1


@pytest.mark.parametrize(
    ("shape", "dtype", "bias"),
    [
        ((5, 96), jnp.bfloat16, jnp.float32),
        ((7, 4095), jnp.float32, None),
        ((8192, 4096), jnp.bfloat16, jnp.bfloat16),  # the benchmark's shape, default blocks
    ],
)
def test_lowers_for_gpu(shape, dtype, bias):
    vector = jax.ShapeDtypeStruct(shape[-1:], dtype)
    if bias is None:
        fn, args = lambda x, s: rk.layer_norm(x, s, None, impl="pallas"), ()
    else:
        fn = lambda x, s, b: rk.layer_norm(x, s, b, impl="pallas")
        args = (jax.ShapeDtypeStruct(shape[-1:], bias),)
    assert_lowers_for_gpu(
        fn,
        jax.ShapeDtypeStruct(shape, dtype),
        vector,
        *args,
        kernels=["layer_norm_fwd"],
        backward_kernels=["layer_norm_bwd"],
    )


def test_auto_is_xla_off_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU, auto is the Pallas path")
    x, scale, bias, _ = _operands((3, 8), jnp.float32, jnp.float32, jnp.float32)
    np.testing.assert_array_equal(
        rk.layer_norm(x, scale, bias), rk.layer_norm(x, scale, bias, impl="xla")
    )


@pytest.mark.parametrize(
    ("bias", "kwargs", "error", "match"),
    [
        (jnp.ones(7), {}, ValueError, r"bias\.shape=\(7,\)"),
        (jnp.ones(8, jnp.float16), {}, TypeError, "bias.dtype=float16"),
        (np.ones(8, np.float32).tolist(), {}, TypeError, "bias must have"),
        (None, {"epsilon": 0}, ValueError, "epsilon=0"),
        (None, {"epsilon": float("inf")}, ValueError, "epsilon=inf"),
        (None, {"impl": "triton"}, ValueError, "impl='triton'"),
    ],
)
def test_bad_input(bias, kwargs, error, match):
    x = jnp.ones((3, 8), jnp.bfloat16)
    with pytest.raises(error, match=match):
        rk.layer_norm(x, jnp.ones(8, jnp.float32), bias, **kwargs)


@pytest.mark.parametrize(
    ("x", "scale", "error", "match"),
    [
        (jnp.ones((3, 8), jnp.int8), jnp.ones(8), TypeError, "x must be a floating"),
        (jnp.ones((3, 8)), jnp.ones(9), ValueError, r"scale\.shape=\(9,\)"),
        (jnp.ones((3, 8)), None, TypeError, "scale must have"),
    ],
)
def test_bad_x_or_scale(x, scale, error, match):
    with pytest.raises(error, match=match):
        rk.layer_norm(x, scale, None)
