"""NF4Linear: a frozen dense layer whose weight is stored in 4-bit NormalFloat (QLoRA's base)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from rudax._validation import check_bool, check_impl, float_dtype
from rudax.kernels import NF4Tensor, nf4_matmul, nf4_quantize
from rudax.layers._frozen import Frozen
from rudax.layers._linear import Linear
from rudax.layers._validation import check_features


class Quantized(nnx.Variable):
    """Quantized storage (codes, scales) kept bit for bit: never trained, never cast.

    Neither an ``nnx.Param`` nor a ``rudax.layers.Frozen``, on purpose:

    - not a ``Param``, so ``nnx.grad``'s and ``nnx.Optimizer``'s default ``wrt`` and
      ``nnx.state(model, nnx.Param)`` leave it out (the uint8 codes have no gradient, and an
      optimizer must never step them);
    - not a ``Frozen``, so ``rudax.layers.to_dtype``'s default filter and FSDP's
      ``compute_dtype`` cast leave it alone: a ``Frozen`` bf16 base may be cast, but casting
      the fp32 absmax of an NF4 weight to bf16 would change every weight it scales.

    ``NF4Linear`` stores its ``NF4Tensor``'s arrays (``codes``, ``absmax`` or ``absmax_codes``,
    ``absmax_scales``, ``absmax_offset``) in variables of this type.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> model = nnx.Dict(w=nnx.Param(jnp.ones(2)), codes=rl.Quantized(jnp.zeros(4, jnp.uint8)))
      >>> list(nnx.state(model, nnx.Param).keys()), list(nnx.state(model, rl.Quantized).keys())
      (['w'], ['codes'])
    """


class NF4Linear(nnx.Module):
    """A frozen dense layer on an NF4 weight: ``y = x @ dequant(W)^T + bias``, W ``[out, in]``.

    With ``c`` the compute dtype (``dtype``, or ``x.dtype`` when it is None)::

        y = c(x) @ c(W)^T + c(bias)        W = nf4_dequantize(weight, c)     (y in dtype c)

    computed by ``rudax.kernels.nf4_matmul`` (its Pallas kernel dequantizes tiles in registers
    on a GPU; its ``"xla"`` path is exactly the formula). ``W`` is ``[out, in]``, the torch /
    Hugging Face / bitsandbytes layout, so its 64-blocks run along ``in`` and a layer quantized
    here holds the codes ``transformers`` with ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4")`` builds from the same checkpoint. Casts are explicit (strict
    dtype promotion), and None means the input's dtype, as for ``rudax.layers.Linear``.

    Nothing here is trained: the ``NF4Tensor``'s arrays are ``rudax.layers.Quantized``
    variables (``codes``; ``absmax``, or ``absmax_codes``, ``absmax_scales``,
    ``absmax_offset`` under double quantization; unused fields are None) and the bias is a
    ``rudax.layers.Frozen``. The weight's shape, dtype and block size are static attributes;
    ``weight`` rebuilds the ``NF4Tensor``. Put LoRA on it with ``rudax.layers.LoRALinear`` or
    ``apply_lora(..., quantize_base="nf4")``.

    Args:
      weight: an ``NF4Tensor`` of shape ``(out_features, in_features)``
        (``rudax.kernels.nf4_quantize`` of the ``[out, in]`` weight).
      bias: ``[out_features]`` floating, or None; stored as it is.
      dtype: compute and output dtype; None for the input's dtype.
      impl: ``nf4_matmul``'s ``"auto"``, ``"pallas"`` or ``"xla"``.

    Returns:
      A module; calling it on ``x[..., in_features]`` returns ``y[..., out_features]`` in the
      compute dtype. A non-floating ``x`` is a TypeError, a wrong last axis a ValueError.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> from rudax.kernels import nf4_dequantize
      >>> layer = rl.NF4Linear.from_linear(rl.Linear(64, 32, rngs=nnx.Rngs(0)))
      >>> layer.in_features, layer.out_features, layer.codes.dtype, layer.codes.shape
      (64, 32, dtype('uint8'), (1024,))
      >>> x = jnp.ones((2, 64))
      >>> y = layer(x)
      >>> bool(jnp.allclose(y, x @ nf4_dequantize(layer.weight).T + layer.bias[...], atol=1e-5))
      True

    References:
      Dettmers et al., `QLoRA: Efficient Finetuning of Quantized LLMs
      <https://arxiv.org/abs/2305.14314>`_, 2023.
    """

    def __init__(
        self,
        weight: NF4Tensor,
        bias: ArrayLike | None = None,
        *,
        dtype: DTypeLike | None = None,
        impl: str = "auto",
    ):
        if not isinstance(weight, NF4Tensor):
            raise TypeError(
                f"weight must be a rudax.kernels.NF4Tensor (nf4_quantize of the [out, in] "
                f"weight), got {type(weight).__name__}: {weight=}"
            )
        if len(weight.shape) != 2:
            raise ValueError(
                f"weight must be a 2-D [out, in] NF4Tensor, got weight.shape={weight.shape}"
            )
        out_features, in_features = weight.shape
        codes_shape = tuple(getattr(weight.codes, "shape", ()))
        n_bytes = out_features * in_features // 2
        if codes_shape != (n_bytes,):
            raise ValueError(
                f"weight.codes must hold two codes a byte, shape ({n_bytes},) for "
                f"weight.shape={weight.shape}, got weight.codes.shape={codes_shape}"
            )
        if bias is not None:
            bias = jnp.asarray(bias)
            if not jnp.issubdtype(bias.dtype, jnp.floating):
                raise TypeError(f"bias must be floating, got bias.dtype={bias.dtype}")
            if bias.shape != (out_features,):
                raise ValueError(
                    f"bias must have shape ({out_features},) (the weight's out features), got "
                    f"bias.shape={bias.shape}"
                )
        self.dtype = float_dtype("dtype", dtype)
        check_impl(impl)
        self.impl = impl
        self.in_features = in_features
        self.out_features = out_features
        self.weight_dtype = jnp.dtype(weight.dtype)
        self.block_size = weight.block_size
        self.codes = Quantized(weight.codes)
        self.absmax = _quantized(weight.absmax)
        self.absmax_codes = _quantized(weight.absmax_codes)
        self.absmax_scales = _quantized(weight.absmax_scales)
        self.absmax_offset = _quantized(weight.absmax_offset)
        self.bias = None if bias is None else Frozen(bias)

    @property
    def weight(self) -> NF4Tensor:
        """The ``NF4Tensor`` the variables hold, shape ``(out_features, in_features)``."""
        return NF4Tensor(
            self.codes[...],
            _array(self.absmax),
            _array(self.absmax_codes),
            _array(self.absmax_scales),
            _array(self.absmax_offset),
            shape=(self.out_features, self.in_features),
            dtype=self.weight_dtype,
            block_size=self.block_size,
        )

    @classmethod
    def from_linear(
        cls,
        linear: Linear | nnx.Linear,
        *,
        block_size: int = 64,
        double_quant: bool = True,
        impl: str = "auto",
    ) -> NF4Linear:
        """The NF4 layer of a dense one: ``nf4_quantize(kernel.T)``, the bias and dtype kept.

        ``rudax.layers.Linear`` and ``flax.nnx.Linear`` store the kernel ``[in, out]``; its
        transpose is quantized, so the blocks are those of the torch ``[out, in]`` weight.
        The kernel may be an ``nnx.Param`` or a ``Frozen`` (a ``LoRALinear``'s base). The
        layer is not changed. The compute ``dtype`` is carried over; for ``nnx.Linear`` note
        that None now means the input's dtype, not flax's promotion of input and kernel.

        Args:
          linear: the layer to quantize; its kernel float32, bfloat16 or float16, its
            ``precision`` None (``nf4_matmul`` runs the dot at the default precision).
          block_size: weights per absmax, a positive even integer dividing ``in * out``.
          double_quant: quantize the absmax values too (QLoRA's double quantization).
          impl: ``nf4_matmul``'s implementation.

        Returns:
          An ``NF4Linear`` with ``weight.dtype`` the kernel's dtype.
        """
        if not isinstance(linear, Linear | nnx.Linear):
            raise TypeError(
                f"linear must be a rudax.layers.Linear or a flax.nnx.Linear, got "
                f"{type(linear).__name__}: {linear=}"
            )
        check_bool("double_quant", double_quant, allow_numpy=False)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive even integer, got {block_size=}")
        if linear.precision is not None:
            raise ValueError(
                f"{type(linear).__name__} has precision={linear.precision!r}; NF4Linear runs "
                "its dot at the default precision, so it cannot keep it (build the layer with "
                "precision=None to quantize it)"
            )
        kernel = _value(linear.kernel)
        size = int(np.prod(kernel.shape))
        if size % block_size:
            raise ValueError(
                f"{type(linear).__name__} of kernel shape [in, out]={tuple(kernel.shape)} has "
                f"{size} weights, not a multiple of {block_size=}; NF4 stores one absmax per "
                "block (pick a block_size that divides it, or leave this layer unquantized)"
            )
        q = nf4_quantize(kernel.T, block_size=block_size, double_quant=double_quant)
        bias = None if linear.bias is None else _value(linear.bias)
        return cls(q, bias, dtype=linear.dtype, impl=impl)

    def __call__(self, x: ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        check_features("NF4Linear", x, self.in_features)
        dtype = x.dtype if self.dtype is None else self.dtype
        y = nf4_matmul(x, self.weight, dtype=dtype, impl=self.impl)
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        return y


def _quantized(value: jax.Array | None) -> Quantized | None:
    """An NF4Tensor field as a variable; an unused field (None) stays None."""
    return None if value is None else Quantized(value)


def _array(var: Quantized | None) -> jax.Array | None:
    return None if var is None else var[...]


def _value(var: Any) -> jax.Array:
    """A variable's array (``nnx.Param`` or ``Frozen``)."""
    return jnp.asarray(var.get_value())
