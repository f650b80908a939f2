"""Tests of rudax.layers.GatedMLP against plain jnp: SwiGLU and other activations, dtypes,
gradients, the fused silu_mul Pallas path (interpreted), bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
from tests.layers._random import normal
from tests.optim._bad_input import rejects


def gated_mlp_plain(x, p, activation, dtype):
    c = lambda a: a.astype(dtype)
    gate, up = c(x) @ c(p["gate_proj"]), c(x) @ c(p["up_proj"])
    h = activation(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    return c(h) @ c(p["down_proj"])


def kernels(mlp):
    return {name: getattr(mlp, name).kernel[...] for name in ("gate_proj", "up_proj", "down_proj")}


@pytest.mark.parametrize("activation", [jax.nn.silu, jax.nn.gelu], ids=["silu", "gelu"])
@pytest.mark.parametrize(
    "x_dtype, param_dtype, dtype",
    [
        (jnp.float32, jnp.float32, None),
        (jnp.bfloat16, jnp.float32, None),
        (jnp.float32, jnp.bfloat16, jnp.float32),
    ],
)
def test_forward_and_grad_match_plain_jnp(activation, x_dtype, param_dtype, dtype):
    mlp = rl.GatedMLP(
        4,
        6,
        activation=activation,
        dtype=dtype,
        param_dtype=param_dtype,
        impl="xla",
        rngs=nnx.Rngs(0),
    )
    out_dtype = dtype or x_dtype
    x = normal((2, 3, 4), 1, x_dtype)
    y = mlp(x)
    assert y.shape == x.shape and y.dtype == out_dtype
    assert mlp.gate_proj.kernel.shape == (4, 6) and mlp.down_proj.kernel.shape == (6, 4)
    assert mlp.gate_proj.bias is None and mlp.gate_proj.kernel.dtype == param_dtype
    expected = gated_mlp_plain(x, kernels(mlp), activation, out_dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if out_dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(expected, np.float32), **tol)
    if out_dtype != jnp.float32:
        return
    loss = lambda out: jnp.sum(out * x)
    g_mlp = nnx.grad(lambda m: loss(m(x)))(mlp)
    g_plain = jax.grad(lambda p: loss(gated_mlp_plain(x, p, activation, out_dtype)))(kernels(mlp))
    rtol = 1e-5 if param_dtype == jnp.float32 else 1e-2
    for name, g in g_plain.items():
        assert g_mlp[name]["kernel"].dtype == param_dtype
        np.testing.assert_allclose(
            np.asarray(g_mlp[name]["kernel"][...], np.float32),
            np.asarray(g, np.float32),
            rtol=rtol,
            atol=rtol,
        )


def test_silu_path_goes_through_the_kernel_and_matches_in_interpret_mode():
    build = lambda **kw: rl.GatedMLP(4, 6, use_bias=True, rngs=nnx.Rngs(0), **kw)
    pallas, xla = build(impl="pallas", interpret=True), build(impl="xla")
    x = normal((3, 4), 1)
    # The Pallas kernel shows in the traced program only where asked for.
    assert "pallas_call" in str(jax.make_jaxpr(pallas)(x))
    assert "pallas_call" not in str(jax.make_jaxpr(xla)(x))
    np.testing.assert_allclose(pallas(x), xla(x), rtol=1e-6, atol=1e-6)
    loss = lambda m: jnp.sum(m(x) ** 2)
    g_pallas, g_xla = nnx.grad(loss)(pallas), nnx.grad(loss)(xla)
    for a, b in zip(jax.tree.leaves(g_pallas), jax.tree.leaves(g_xla), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_call_rejects_wrong_features():
    with pytest.raises(ValueError, match=r"x.shape=\(2, 5\)"):
        rl.GatedMLP(4, 6, rngs=nnx.Rngs(0))(jnp.ones((2, 5)))


test_bad_arguments = rejects(
    rl.GatedMLP,
    [
        ({"features": 0}, ValueError, "features=0"),
        ({"hidden_features": 1.5}, TypeError, "hidden_features=1.5"),
        ({"activation": "silu"}, TypeError, "activation='silu'"),
        ({"impl": "triton"}, ValueError, "impl='triton'"),
        ({"use_bias": None}, TypeError, "use_bias=None"),
    ],
    features=4,
    hidden_features=6,
    rngs=nnx.Rngs(0),
)
