"""Skipping updates whose gradients are not finite, and the skip machinery loss scaling shares.

A skipped update must leave the optimizer exactly where it was: step counts (so schedules do
not advance), moments, fp32 masters. The inner update runs under ``lax.cond``, only when
every gradient is finite; on a skipped step the inner state is passed through untouched and
the updates are ``-0.0``. Measured on CPU (16M fp32 parameters, clip + AdamW, donated), the
cond costs 2.6x the unchecked step; selecting per element from an always-computed update was
slower still (3.2x: XLA re-fuses the inner arithmetic into each select and copies the
moments). ``rudax.optim.fused_adamw`` puts the skip inside its single update pass instead.

Negative zero, not ``+0.0``, because it is IEEE's exact additive identity: ``p + (-0.0) == p``
bit for bit for every ``p``, while ``-0.0 + 0.0 == +0.0`` would flip the sign bit of a
parameter stored as ``-0.0``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rudax.optim._base import transformation_with_extra_args
from rudax.optim._validation import check_gradients, check_transformation


class SkipNonfiniteState(NamedTuple):
    """State of ``skip_nonfinite``."""

    last_skipped: jax.Array  # shape=(), bool: True if the most recent update was skipped
    num_skipped: jax.Array  # shape=(), int32: updates skipped since init
    inner_state: Any  # the inner transformation's state; a skipped update leaves it as it was


def all_finite(tree: Any) -> jax.Array:
    """A bool scalar: whether every element of every leaf is finite (True for no leaves)."""
    # sum(x * 0) is NaN exactly when some element is inf or NaN (inf * 0 = NaN), and is one
    # plain vectorized float reduction; a boolean all() over isfinite runs as a slow cascade
    # of predicate reductions on XLA:CPU.
    sums = [jnp.sum(jnp.asarray(x) * 0, dtype=jnp.float32) for x in jax.tree.leaves(tree)]
    if not sums:
        return jnp.asarray(True)
    return jnp.isfinite(sum(sums))


def update_unless_skipped(
    finite: jax.Array,
    apply_fn: Callable[[Any, Any], tuple[Any, Any]],
    grads: Any,
    inner_state: Any,
) -> tuple[Any, Any]:
    """``apply_fn(grads, inner_state)`` if finite, else (``-0.0`` updates, ``inner_state``).

    The skip branch takes the updates' shapes and dtypes from ``apply_fn`` itself, so the
    zeros match whatever the inner transformation returns.
    """

    def skip(grads: Any, inner_state: Any) -> tuple[Any, Any]:
        shapes, _ = jax.eval_shape(apply_fn, grads, inner_state)
        zeros = jax.tree.map(lambda s: jnp.full(s.shape, -0.0, s.dtype), shapes)
        return zeros, inner_state

    return jax.lax.cond(finite, apply_fn, skip, grads, inner_state)


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Skips every update whose gradients contain a NaN or an infinity.

    For gradients ``g`` (any dtypes)::

        if all(isfinite(g)):  updates, inner_state = inner.update(g, inner_state, params)
        else:                 updates = -0.0 (each leaf), inner_state unchanged

    The state counts skipped updates for logging. This is ``dynamic_loss_scale`` without the
    scale, for bf16 or fp32 training where an occasional bad batch should cost one step, not
    the run. torch has no such wrapper (its ``GradScaler`` skips only together with scaling);
    optax's nearest is ``optax.apply_if_finite``, which returns ``+0.0`` updates and, after
    ``max_consecutive_errors`` skips in a row, applies the non-finite update after all.

    Args:
      inner: the transformation to run on finite gradients.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a ``SkipNonfiniteState``.
      Updates have the dtypes ``inner`` returns; extra keyword arguments go to ``inner``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.ones((2,))}
      >>> tx = ro.skip_nonfinite(optax.sgd(0.1))
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
      >>> updates["w"].tolist(), bool(state.last_skipped), int(state.num_skipped)
      ([-0.0, -0.0], True, 1)

    References:
      Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
      2018 (skipping updates on overflow).
    """
    check_transformation("inner", inner)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> SkipNonfiniteState:
        return SkipNonfiniteState(
            last_skipped=jnp.zeros((), jnp.bool_),
            num_skipped=jnp.zeros((), jnp.int32),
            inner_state=inner.init(params),
        )

    def update_fn(
        updates: Any, state: SkipNonfiniteState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, SkipNonfiniteState]:
        def apply_fn(grads: Any, inner_state: Any) -> tuple[Any, Any]:
            return inner.update(grads, inner_state, params, **extra_args)

        check_gradients("skip_nonfinite", updates, params)
        finite = all_finite(updates)
        new_updates, inner_state = update_unless_skipped(
            finite, apply_fn, updates, state.inner_state
        )
        skipped = jnp.logical_not(finite)
        return new_updates, SkipNonfiniteState(
            last_skipped=skipped,
            num_skipped=state.num_skipped + skipped.astype(jnp.int32),
            inner_state=inner_state,
        )

    return transformation_with_extra_args(init_fn, update_fn)
