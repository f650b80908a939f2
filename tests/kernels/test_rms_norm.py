"""rudax.kernels.rms_norm against rms_norm_reference and jax.grad of it.

The Pallas kernels run compiled on a GPU and in interpret mode elsewhere (about 1 ms per grid
step there), with small blocks (``RowBlock(rows=2, programs=2)``) so that the tiny shapes here
still take several grid steps: (5, 96) is three row blocks, the last one ragged, and the
backward's two programs loop twice, the second pass of one of them wholly past the last row.
Feature sizes 8, 96 and 100 are padded to 8, 128 and 128 inside the kernels and masked.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import rudax.kernels as rk
from rudax.kernels import _rms_norm
from tests.kernels._lowering import assert_lowers_for_gpu

SMALL = rk.RowBlock(rows=2, programs=2)
# Compiled on a GPU (benchmarks/gpu_check.sh runs this file there), interpreted elsewhere.
INTERPRET = jax.default_backend() != "gpu"

# fp32: forward and backward are fp32 expressions of the same terms as the reference and its
# autodiff, summed in another order: a few ulps apart. bf16: every result is an fp32 value
# rounded once, so op and reference agree to one bf16 ulp (2**-7 relative); the scale's
# gradient, when the scale is fp32, is an fp32 sum of bf16 products and stays tight.
TOLERANCES = {
    jnp.float32: dict(rtol=1e-5, atol=1e-6),
    jnp.bfloat16: dict(rtol=2**-7, atol=1e-5),
}

IMPLS = [
    pytest.param({"impl": "pallas", "interpret": INTERPRET, "block": SMALL}, id="pallas"),
    pytest.param({"impl": "xla"}, id="xla"),
]


def _operands(shape, dtype, scale_dtype, seed=0):
    kx, ks, kg = jax.random.split(jax.random.key(seed), 3)
    x = (2.0 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    scale = (1.0 + 0.5 * jax.random.normal(ks, shape[-1:], jnp.float32)).astype(scale_dtype)
    dy = jax.random.normal(kg, shape, jnp.float32).astype(dtype)
    return x, scale, dy


@functools.partial(jax.jit, static_argnums=0)
def _value_and_vjp(fn, x, scale, dy):
    """(fn(x, scale), dx, dscale) in one compilation."""
    y, vjp = jax.vjp(fn, x, scale)
    return (y, *vjp(dy))


def _assert_matches_reference(kwargs, x, scale, dy, tol):
    op = functools.partial(rk.rms_norm, epsilon=1e-6, **kwargs)
    ref = functools.partial(rk.rms_norm_reference, epsilon=1e-6)
    got = _value_and_vjp(op, x, scale, dy)
    want = _value_and_vjp(ref, x, scale, dy)
    for name, g, w in zip(("y", "dx", "dscale"), got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=name, **tol
        )


@pytest.mark.parametrize("kwargs", IMPLS)
@pytest.mark.parametrize("shape", [(3, 8), (5, 96), (2, 3, 100)])
def test_fp32_matches_reference(kwargs, shape):
    x, scale, dy = _operands(shape, jnp.float32, jnp.float32)
    _assert_matches_reference(kwargs, x, scale, dy, TOLERANCES[jnp.float32])


@pytest.mark.parametrize("kwargs", IMPLS)
@pytest.mark.parametrize(
    ("shape", "scale_dtype"), [((5, 96), jnp.bfloat16), ((2, 3, 100), jnp.float32)]
)
def test_bf16_matches_reference(kwargs, shape, scale_dtype):
    x, scale, dy = _operands(shape, jnp.bfloat16, scale_dtype)
    _assert_matches_reference(kwargs, x, scale, dy, TOLERANCES[jnp.bfloat16])


@pytest.mark.parametrize("kwargs", IMPLS)
def test_vmap(kwargs):
    """vmap of the op and of its gradient (per-example scale gradients) match the reference's."""
    x, scale, dy = _operands((3, 5, 96), jnp.float32, jnp.float32)
    op = functools.partial(rk.rms_norm, **kwargs)

    def per_example(fn):
        return jax.jit(jax.vmap(lambda x, dy: _value_and_vjp(fn, x, scale, dy)))(x, dy)

    got, want = per_example(op), per_example(rk.rms_norm_reference)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOLERANCES[jnp.float32])


@pytest.mark.parametrize("kwargs", IMPLS)
def test_non_finite_stays_in_its_row(kwargs):
    x, scale, dy = _operands((5, 96), jnp.float32, jnp.float32)
    x = x.at[1, 7].set(jnp.nan).at[3, 95].set(jnp.inf)
    got = _value_and_vjp(functools.partial(rk.rms_norm, **kwargs), x, scale, dy)
    want = _value_and_vjp(rk.rms_norm_reference, x, scale, dy)
    clean = np.array([0, 2, 4])
    for g, w in zip(got[:2], want[:2], strict=True):  # y and dx are per row
        assert np.isfinite(g[clean]).all()
        assert not np.isfinite(g[1]).any()  # NaN reaches every feature of its row
        np.testing.assert_allclose(g, w, **TOLERANCES[jnp.float32])  # NaN where it has NaN
    assert not np.isfinite(got[2]).all()  # dscale sums over rows


