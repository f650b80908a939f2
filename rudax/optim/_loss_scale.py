"""Dynamic loss scaling for fp16 training: unscale, skip non-finite steps, adapt the scale.

fp16 gradients underflow below 6e-8 and overflow above 65504. Multiplying the loss by a large
scale before differentiation lifts small gradients into range; the optimizer divides the scale
out again in fp32. The scale is kept as large as the gradients allow: an overflow (any
non-finite unscaled gradient) skips the step and backs the scale off, and a long enough run
of finite steps grows it again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import optax

from rudax._validation import check_in_range, check_positive, check_positive_int
from rudax.optim._base import transformation_with_extra_args
from rudax.optim._nonfinite import all_finite, update_unless_skipped
from rudax.optim._validation import check_gradients, check_transformation


class DynamicLossScaleState(NamedTuple):
    """State of ``dynamic_loss_scale``; ``loss_scale(state)`` reads the scale from any state."""

    scale: jax.Array  # shape=(), float32: the current loss scale, >= min_scale and finite
    good_steps: jax.Array  # shape=(), int32: finite updates since the scale last changed
    inner_state: Any  # the inner transformation's state; a skipped update leaves it as it was


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    init_scale: float | jax.Array = 2.0**15,
    growth_interval: int = 2000,
    growth_factor: float | jax.Array = 2.0,
    backoff_factor: float | jax.Array = 0.5,
    min_scale: float | jax.Array = 1.0,
) -> optax.GradientTransformationExtraArgs:
    """Unscales gradients, skips the step on overflow and adapts the loss scale.

    The caller multiplies the loss by ``loss_scale(opt_state)`` before ``jax.grad``. Then, for
    the gradients ``G`` of the scaled loss::

        g = float32(G) / scale
        if all(isfinite(g)):
            updates, inner_state = inner.update(g, inner_state, params)
            good_steps += 1
            if good_steps == growth_interval:
                scale *= growth_factor        (unless that overflows float32)
                good_steps = 0
        else:
            updates = -0.0; inner_state unchanged (step counts, moments, masters)
            scale = max(scale * backoff_factor, min_scale); good_steps = 0

    A skipped step leaves the inner state bitwise as it was, so schedules do not advance.
    The scale never grows past float32's largest finite value; it stays finite and
    ``>= min_scale``. This is ``torch.amp.GradScaler``'s rule folded into one transformation
    (torch keeps the scaler beside the optimizer: ``scaler.scale(loss)``, ``scaler.step``,
    ``scaler.update``); torch's default ``init_scale`` is ``2**16`` and it has no
    ``min_scale``. optax has no dynamic loss scale (``jmp.DynamicLossScale`` is the JAX one).

    Args:
      inner: the optimizer to step with unscaled float32 gradients. For bf16 or fp16
        parameters wrap ``fp32_master``: ``dynamic_loss_scale(fp32_master(adamw(lr)))``.
      init_scale: the first scale; finite and > 0.
      growth_interval: consecutive finite updates after which the scale grows; an int > 0.
      growth_factor: multiplies the scale on growth; finite and > 1.
      backoff_factor: multiplies the scale on overflow; in (0, 1).
      min_scale: the scale's floor; finite, > 0 and <= init_scale.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a ``DynamicLossScaleState``.
      Updates have the dtypes ``inner`` returns (float32 unless ``inner`` casts, as
      ``fp32_master`` does, to the parameters' dtypes); extra keyword arguments go to
      ``inner``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.ones((2,), jnp.float16)}
      >>> tx = ro.dynamic_loss_scale(ro.fp32_master(optax.sgd(0.1)))
      >>> state = tx.init(params)
      >>> float(ro.loss_scale(state))
      32768.0
      >>> grads = {"w": jnp.array([jnp.inf, 1.0], jnp.float16)}  # the scaled loss overflowed
      >>> updates, state = tx.update(grads, state, params)
      >>> float(ro.loss_scale(state)), updates["w"].tolist()
      (16384.0, [-0.0, -0.0])

    References:
      Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
      2018; PyTorch, ``torch.amp.GradScaler``.
    """
    check_transformation("inner", inner)
    check_positive("init_scale", init_scale)
    check_positive_int("growth_interval", growth_interval)
    check_in_range("growth_factor", growth_factor, 1.0, float("inf"), low_inclusive=False)
    check_in_range(
        "backoff_factor", backoff_factor, 0.0, 1.0, low_inclusive=False, high_inclusive=False
    )
    check_positive("min_scale", min_scale)
    if not isinstance(min_scale, jax.core.Tracer) and not isinstance(init_scale, jax.core.Tracer):
        if float(min_scale) > float(init_scale):
            raise ValueError(f"min_scale must be <= init_scale, got {min_scale=} and {init_scale=}")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> DynamicLossScaleState:
        return DynamicLossScaleState(
            scale=jnp.asarray(init_scale).astype(jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            inner_state=inner.init(params),
        )

    def next_scale(
        finite: jax.Array, scale: jax.Array, good_steps: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        good_steps = good_steps + 1
        grow = good_steps >= growth_interval
        grown = scale * jnp.asarray(growth_factor).astype(jnp.float32)
        # torch's rule: a growth that would overflow is not taken (the count still resets).
        scale_if_finite = jnp.where(grow & jnp.isfinite(grown), grown, scale)
        backed_off = jnp.maximum(
            scale * jnp.asarray(backoff_factor).astype(jnp.float32),
            jnp.asarray(min_scale).astype(jnp.float32),
        )
        return (
            jnp.where(finite, scale_if_finite, backed_off),
            jnp.where(finite & jnp.logical_not(grow), good_steps, 0),
        )

    def update_fn(
        updates: Any, state: DynamicLossScaleState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, DynamicLossScaleState]:
        def unscale(g: Any) -> jax.Array:
            return jnp.asarray(g).astype(jnp.float32) / state.scale

        def apply_fn(grads: Any, inner_state: Any) -> tuple[Any, Any]:
            return inner.update(jax.tree.map(unscale, grads), inner_state, params, **extra_args)

        check_gradients("dynamic_loss_scale", updates, params)
        # The check and the step each unscale on the fly rather than sharing an unscaled copy:
        # lax.cond would materialize that copy, a float32 buffer as large as all gradients.
        finite = all_finite(jax.tree.map(unscale, updates))
        new_updates, inner_state = update_unless_skipped(
            finite, apply_fn, updates, state.inner_state
        )
        scale, good_steps = next_scale(finite, state.scale, state.good_steps)
        return new_updates, DynamicLossScaleState(scale, good_steps, inner_state)

    return transformation_with_extra_args(init_fn, update_fn)


def _is_loss_scale_state(x: Any) -> bool:
    return isinstance(x, DynamicLossScaleState)


def _find_loss_scale_states(tree: Any, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    found = []
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_loss_scale_state)[0]
    for path, leaf in flat:
        if _is_loss_scale_state(leaf):
            path = prefix + tuple(path)
            found.append((path, leaf))
            inner_path = (*path, jax.tree_util.GetAttrKey("inner_state"))
            found += _find_loss_scale_states(leaf.inner_state, inner_path)
    return found


def loss_scale(opt_state: optax.OptState) -> jax.Array:
    """The current loss scale in an optimizer state built with ``dynamic_loss_scale``.

    The ``DynamicLossScaleState`` may sit anywhere in ``opt_state`` (inside ``optax.chain``,
    ``fp32_master`` or any other wrapper); it is found by searching the pytree. Multiply the
    loss by the result before differentiating: ``loss.astype(jnp.float32) * loss_scale(s)``.

    Args:
      opt_state: an optimizer state containing exactly one ``DynamicLossScaleState``.

    Returns:
      A float32 scalar. Works inside ``jit``.

    Raises:
      ValueError: if ``opt_state`` holds no ``DynamicLossScaleState``, or more than one.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import rudax.optim as ro
      >>> tx = optax.chain(optax.clip(1.0), ro.dynamic_loss_scale(optax.sgd(0.1), 1024.0))
      >>> float(ro.loss_scale(tx.init({"w": jnp.zeros(3)})))
      1024.0

    References:
      PyTorch, ``torch.amp.GradScaler.get_scale``.
    """
    found = _find_loss_scale_states(opt_state)
    if not found:
        raise ValueError(
            "loss_scale: opt_state holds no DynamicLossScaleState; build the optimizer with "
            "rudax.optim.dynamic_loss_scale(...)"
        )
    if len(found) > 1:
        paths = ", ".join(f"opt_state{jax.tree_util.keystr(p)}" for p, _ in found)
        raise ValueError(f"loss_scale: opt_state holds several DynamicLossScaleStates: {paths}")
    return found[0][1].scale
