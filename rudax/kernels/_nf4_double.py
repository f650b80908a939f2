"""``nf4_double_quantize``: the second quantization of NF4's block scales, on its own.

``nf4_quantize(w)`` quantizes the blocks of ``w`` and then, under double quantization, the
vector of their absmax values, whose offset is the mean of them all: the only step that needs
the whole tensor. A loader that quantizes a weight in pieces (each process its own blocks,
``nf4_quantize(piece, double_quant=False)``) gathers the pieces' absmax values and finishes
here, with the bits ``nf4_quantize`` of the whole weight gives.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from rudax.kernels._nf4 import _double_quantize_all

__all__ = ["nf4_double_quantize"]


def nf4_double_quantize(
    absmax: jax.Array | np.ndarray, *, absmax_rounding: Literal["cuda", "cpu"] = "cuda"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ``(absmax_codes, absmax_scales, absmax_offset)`` of an NF4 weight's block scales.

    ``offset = mean(absmax)`` (torch's summation order, as ``nf4_quantize``), and
    ``absmax - offset`` as 8-bit codes of the signed dynamic map in blocks of 256, each with
    its fp32 absmax: the fields ``nf4_quantize(w)`` fills under double quantization, equal
    bit for bit when ``absmax`` is ``nf4_quantize(w, double_quant=False).absmax``, whether
    that was computed whole or piece by piece (each block's absmax depends on its block only).

    Args:
      absmax: fp32, shape ``(blocks,)``: every block's absmax, in the weight's order.
      absmax_rounding: "cuda" or "cpu", as for ``nf4_quantize``.

    Returns:
      ``absmax_codes`` (uint8, ``(blocks,)``), ``absmax_scales`` (fp32,
      ``(ceil(blocks / 256),)``) and ``absmax_offset`` (fp32, ``()``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from rudax.kernels import nf4_double_quantize, nf4_quantize
      >>> w = jax.random.normal(jax.random.key(0), (128, 64))
      >>> halves = [nf4_quantize(h, double_quant=False).absmax for h in (w[:64], w[64:])]
      >>> codes, scales, offset = nf4_double_quantize(jnp.concatenate(halves))
      >>> bool((codes == nf4_quantize(w).absmax_codes).all())
      True
    """
    if absmax_rounding not in ("cuda", "cpu"):
        raise ValueError(f'absmax_rounding must be "cuda" or "cpu", got {absmax_rounding=}')
    if not isinstance(absmax, jax.Array | np.ndarray):
        raise TypeError(f"absmax must be an array, got {type(absmax).__name__}")
    if absmax.ndim != 1 or absmax.shape[0] == 0 or absmax.dtype != np.float32:
        raise ValueError(
            f"absmax must be a non-empty 1-D float32 array (one value per block), got "
            f"shape={tuple(absmax.shape)} dtype={absmax.dtype}"
        )
    return _double_quantize_all(jnp.asarray(absmax), absmax_rounding)
