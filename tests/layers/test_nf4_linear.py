"""rudax.layers.NF4Linear: its output against a float64 numpy reference and, bit for bit, the
xla path's definition; from_linear's weight against nf4_quantize and bitsandbytes; its storage.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import rudax.layers as rl
from rudax.kernels import NF4Tensor, _nf4, nf4_dequantize, nf4_quantize
from rudax.layers._matmul import rows_matmul
from tests._bitsandbytes import bnbf, dequantize_4bit, needs_bitsandbytes
from tests.layers._random import normal

IN, OUT = 96, 32  # a 64-block straddles rows of the [out, in] weight (96 = 1.5 blocks)


def _bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def _np_weight(layer):
    """The [out, in] weight the layer's variables store, dequantized in numpy (fp32 products)."""
    codes = np.asarray(layer.codes[...])
    index = np.stack([codes >> 4, codes & 0xF], axis=1).reshape(-1, layer.block_size)
    if layer.absmax is not None:
        absmax = np.asarray(layer.absmax[...])
    else:
        absmax_codes = np.asarray(layer.absmax_codes[...])
        scales = np.repeat(np.asarray(layer.absmax_scales[...]), 256)[: absmax_codes.size]
        absmax = (_nf4.DYNAMIC_CODE[absmax_codes] * scales).astype(np.float32)
        absmax = absmax + np.asarray(layer.absmax_offset[...])
    values = (_nf4.NF4_CODE[index] * absmax[:, None]).astype(np.float32)
    return values.reshape(layer.out_features, layer.in_features)


def _layer(double_quant, *, dtype=None, param_dtype=jnp.float32, use_bias=True):
    lin = rl.Linear(IN, OUT, use_bias=use_bias, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    if use_bias:
        lin.bias[...] = normal((OUT,), 3, param_dtype)
    lin.dtype = dtype
    return lin, rl.NF4Linear.from_linear(lin, double_quant=double_quant, impl="xla")


# ---------------------------------------------------------------------------- the output


@pytest.mark.parametrize("double_quant", [False, True])
def test_forward_matches_float64_numpy(double_quant):
    _, layer = _layer(double_quant)
    x = normal((2, 5, IN), 1)
    y = layer(x)
    assert y.shape == (2, 5, OUT) and y.dtype == jnp.float32
    w = _np_weight(layer).astype(np.float64)
    x64 = np.asarray(x, np.float64)
    ref = x64 @ w.T + np.asarray(layer.bias[...], np.float64)
    # fp32 dot of IN terms: each rounding at most 2**-24 of the running sum of |terms|.
    bound = IN * 2.0**-24 * (np.abs(x64) @ np.abs(w).T + np.abs(ref))
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= bound)


@pytest.mark.parametrize(
    "x_dtype, dtype, param_dtype",
    [
        (jnp.float32, None, jnp.float32),
        (jnp.bfloat16, None, jnp.float32),  # None: the input's dtype, bf16
        (jnp.float32, jnp.bfloat16, jnp.bfloat16),
        (jnp.float16, jnp.float32, jnp.bfloat16),
    ],
)
def test_xla_path_is_rows_matmul_of_the_dequantized_weight_bitwise(x_dtype, dtype, param_dtype):
    _, layer = _layer(True, dtype=dtype, param_dtype=param_dtype)
    assert layer.weight_dtype == jnp.dtype(param_dtype) and layer.dtype == dtype
    x = normal((3, IN), 2, x_dtype)
    c = jnp.dtype(x_dtype if dtype is None else dtype)
    expected = rows_matmul(x.astype(c), nf4_dequantize(layer.weight, c), w_axis=1)
    expected = expected + layer.bias[...].astype(c)
    y = layer(x)
    assert y.dtype == c
    np.testing.assert_array_equal(_bits(y), _bits(expected))
    # The dequantized weight is the numpy one, rounded once to c.
    np.testing.assert_array_equal(
        _bits(nf4_dequantize(layer.weight, jnp.float32)), _bits(_np_weight(layer))
    )


def test_input_gradient_is_the_transposed_weight():
    _, layer = _layer(True)
    x = normal((4, IN), 5)
    g = normal((4, OUT), 6)
    dx = jax.grad(lambda x: jnp.sum(layer(x) * g))(x)
    w = _np_weight(layer).astype(np.float64)
    ref = np.asarray(g, np.float64) @ w
    bound = OUT * 2.0**-24 * (np.abs(np.asarray(g, np.float64)) @ np.abs(w) + np.abs(ref))
    assert np.all(np.abs(np.asarray(dx, np.float64) - ref) <= bound)


