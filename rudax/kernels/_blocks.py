"""Kernel blocks: the ``block`` argument's check, and 1-D blocks over a flattened array.

Every op takes ``block``, None or its own frozen dataclass of block sizes (``RowBlock``,
``SiluMulBlock``, ...), whose fields check themselves when built (``rudax/_validation.py``).

``silu_mul`` and ``adamw_update`` view each operand as 1-D (a free reshape of a contiguous
array) and give each Pallas program one block of ``block_size`` elements, a power of two. The
last block may overhang the array; its loads and stores are masked (``_compat.load`` and
``_compat.store``), so no padded copy is ever made.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from rudax.kernels import _compat


def check_block(block: Any, block_type: type) -> None:
    """TypeError unless block is None or an instance of ``block_type``."""
    if block is not None and not isinstance(block, block_type):
        raise TypeError(
            f"block must be a rudax.kernels.{block_type.__name__} or None, got {block=}"
        )


def block_size_for(num_elements: int, size: int) -> int:
    """``size``, or a smaller array's size rounded up to a power of two (one block then)."""
    return min(size, pl.next_power_of_2(num_elements))


def tail_mask(num_elements: int, block_size: int) -> jax.Array | None:
    """True where this program's block element lies inside the array; None if none overhangs.

    Written as ``program < full blocks or lane < remainder`` rather than comparing
    ``program * block_size + lane`` with the size, which passes 2**31 - 1 (int32) in the last
    block of an array of 2**31 elements or more.
    """
    full_blocks, remainder = divmod(num_elements, block_size)
    if remainder == 0:
        return None
    lane = lax.broadcasted_iota(jnp.int32, (block_size,), 0)
    return (pl.program_id(0) < full_blocks) | (lane < remainder)


def load_block(ref: Any, mask: jax.Array | None) -> jax.Array:
    """Reads a block in its stored dtype; lanes past the array's end read as 0.

    Zero is finite, so the padded lanes compute finite values, and their stores are masked.
    """
    if mask is None:  # Triton refuses `other` without a mask
        return _compat.load(ref)
    return _compat.load(ref, mask=mask, other=jnp.zeros((), ref.dtype))
