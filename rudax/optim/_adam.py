"""Adam and AdamW with ``torch.optim``'s update rules, and the moment-dtype wrapper.

Both optimizers share one transform, ``scale_by_torch_adam``, which differs from
``optax.scale_by_adam`` in one place: its amsgrad keeps the running maximum of the *raw*
second moment and bias-corrects that maximum, as torch does (optax's ``scale_by_amsgrad``
keeps the maximum of the bias-corrected moment, which gives a different, larger denominator
in early steps). Weight decay is optax's ``add_decayed_weights`` placed before the moments
(``adam``, L2-coupled) or after them (``adamw``, decoupled).

``with_moment_dtype`` lives here because every torch-style optimizer (sgd, adagrad, rmsprop
too) uses it and adam is the first of them; it keeps fp32 buffers for bf16 parameters.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rudax.optim._validation import (
    check_bool,
    check_float_dtype,
    check_in_range,
    check_learning_rate,
    check_non_negative,
)

Schedule = Callable[[jax.Array], jax.Array]


def as_weak(value: Any) -> Any:
    """A concrete Python or NumPy number as a Python float; anything else as it is.

    JAX treats a Python float as weakly typed, so ``b1 * m`` keeps ``m``'s dtype under strict
    promotion even when ``m`` is bf16; a NumPy float32 scalar would not. Arrays (as
    ``optax.inject_hyperparams`` passes) stay arrays.
    """
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


def static_nonzero(value: Any) -> bool:
    """False only for a Python or NumPy number equal to 0, which lets a factory drop a term.

    An array, even a concrete one, counts as non-zero: ``optax.inject_hyperparams`` builds the
    optimizer once with concrete arrays (init) and once with tracers (update), and both must
    give the same state structure.
    """
    return not (isinstance(value, numbers.Real) and value == 0)


def with_moment_dtype(
    inner: optax.GradientTransformation, moment_dtype: Any
) -> optax.GradientTransformation:
    """Runs ``inner`` with gradients, parameters and buffers in ``moment_dtype``.

    ``inner.init`` sees the parameters cast to ``moment_dtype``, so every float buffer it
    allocates has that dtype; ``inner.update`` sees the gradients and parameters cast to it, so
    its arithmetic (moments, weight decay, learning rate) runs in it; the updates are cast once,
    at the end, to each parameter's dtype (the gradient's when ``params`` is not given). With
    ``moment_dtype=None`` this returns ``inner`` unchanged: buffers and arithmetic in each
    parameter's own dtype.

    Args:
      inner: the transformation to run.
      moment_dtype: a floating dtype, or None.

    Returns:
      An ``optax.GradientTransformation`` with ``inner``'s state.
    """
    check_float_dtype("moment_dtype", moment_dtype)
    if moment_dtype is None:
        return inner
    dtype = jnp.dtype(moment_dtype)

    def cast(tree: Any, what: str) -> Any:
        def leaf(path: Any, x: Any) -> jax.Array:
            x = jnp.asarray(x)
            if not jnp.issubdtype(x.dtype, jnp.floating):
                raise TypeError(
                    f"{what} {jax.tree_util.keystr(path)} must have a floating dtype to be "
                    f"computed in moment_dtype={dtype.name}, got dtype={x.dtype}"
                )
            return x.astype(dtype)

        return jax.tree_util.tree_map_with_path(leaf, tree)

    def init_fn(params: Any) -> Any:
        return inner.init(cast(params, "parameter"))

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        like = updates if params is None else params
        cast_params = None if params is None else cast(params, "parameter")
        new_updates, state = inner.update(cast(updates, "gradient"), state, cast_params)
        new_updates = jax.tree.map(lambda u, x: u.astype(jnp.result_type(x)), new_updates, like)
        return new_updates, state

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_learning_rate(learning_rate: float | Schedule) -> optax.GradientTransformation:
    """``optax.scale_by_learning_rate`` with a number made weakly typed (see ``as_weak``)."""
    return optax.scale_by_learning_rate(
        learning_rate if callable(learning_rate) else as_weak(learning_rate)
    )


def _log(decay: Any) -> Any:
    """log(decay), in float64 when decay is known at construction (log(0) = -inf)."""
    if isinstance(decay, numbers.Real):
        return math.log(decay) if decay > 0 else -math.inf
    return jnp.log(decay)


class ScaleByTorchAdamState(NamedTuple):
    """State of ``scale_by_torch_adam``; field names are torch's ``Adam`` state keys."""

    count: jax.Array  # shape=(), int32: completed updates, saturating at 2**31 - 1
    exp_avg: Any  # like params: first moment m
    exp_avg_sq: Any  # like params: second moment v
    max_exp_avg_sq: Any  # like params: running max of v when amsgrad, else None


