"""QLoRA's double quantization: the absmax values as 8-bit codes of the signed dynamic map.

``_double_quantize`` stores ``absmax - offset`` in blocks of ``ABSMAX_BLOCK_SIZE``, each block
scaled by the fp32 reciprocal of its own absmax, as bitsandbytes' ``quantize_blockwise``
does. Its two kernels then choose a code differently for values next to a midpoint, and
``rounding`` names which one to reproduce bit for bit: "cuda" (``kQuantizeBlockwise``'s
binary search and midpoint test) or "cpu" (``quantize_cpu_impl``'s 65,536-bin table). The
NF4 format around it is ``_nf4.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Double quantization stores the per-block absmax in 8 bits, in blocks of this many values.
ABSMAX_BLOCK_SIZE = 256


def _linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace in fp32 on the CPU: each half stepped from its own end, fused.

    ``start + step * i`` (``end - step * (steps - 1 - i)`` for the upper half) is rounded to
    fp32 once, as a fused multiply-add does: the fp32 product is exact in float64.
    """
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float64((end32 - start32) / np.float32(steps - 1))
    i = np.arange(steps)
    low = np.float64(start32) + step * i
    high = np.float64(end32) - step * (steps - 1 - i)
    return np.where(i < steps // 2, low, high).astype(np.float32)


def _dynamic_code() -> np.ndarray:
    """The signed 8-bit dynamic map (Dettmers 2015) that double quantization uses.

    Seven exponent levels 10**-6 .. 10**0; level ``i`` holds the midpoints of
    ``2**i + 1`` evenly spaced points in [0.1, 1], with both signs (254 values), plus 0 and
    1, sorted: bitsandbytes' ``create_dynamic_map()``, value for value.
    """
    values: list[float] = []
    for i in range(7):
        bounds = _linspace_f32(0.1, 1.0, 2**i + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
        # An fp32 product, with the scale rounded to fp32 first (a torch tensor times a
        # Python float does that).
        scaled = (np.float32(10.0 ** (-6 + i)) * means).astype(np.float32).tolist()
        values += scaled + [-v for v in scaled]
    values += [0.0, 1.0]
    return np.sort(np.array(values, dtype=np.float32))


DYNAMIC_CODE = _dynamic_code()


def _midpoints(code: np.ndarray) -> np.ndarray:
    return ((code[:-1] + code[1:]) / np.float32(2.0)).astype(np.float32)


def _quantize_dynamic(x_MxK: jax.Array, rounding: str) -> tuple[jax.Array, jax.Array]:
    """Each row's absmax, and each value's dynamic-map index after scaling by its reciprocal.

    ``rounding`` names the bitsandbytes kernel whose choice of code is reproduced: "cuda"
    (``kQuantizeBlockwise``'s binary search) or "cpu" (``quantize_cpu_impl``'s table).
    Both scale by the fp32 reciprocal of the absmax, as here; both give an all-zero row
    code 0.
    """
    absmax_M = jnp.max(jnp.abs(x_MxK), axis=1)
    nonzero_M = absmax_M > 0
    inv_M = jnp.where(nonzero_M, jnp.float32(1.0) / jnp.where(nonzero_M, absmax_M, 1.0), 0.0)
    scaled = x_MxK * inv_M[:, None]
    index = _dynamic_index_cuda(scaled) if rounding == "cuda" else _dynamic_index_cpu(scaled)
    index = jnp.where(nonzero_M[:, None], index, 0)
    return absmax_M, index.astype(jnp.uint8)


def _dynamic_index_cuda(x: jax.Array) -> jax.Array:
    """bitsandbytes' CUDA ``dQuantize``: a 7-step binary search, then a midpoint test.

    The nearest code, except that a value exactly on a fp32 midpoint goes to whichever of its
    two codes the search ended on. Written as the kernel's own steps, so that tie follows.
    """
    code = jnp.asarray(DYNAMIC_CODE)
    pivot = jnp.full(x.shape, 127, jnp.int32)
    lower_pivot = jnp.zeros(x.shape, jnp.int32)
    upper_pivot = jnp.full(x.shape, code.shape[0] - 1, jnp.int32)
    for step in (64, 32, 16, 8, 4, 2, 1):
        above = x > code[pivot]
        lower_pivot = jnp.where(above, pivot, lower_pivot)
        upper_pivot = jnp.where(above, upper_pivot, pivot)
        pivot = pivot + jnp.where(above, step, -step)
    value = code[pivot]
    up = jnp.where(x > (code[upper_pivot] + value) * 0.5, upper_pivot, pivot)
    down = jnp.where(x < (code[lower_pivot] + value) * 0.5, lower_pivot, pivot)
    return jnp.where(x > value, up, down)


# bitsandbytes' CPU kernel looks codes up in a table of this many evenly spaced bins of
# [-1, 1]: bin i holds the code nearest to -1 + 2i / (size - 1).
_CPU_TABLE_SIZE = 65536


@functools.cache
def _cpu_table() -> np.ndarray:
    bins = np.arange(_CPU_TABLE_SIZE, dtype=np.float32)
    centres = np.float32(-1.0) + (np.float32(2.0) * bins) / np.float32(_CPU_TABLE_SIZE - 1)
    # The count of fp32 midpoints strictly below each bin's centre.
    return np.searchsorted(_midpoints(DYNAMIC_CODE), centres, side="left").astype(np.uint8)


def _dynamic_index_cpu(x: jax.Array) -> jax.Array:
    """bitsandbytes' CPU ``quantize_cpu_impl``: the code of the value's bin in the table.

    The value's bin is ``trunc((clip(x, -1, 1) + 1) * 0.5 * 65535 + 0.5)``. A bin is about
    3e-5 wide, so for values within half a bin of a midpoint this is not the nearest code
    (about 1 in 1000 of a model's absmax values).
    """
    t = (jnp.clip(x, -1.0, 1.0) + 1.0) * 0.5
    # float -> unsigned conversion truncates toward zero, as the C++ cast does.
    bin_index = (t * np.float32(_CPU_TABLE_SIZE - 1) + 0.5).astype(jnp.uint16)
    return jnp.asarray(_cpu_table())[bin_index.astype(jnp.int32)].astype(jnp.int32)


def _double_quantize(
    absmax_N: jax.Array, offset: jax.Array, rounding: str
) -> tuple[jax.Array, jax.Array]:
    """``absmax - offset`` as 8-bit dynamic-map codes in blocks of 256, and their scales."""
    centred = absmax_N - offset
    n = centred.shape[0]
    padded = -(-n // ABSMAX_BLOCK_SIZE) * ABSMAX_BLOCK_SIZE
    # Zero padding changes no 256-block's absmax; the padded codes are dropped.
    centred_MxK = jnp.pad(centred, (0, padded - n)).reshape(-1, ABSMAX_BLOCK_SIZE)
    scales_M, codes_MxK = _quantize_dynamic(centred_MxK, rounding)
    return codes_MxK.reshape(-1)[:n], scales_M
