"""Adagrad with ``torch.optim.Adagrad``'s update rule and defaults.

torch and optax disagree on three points, so ``optax.adagrad`` cannot be reused: torch adds
``eps`` (1e-10) outside the square root, optax inside (1e-7); torch's accumulator starts at 0,
optax's at 0.1; and torch has ``lr_decay`` and an L2 ``weight_decay``, optax neither.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from rudax._validation import check_non_negative
from rudax.optim._base import safe_increment, transformation
from rudax.optim._inject import static_arguments
from rudax.optim._precision import as_weak, map_in_compute_dtype
from rudax.optim._torch_chain import DecayMask, torch_chain
from rudax.optim._validation import check_learning_rate


class ScaleByTorchAdagradState(NamedTuple):
    """State of ``scale_by_torch_adagrad``; field names are torch's ``Adagrad`` state keys."""

    # shape=(), int32: completed updates, for lr_decay.
    # Named as optax names its counts, so optax.tree.get(state, "count") finds it; mypy
    # reports the field for overriding tuple.count (a method), as optax's states override it.
    count: jax.Array  # type: ignore[assignment]
    sum: Any  # like params: initial_accumulator_value plus the sum of squared gradients


def scale_by_torch_adagrad(
    lr_decay: float | jax.Array = 0.0,
    initial_accumulator_value: float | jax.Array = 0.0,
    eps: float | jax.Array = 1e-10,
) -> optax.GradientTransformation:
    """Scales gradients by torch's Adagrad direction (no learning rate, no weight decay).

    With ``t`` the 1-based update count::

        s = s + g**2
        u = g / (sqrt(s) + eps) / (1 + (t - 1) * lr_decay)

    Args:
      lr_decay: the learning-rate decay, >= 0.
      initial_accumulator_value: the starting value of ``s``, >= 0.
      eps: added to ``sqrt(s)``, >= 0.

    Returns:
      An ``optax.GradientTransformation`` whose state is a ``ScaleByTorchAdagradState``.
    """
    check_non_negative("lr_decay", lr_decay)
    check_non_negative("initial_accumulator_value", initial_accumulator_value)
    check_non_negative("eps", eps)
    lr_decay, eps = as_weak(lr_decay), as_weak(eps)
    initial_accumulator_value = as_weak(initial_accumulator_value)

    def initial_sum(p: jax.Array) -> jax.Array:
        # On a complex parameter's real view both parts start at the value, as in torch
        # (which fills complex(value, value)).
        value = initial_accumulator_value
        return jnp.full_like(p, value * (1 + 1j) if jnp.iscomplexobj(p) else value)

    def init_fn(params: Any) -> ScaleByTorchAdagradState:
        return ScaleByTorchAdagradState(
            count=jnp.zeros((), jnp.int32), sum=jax.tree.map(initial_sum, params)
        )

    def update_fn(
        updates: Any, state: ScaleByTorchAdagradState, params: Any = None
    ) -> tuple[Any, ScaleByTorchAdagradState]:
        del params
        # Before the increment the count is torch's t - 1.
        decay = 1 + state.count.astype(jnp.float32) * lr_decay

        def leaf(g: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array]:
            s = s + g * g
            return g / (jnp.sqrt(s) + eps) / decay.astype(g.dtype), s

        new_updates, sums = map_in_compute_dtype(
            leaf, updates, state.sum, owner="scale_by_torch_adagrad", names=("sum",)
        )
        return new_updates, ScaleByTorchAdagradState(safe_increment(state.count), sums)

    return transformation(init_fn, update_fn)


@static_arguments("moment_dtype", "mask")
def adagrad(
    learning_rate: optax.ScalarOrSchedule,
    lr_decay: float | jax.Array = 0.0,
    weight_decay: float | jax.Array = 0.0,
    initial_accumulator_value: float | jax.Array = 0.0,
    eps: float | jax.Array = 1e-10,
    *,
    moment_dtype: DTypeLike | None = None,
    mask: DecayMask = None,
) -> optax.GradientTransformation:
    """Adagrad with torch's rules: ``eps`` outside the root, ``lr_decay``, L2 weight decay.

    With ``t`` the 1-based update count and ``lr_t`` the learning rate at this update::

        g = g + weight_decay * p                  (L2)
        s = s + g**2                              (s starts at initial_accumulator_value)
        p = p - lr_t / (1 + (t - 1) * lr_decay) * g / (sqrt(s) + eps)

    This is ``torch.optim.Adagrad``. ``optax.adagrad`` computes ``g / sqrt(s + eps)`` with
    ``eps=1e-7``, starts ``s`` at 0.1, and has neither ``lr_decay`` nor weight decay. A
    schedule as ``learning_rate`` and ``lr_decay`` multiply, as a torch LR scheduler and
    ``lr_decay`` do.

    Args:
      learning_rate: a number >= 0, or a schedule mapping the update count (0 at the first
        update) to the learning rate; it is evaluated once per update.
      lr_decay: the learning-rate decay, >= 0.
      weight_decay: L2 coefficient added to the gradient; >= 0.
      initial_accumulator_value: the starting value of the sum of squares, >= 0.
      eps: added to the root of the sum of squares, >= 0.
      moment_dtype: storage dtype of the sum of squares, e.g. ``jnp.float32`` for bf16
        parameters; None keeps each parameter's dtype. Each update is computed in the wider of
        this and the gradient's dtype and returned in the parameter's dtype.
      mask: which parameters decay, as in ``optax.add_decayed_weights``: a pytree of bools
        like the parameters (or a prefix of it), or a callable of the parameters returning
        one. A False leaf still gets its step, without decay (torch's parameter group with
        ``weight_decay=0``). None decays all.

    Returns:
      An ``optax.GradientTransformation``: ``chain(add_decayed_weights,
      scale_by_torch_adagrad, scale_by_learning_rate)`` (the decay a no-op when
      ``weight_decay`` is 0).

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.array([1.0, -2.0])}
      >>> tx = ro.adagrad(0.1, initial_accumulator_value=3.0)
      >>> updates, state = tx.update({"w": jnp.array([1.0, -1.0])}, tx.init(params), params)
      >>> new_params = optax.apply_updates(params, updates)  # p - 0.1 * g / sqrt(3 + 1)
      >>> [round(x, 6) for x in new_params["w"].tolist()]
      [0.95, -1.95]

    References:
      Duchi et al., `Adaptive Subgradient Methods for Online Learning and Stochastic
      Optimization <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011; PyTorch,
      ``torch.optim.Adagrad``.
    """
    check_learning_rate(learning_rate)
    check_non_negative("weight_decay", weight_decay)
    return torch_chain(
        [scale_by_torch_adagrad(lr_decay, initial_accumulator_value, eps)],
        learning_rate,
        weight_decay,
        moment_dtype,
        name="adagrad",
        mask=mask,
    )