def scale_by_torch_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, amsgrad: bool = False
) -> optax.GradientTransformation:
    """Scales gradients by torch's Adam direction (no learning rate, no weight decay).

    With ``t`` the 1-based update count::

        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        v_max = max(v_max, v)                     (amsgrad; v_max replaces v below)
        u = (m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps)

    Buffers have the parameters' dtype; wrap with ``with_moment_dtype`` to change it.

    Args:
      b1: decay of the first moment, in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: added to the bias-corrected root of the second moment; >= 0.
      amsgrad: keep and use the running maximum of the raw second moment.

    Returns:
      An ``optax.GradientTransformation`` whose state is a ``ScaleByTorchAdamState``.
    """
    check_in_range("b1", b1, 0.0, 1.0)
    check_in_range("b2", b2, 0.0, 1.0)
    check_non_negative("eps", eps)
    check_bool("amsgrad", amsgrad)
    b1, b2, eps = as_weak(b1), as_weak(b2), as_weak(eps)
    # In fp32, 1 - 0.999**t is off by 1.3e-5 at t=1 (1 - 0.999f cancels); -expm1(t * log b)
    # with log b taken in float64 keeps it to fp32 rounding, as torch's float64 Python math.
    log_b1, log_b2 = _log(b1), _log(b2)

    def init_fn(params: Any) -> ScaleByTorchAdamState:
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return ScaleByTorchAdamState(
            count=jnp.zeros((), jnp.int32),
            exp_avg=zeros(),
            exp_avg_sq=zeros(),
            max_exp_avg_sq=zeros() if amsgrad else None,
        )

    def update_fn(
        updates: Any, state: ScaleByTorchAdamState, params: Any = None
    ) -> tuple[Any, ScaleByTorchAdamState]:
        del params
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        bias_correction1 = -jnp.expm1(t * log_b1)
        bias_correction2_sqrt = jnp.sqrt(-jnp.expm1(t * log_b2))

        exp_avg = jax.tree.map(lambda g, m: b1 * m + (1 - b1) * g, updates, state.exp_avg)
        exp_avg_sq = jax.tree.map(lambda g, v: b2 * v + (1 - b2) * g * g, updates, state.exp_avg_sq)
        max_exp_avg_sq = (
            jax.tree.map(jnp.maximum, state.max_exp_avg_sq, exp_avg_sq) if amsgrad else None
        )

        # The bias corrections are scalars: multiplying by their reciprocals (one scalar
        # division each) leaves one division per element instead of three. The step is
        # memory- and divide-bound on CPU, and the result is within an ulp of torch's
        # `m / bc1 / (sqrt(v) / sqrt(bc2) + eps)`.
        inv_bc1 = 1.0 / bias_correction1
        inv_bc2_sqrt = 1.0 / bias_correction2_sqrt

        def direction(m: jax.Array, v: jax.Array) -> jax.Array:
            denom = jnp.sqrt(v) * inv_bc2_sqrt.astype(v.dtype) + eps
            return (m * inv_bc1.astype(m.dtype)) / denom

        second = max_exp_avg_sq if amsgrad else exp_avg_sq
        new_updates = jax.tree.map(direction, exp_avg, second)
        return new_updates, ScaleByTorchAdamState(count, exp_avg, exp_avg_sq, max_exp_avg_sq)

    return optax.GradientTransformation(init_fn, update_fn)


def _check_common(learning_rate: Any, eps: Any, weight_decay: Any) -> None:
    check_learning_rate(learning_rate)
    check_non_negative("eps", eps)
    check_non_negative("weight_decay", weight_decay)


