"""rudax.kernels.silu_mul against silu_mul_reference, jax.nn.silu and jax.grad of both.

The Pallas kernel runs in interpret mode on CPU (about 1 ms per grid step), so the blocks
here are small (``SiluMulBlock(size=128)``): (8, 16) is one full block, (3, 100) and
(2, 5, 96) end in a block that overhangs the array and is read and written under a mask.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import rudax.kernels as rk
from rudax.kernels import _silu_mul
from tests.kernels._lowering import assert_lowers_for_gpu

ON_GPU = jax.default_backend() == "gpu"
# Compiled on a GPU (benchmarks/gpu_check.sh), interpreted elsewhere.
INTERPRET = not ON_GPU
SHAPES = [(8, 16), (3, 100), (2, 5, 96)]
SMALL = rk.SiluMulBlock(size=128)

# fp32: the op and the reference run the same fp32 expression, so the forward agrees to
# rounding; the gradients are the hand-written rule against autodiff's own association of
# the same terms, a few ulps apart. bf16: each result is the fp32 value rounded once, so it
# is within one bf16 ulp (2**-8 relative) of the rounded fp32 reference.
TOLERANCES = {
    jnp.float32: {"forward": dict(rtol=1e-6, atol=1e-7), "grad": dict(rtol=1e-5, atol=1e-6)},
    jnp.bfloat16: {"forward": dict(rtol=2**-8, atol=1e-6), "grad": dict(rtol=2**-8, atol=1e-5)},
}

IMPLS = [
    pytest.param({"impl": "pallas", "interpret": INTERPRET, "block": SMALL}, id="pallas"),
    pytest.param({"impl": "xla"}, id="xla"),
]


def _operands(shape, dtype, seed=0):
    """gate spread over [-9, 9] (both saturated tails of the sigmoid), up and d_out ~ N(0, 1)."""
    kg, ku, kd = jax.random.split(jax.random.key(seed), 3)
    gate = (3.0 * jax.random.normal(kg, shape, jnp.float32)).astype(dtype)
    up = jax.random.normal(ku, shape, jnp.float32).astype(dtype)
    d_out = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return gate, up, d_out


@functools.partial(jax.jit, static_argnums=0)
def _value_and_vjp(fn, gate, up, d_out):
    """(fn(gate, up), d_gate, d_up), in one compilation (faster than eager vjp here)."""
    out, vjp = jax.vjp(fn, gate, up)
    return (out, *vjp(d_out))


def _plain_silu_mul(gate, up):
    """jax.nn.silu(gate) * up, written without rudax: in fp32, rounded to the input dtype."""
    f32 = jnp.float32
    return (jax.nn.silu(gate.astype(f32)) * up.astype(f32)).astype(gate.dtype)


def _assert_close(actual, expected, tol, what):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), err_msg=what, **tol
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kwargs", IMPLS)
def test_forward_and_grad_match_references(kwargs, shape, dtype):
    gate, up, d_out = _operands(shape, dtype)
    out, d_gate, d_up = _value_and_vjp(lambda g, u: rk.silu_mul(g, u, **kwargs), gate, up, d_out)
    assert out.shape == d_gate.shape == d_up.shape == shape
    assert out.dtype == d_gate.dtype == d_up.dtype == dtype
    tol = TOLERANCES[dtype]
    for name, reference in [("reference", rk.silu_mul_reference), ("silu", _plain_silu_mul)]:
        want = _value_and_vjp(reference, gate, up, d_out)
        _assert_close(out, want[0], tol["forward"], f"forward vs {name}")
        _assert_close(d_gate, want[1], tol["grad"], f"d_gate vs {name}")
        _assert_close(d_up, want[2], tol["grad"], f"d_up vs {name}")


def test_pallas_equals_xla_with_the_default_block():
    # One block of 1024 for 960 elements: the masked tail inside a single program.
    gate, up, d_out = _operands((2, 5, 96), jnp.float32, seed=1)
    pallas = _value_and_vjp(
        lambda g, u: rk.silu_mul(g, u, impl="pallas", interpret=INTERPRET), gate, up, d_out
    )
    xla = _value_and_vjp(lambda g, u: rk.silu_mul(g, u, impl="xla"), gate, up, d_out)
    for p, x, what in zip(pallas, xla, ["out", "d_gate", "d_up"], strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(x), err_msg=what)


@pytest.mark.parametrize("shape", [(), (1,), (0, 3)], ids=str)
def test_scalar_single_and_empty(shape):
    gate, up, d_out = _operands(shape, jnp.float32, seed=2)
    got = _value_and_vjp(
        lambda g, u: rk.silu_mul(g, u, impl="pallas", interpret=INTERPRET), gate, up, d_out
    )
    want = _value_and_vjp(rk.silu_mul_reference, gate, up, d_out)
    for g, w in zip(got, want, strict=True):
        assert g.shape == shape
        _assert_close(g, w, TOLERANCES[jnp.float32]["grad"], str(shape))


@pytest.mark.parametrize("kwargs", IMPLS)
def test_vmap_of_forward_and_grad(kwargs):
    gate, up, d_out = _operands((2, 5, 96), jnp.float32, seed=3)
    op = lambda g, u: rk.silu_mul(g, u, **kwargs)
    per_example = lambda g, u, d: _value_and_vjp(op, g, u, d)
    got = jax.vmap(per_example)(gate, up, d_out)
    want = _value_and_vjp(rk.silu_mul_reference, gate, up, d_out)
    for g, w, what in zip(got, want, ["out", "d_gate", "d_up"], strict=True):
        _assert_close(g, w, TOLERANCES[jnp.float32]["grad"], what)


@pytest.mark.parametrize("kwargs", IMPLS)
def test_nonfinite_inputs_propagate_elementwise(kwargs):
    gate, up, d_out = _operands((3, 100), jnp.float32, seed=4)
    gate = gate.at[0, 3].set(jnp.nan).at[1, 50].set(jnp.inf).at[2, 99].set(-jnp.inf)
    up = up.at[0, 7].set(jnp.nan).at[2, 0].set(jnp.inf)
    got = _value_and_vjp(lambda g, u: rk.silu_mul(g, u, **kwargs), gate, up, d_out)
    want = _value_and_vjp(_plain_silu_mul, gate, up, d_out)
    bad = np.zeros((3, 100), bool)
    bad[0, 3] = bad[1, 50] = bad[2, 99] = bad[0, 7] = bad[2, 0] = True
    for g, w, what in zip(got, want, ["out", "d_gate", "d_up"], strict=True):
        g, w = np.asarray(g), np.asarray(w)
        # Where jax.nn.silu gives NaN or inf, so does the op; no other element is touched.
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=what)
        np.testing.assert_array_equal(np.isposinf(g), np.isposinf(w), err_msg=what)
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg=what)
        assert np.isfinite(g[~bad]).all(), what
        np.testing.assert_allclose(g[~bad], w[~bad], err_msg=what, rtol=1e-5, atol=1e-6)
    # silu(-inf) = -inf * sigmoid(-inf) = -inf * 0: NaN, as jax.nn.silu has it.
    assert np.isnan(np.asarray(got[0])[2, 99])


@pytest.mark.parametrize("kwargs", IMPLS)
def test_backward_saves_only_the_inputs(kwargs, capsys):
    gate, up, _ = _operands((3, 100), jnp.bfloat16, seed=5)
    loss = lambda g, u: rk.silu_mul(g, u, **kwargs).astype(jnp.float32).sum()
    print_saved_residuals(loss, gate, up)
    lines = capsys.readouterr().out.strip().splitlines()
    assert sorted(lines) == [
        "bf16[3,100] from the argument g",
        "bf16[3,100] from the argument u",
    ], lines


def test_plain_silu_would_fail_the_residual_check(capsys):
    """The check above can fail: autodiff of jax.nn.silu in fp32 keeps fp32 activations."""
    gate, up, _ = _operands((3, 100), jnp.bfloat16, seed=5)
    loss = lambda g, u: _plain_silu_mul(g, u).astype(jnp.float32).sum()
    print_saved_residuals(loss, gate, up)
    assert "f32[3,100]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((8192, 4096), jnp.bfloat16), ((3, 100), jnp.float32), ((2, 5, 96), jnp.float16)],
    ids=["8192x4096-bf16", "3x100-fp32", "2x5x96-fp16"],
)
def test_lowers_for_gpu(shape, dtype):
    spec = jax.ShapeDtypeStruct(shape, dtype)
    assert_lowers_for_gpu(
        lambda g, u: rk.silu_mul(g, u, impl="pallas"),
        spec,
        spec,
        kernels=["silu_mul_fwd"],
        backward_kernels=["silu_mul_bwd"],
    )


def test_second_call_does_not_recompile():
    shape = (7, 9)  # a shape no other test uses, so the first call below compiles
    first, second = _operands(shape, jnp.float32, seed=6), _operands(shape, jnp.float32, seed=7)
    op = lambda g, u: rk.silu_mul(g, u, impl="pallas", interpret=INTERPRET, block=SMALL)
    before = _silu_mul._silu_mul_jit._cache_size()
    op(*first[:2])
    assert _silu_mul._silu_mul_jit._cache_size() == before + 1
    op(*second[:2])
    assert _silu_mul._silu_mul_jit._cache_size() == before + 1, "the second call recompiled"

    step = jax.jit(jax.grad(lambda g, u: op(g, u).sum(), argnums=(0, 1)))
    step(*first[:2])
    step(*second[:2])
    assert step._cache_size() == 1, "the gradient recompiled for new values"


@pytest.mark.parametrize(
    ("gate", "up", "kwargs", "error", "match"),
    [
        (jnp.ones((3, 4)), jnp.ones((4, 3)), {}, ValueError, r"gate.shape=\(3, 4\), up.shape"),
        (jnp.ones(3), jnp.ones(3, jnp.bfloat16), {}, TypeError, "up.dtype=bfloat16"),
        (jnp.ones(3, jnp.int32), jnp.ones(3, jnp.int32), {}, TypeError, "floating dtype"),
        ([1.0, 2.0], jnp.ones(2), {}, TypeError, r"gate=\[1.0, 2.0\]"),
        (jnp.ones(3), jnp.ones(3), {"impl": "triton"}, ValueError, "impl='triton'"),
        (jnp.ones(3), jnp.ones(3), {"interpret": 1}, TypeError, "interpret=1"),
        (jnp.ones(3), jnp.ones(3), {"block": 128}, TypeError, "block=128"),
    ],
)
def test_bad_inputs(gate, up, kwargs, error, match):
    with pytest.raises(error, match=match):
        rk.silu_mul(gate, up, **kwargs)


@pytest.mark.skipif(ON_GPU, reason="compiled Pallas runs on a GPU")
def test_compiled_pallas_on_cpu_says_to_interpret():
    with pytest.raises(ValueError, match="interpret=True"):
        rk.silu_mul(jnp.ones(3), jnp.ones(3), impl="pallas")


def test_arrays_past_int32_offsets_take_the_xla_path():
    """Traced only (no 4 GiB array): the Triton lowering indexes 1-D blocks in int32."""
    huge = jax.ShapeDtypeStruct((2**31,), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"at most 2147483647 elements"):
        jax.eval_shape(lambda g: rk.silu_mul(g, g, impl="pallas", interpret=INTERPRET), huge)
    # "auto" is plain XLA at any size (measured faster than the kernel on an H200:
    # rudax.kernels._auto); "pallas" binds the kernel call up to the limit.
    small = jax.ShapeDtypeStruct((2**31 - 1,), jnp.bfloat16)
    for shape in (huge, small):
        assert "rudax_on_platform" not in str(jax.make_jaxpr(lambda g: rk.silu_mul(g, g))(shape))
    pallas = lambda g: rk.silu_mul(g, g, impl="pallas", interpret=INTERPRET)
    assert ("rudax_on_platform" in str(jax.make_jaxpr(pallas)(small))) is not INTERPRET


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"size": 100}, ValueError, "size=100"),
        ({"size": 0}, ValueError, "size=0"),
        ({"size": 128.0}, TypeError, "size=128.0"),
        ({"num_warps": 3}, ValueError, "num_warps=3"),
        ({"num_warps": True}, TypeError, "num_warps=True"),
    ],
)
def test_bad_block(kwargs, error, match):
    with pytest.raises(error, match=match):
        rk.SiluMulBlock(**kwargs)
