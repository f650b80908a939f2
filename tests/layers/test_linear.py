"""Tests of rudax.layers.Linear against numpy: shapes, storage and compute dtypes, jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
from tests.layers._random import normal
from tests.optim._bad_input import rejects


def linear_reference(x, kernel, bias):
    y = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)
    return y if bias is None else y + np.asarray(bias, np.float64)


@pytest.mark.parametrize("shape, use_bias", [((5,), False), ((2, 5), True), ((2, 3, 5), True)])
def test_matches_numpy(shape, use_bias):
    layer = rl.Linear(5, 3, use_bias=use_bias, rngs=nnx.Rngs(0))
    if use_bias:
        layer.bias[...] = jnp.arange(3, dtype=jnp.float32)
    x = normal(shape, 1)
    y = layer(x)
    assert y.shape == (*shape[:-1], 3) and y.dtype == jnp.float32
    assert layer.kernel.shape == (5, 3)
    bias = layer.bias[...] if use_bias else None
    np.testing.assert_allclose(
        y, linear_reference(x, layer.kernel[...], bias), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "x_dtype, param_dtype, dtype, out_dtype",
    [
        (jnp.float32, jnp.bfloat16, None, jnp.float32),  # None: the input's dtype
        (jnp.bfloat16, jnp.float32, None, jnp.bfloat16),
        (jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32),
        (jnp.float32, jnp.float32, jnp.bfloat16, jnp.bfloat16),
        (jnp.float16, jnp.bfloat16, None, jnp.float16),
    ],
)
def test_storage_and_compute_dtypes(x_dtype, param_dtype, dtype, out_dtype):
    layer = rl.Linear(4, 6, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    layer.bias[...] = jnp.linspace(-1, 1, 6).astype(param_dtype)
    x = normal((3, 4), 1, x_dtype)
    y = layer(x)
    assert y.dtype == out_dtype
    assert layer.kernel.dtype == param_dtype and layer.bias.dtype == param_dtype
    # The same casts written out in jnp: bitwise equal, the arithmetic is in out_dtype.
    c = lambda a: a.astype(out_dtype)
    expected = c(x) @ c(layer.kernel[...]) + c(layer.bias[...])
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))
    # ... and close to the float64 math to the compute dtype's precision.
    rtol = 1e-5 if out_dtype == jnp.float32 else 2e-2
    ref = linear_reference(c(x), c(layer.kernel[...]), c(layer.bias[...]))
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=rtol, atol=rtol)


def test_kernel_init_default_and_custom():
    layer = rl.Linear(256, 128, rngs=nnx.Rngs(0))
    # LeCun normal: variance 1/in.
    np.testing.assert_allclose(np.var(layer.kernel[...]), 1 / 256, rtol=0.05)
    np.testing.assert_array_equal(layer.bias[...], np.zeros(128))
    ones = rl.Linear(2, 3, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(ones.kernel[...], np.ones((2, 3)))


def test_jit_compiles_once_per_shape():
    layer = rl.Linear(4, 2, rngs=nnx.Rngs(0))
    traces = []

    @nnx.jit
    def apply(layer, x):
        traces.append(x.shape)
        return layer(x)

    x = jnp.ones((3, 4))
    np.testing.assert_allclose(apply(layer, x), layer(x), rtol=1e-6)
    apply(layer, x + 1)
    assert len(traces) == 1
    apply(layer, jnp.ones((5, 4)))
    assert len(traces) == 2


def test_grad_wrt_params():
    layer = rl.Linear(3, 2, rngs=nnx.Rngs(0))
    x = normal((4, 3), 1)
    grads = nnx.grad(lambda m: jnp.sum(m(x)))(layer)
    np.testing.assert_allclose(grads["kernel"][...], np.repeat(x.sum(0)[:, None], 2, 1), rtol=1e-6)
    np.testing.assert_allclose(grads["bias"][...], np.full(2, 4.0), rtol=1e-6)


def test_grad_of_a_3d_input_is_one_gemm_over_the_flattened_rows():
    # The leading axes are merged before the dot, so the kernel's gradient contracts one
    # axis (XLA:CPU would transpose the activations to contract two), and it still equals
    # x^T dy summed over every row.
    layer = rl.Linear(3, 2, use_bias=False, rngs=nnx.Rngs(0))
    x = normal((2, 4, 3), 1)
    loss = lambda m: jnp.sum(m(x) ** 2)
    jaxpr = jax.make_jaxpr(nnx.grad(loss))(layer)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(len(e.params["dimension_numbers"][0][0]) == 1 for e in dots)
    rows = np.asarray(x, np.float64).reshape(8, 3)
    dy = 2 * rows @ np.asarray(layer.kernel[...], np.float64)
    np.testing.assert_allclose(nnx.grad(loss)(layer)["kernel"][...], rows.T @ dy, rtol=1e-5)


def test_zero_rows_give_an_empty_output():
    assert rl.Linear(3, 2, rngs=nnx.Rngs(0))(jnp.ones((0, 4, 3))).shape == (0, 4, 2)


def test_call_rejects_wrong_features_and_integer_input():
    layer = rl.Linear(3, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x.shape\[-1\] == 3.*x.shape=\(2, 4\)"):
        layer(jnp.ones((2, 4)))
    with pytest.raises(TypeError, match=r"x\.dtype=int32"):
        layer(jnp.ones((2, 3), jnp.int32))


test_bad_arguments = rejects(
    rl.Linear,
    [
        ({"in_features": 0}, ValueError, "in_features=0"),
        ({"out_features": 2.0}, TypeError, "out_features=2.0"),
        ({"use_bias": 1}, TypeError, "use_bias=1"),
        ({"dtype": jnp.int32}, TypeError, "dtype="),
        ({"param_dtype": None}, TypeError, "param_dtype=None"),
    ],
    in_features=3,
    out_features=2,
    rngs=nnx.Rngs(0),
)
