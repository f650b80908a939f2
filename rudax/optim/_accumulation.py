"""Gradient accumulation over microbatches, as a functional pytree.

``GradientAccumulator`` is a frozen dataclass registered as a pytree: it goes through
``jax.jit`` as an argument, lives in the train state next to the optimizer state and is saved
in a checkpoint like any other pytree, so a run restored mid-window continues exactly. Its
methods return a new accumulator and never mutate the old one.

Two ways to accumulate, chosen by what the loss returns:

* Equal microbatches: add the gradients of ``mean_loss / k`` for ``k`` microbatches; the sum
  is the full-batch mean-loss gradient. ``pop()``.
* Token-weighted (unequal microbatches): add the gradients of the loss *sum* with
  ``weight=`` its token count; ``pop(normalize=True)`` divides by the total weight and gives
  the gradient of the token-mean loss over the whole window.

The accumulator never touches the optimizer state: an optimizer's update count, and so its
learning-rate schedule, advances once per ``tx.update`` after ``pop``, never per ``add``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import chex
import jax
import jax.core
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from rudax._validation import check_bool, check_non_negative, float_dtype
from rudax.optim._validation import check_tree_like


def _as_weight(weight: Any) -> jax.Array:
    if weight is None:
        return jnp.ones((), jnp.float32)
    if not isinstance(weight, jax.core.Tracer):
        check_non_negative("weight", weight)
        # float() first: a token count past 2**31 must not go through int32.
        return jnp.asarray(float(weight), jnp.float32)
    if weight.ndim != 0:
        raise TypeError(f"weight must be a scalar, got shape {weight.shape}: {weight=}")
    if not (
        jnp.issubdtype(weight.dtype, jnp.integer) or jnp.issubdtype(weight.dtype, jnp.floating)
    ):
        raise TypeError(f"weight must be an int or float scalar, got dtype {weight.dtype}")
    return weight.astype(jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GradientAccumulator:
    """Sums gradients over the microbatches of one window, then hands them to the optimizer.

    The update rule, for each ``add(grads, weight)`` and each leaf::

        sums <- sums + grads.astype(sums.dtype)
        count <- count + 1
        total_weight <- total_weight + (1 if weight is None else weight)

    and ``pop(normalize)`` returns ``sums / total_weight`` (normalize) or ``sums``, with an
    emptied accumulator. Build one with ``GradientAccumulator.init``.

    Attributes:
      sums: the running sum of the gradients, a pytree shaped like the parameters.
      count: shape=(), int32: microbatches added since the last ``pop``.
      total_weight: shape=(), float32: the sum of their weights since the last ``pop``.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.zeros(2)}
      >>> acc = ro.GradientAccumulator.init(params)
      >>> acc = acc.add({"w": jnp.array([3.0, 6.0])}, weight=3)
      >>> acc = acc.add({"w": jnp.array([1.0, 0.0])}, weight=1)
      >>> grads, acc = acc.pop(normalize=True)
      >>> grads["w"].tolist(), int(acc.count)
      ([1.0, 1.5], 0)

    References:
      Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
      <https://arxiv.org/abs/1706.02677>`_, 2017 (the equal-microbatch equivalence).
    """

    sums: chex.ArrayTree  # pytree like the params; each leaf in the accumulation dtype
    count: jax.Array  # shape=(), int32: pending microbatches
    total_weight: jax.Array  # shape=(), float32: sum of the pending microbatches' weights

    @classmethod
    def init(cls, params: chex.ArrayTree, dtype: DTypeLike | None = None) -> GradientAccumulator:
        """An empty accumulator with zero sums shaped like ``params``.

        Args:
          params: the parameters (arrays or ``jax.ShapeDtypeStruct``), any pytree, e.g. a
            nested dict or a ``flax.nnx.State``. Every leaf must have a floating dtype.
          dtype: the accumulation dtype. None keeps each leaf's own dtype; ``jnp.float32``
            accumulates bf16/fp16 gradients in fp32 (each is converted before it is added).

        Returns:
          A ``GradientAccumulator`` with zero sums, ``count == 0`` and ``total_weight == 0``.
        """
        float_dtype("dtype", dtype, none_in_message=True)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise TypeError(
                    f"GradientAccumulator.init: parameter {jax.tree_util.keystr(path)} has "
                    f"dtype={leaf.dtype}; only floating leaves have gradients to accumulate"
                )
        sums = jax.tree.map(
            lambda p: jnp.zeros_like(p, dtype=p.dtype if dtype is None else dtype), params
        )
        return cls(
            sums=sums,
            count=jnp.zeros((), jnp.int32),
            total_weight=jnp.zeros((), jnp.float32),
        )

    def add(self, grads: chex.ArrayTree, weight: ArrayLike | None = None) -> GradientAccumulator:
        """Adds one microbatch's gradients; returns the new accumulator.

        Args:
          grads: gradients with the same pytree structure and shapes as the sums, floating
            dtype. Each leaf is converted to its sum's dtype before the addition, so with an
            fp32 accumulator bf16 gradients are summed in fp32.
          weight: the microbatch's weight, e.g. its token count: a Python number >= 0 or a
            (possibly traced) int or float scalar, converted to fp32. None counts as 1.0, so
            unweighted adds count microbatches; mixing the two within one window counts each
            unweighted microbatch as one token, which is rarely what is meant. A traced weight
            cannot be checked and must be >= 0.

        Returns:
          A ``GradientAccumulator`` with the gradients added, ``count + 1`` and the weight
          added to ``total_weight``.
        """
        check_tree_like("GradientAccumulator.add", "gradients", grads, "sums", self.sums)
        w = _as_weight(weight)

        def add_leaf(path: Any, s: jax.Array, g: Any) -> jax.Array:
            g = jnp.asarray(g)
            where = jax.tree_util.keystr(path)
            if not jnp.issubdtype(g.dtype, jnp.floating):
                raise TypeError(f"GradientAccumulator.add: grads{where} has dtype={g.dtype}")
            return s + g.astype(s.dtype)

        sums = jax.tree_util.tree_map_with_path(add_leaf, self.sums, grads)
        return GradientAccumulator(
            sums=sums, count=self.count + 1, total_weight=self.total_weight + w
        )

    def pop(self, normalize: bool = False) -> tuple[chex.ArrayTree, GradientAccumulator]:
        """Returns the accumulated gradients and an emptied accumulator.

        Args:
          normalize: False returns the sums; True returns ``sums / total_weight``. The
            division is done in fp32 or wider and rounded once to the accumulator's dtype,
            which is also the result's dtype. Where ``total_weight`` is 0 (an empty window, or
            only zero-weight microbatches) the normalized result is zeros, not NaN: an error
            cannot be raised on a traced value, so check ``acc.count`` beforehand if an empty
            window is possible.

        Returns:
          ``(grads, acc)``: the gradients, shaped and typed like the sums, and an accumulator
          with zero sums, ``count == 0`` and ``total_weight == 0``.
        """
        check_bool("normalize", normalize)
        grads = self.sums
        if normalize:
            w = self.total_weight
            safe_w = jnp.where(w > 0, w, 1.0)

            def divide(s: jax.Array) -> jax.Array:
                # At least fp32 (jnp.promote_types would refuse bf16 + fp32 under strict).
                compute_dtype = s.dtype if jnp.finfo(s.dtype).bits >= 32 else jnp.float32
                q = (s.astype(compute_dtype) / safe_w.astype(compute_dtype)).astype(s.dtype)
                return jnp.where(w > 0, q, jnp.zeros_like(q))

            grads = jax.tree.map(divide, grads)
        empty = GradientAccumulator(
            sums=jax.tree.map(jnp.zeros_like, self.sums),
            count=jnp.zeros_like(self.count),
            total_weight=jnp.zeros_like(self.total_weight),
        )
        return grads, empty