def test_no_bias_and_jit():
    _, layer = _layer(False, use_bias=False)
    assert layer.bias is None
    graphdef, state = nnx.split(layer)
    f = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    x = normal((2, IN), 7)
    np.testing.assert_array_equal(f(state, x), layer(x))
    f(state, normal((2, IN), 8))
    assert f._cache_size() == 1


# ---------------------------------------------------------------------------- from_linear


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("kind", ["rudax", "flax", "frozen"])
def test_from_linear_quantizes_the_transposed_kernel(kind, double_quant):
    if kind == "flax":
        lin = nnx.Linear(IN, OUT, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
        lin.bias[...] = normal((OUT,), 4, jnp.bfloat16)
    else:
        lin = rl.Linear(IN, OUT, param_dtype=jnp.bfloat16, dtype=jnp.float32, rngs=nnx.Rngs(1))
        lin.bias[...] = normal((OUT,), 4, jnp.bfloat16)
        if kind == "frozen":  # a LoRALinear's base: its kernel and bias re-tagged Frozen
            lin = rl.LoRALinear(lin, 2, alpha=2.0, rngs=nnx.Rngs(2)).base
            assert type(lin.kernel) is rl.Frozen
    kernel = lin.kernel.get_value()
    before = np.asarray(kernel).copy()
    layer = rl.NF4Linear.from_linear(lin, double_quant=double_quant)
    q = nf4_quantize(kernel.T, double_quant=double_quant)
    got = layer.weight
    assert isinstance(got, NF4Tensor)
    assert (got.shape, got.dtype, got.block_size) == ((OUT, IN), jnp.bfloat16, 64)
    for name in ("codes", "absmax", "absmax_codes", "absmax_scales", "absmax_offset"):
        want, have = getattr(q, name), getattr(got, name)
        assert (want is None) == (have is None), name
        if want is not None:
            np.testing.assert_array_equal(_bits(have), _bits(want), err_msg=name)
            assert have.dtype == want.dtype
    np.testing.assert_array_equal(_bits(layer.bias[...]), _bits(lin.bias.get_value()))
    assert layer.bias[...].dtype == jnp.bfloat16
    assert layer.dtype == lin.dtype
    np.testing.assert_array_equal(_bits(lin.kernel.get_value()), _bits(before))  # untouched


@needs_bitsandbytes
def test_weight_is_bitsandbytes_quantize_4bit_of_the_torch_weight():
    """The torch nn.Linear's [out, in] weight through bitsandbytes, against the twin's layer."""
    torch.manual_seed(0)
    t = torch.nn.Linear(IN, OUT)
    lin = rl.Linear(IN, OUT, rngs=nnx.Rngs(0))
    lin.kernel[...] = jnp.asarray(t.weight.detach().numpy().T)
    lin.bias[...] = jnp.asarray(t.bias.detach().numpy())
    layer = rl.NF4Linear.from_linear(lin, double_quant=False)
    codes_t, state = bnbf.quantize_4bit(
        t.weight.detach(), quant_type="nf4", blocksize=64, compress_statistics=False
    )
    np.testing.assert_array_equal(np.asarray(layer.codes[...]), codes_t.numpy().reshape(-1))
    np.testing.assert_array_equal(_bits(layer.absmax[...]), _bits(state.absmax.numpy()))
    dequantized = dequantize_4bit(codes_t, state).numpy()
    np.testing.assert_array_equal(_bits(nf4_dequantize(layer.weight)), _bits(dequantized))


@needs_bitsandbytes
@pytest.mark.parametrize("double_quant", [False, True])
def test_a_nan_weight_stays_nan_as_in_bitsandbytes(double_quant):
    """Issue 39: a (64, 64) layer with a NaN at weight [7, 3] came back finite (XLA:CPU's max
    dropped the NaN); bitsandbytes gives a NaN block, and under double quantization a NaN
    offset, so a NaN weight everywhere. A NaN in each column in turn (in row 7, or the diagonal)."""
    rng = np.random.default_rng(3)
    kernel = rng.normal(0.0, 0.05, (64, 64)).astype(np.float32)  # [in, out]
    lin = rl.Linear(64, 64, use_bias=False, rngs=nnx.Rngs(0))
    for i in range(64):
        w = kernel.T.copy()  # [out, in], as torch and bitsandbytes store it
        w[7 if i % 2 else i, i] = np.nan
        lin.kernel[...] = jnp.asarray(w.T)
        layer = rl.NF4Linear.from_linear(lin, double_quant=double_quant, impl="xla")
        codes_t, state = bnbf.quantize_4bit(
            torch.from_numpy(w), quant_type="nf4", blocksize=64, compress_statistics=double_quant
        )
        want = dequantize_4bit(codes_t, state).numpy()
        np.testing.assert_array_equal(nf4_dequantize(layer.weight), want, err_msg=f"{i=}")
        y = np.asarray(layer(jnp.ones((1, 64))))
        assert np.isnan(y).all() if double_quant else np.isnan(y).sum() == 1


# ---------------------------------------------------------------------------- storage


def test_storage_is_quantized_variables_only_bias_frozen():
    _, layer = _layer(True)
    flat = {".".join(p): v for p, v in nnx.to_flat_state(nnx.state(layer))}
    assert {k: type(v).__name__ for k, v in flat.items()} == {
        "codes": "Quantized",
        "absmax_codes": "Quantized",
        "absmax_scales": "Quantized",
        "absmax_offset": "Quantized",
        "bias": "Frozen",
    }
    assert layer.absmax is None
    assert flat["codes"].get_value().dtype == jnp.uint8
    assert flat["codes"].get_value().shape == (OUT * IN // 2,)
    assert flat["absmax_codes"].get_value().shape == (OUT * IN // 64,)
    assert flat["absmax_offset"].get_value().shape == ()
    assert not nnx.state(layer, nnx.Param)  # nothing trains
    assert not isinstance(layer.codes, nnx.Param | rl.Frozen)
    _, single = _layer(False)
    assert single.absmax[...].dtype == jnp.float32 and single.absmax_codes is None


# ---------------------------------------------------------------------------- bad input


def _q(shape=(OUT, IN)):
    return nf4_quantize(jnp.ones(shape))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: rl.NF4Linear(jnp.ones((OUT, IN))), TypeError, r"weight must be a rudax\.kernels"),
        (lambda: rl.NF4Linear(_q((64,))), ValueError, r"2-D \[out, in\].*shape=\(64,\)"),
        (
            lambda: rl.NF4Linear(dataclasses.replace(_q(), codes=jnp.zeros(8, jnp.uint8))),
            ValueError,
            r"weight\.codes must hold two codes a byte, shape \(1536,\) for "
            r"weight\.shape=\(32, 96\), got weight\.codes\.shape=\(8,\)",
        ),
        (lambda: rl.NF4Linear(_q(), jnp.ones(IN)), ValueError, r"bias must have shape \(32,\)"),
        (lambda: rl.NF4Linear(_q(), jnp.ones(OUT, jnp.int32)), TypeError, r"bias must be floating"),
        (lambda: rl.NF4Linear(_q(), dtype=jnp.int8), TypeError, r"dtype must be a floating"),
        (lambda: rl.NF4Linear(_q(), impl="cuda"), ValueError, r"impl must be one of"),
        (
            lambda: rl.NF4Linear.from_linear(rl.RMSNorm(4, rngs=nnx.Rngs(0))),
            TypeError,
            r"linear must be a rudax\.layers\.Linear or a flax\.nnx\.Linear, got RMSNorm",
        ),
        (
            lambda: rl.NF4Linear.from_linear(rl.Linear(6, 6, rngs=nnx.Rngs(0))),
            ValueError,
            r"kernel shape \[in, out\]=\(6, 6\) has 36 weights, not a multiple of block_size=64",
        ),
        (
            lambda: rl.NF4Linear.from_linear(
                rl.Linear(8, 8, precision=jax.lax.Precision.HIGHEST, rngs=nnx.Rngs(0))
            ),
            ValueError,
            r"precision=.*HIGHEST.*default precision",
        ),
        (
            lambda: rl.NF4Linear.from_linear(rl.Linear(8, 8, rngs=nnx.Rngs(0)), block_size=0),
            ValueError,
            r"block_size must be a positive even integer, got block_size=0",
        ),
        (
            lambda: rl.NF4Linear.from_linear(rl.Linear(8, 8, rngs=nnx.Rngs(0)), double_quant=1),
            TypeError,
            r"double_quant must be a bool",
        ),
        (
            lambda: rl.NF4Linear(_q())(jnp.ones((2, OUT))),
            ValueError,
            r"NF4Linear expects x\.shape\[-1\] == 96 .* got x\.shape=\(2, 32\)",
        ),
        (
            lambda: rl.NF4Linear(_q())(jnp.ones((2, IN), jnp.int32)),
            TypeError,
            r"NF4Linear expects a floating input",
        ),
    ],
    ids=[
        "weight-array",
        "weight-1d",
        "weight-codes",
        "bias-shape",
        "bias-int",
        "dtype-int",
        "impl",
        "from-norm",
        "from-size-not-blocks",
        "from-precision",
        "from-block-size",
        "from-double-quant",
        "x-features",
        "x-int",
    ],
)
def test_bad_inputs(make, error, match):
    with pytest.raises(error, match=match):
        make()