def adam(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    moment_dtype: Any = None,
) -> optax.GradientTransformation:
    """Adam with torch's rules: L2-coupled weight decay and torch's amsgrad.

    With ``t`` the 1-based update count and ``lr_t`` the learning rate at this update::

        g = g + weight_decay * p                  (L2: the decay enters the moments)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        v_max = max(v_max, v)                     (amsgrad; v_max replaces v below)
        p = p - lr_t * (m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps)

    This is ``torch.optim.Adam``. It differs from ``optax.adam`` in two ways: optax has no
    weight decay, and optax's amsgrad takes the maximum of the bias-corrected second moment
    ``v / (1 - b2**t)`` instead of the raw ``v``. For decoupled decay use ``adamw``.

    Args:
      learning_rate: a number >= 0, or a schedule mapping the update count (0 at the first
        update) to the learning rate; it is evaluated once per update.
      b1: decay of the first moment, in [0, 1) (torch's ``betas[0]``).
      b2: decay of the second moment, in [0, 1) (torch's ``betas[1]``).
      eps: added to the bias-corrected root of the second moment; >= 0.
      weight_decay: L2 coefficient added to the gradient before the moments; >= 0.
      amsgrad: use the running maximum of the second moment (Reddi et al.).
      moment_dtype: dtype of the moment buffers and of the update arithmetic (None: each
        parameter's own dtype). ``jnp.float32`` with bf16 parameters keeps fp32 moments;
        updates are returned in the parameters' dtype.

    Returns:
      An ``optax.GradientTransformation``: ``chain(add_decayed_weights, scale_by_torch_adam,
      scale_by_learning_rate)`` (the decay only when ``weight_decay`` is non-zero).

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.array([1.0, -2.0])}
      >>> tx = ro.adam(0.1)
      >>> updates, state = tx.update({"w": jnp.array([0.5, 0.5])}, tx.init(params), params)
      >>> [round(x, 6) for x in optax.apply_updates(params, updates)["w"].tolist()]
      [0.9, -2.1]

    References:
      Kingma and Ba, `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, 2014; Reddi et al., `On the Convergence of Adam
      and Beyond <https://openreview.net/forum?id=ryQu7f-RZ>`_, 2018; PyTorch,
      ``torch.optim.Adam``.
    """
    _check_common(learning_rate, eps, weight_decay)
    decay = (
        [optax.add_decayed_weights(as_weak(weight_decay))] if static_nonzero(weight_decay) else []
    )
    return with_moment_dtype(
        optax.chain(
            *decay,
            scale_by_torch_adam(b1, b2, eps, amsgrad),
            scale_by_learning_rate(learning_rate),
        ),
        moment_dtype,
    )


def adamw(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    moment_dtype: Any = None,
) -> optax.GradientTransformation:
    """AdamW with torch's rules: decoupled weight decay scaled by the learning rate.

    With ``t`` the 1-based update count and ``lr_t`` the learning rate at this update::

        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        v_max = max(v_max, v)                     (amsgrad; v_max replaces v below)
        u = (m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps)
        p = p - lr_t * (u + weight_decay * p)

    The last line is torch's ``p *= 1 - lr_t * weight_decay`` followed by ``p -= lr_t * u``.
    This is ``torch.optim.AdamW``. ``optax.adamw`` has the same decoupled decay but a default
    ``weight_decay`` of 1e-4 (torch: 1e-2) and optax's amsgrad (see ``adam``); the decay is not
    masked here: wrap in ``optax.masked`` to exempt biases and norms.

    Args:
      learning_rate: a number >= 0, or a schedule mapping the update count (0 at the first
        update) to the learning rate; it is evaluated once per update.
      b1: decay of the first moment, in [0, 1) (torch's ``betas[0]``).
      b2: decay of the second moment, in [0, 1) (torch's ``betas[1]``).
      eps: added to the bias-corrected root of the second moment; >= 0.
      weight_decay: decoupled decay coefficient, multiplied by the learning rate; >= 0.
      amsgrad: use the running maximum of the second moment (Reddi et al.).
      moment_dtype: dtype of the moment buffers and of the update arithmetic (None: each
        parameter's own dtype). ``jnp.float32`` with bf16 parameters keeps fp32 moments;
        updates are returned in the parameters' dtype.

    Returns:
      An ``optax.GradientTransformation``: ``chain(scale_by_torch_adam, add_decayed_weights,
      scale_by_learning_rate)`` (the decay only when ``weight_decay`` is non-zero).

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.array([1.0, -2.0])}
      >>> tx = ro.adamw(0.1, weight_decay=0.5)
      >>> updates, state = tx.update({"w": jnp.array([0.5, 0.5])}, tx.init(params), params)
      >>> [round(x, 6) for x in optax.apply_updates(params, updates)["w"].tolist()]
      [0.85, -2.0]

    References:
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019; PyTorch, ``torch.optim.AdamW``.
    """
    _check_common(learning_rate, eps, weight_decay)
    decay = (
        [optax.add_decayed_weights(as_weak(weight_decay))] if static_nonzero(weight_decay) else []
    )
    return with_moment_dtype(
        optax.chain(
            scale_by_torch_adam(b1, b2, eps, amsgrad),
            *decay,
            scale_by_learning_rate(learning_rate),
        ),
        moment_dtype,
    )