@pytest.mark.parametrize("kwargs", IMPLS)
def test_residuals_are_inputs_and_fp32_row_statistics(kwargs, capsys):
    """What the backward keeps: x (bf16), the scale and an fp32 rstd per row; no fp32 copy."""
    x, scale, _ = _operands((2, 3, 100), jnp.bfloat16, jnp.float32)
    print_saved_residuals(functools.partial(rk.rms_norm, **kwargs), x, scale)
    lines = sorted(capsys.readouterr().out.strip().splitlines())
    assert [line.split()[0] for line in lines] == ["bf16[6,100]", "f32[100]", "f32[6]"], lines

    print_saved_residuals(rk.rms_norm_reference, x, scale)  # the reference does keep copies
    assert "f32[2,3,100]" in capsys.readouterr().out


def test_no_recompilation_on_second_call():
    x, scale, dy = _operands((5, 96), jnp.float32, jnp.float32)
    op = functools.partial(rk.rms_norm, impl="pallas", interpret=INTERPRET, block=SMALL)
    step = jax.jit(lambda x, s, dy: _value_and_vjp(op, x, s, dy))
    compiled = _rms_norm._rms_norm_jit._cache_size()
    rk.rms_norm(x, scale)
    rk.rms_norm(x + 1, scale * 2)
    assert _rms_norm._rms_norm_jit._cache_size() == compiled + 1
    step(x, scale, dy)
    step(x + 1, scale, dy)
    assert step._cache_size() == 1


@pytest.mark.parametrize(
    ("shape", "dtype", "scale_dtype"),
    [
        ((5, 96), jnp.bfloat16, jnp.float32),
        ((7, 4095), jnp.float32, jnp.float32),
        ((8192, 4096), jnp.bfloat16, jnp.bfloat16),  # the benchmark's shape, default blocks
    ],
)
def test_lowers_for_gpu(shape, dtype, scale_dtype):
    assert_lowers_for_gpu(
        lambda x, s: rk.rms_norm(x, s, impl="pallas"),
        jax.ShapeDtypeStruct(shape, dtype),
        jax.ShapeDtypeStruct(shape[-1:], scale_dtype),
        kernels=["rms_norm_fwd"],
        backward_kernels=["rms_norm_bwd"],
    )


def test_auto_is_xla_off_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU, auto is the Pallas path")
    x, scale, _ = _operands((3, 8), jnp.float32, jnp.float32)
    np.testing.assert_array_equal(rk.rms_norm(x, scale), rk.rms_norm(x, scale, impl="xla"))


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (((3, 8), jnp.int32, (8,), jnp.float32), {}, TypeError, "x must be a floating"),
        (((3, 8), jnp.float32, (7,), jnp.float32), {}, ValueError, r"scale\.shape=\(7,\)"),
        (((3, 8), jnp.float32, (3, 8), jnp.float32), {}, ValueError, "scale must have shape"),
        (((3, 8), jnp.float32, (8,), jnp.bfloat16), {}, TypeError, "scale.dtype=bfloat16"),
        (((3, 0), jnp.float32, (0,), jnp.float32), {}, ValueError, "non-empty last"),
        (((3, 8), jnp.float32, (8,), jnp.float32), {"epsilon": 0.0}, ValueError, "epsilon=0.0"),
        (((3, 8), jnp.float32, (8,), jnp.float32), {"epsilon": -1}, ValueError, "epsilon=-1"),
        (((3, 8), jnp.float32, (8,), jnp.float32), {"epsilon": np.nan}, ValueError, "epsilon"),
        (((3, 8), jnp.float32, (8,), jnp.float32), {"epsilon": "1e-6"}, TypeError, "epsilon"),
        (((3, 8), jnp.float32, (8,), jnp.float32), {"impl": "cuda"}, ValueError, "impl='cuda'"),
        (((3, 8), jnp.float32, (8,), jnp.float32), {"block": 8}, TypeError, "block=8"),
        (((3, 8), jnp.float32, (8,), jnp.float32), {"interpret": 1}, TypeError, "interpret=1"),
        (
            ((1, 16385), jnp.float32, (16385,), jnp.float32),
            {"impl": "pallas", "interpret": True},
            ValueError,
            "at most 16384 features",
        ),
    ],
)
def test_bad_input(args, kwargs, error, match):
    shape, dtype, scale_shape, scale_dtype = args
    with pytest.raises(error, match=match):
        rk.rms_norm(jnp.ones(shape, dtype), jnp.ones(scale_shape, scale_dtype), **kwargs)


def test_pallas_off_gpu_needs_interpret():
    if jax.default_backend() == "gpu":
        pytest.skip("compiled Pallas runs on a GPU")
    with pytest.raises(ValueError, match="interpret=True"):
        rk.rms_norm(jnp.ones((3, 8)), jnp.ones(8), impl="pallas")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rows": 3}, ValueError, "rows=3"),
        ({"num_warps": 0}, ValueError, "num_warps=0"),
        ({"programs": 0}, ValueError, "programs=0"),
        ({"programs": 1.5}, TypeError, "programs=1.5"),
        ({"rows": True}, TypeError, "rows=True"),
    ],
)
def test_bad_row_block(kwargs, error, match):
    with pytest.raises(error, match=match):
        rk.RowBlock(**kwargs)
