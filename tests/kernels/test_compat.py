"""rudax.kernels._compat: impl resolution, the GPU lowering, masked block access, and the
lowering check (tests/kernels/_lowering.py) every kernel test relies on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from rudax.kernels import _compat
from tests.kernels._lowering import assert_lowers_for_gpu

ON_GPU = jax.default_backend() == "gpu"


def test_resolve_impl_does_not_ask_the_backend():
    """The path is the same on any host: Pallas or XLA is chosen where it is lowered."""
    assert _compat.resolve_impl("xla") == "xla"
    assert _compat.resolve_impl("xla", interpret=True) == "xla"
    assert _compat.resolve_impl("auto") == "auto"
    assert _compat.resolve_impl("auto", interpret=True) == "auto"
    assert _compat.resolve_impl("pallas") == "pallas"
    assert _compat.resolve_impl("pallas", interpret=True) == "interpret"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"impl": "triton"}, ValueError, "impl='triton'"),
        ({"impl": None}, ValueError, "impl=None"),
        ({"impl": "xla", "interpret": 1}, TypeError, "interpret=1"),
    ],
)
def test_resolve_impl_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        _compat.resolve_impl(**kwargs)


def test_gpu_compiler_params():
    params = _compat.gpu_compiler_params(num_warps=8, num_stages=2)
    assert (params.num_warps, params.num_stages) == (8, 2)
    for kwargs, match in [
        ({"num_warps": 3}, "num_warps=3"),
        ({"num_warps": 0}, "num_warps=0"),
        ({"num_stages": 0}, "num_stages=0"),
        ({"num_stages": True}, "num_stages=True"),
    ]:
        with pytest.raises(ValueError, match=match):
            _compat.gpu_compiler_params(**kwargs)


def _double_kernel(x_ref, o_ref, *, rows, cols):
    """Doubles a (4, 128) block of a smaller array: the overhang is masked on both axes."""
    r = pl.program_id(0) * x_ref.shape[0] + jnp.arange(x_ref.shape[0])
    c = jnp.arange(x_ref.shape[1])
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    x = _compat.load(x_ref, mask=mask, other=0.0)
    _compat.store(o_ref, x * 2, mask=mask)


def _double(x, *, interpret, name="double"):
    rows, cols = x.shape
    spec = pl.BlockSpec((4, 128), lambda i: (i, 0))
    return _compat.pallas_call(
        functools.partial(_double_kernel, rows=rows, cols=cols),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(rows, 4),),
        in_specs=[spec],
        out_specs=spec,
        interpret=interpret,
        name=name,
    )(x)


@jax.custom_vjp
def _double_differentiable(x):
    return _double(x, interpret=False)


def _double_fwd(x):
    return _double(x, interpret=False), None


def _double_bwd(_, g):
    return (_double(g, interpret=False, name="double_bwd"),)


_double_differentiable.defvjp(_double_fwd, _double_bwd)


def test_masked_block():
    """Interpreted off a GPU, compiled on one."""
    x = jnp.arange(6 * 100, dtype=jnp.float32).reshape(6, 100)
    np.testing.assert_array_equal(_double(x, interpret=not ON_GPU), 2 * np.asarray(x))


def test_lowering_check_accepts_a_kernel_and_rejects_a_fallback():
    struct = jax.ShapeDtypeStruct((6, 100), jnp.bfloat16)
    kernel = _double_differentiable
    assert_lowers_for_gpu(kernel, struct, kernels=["double"], backward_kernels=["double_bwd"])
    with pytest.raises(AssertionError, match="not in the export"):
        assert_lowers_for_gpu(kernel, struct, kernels=["triple"])
    with pytest.raises(AssertionError, match="backward: kernels"):
        assert_lowers_for_gpu(kernel, struct, backward_kernels=["triple_bwd"])
    with pytest.raises(AssertionError, match="fall back to XLA"):
        assert_lowers_for_gpu(lambda x: x * 2, struct)


def test_without_the_triton_backend(monkeypatch):
    """A JAX without pallas.triton: auto falls back to XLA, interpreted kernels still run."""
    monkeypatch.setattr(_compat, "_triton", None)
    assert not _compat.gpu_lowering_available()
    assert _compat.gpu_compiler_params() is None
    assert _compat.resolve_impl("auto") == "xla"
    with pytest.raises(ValueError, match="Triton lowering"):
        _compat.resolve_impl("pallas")
    assert _compat.resolve_impl("pallas", interpret=True) == "interpret"
    x = jnp.arange(6 * 100, dtype=jnp.float32).reshape(6, 100)
    np.testing.assert_array_equal(_double(x, interpret=True), 2 * np.asarray(x))
