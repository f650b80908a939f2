"""Tests of rudax.layers.RMSNorm and LayerNorm against plain jnp written here: forward, grad,
storage and compute dtypes, ragged feature sizes, the Pallas path (interpreted), bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

import rudax.layers as rl
from tests.layers._random import normal
from tests.optim._bad_input import rejects


def rms_norm_plain(x, scale, epsilon):
    x32 = x.astype(jnp.float32)
    y = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm_plain(x, scale, bias, epsilon):
    x32 = x.astype(jnp.float32)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = centred / jnp.sqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + epsilon)
    y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def build(kind, features, **kwargs):
    """The layer with non-trivial affine parameters, and the plain function of (x, params)."""
    if kind == "rms":
        layer = rl.RMSNorm(features, **kwargs)
        plain = lambda x, p: rms_norm_plain(x, p["scale"], layer.epsilon)
    else:
        layer = rl.LayerNorm(features, **kwargs)
        plain = lambda x, p: layer_norm_plain(x, p["scale"], p.get("bias"), layer.epsilon)
    layer.scale[...] = jnp.linspace(0.5, 1.5, features).astype(layer.scale.dtype)
    if getattr(layer, "bias", None) is not None:
        layer.bias[...] = jnp.linspace(-0.3, 0.3, features).astype(layer.bias.dtype)
    return layer, plain


def params_of(layer):
    return {k: v[...] for k, v in nnx.state(layer, nnx.Param).items()}


# Per-dtype tolerances: fp32 to its rounding; bf16 outputs within one bf16 ulp (2**-8 relative).
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-6), jnp.bfloat16: dict(rtol=8e-3, atol=8e-3)}


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize(
    "x_dtype, param_dtype, dtype",
    [
        (jnp.float32, jnp.float32, None),
        (jnp.bfloat16, jnp.float32, None),  # fp32 affine with bf16 activations
        (jnp.bfloat16, jnp.bfloat16, None),
        (jnp.float32, jnp.bfloat16, None),  # bf16 storage widened to fp32
        (jnp.float32, jnp.float32, jnp.bfloat16),  # compute dtype overrides the input's
    ],
)
def test_forward_and_grad_match_plain_jnp(kind, x_dtype, param_dtype, dtype):
    layer, plain = build(kind, 5, param_dtype=param_dtype, dtype=dtype, impl="xla")
    x = (3.0 + 2.0 * normal((2, 3, 5), 0)).astype(x_dtype)
    out_dtype = dtype or x_dtype
    y = layer(x)
    assert y.shape == x.shape and y.dtype == out_dtype
    assert all(v.dtype == param_dtype for v in params_of(layer).values())
    expected = plain(x.astype(out_dtype), params_of(layer))
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(expected, np.float32), **TOL[out_dtype]
    )
    # Gradients w.r.t. the parameters and the input, through nnx.grad.
    w = normal(x.shape, 1)
    loss = lambda out: jnp.sum(out.astype(jnp.float32) * w)
    g_layer, g_x = nnx.grad(lambda m, x: loss(m(x)), argnums=(0, 1))(layer, x)
    g_params, g_x_plain = jax.grad(
        lambda p, x: loss(plain(x.astype(out_dtype), p)), argnums=(0, 1)
    )(params_of(layer), x)
    tol = TOL[jnp.float32] if (out_dtype, param_dtype) == (jnp.float32,) * 2 else TOL[jnp.bfloat16]
    np.testing.assert_allclose(
        np.asarray(g_x, np.float32), np.asarray(g_x_plain, np.float32), **tol
    )
    for name, g in g_params.items():
        assert g_layer[name].dtype == param_dtype
        np.testing.assert_allclose(
            np.asarray(g_layer[name][...], np.float32), np.asarray(g, np.float32), **tol
        )


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_pallas_interpreted_matches_xla(kind):
    # 3 rows of 6 features (not a power of two: padded and masked in the kernel).
    layer, _ = build(kind, 6, impl="pallas", interpret=True)
    xla, _ = build(kind, 6, impl="xla")
    x = normal((3, 6), 0)
    np.testing.assert_allclose(layer(x), xla(x), rtol=1e-6, atol=1e-6)
    loss = lambda m: jnp.sum(m(x) * x)
    g_pallas, g_xla = nnx.grad(loss)(layer), nnx.grad(loss)(xla)
    for name in g_xla:
        np.testing.assert_allclose(g_pallas[name][...], g_xla[name][...], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_backward_saves_bf16_input_and_fp32_row_statistics_only(kind, capsys):
    layer, _ = build(kind, 8, impl="xla")
    graphdef, params = nnx.split(layer)
    apply = lambda params, x: nnx.merge(graphdef, params)(x)
    print_saved_residuals(apply, params, jnp.ones((4, 8), jnp.bfloat16))
    saved = [line.split(" ")[0] for line in capsys.readouterr().out.splitlines()]
    # The input as it is, the fp32 parameters, one or two fp32 values per row: no fp32 copy
    # of the activations.
    assert "bf16[4,8]" in saved and "f32[4,8]" not in saved
    assert set(saved) <= {"bf16[4,8]", "f32[8]", "f32[4]"}, saved


def test_layer_norm_without_bias_and_defaults():
    layer, plain = build("layer", 4, use_bias=False, impl="xla")
    assert layer.bias is None and layer.epsilon == 1e-5 and rl.RMSNorm(4).epsilon == 1e-6
    assert sorted(nnx.state(layer).keys()) == ["scale"]
    x = normal((2, 4), 0)
    np.testing.assert_allclose(layer(x), plain(x, params_of(layer)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_nonfinite_row_stays_in_its_row(kind):
    layer, _ = build(kind, 4, impl="xla")
    x = jnp.array([[1.0, 2.0, 3.0, 4.0], [1.0, jnp.inf, 0.0, 0.0], [1.0, jnp.nan, 0.0, 0.0]])
    y = np.asarray(layer(x))
    assert np.isfinite(y[0]).all() and not np.isfinite(y[1]).all() and np.isnan(y[2]).all()


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_jit_compiles_once(kind):
    layer, _ = build(kind, 4, impl="xla")
    traces = []

    @nnx.jit
    def apply(layer, x):
        traces.append(None)
        return layer(x)

    x = jnp.ones((2, 4))
    apply(layer, x)
    apply(layer, x * 2)
    assert len(traces) == 1


@pytest.mark.parametrize("cls", [rl.RMSNorm, rl.LayerNorm])
def test_call_rejects_wrong_features(cls):
    with pytest.raises(ValueError, match=r"x.shape\[-1\] == 4.*x.shape=\(2, 3\)"):
        cls(4, impl="xla")(jnp.ones((2, 3)))
    with pytest.raises(TypeError, match=r"x\.dtype=int32"):
        cls(4, impl="xla")(jnp.ones((2, 4), jnp.int32))


test_bad_arguments = rejects(
    [rl.RMSNorm, rl.LayerNorm],
    [
        ({"features": 0}, ValueError, "features=0"),
        ({"epsilon": 0.0}, ValueError, "epsilon=0.0"),
        ({"epsilon": float("nan")}, ValueError, "epsilon=nan"),
        ({"impl": "cuda"}, ValueError, "impl='cuda'"),
        ({"interpret": "yes"}, TypeError, "interpret='yes'"),
        ({"dtype": jnp.int32}, TypeError, "dtype="),
    ],
    features=4,
)
