"""Rounding fp32 values to a storage dtype, and the bit-exact master-weight update built on it.

Shared by ``rudax.optim.fp32_master`` and the fused AdamW kernel (``_adamw.py``), which keep
fp32 masters for parameters stored in bf16 or fp16: the updates they return make
``optax.apply_updates(param, update)`` store exactly ``master.astype(param.dtype)``, bit for
bit. ``rudax/optim/_master.py`` explains the scheme and why it is exact.

Because of that invariant a stored parameter that differs from its master rounded to storage,
in any bit, was written by someone else: weights loaded after ``tx.init``, say.
``adopt_replaced`` makes such an element's master the parameter again, before the step reads
it, so an optimizer never writes a stale master back over loaded weights.

Every rounding in XLA code goes through ``round_to``, built from ``lax.reduce_precision``,
instead of a float32 -> bf16 -> float32 cast pair: XLA's GPU backend may delete such a pair
(openxla/xla#41605, "excess precision"), which would let the value the caller adds differ from
the one checked here. ``reduce_precision`` exists so that it cannot be. Inside a Pallas kernel
(which XLA does not rewrite, and whose Triton lowering has no ``reduce_precision``) the cast
pair is the rounding: ``round_by_cast``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def round_to(x: jax.Array, dtype: Any) -> jax.Array:
    """Rounds float32 ``x`` to the nearest ``dtype`` value, kept as float32 (ties to even)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return x
    info = jnp.finfo(dtype)
    rounded = lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if info.minexp > jnp.finfo(jnp.float32).minexp:
        # reduce_precision flushes the target's subnormals to zero; fp16's subnormals are
        # float32 normals on a fixed grid, so round them there (the scaling is exact).
        ulp = 2.0 ** (info.minexp - info.nmant)
        subnormal = jnp.round(x * (1.0 / ulp)) * ulp
        rounded = jnp.where(jnp.abs(x) < float(info.smallest_normal), subnormal, rounded)
    return rounded


def round_by_cast(x: jax.Array, dtype: Any) -> jax.Array:
    """``round_to`` as a cast pair, for kernel bodies that XLA's simplifier never sees."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return x
    return x.astype(dtype).astype(jnp.float32)


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def adopt_replaced(
    master: jax.Array,
    param: jax.Array,
    *,
    rounding: Callable[[jax.Array, Any], jax.Array] = round_to,
) -> jax.Array:
    """The master, or ``float32(param)`` wherever ``param`` is not the master rounded, bitwise.

    ``storage_update``'s updates keep ``param == round(master)`` bit for bit, so a difference
    means the parameter was replaced outside the optimizer; its value is then the truth. The
    comparison is of bits, not values, so a replaced ``-0.0`` over a ``+0.0`` master is
    adopted too. An element replaced by exactly the value its
    master rounds to keeps the master: the two differ by less than one storage ulp.

    Per element one rounding, one integer compare and one select, on the master and the
    parameter that the step reads anyway: no memory traffic of its own.

    Args:
      master: the fp32 master of ``param``.
      param: the stored parameter, bf16, fp16 or fp32.
      rounding: ``round_to`` in XLA code, ``round_by_cast`` inside a Pallas kernel.
    """
    p = param.astype(jnp.float32)
    same = _bits(rounding(master, param.dtype)) == _bits(p)
    return jnp.where(same, master, p)


def storage_update(
    master: jax.Array,
    param: jax.Array,
    update: jax.Array,
    *,
    rounding: Callable[[jax.Array, Any], jax.Array] = round_to,
) -> tuple[jax.Array, jax.Array]:
    """Returns (update in param's dtype, new master) for one leaf; see ``rudax/optim/_master.py``.

    Args:
      master: the fp32 master of ``param``.
      param: the stored parameter, bf16, fp16 or fp32.
      update: the step to add to the master (any floating dtype; added in fp32).
      rounding: how to round fp32 to ``param``'s dtype: ``round_to`` in XLA code,
        ``round_by_cast`` inside a Pallas kernel.
    """
    m = master + update.astype(jnp.float32)
    p = param.astype(jnp.float32)
    t = rounding(m, param.dtype)
    # -(p - t) is t - p, except -0.0 rather than +0.0 when t == p: -0.0 is IEEE's exact
    # additive identity, so an unchanged parameter keeps its bits (-0.0 + 0.0 is +0.0).
    u = rounding(-(p - t), param.dtype)
    # What apply_updates will store: round(p + u) in param's dtype. Rounding the float32 sum
    # again gives the correctly rounded bf16 or fp16 sum: float32's 24 bits are >= 2 * 11 + 2.
    stored = rounding(p + u, param.dtype)
    hits_target = _bits(stored) == _bits(t)
    return u.astype(param.dtype), jnp.where(hits_target, m, stored)
