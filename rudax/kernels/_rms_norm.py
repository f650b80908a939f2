"""RMSNorm over the last axis: a Pallas forward and backward under ``jax.custom_vjp``.

Statistics are fp32 whatever the activations' dtype; the output has x's dtype. The backward
saves x, the scale and one fp32 ``rstd`` per row, never an fp32 copy of the activations: for
bf16 activations that is half the residual memory of differentiating the jnp expression, on
both paths (``impl="xla"`` is the same ``custom_vjp`` with jnp in place of the kernels).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rudax.kernels import _compat, _platform, _rowwise
from rudax.kernels._rowwise import RowBlock


def _rms_norm_kernel(x, scale, *, col_mask, epsilon, features):
    """fp32 block math: padded positions of x and scale are zero, so sums need no mask."""
    del col_mask
    rstd = jax.lax.rsqrt(jnp.sum(x * x, axis=-1) / features + epsilon)
    return x * rstd[:, None] * scale[None, :], (rstd,)


def _rms_norm_backward_kernel(x, g, scale, rstd, *, col_mask, features):
    """dx = rstd * (g*w - x_hat * mean(g*w*x_hat)); per-row dscale = g * x_hat."""
    del col_mask
    x_hat = x * rstd[:, None]
    gw = g * scale[None, :]
    c = jnp.sum(gw * x_hat, axis=-1) / features
    return (gw - x_hat * c[:, None]) * rstd[:, None], (g * x_hat,)


@dataclasses.dataclass(frozen=True)
class _Static:
    epsilon: float
    path: str  # resolve_impl's answer: "auto", "pallas", "interpret" or "xla"
    interpret: bool
    block: RowBlock


def _rms_norm_forward(x_RxN, scale, s: _Static):
    math = functools.partial(_rms_norm_kernel, epsilon=s.epsilon, features=x_RxN.shape[-1])

    def xla(x_RxN, scale):
        f32 = jnp.float32
        y, (rstd,) = math(x_RxN.astype(f32), scale.astype(f32), col_mask=None)
        return y.astype(x_RxN.dtype), rstd

    def pallas(x_RxN, scale):
        y, (rstd,) = _rowwise.forward(
            math,
            x_RxN,
            [scale],
            num_stats=1,
            block=s.block,
            interpret=s.interpret,
            name="rms_norm_fwd",
        )
        return y, rstd

    return _platform.run(s.path, pallas, xla, x_RxN, scale, name="rms_norm")


def _rms_norm_backward(x_RxN, g_RxN, scale, rstd, s: _Static):
    math = functools.partial(_rms_norm_backward_kernel, features=x_RxN.shape[-1])

    def xla(x_RxN, g_RxN, scale, rstd):
        f32 = jnp.float32
        dx, (dscale_rows,) = math(
            x_RxN.astype(f32), g_RxN.astype(f32), scale.astype(f32), rstd, col_mask=None
        )
        return dx.astype(x_RxN.dtype), jnp.sum(dscale_rows, axis=0)

    def pallas(x_RxN, g_RxN, scale, rstd):
        dx, (dscale,) = _rowwise.backward(
            math,
            x_RxN,
            g_RxN,
            [scale],
            [rstd],
            num_partials=1,
            block=s.block,
            interpret=s.interpret,
            name="rms_norm_bwd",
        )
        return dx, dscale

    return _platform.run(s.path, pallas, xla, x_RxN, g_RxN, scale, rstd, name="rms_norm")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x_RxN: jax.Array, scale: jax.Array, s: _Static) -> jax.Array:
    return _rms_norm_forward(x_RxN, scale, s)[0]


def _rms_norm_fwd(x_RxN, scale, s):
    y, rstd = _rms_norm_forward(x_RxN, scale, s)
    return y, (x_RxN, scale, rstd)


def _rms_norm_bwd(s, residuals, g_RxN):
    x_RxN, scale, rstd = residuals
    dx, dscale = _rms_norm_backward(x_RxN, g_RxN, scale, rstd, s)
    return dx, dscale.astype(scale.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.jit, static_argnames=("s",))
def _rms_norm_jit(x, scale, s):
    scale = _compat.vary_like(scale, x)
    y_RxN = _rms_norm(_rowwise.to_rows(x), scale, s)
    # jax.custom_vjp.__new__ is unannotated (it may build a custom_vjp3), so pyright cannot
    # solve its return type through functools.partial and calls it `object`; it is an Array.
    return y_RxN.reshape(x.shape)  # pyright: ignore[reportAttributeAccessIssue]  # see above


def rms_norm(
    x: jax.Array,
    scale: jax.Array,
    *,
    epsilon: float = 1e-6,
    impl: str = "auto",
    interpret: bool = False,
    block: RowBlock | None = None,
) -> jax.Array:
    """Root-mean-square normalisation over the last axis, scaled per feature.

    For each row ``x`` of ``N`` features, in fp32::

        rstd = 1 / sqrt(mean(x ** 2) + epsilon)
        y = x * rstd * scale

    rounded once to x's dtype. Gradients: ``dx = rstd * (g*scale - x_hat * mean(g*scale*x_hat))``
    with ``x_hat = x * rstd``, and ``dscale = sum over rows of g * x_hat``, accumulated in fp32
    and returned in x's and scale's dtypes. A non-finite value changes only its own row: a NaN
    makes the whole row NaN, an inf gives NaN in its place and zeros beside it (rstd is 0), as
    the expression above does; the scale's gradient, a sum over rows, is then non-finite.

    ``torch.nn.RMSNorm`` computes the same way (fp32 for bf16/fp16 inputs, the scale applied in
    fp32, one rounding) but defaults ``eps`` to fp32's machine epsilon (about 1.19e-7); rudax
    defaults ``epsilon`` to 1e-6, flax's ``nnx.RMSNorm`` default.

    Args:
      x: activations ``[..., N]``, any floating dtype.
      scale: ``[N]``, x's dtype or float32.
      epsilon: added to the mean square; a Python number > 0.
      impl: ``"auto"`` (Pallas on a GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``. The
        choice is made where the computation is lowered, per platform, so one trace
        exported with ``jax.export(..., platforms=["cuda", "cpu"])`` runs the kernel on CUDA
        and XLA on the CPU; ``"pallas"`` lowered for a platform other than a GPU raises.
      interpret: run the Pallas kernels in interpret mode (any backend; for tests).
      block: Pallas block sizes; None for the ones measured fastest on the GPU lowered for
        (``rudax/kernels/auto_table.json``), else picked from the shape.

    Returns:
      ``y`` with x's shape and dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> x = jnp.array([[1.0, -1.0], [2.0, 2.0]])
      >>> rk.rms_norm(x, jnp.array([1.0, 0.5]), epsilon=1e-6).round(3)
      Array([[ 1. , -0.5],
             [ 1. ,  0.5]], dtype=float32)

    References:
      Zhang and Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019.
    """
    epsilon, path, block = _rowwise.check_arguments(
        x, {"scale": scale}, epsilon, impl, interpret, block, kernel="rms_norm"
    )
    return _rms_norm_jit(x, scale, _Static(epsilon, path, interpret, block))


def rms_norm_reference(x: jax.Array, scale: jax.Array, *, epsilon: float = 1e-6) -> jax.Array:
    """``rms_norm`` in plain jnp, differentiated by JAX: the definition the kernels match.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> rk.rms_norm_reference(jnp.array([[2.0, -2.0]]), jnp.ones(2)).round(3)
      Array([[ 1., -1.]], dtype=float32)
    """
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)
    return (x32 * rstd * scale.astype(jnp.float32)).astype(x.dtype)
