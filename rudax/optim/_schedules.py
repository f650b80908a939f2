"""Learning-rate schedules as functions of the optimizer's update count.

A schedule maps the update count of the transform that holds it (``optax.scale_by_learning_rate``
inside every rudax optimizer) to a value. That count advances once per parameter update, that
is once per ``tx.update`` call, never per microbatch: ``GradientAccumulator.add`` does not touch
the optimizer state, so ``step_size=100`` means 100 optimizer updates whatever the number of
microbatches per update. This is ``torch.optim.lr_scheduler`` called once after each
``optimizer.step()``.

The schedules here run under ``jax_numpy_dtype_promotion="strict"``: the count (an int32 array,
traced under jit, or a Python int) is cast explicitly and the value is always fp32. optax's own
schedules, re-exported in ``rudax.optim`` for convenience, multiply a Python float by an int32
count and so need standard promotion.

One name per schedule: a schedule optax has keeps optax's name, signature and argument order.
``warmup_cosine_decay_schedule`` is rudax's own implementation of optax's (same signature, same
values, strict promotion); the others are optax's functions themselves. ``step_schedule`` is
torch's ``StepLR``, which optax spells only as a special case of ``exponential_decay``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

# optax's schedules, re-exported by rudax.optim from here. They need standard dtype promotion.
from optax import constant_schedule as constant_schedule
from optax import cosine_decay_schedule as cosine_decay_schedule
from optax import cosine_onecycle_schedule as cosine_onecycle_schedule
from optax import exponential_decay as exponential_decay
from optax import join_schedules as join_schedules
from optax import linear_schedule as linear_schedule
from optax import piecewise_constant_schedule as piecewise_constant_schedule
from optax import polynomial_schedule as polynomial_schedule

from rudax._validation import check_finite, check_int, check_positive, check_positive_int

# A count past this cannot be represented by the int32 count optax's transforms keep.
_MAX_COUNT = 2**31 - 1


def _int32_count(count: ArrayLike) -> jax.Array:
    """The update count as an int32 scalar; a float count is a caller's bug, not a step."""
    count = jnp.asarray(count)
    if not jnp.issubdtype(count.dtype, jnp.integer):
        raise TypeError(f"a schedule's count must be an integer update count, got {count.dtype=}")
    if count.ndim != 0:
        raise TypeError(f"a schedule's count must be a scalar, got {count.shape=}")
    return count.astype(jnp.int32)


def _check_step_count(name: str, value: Any, *, allow_zero: bool) -> None:
    check_int(name, value)
    low = 0 if allow_zero else 1
    if not low <= value <= _MAX_COUNT:
        raise ValueError(f"{name} must be an int in [{low}, {_MAX_COUNT}], got {name}={value!r}")


