"""LayerNorm over the last axis: a Pallas forward and backward under ``jax.custom_vjp``.

Mean and variance are fp32 whatever the activations' dtype; the output has x's dtype. The
backward saves x, the scale and two fp32 numbers per row (mean and rstd), never an fp32 copy of
the activations, on both paths (``impl="xla"`` is the same ``custom_vjp`` with jnp in place of
the kernels). ``bias=None`` means no bias: it is an empty pytree to ``custom_vjp``, whose
gradient is None, and the kernels are built without it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rudax.kernels import _compat, _platform, _rowwise
from rudax.kernels._rowwise import RowBlock


def _centered(x, mean, col_mask):
    """x - mean, zero at padded positions (a padded zero minus the mean is not zero)."""
    xc = x - mean[:, None]
    return xc if col_mask is None else jnp.where(col_mask[None, :], xc, 0.0)


def _layer_norm_kernel(x, scale, *bias, col_mask, epsilon, features):
    """fp32 block math; padded positions of x, scale and bias are zero."""
    mean = jnp.sum(x, axis=-1) / features
    xc = _centered(x, mean, col_mask)
    # Two passes over the block (mean, then squared deviations), not E[x^2] - E[x]^2, which
    # cancels catastrophically when |mean| >> std.
    rstd = jax.lax.rsqrt(jnp.sum(xc * xc, axis=-1) / features + epsilon)
    y = xc * rstd[:, None] * scale[None, :]
    if bias:
        y = y + bias[0][None, :]
    return y, (mean, rstd)


def _layer_norm_backward_kernel(x, g, scale, *rest, col_mask, features, has_bias):
    """dx = rstd * (g*w - mean(g*w) - x_hat * mean(g*w*x_hat)); per row dscale = g * x_hat,
    dbias = g."""
    mean, rstd = rest[-2:]  # rest is (bias, mean, rstd) or (mean, rstd)
    x_hat = _centered(x, mean, col_mask) * rstd[:, None]
    gw = g * scale[None, :]
    c1 = jnp.sum(gw, axis=-1) / features
    c2 = jnp.sum(gw * x_hat, axis=-1) / features
    dx = (gw - c1[:, None] - x_hat * c2[:, None]) * rstd[:, None]
    return dx, ((g * x_hat, g) if has_bias else (g * x_hat,))


@dataclasses.dataclass(frozen=True)
class _Static:
    epsilon: float
    path: str  # resolve_impl's answer: "auto", "pallas", "interpret" or "xla"
    interpret: bool
    block: RowBlock
    bias_dtype: jnp.dtype | None  # None: no bias


def _layer_norm_forward(x_RxN, scale, bias, s: _Static):
    math = functools.partial(_layer_norm_kernel, epsilon=s.epsilon, features=x_RxN.shape[-1])

    def xla(x_RxN, *vectors):
        f32 = jnp.float32
        y, stats = math(x_RxN.astype(f32), *(v.astype(f32) for v in vectors), col_mask=None)
        return y.astype(x_RxN.dtype), *stats

    def pallas(x_RxN, *vectors):
        y, stats = _rowwise.forward(
            math,
            x_RxN,
            vectors,
            num_stats=2,
            block=s.block,
            interpret=s.interpret,
            name="layer_norm_fwd",
        )
        return y, *stats

    vectors = [scale] if bias is None else [scale, bias]
    y, *stats = _platform.run(s.path, pallas, xla, x_RxN, *vectors, name="layer_norm")
    return y, tuple(stats)


def _layer_norm_backward(x_RxN, g_RxN, scale, stats, s: _Static):
    has_bias = s.bias_dtype is not None
    math = functools.partial(
        _layer_norm_backward_kernel, features=x_RxN.shape[-1], has_bias=has_bias
    )

    def xla(x_RxN, g_RxN, scale, *stats):
        f32 = jnp.float32
        dx, row_partials = math(
            x_RxN.astype(f32), g_RxN.astype(f32), scale.astype(f32), *stats, col_mask=None
        )
        return dx.astype(x_RxN.dtype), *(jnp.sum(p, axis=0) for p in row_partials)

    def pallas(x_RxN, g_RxN, scale, *stats):
        dx, partials = _rowwise.backward(
            math,
            x_RxN,
            g_RxN,
            [scale],
            stats,
            num_partials=2 if has_bias else 1,
            block=s.block,
            interpret=s.interpret,
            name="layer_norm_bwd",
        )
        return dx, *partials

    dx, *partials = _platform.run(
        s.path, pallas, xla, x_RxN, g_RxN, scale, *stats, name="layer_norm"
    )
    return dx, tuple(partials)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(
    x_RxN: jax.Array, scale: jax.Array, bias: jax.Array | None, s: _Static
) -> jax.Array:
    return _layer_norm_forward(x_RxN, scale, bias, s)[0]


def _layer_norm_fwd(x_RxN, scale, bias, s):
    y, stats = _layer_norm_forward(x_RxN, scale, bias, s)
    return y, (x_RxN, scale, stats)


def _layer_norm_bwd(s, residuals, g_RxN):
    x_RxN, scale, stats = residuals
    dx, (dscale, *dbias) = _layer_norm_backward(x_RxN, g_RxN, scale, stats, s)
    dbias = dbias[0].astype(s.bias_dtype) if dbias else None
    return dx, dscale.astype(scale.dtype), dbias


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@functools.partial(jax.jit, static_argnames=("s",))
def _layer_norm_jit(x, scale, bias, s):
    scale, bias = _compat.vary_like(scale, x), _compat.vary_like(bias, x)
    y_RxN = _layer_norm(_rowwise.to_rows(x), scale, bias, s)
    # jax.custom_vjp.__new__ is unannotated (it may build a custom_vjp3), so pyright cannot
    # solve its return type through functools.partial and calls it `object`; it is an Array.
    return y_RxN.reshape(x.shape)  # pyright: ignore[reportAttributeAccessIssue]  # see above


def layer_norm(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array | None,
    *,
    epsilon: float = 1e-5,
    impl: str = "auto",
    interpret: bool = False,
    block: RowBlock | None = None,
) -> jax.Array:
    """Layer normalisation over the last axis, scaled and shifted per feature.

    For each row ``x`` of ``N`` features, in fp32::

        mean = mean(x)
        rstd = 1 / sqrt(mean((x - mean) ** 2) + epsilon)
        y = (x - mean) * rstd * scale + bias

    rounded once to x's dtype. Gradients, with ``x_hat = (x - mean) * rstd`` and
    ``gw = g * scale``: ``dx = rstd * (gw - mean(gw) - x_hat * mean(gw * x_hat))``,
    ``dscale = sum over rows of g * x_hat``, ``dbias = sum over rows of g``, accumulated in
    fp32 and returned in the inputs' dtypes. A non-finite value in a row makes that row's
    output non-finite and leaves other rows alone. ``epsilon`` and the biased variance are
    ``torch.nn.LayerNorm``'s.

    Args:
      x: activations ``[..., N]``, any floating dtype.
      scale: ``[N]``, x's dtype or float32.
      bias: ``[N]``, x's dtype or float32; or None for no bias.
      epsilon: added to the variance; a Python number > 0.
      impl: ``"auto"`` (Pallas on a GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.
      interpret: run the Pallas kernels in interpret mode (any backend; for tests).
      block: Pallas block sizes; None for the ones measured fastest on the GPU lowered for
        (``rudax/kernels/auto_table.json``), else picked from the shape.

    Returns:
      ``y`` with x's shape and dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> x = jnp.array([[1.0, 3.0], [2.0, 2.0]])
      >>> rk.layer_norm(x, jnp.ones(2), jnp.zeros(2), epsilon=1e-5).round(3)
      Array([[-1.,  1.],
             [ 0.,  0.]], dtype=float32)

    References:
      Ba, Kiros and Hinton, "Layer Normalization", arXiv:1607.06450, 2016.
    """
    vectors = {"scale": scale} if bias is None else {"scale": scale, "bias": bias}
    epsilon, path, block = _rowwise.check_arguments(
        x, vectors, epsilon, impl, interpret, block, kernel="layer_norm"
    )
    bias_dtype = None if bias is None else jnp.dtype(bias.dtype)
    return _layer_norm_jit(x, scale, bias, _Static(epsilon, path, interpret, block, bias_dtype))


def layer_norm_reference(
    x: jax.Array, scale: jax.Array, bias: jax.Array | None, *, epsilon: float = 1e-5
) -> jax.Array:
    """``layer_norm`` in plain jnp, differentiated by JAX: the definition the kernels match.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> rk.layer_norm_reference(jnp.array([[1.0, 3.0]]), jnp.ones(2), None).round(3)
      Array([[-1.,  1.]], dtype=float32)
    """
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + epsilon) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
