"""Linear: y = x @ W + b over the last axis, with storage and compute dtypes chosen apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from rudax._validation import check_bool, check_positive_int, float_dtype
from rudax.layers._matmul import rows_matmul
from rudax.layers._validation import check_features

# flax's default for dense kernels: a normal truncated at ±2 std, scaled to variance 1/in.
DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()


class Linear(nnx.Module):
    """A dense layer over the last axis: ``y = x @ kernel + bias``, kernel stored ``[in, out]``.

    With ``c`` the compute dtype (``dtype``, or ``x.dtype`` when it is None)::

        y = c(x) @ c(kernel) + c(bias)        (y in dtype c)

    Casts are explicit, so the layer runs under ``jax_numpy_dtype_promotion="strict"``. flax's
    ``nnx.Linear`` with ``dtype=None`` promotes ``x`` and the parameters to a common dtype
    (bf16 ``x`` with fp32 parameters computes in fp32); here None means the input's dtype, so
    a bf16 activation stream stays bf16 whatever the parameters are stored in.

    Args:
      in_features: size of the input's last axis, > 0.
      out_features: size of the output's last axis, > 0.
      use_bias: whether to add a bias (initialized to zeros).
      dtype: compute and output dtype; None for the input's dtype.
      param_dtype: storage dtype of kernel and bias.
      kernel_init: initializer of the ``[in, out]`` kernel; flax's default, LeCun normal
        (torch's ``nn.Linear`` draws U(±1/sqrt(in)) instead).
      precision: passed to ``lax.dot_general``.
      rngs: the ``nnx.Rngs`` whose ``params`` stream draws the kernel.

    Returns:
      A module; calling it on ``x[..., in_features]`` returns ``y[..., out_features]`` in the
      compute dtype. A non-floating ``x`` is a TypeError, a wrong last axis a ValueError.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> layer = rl.Linear(3, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> y = layer(jnp.ones((2, 3), jnp.float32))
      >>> y.shape, y.dtype, layer.kernel.dtype
      ((2, 4), dtype('float32'), dtype(bfloat16))

    References:
      LeCun et al., `Efficient BackProp <https://doi.org/10.1007/978-3-642-35289-8_3>`_, 1998
      (the default initializer).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        kernel_init: nnx.Initializer = DEFAULT_KERNEL_INIT,
        precision: lax.PrecisionLike = None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("in_features", in_features)
        check_positive_int("out_features", out_features)
        check_bool("use_bias", use_bias)
        self.dtype = float_dtype("dtype", dtype)
        param_dtype = float_dtype("param_dtype", param_dtype, allow_none=False)
        self.in_features = in_features
        self.out_features = out_features
        self.precision = precision
        self.kernel = nnx.Param(
            kernel_init(rngs.params(), (in_features, out_features), param_dtype)
        )
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    def __call__(self, x: ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        check_features("Linear", x, self.in_features)
        dtype = x.dtype if self.dtype is None else self.dtype
        y = rows_matmul(x.astype(dtype), self.kernel[...].astype(dtype), precision=self.precision)
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        return y
