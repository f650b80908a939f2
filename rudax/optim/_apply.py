"""``update_and_apply``: optax's ``update`` then ``apply_updates``, in one pass where the
optimizer has one.

An optax optimizer returns updates, and ``optax.apply_updates`` adds them to the parameters:
two passes over the parameters unless a compiler fuses them. XLA does, when it sees both; a
Pallas kernel is opaque to it, so ``fused_adamw``'s kernel would write the update and a
second pass would read it back with the parameters. ``fused_adamw`` therefore also knows how
to write the new parameters itself, in its one pass (over the parameters, moments and
masters, in place where the caller donates them); ``update_and_apply`` uses that where the
optimizer is one that knows (it registered itself, ``register_in_place``) and the usual two
calls otherwise, with the same result bit for bit.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import optax

__all__ = ["register_in_place", "update_and_apply"]

# tx.update -> the function that applies the update in the same pass. Keyed by the update
# function (a closure per optimizer built), weakly: an optimizer dropped drops its entry. A
# wrapper (optax.chain, inject_hyperparams, MultiSteps) has an update of its own, not in
# here, so it takes the two calls, as it must: it changes what the update is.
_IN_PLACE: weakref.WeakKeyDictionary[Callable[..., Any], Callable[..., Any]] = (
    weakref.WeakKeyDictionary()
)


def register_in_place(
    tx: optax.GradientTransformation, apply: Callable[[Any, Any, Any], tuple[Any, Any]]
) -> None:
    """Records that ``apply(grads, state, params) -> (new_params, new_state)`` equals
    ``tx.update`` followed by ``optax.apply_updates``, bit for bit."""
    _IN_PLACE[tx.update] = apply


def update_and_apply(
    tx: optax.GradientTransformation, grads: Any, state: Any, params: Any, **extra_args: Any
) -> tuple[Any, Any]:
    """``updates, state = tx.update(grads, state, params)`` then
    ``optax.apply_updates(params, updates)``, in one pass where ``tx`` has one.

    ``rudax.optim.fused_adamw`` has: its kernel writes each new parameter, moment and master
    once (in place where the jitted step donates them) instead of writing the update for a
    second pass to add. The result is the two calls' bit for bit, on every path. Any other
    optimizer takes the two calls (``extra_args`` go to its ``update``).

    Args:
      tx: an optax gradient transformation.
      grads: the gradients, a pytree like ``params``.
      state: ``tx``'s state.
      params: the parameters.
      **extra_args: passed to ``tx.update`` (optax's extra arguments), where it is called.

    Returns:
      ``(new_params, new_state)``.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.array([1.0, -2.0])}
      >>> tx = ro.fused_adamw(0.1, weight_decay=0.0)
      >>> grads = {"w": jnp.array([3.0, 4.0])}
      >>> params, state = ro.update_and_apply(tx, grads, tx.init(params), params)
      >>> [round(x, 6) for x in params["w"].tolist()]
      [0.9, -2.1]
    """
    apply = _IN_PLACE.get(tx.update)
    if apply is not None:  # fused_adamw's update ignores extra arguments; so does this
        return apply(grads, state, params)
    updates, state = tx.update(grads, state, params, **extra_args)
    return optax.apply_updates(params, updates), state
