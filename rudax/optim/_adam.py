"""Adam and AdamW with ``torch.optim``'s update rules.

Both optimizers share one transform, ``scale_by_torch_adam``, which differs from
``optax.scale_by_adam`` in one place: its amsgrad keeps the running maximum of the *raw*
second moment and bias-corrects that maximum, as torch does (optax's ``scale_by_amsgrad``
keeps the maximum of the bias-corrected moment, which gives a different, larger denominator
in early steps). Weight decay is optax's ``add_decayed_weights`` placed before the moments
(``adam``, L2-coupled) or after them (``adamw``, decoupled); see ``torch_chain``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from rudax._validation import check_bool, check_in_range, check_non_negative
from rudax.optim._base import safe_increment, transformation
from rudax.optim._inject import static_arguments
from rudax.optim._precision import as_weak, map_in_compute_dtype
from rudax.optim._torch_chain import DecayMask, torch_chain
from rudax.optim._validation import check_learning_rate


def _log(decay: Any) -> Any:
    """log(decay), in float64 when decay is known at construction (log(0) = -inf)."""
    if isinstance(decay, numbers.Real):
        value = float(decay)
        return math.log(value) if value > 0 else -math.inf
    return jnp.log(decay)


class ScaleByTorchAdamState(NamedTuple):
    """State of ``scale_by_torch_adam``; field names are torch's ``Adam`` state keys."""

    # shape=(), int32: completed updates, saturating at 2**31 - 1.
    # Named as optax names its counts, so optax.tree.get(state, "count") finds it; mypy
    # reports the field for overriding tuple.count (a method), as optax's states override it.
    count: jax.Array  # type: ignore[assignment]
    exp_avg: Any  # like params: first moment m
    exp_avg_sq: Any  # like params: second moment v
    max_exp_avg_sq: Any  # like params: running max of v when amsgrad, else None


def scale_by_torch_adam(
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.999,
    eps: float | jax.Array = 1e-8,
    amsgrad: bool = False,
) -> optax.GradientTransformation:
    """Scales gradients by torch's Adam direction (no learning rate, no weight decay).

    With ``t`` the 1-based update count::

        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        v_max = max(v_max, v)                     (amsgrad; v_max replaces v below)
        u = (m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps)

    Buffers are allocated like the parameters ``init`` sees; each leaf is computed in the wider
    of its gradient's and its buffers' dtypes (``rudax/optim/_precision.py``).

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
        count = safe_increment(state.count)
        t = count.astype(jnp.float32)
        # The bias corrections are scalars: multiplying by their reciprocals (one scalar
        # division each) leaves one division per element instead of three. The step is
        # memory- and divide-bound on CPU, and the result is within an ulp of torch's
        # `m / bc1 / (sqrt(v) / sqrt(bc2) + eps)`.
        inv_bc1 = 1.0 / -jnp.expm1(t * log_b1)
        inv_bc2_sqrt = 1.0 / jnp.sqrt(-jnp.expm1(t * log_b2))

        def leaf(g: jax.Array, m: jax.Array, v: jax.Array, *v_max: jax.Array) -> tuple:
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            v_max = tuple(jnp.maximum(x, v) for x in v_max)  # empty unless amsgrad
            denom = jnp.sqrt(v_max[0] if amsgrad else v) * inv_bc2_sqrt.astype(g.dtype) + eps
            return (m * inv_bc1.astype(g.dtype)) / denom, m, v, *v_max

        names = ("exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if amsgrad else []))
        new_updates, exp_avg, exp_avg_sq, *v_max = map_in_compute_dtype(
            leaf,
            updates,
            *(getattr(state, n) for n in names),
            owner="scale_by_torch_adam",
            names=names,
        )
        max_exp_avg_sq = v_max[0] if amsgrad else None
        return new_updates, ScaleByTorchAdamState(count, exp_avg, exp_avg_sq, max_exp_avg_sq)

    return transformation(init_fn, update_fn)


@static_arguments("amsgrad", "moment_dtype", "mask")
def adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.999,
    eps: float | jax.Array = 1e-8,
    weight_decay: float | jax.Array = 0.0,
    amsgrad: bool = False,
    *,
    moment_dtype: DTypeLike | None = None,
    mask: DecayMask = None,
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
      moment_dtype: storage dtype of the moments (and amsgrad's maximum), e.g. ``jnp.float32``
        for bf16 parameters; None keeps each parameter's dtype. Each update is computed in the
        wider of this and the gradient's dtype and returned in the parameter's dtype.
      mask: which parameters decay, as in ``optax.add_decayed_weights``: a pytree of bools
        like the parameters (or a prefix of it), or a callable of the parameters returning
        one. A False leaf still gets its step, without decay (torch's parameter group with
        ``weight_decay=0``). None decays all.

    Returns:
      An ``optax.GradientTransformation``: ``chain(add_decayed_weights, scale_by_torch_adam,
      scale_by_learning_rate)`` (the decay a no-op when ``weight_decay`` is 0).

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
    check_learning_rate(learning_rate)
    check_non_negative("weight_decay", weight_decay)
    return torch_chain(
        [scale_by_torch_adam(b1, b2, eps, amsgrad)],
        learning_rate,
        weight_decay,
        moment_dtype,
        name="adam",
        mask=mask,
    )


@static_arguments("amsgrad", "moment_dtype", "mask")
def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.999,
    eps: float | jax.Array = 1e-8,
    weight_decay: float | jax.Array = 1e-2,
    amsgrad: bool = False,
    *,
    moment_dtype: DTypeLike | None = None,
    mask: DecayMask = None,
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
    ``weight_decay`` of 1e-4 (torch: 1e-2) and optax's amsgrad (see ``adam``). To exempt biases
    and norms from the decay, pass ``mask=`` (as to ``optax.adamw``), not ``optax.masked``
    around the optimizer: that would leave the exempted parameters with no optimizer at all,
    stepping by their raw gradient.

    Args:
      learning_rate: a number >= 0, or a schedule mapping the update count (0 at the first
        update) to the learning rate; it is evaluated once per update.
      b1: decay of the first moment, in [0, 1) (torch's ``betas[0]``).
      b2: decay of the second moment, in [0, 1) (torch's ``betas[1]``).
      eps: added to the bias-corrected root of the second moment; >= 0.
      weight_decay: decoupled decay coefficient, multiplied by the learning rate; >= 0.
      amsgrad: use the running maximum of the second moment (Reddi et al.).
      moment_dtype: storage dtype of the moments (and amsgrad's maximum), e.g. ``jnp.float32``
        for bf16 parameters; None keeps each parameter's dtype. Each update is computed in the
        wider of this and the gradient's dtype and returned in the parameter's dtype.
      mask: which parameters decay, as in ``optax.add_decayed_weights``: a pytree of bools
        like the parameters (or a prefix of it), or a callable of the parameters returning
        one. A False leaf still gets its step, without decay (torch's parameter group with
        ``weight_decay=0``). None decays all.

    Returns:
      An ``optax.GradientTransformation``: ``chain(scale_by_torch_adam, add_decayed_weights,
      scale_by_learning_rate)`` (the decay a no-op when ``weight_decay`` is 0).

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
    check_learning_rate(learning_rate)
    check_non_negative("weight_decay", weight_decay)
    return torch_chain(
        [scale_by_torch_adam(b1, b2, eps, amsgrad)],
        learning_rate,
        weight_decay,
        moment_dtype,
        name="adamw",
        decoupled=True,
        mask=mask,
    )
