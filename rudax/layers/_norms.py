"""RMSNorm and LayerNorm over the last axis, running on rudax.kernels' fused norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from rudax._validation import (
    check_bool,
    check_impl,
    check_positive,
    check_positive_int,
    float_dtype,
)
from rudax.kernels import layer_norm, rms_norm
from rudax.layers._validation import check_features


def _affine(param: nnx.Param, dtype: jnp.dtype) -> jax.Array:
    """The parameter as the kernel takes it: in the activation dtype or in fp32.

    Storage in any other floating dtype (bf16 scale with fp16 or fp32 activations, say) is
    widened to fp32, which is exact, rather than rounded to the activation dtype.
    """
    value = param[...]
    if value.dtype in (dtype, jnp.dtype(jnp.float32)):
        return value
    return value.astype(jnp.float32)


class RMSNorm(nnx.Module):
    """Root-mean-square normalization over the last axis: ``y = x / rms(x) * scale``.

    With ``c`` the compute dtype (``dtype``, or ``x.dtype`` when it is None)::

        x = c(x)
        y = x * rsqrt(mean(x**2, axis=-1) + epsilon) * scale      (statistics in fp32)

    returned in ``c``. The arithmetic is ``rudax.kernels.rms_norm``: fp32 row statistics, a
    fused Pallas kernel on the GPU (forward and backward), an exact XLA path elsewhere. The
    scale is passed as stored when that is ``c`` or fp32; other storage is widened to fp32.
    Unlike torch's ``nn.RMSNorm`` (``eps=None``: the dtype's machine epsilon), ``epsilon``
    defaults to 1e-6, as in flax.

    Args:
      features: size of the normalized last axis, > 0.
      epsilon: added to the mean square, > 0.
      dtype: compute and output dtype; None for the input's dtype.
      param_dtype: storage dtype of ``scale`` (initialized to ones).
      impl: ``"auto"``, ``"pallas"`` or ``"xla"``, passed to ``rudax.kernels.rms_norm``.
      interpret: run the Pallas kernel in interpret mode (tests on CPU).
      rngs: accepted for symmetry with flax's norms and unused (the init is deterministic).

    Returns:
      A module; calling it on ``x[..., features]`` returns an array of the same shape.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.layers as rl
      >>> norm = rl.RMSNorm(4)
      >>> norm(jnp.array([[2.0, -2.0, 2.0, -2.0]], jnp.bfloat16))
      Array([[1, -1, 1, -1]], dtype=bfloat16)

    References:
      Zhang & Sennrich, `Root Mean Square Layer Normalization
      <https://arxiv.org/abs/1910.07467>`_, 2019.
    """

    def __init__(
        self,
        features: int,
        *,
        epsilon: float = 1e-6,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        impl: str = "auto",
        interpret: bool = False,
        rngs: nnx.Rngs | None = None,
    ):
        check_positive_int("features", features)
        self.epsilon = check_positive("epsilon", epsilon, accept="concrete")
        self.dtype = float_dtype("dtype", dtype)
        param_dtype = float_dtype("param_dtype", param_dtype, allow_none=False)
        check_impl(impl)
        check_bool("interpret", interpret)
        self.features = features
        self.impl = impl
        self.interpret = interpret
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))

    def __call__(self, x: ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        check_features("RMSNorm", x, self.features)
        x = x if self.dtype is None else x.astype(self.dtype)
        return rms_norm(
            x,
            _affine(self.scale, x.dtype),
            epsilon=self.epsilon,
            impl=self.impl,
            interpret=self.interpret,
        )


class LayerNorm(nnx.Module):
    """Layer normalization over the last axis: ``y = (x - mean) / std * scale + bias``.

    With ``c`` the compute dtype (``dtype``, or ``x.dtype`` when it is None)::

        x = c(x)
        y = (x - mean(x)) * rsqrt(var(x) + epsilon) * scale + bias   (statistics in fp32)

    returned in ``c``; ``var`` is the biased variance, as in torch and flax. The arithmetic is
    ``rudax.kernels.layer_norm`` (fp32 row statistics, fused Pallas on the GPU, exact XLA
    elsewhere). Scale and bias are passed as stored when that is ``c`` or fp32; other storage
    is widened to fp32.

    Args:
      features: size of the normalized last axis, > 0.
      epsilon: added to the variance, > 0; 1e-5 as in torch (flax uses 1e-6).
      use_bias: whether to add a bias (initialized to zeros).
      dtype: compute and output dtype; None for the input's dtype.
      param_dtype: storage dtype of ``scale`` (ones) and ``bias``.
      impl: ``"auto"``, ``"pallas"`` or ``"xla"``, passed to ``rudax.kernels.layer_norm``.
      interpret: run the Pallas kernel in interpret mode (tests on CPU).
      rngs: accepted for symmetry with flax's norms and unused (the init is deterministic).

    Returns:
      A module; calling it on ``x[..., features]`` returns an array of the same shape.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.layers as rl
      >>> norm = rl.LayerNorm(4)
      >>> norm(jnp.array([[1.0, 3.0, 1.0, 3.0]])).round(3)
      Array([[-1.,  1., -1.,  1.]], dtype=float32)

    References:
      Ba et al., `Layer Normalization <https://arxiv.org/abs/1607.06450>`_, 2016.
    """

    def __init__(
        self,
        features: int,
        *,
        epsilon: float = 1e-5,
        use_bias: bool = True,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        impl: str = "auto",
        interpret: bool = False,
        rngs: nnx.Rngs | None = None,
    ):
        check_positive_int("features", features)
        self.epsilon = check_positive("epsilon", epsilon, accept="concrete")
        check_bool("use_bias", use_bias)
        self.dtype = float_dtype("dtype", dtype)
        param_dtype = float_dtype("param_dtype", param_dtype, allow_none=False)
        check_impl(impl)
        check_bool("interpret", interpret)
        self.features = features
        self.impl = impl
        self.interpret = interpret
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype)) if use_bias else None

    def __call__(self, x: ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        check_features("LayerNorm", x, self.features)
        x = x if self.dtype is None else x.astype(self.dtype)
        return layer_norm(
            x,
            _affine(self.scale, x.dtype),
            None if self.bias is None else _affine(self.bias, x.dtype),
            epsilon=self.epsilon,
            impl=self.impl,
            interpret=self.interpret,
        )