def step_schedule(
    init_value: float | jax.Array, step_size: int, gamma: float | jax.Array
) -> optax.Schedule:
    """Multiplies the value by ``gamma`` every ``step_size`` updates (torch ``StepLR``).

    The value after ``count`` parameter updates is::

        value(count) = init_value * gamma ** (count // step_size)

    ``step_schedule(1e-3, step_size=100, gamma=0.5)`` gives 1e-3 for updates 0-99, 5e-4 for
    100-199, and so on. This is the closed form of ``torch.optim.lr_scheduler.StepLR`` stepped
    once per ``optimizer.step()``; optax's nearest is ``exponential_decay(..., staircase=True)``,
    which takes a decay rate per ``transition_steps`` instead.

    The count advances once per parameter update (``tx.update``), never per microbatch.

    Args:
      init_value: the value for the first ``step_size`` updates; finite.
      step_size: the number of updates between two decays; a positive int.
      gamma: the multiplicative factor applied every ``step_size`` updates; finite and > 0.

    Returns:
      A schedule: a function of the int update count (Python int or int32 array, traced or
      not) returning an fp32 scalar.

    Example:
      >>> import rudax.optim as ro
      >>> schedule = ro.step_schedule(1e-3, step_size=100, gamma=0.5)
      >>> [float(schedule(n)) for n in (0, 99, 100, 250)]
      [0.0010000000474974513, 0.0010000000474974513, 0.0005000000237487257, 0.0002500000118743628]

    References:
      PyTorch, ``torch.optim.lr_scheduler.StepLR``.
    """
    check_finite("init_value", init_value)
    check_positive_int("step_size", step_size)
    check_positive("gamma", gamma)

    def schedule(count: ArrayLike) -> jax.Array:
        decays = jnp.floor_divide(_int32_count(count), step_size)
        factor = jnp.power(jnp.asarray(gamma, jnp.float32), decays.astype(jnp.float32))
        return jnp.asarray(init_value, jnp.float32) * factor

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float | jax.Array,
    peak_value: float | jax.Array,
    warmup_steps: int,
    decay_steps: int,
    end_value: float | jax.Array = 0.0,
    exponent: float | jax.Array = 1.0,
) -> optax.Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    ``optax.warmup_cosine_decay_schedule``'s signature, argument order and values, under strict
    dtype promotion and with its arguments checked. With ``W = warmup_steps``,
    ``D = decay_steps`` (``D`` counts the warmup: the cosine part lasts ``D - W`` updates) and
    ``p = exponent``::

        value(count) = init_value + (peak_value - init_value) * count / W     count < W
        value(count) = end_value + (peak_value - end_value)
                       * (0.5 * (1 + cos(pi * (count - W) / (D - W)))) ** p   W <= count <= D
        value(count) = end_value                                              count >= D

    The peak is reached at ``count == W``; ``W = 0`` starts at the peak. Every argument means
    what it means in optax, in the same position, so ``optax.warmup_cosine_decay_schedule(...)``
    becomes ``rudax.optim.warmup_cosine_decay_schedule(...)`` with the same values. Three
    differences: the value is always an fp32 scalar and the count is cast explicitly, so the
    schedule runs under ``jax_numpy_dtype_promotion="strict"`` (optax's needs standard
    promotion); bad arguments (a NaN value, a negative or float step count) are a ValueError
    or TypeError here, where optax builds a schedule from them; and ``end_value`` is honoured
    when ``peak_value == 0``, where optax decays relative to the peak and so silently returns
    0. torch has no single equivalent (``LinearLR`` then ``CosineAnnealingLR`` joined by
    ``SequentialLR``).

    The count advances once per parameter update (``tx.update``), never per microbatch.

    Args:
      init_value: the value at count 0, where the warmup starts; finite.
      peak_value: the value at the end of the warmup; finite.
      warmup_steps: the number of warmup updates; an int >= 0.
      decay_steps: the total number of updates, warmup included, after which the value stays
        at ``end_value``; an int > ``warmup_steps``.
      end_value: the value from ``decay_steps`` on; finite.
      exponent: the power ``p`` of the cosine factor; finite and > 0 (1 is the plain cosine).

    Returns:
      A schedule: a function of the int update count (Python int or int32 array, traced or
      not) returning an fp32 scalar.

    Example:
      >>> import rudax.optim as ro
      >>> schedule = ro.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=110)
      >>> [round(float(schedule(n)), 4) for n in (0, 5, 10, 60, 110, 500)]
      [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]

    References:
      Loshchilov & Hutter, `SGDR: Stochastic Gradient Descent with Warm Restarts
      <https://arxiv.org/abs/1608.03983>`_, 2017; Goyal et al., `Accurate, Large Minibatch
      SGD: Training ImageNet in 1 Hour <https://arxiv.org/abs/1706.02677>`_, 2017 (warmup).
    """
    check_finite("init_value", init_value)
    check_finite("peak_value", peak_value)
    _check_step_count("warmup_steps", warmup_steps, allow_zero=True)
    _check_step_count("decay_steps", decay_steps, allow_zero=False)
    check_finite("end_value", end_value)
    concrete_exponent = check_positive("exponent", exponent)
    if decay_steps <= warmup_steps:
        raise ValueError(
            "decay_steps counts the warmup and must be > warmup_steps, "
            f"got {decay_steps=}, {warmup_steps=}"
        )
    cosine_steps = decay_steps - warmup_steps

    def schedule(count: ArrayLike) -> jax.Array:
        count = _int32_count(count)
        init, peak, end = (jnp.asarray(v, jnp.float32) for v in (init_value, peak_value, end_value))
        # max(.., 1) only guards the division when W = 0, where the warmup branch is never taken.
        warmup_frac = count.astype(jnp.float32) / max(warmup_steps, 1)
        warmup = init + (peak - init) * warmup_frac
        # Subtracting in int32 before the cast keeps the cosine's phase exact for large counts.
        elapsed = jnp.clip(count - warmup_steps, 0, cosine_steps).astype(jnp.float32)
        cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * (elapsed / cosine_steps)))
        # The default exponent compiles no pow: the plain cosine stays bit-for-bit the same on
        # every backend. A traced exponent (concrete_exponent None) always takes the pow.
        if concrete_exponent != 1.0:
            cosine = jnp.power(cosine, jnp.asarray(exponent, jnp.float32))
        decay = end + (peak - end) * cosine
        return jnp.where(count < warmup_steps, warmup, decay)

    return schedule
