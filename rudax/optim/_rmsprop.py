"""RMSprop with ``torch.optim.RMSprop``'s update rule and defaults.

torch adds ``eps`` outside the square root (optax's ``scale_by_rms`` adds it inside by
default), decays with ``alpha=0.99`` (optax: 0.9), and applies momentum to ``g / avg`` before
the learning rate (optax's ``rmsprop`` applies ``trace`` after it, which differs once the
learning rate changes). The momentum buffer is SGD's ``scale_by_torch_momentum`` without
dampening: ``optax.trace`` computes the same buffer, but adds a buffer stored in bf16 to fp32
arithmetic directly, which strict promotion rejects (``rudax/optim/_precision.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from rudax._validation import check_bool, check_in_range, check_non_negative
from rudax.optim._base import transformation
from rudax.optim._inject import static_arguments
from rudax.optim._precision import as_weak, map_in_compute_dtype
from rudax.optim._sgd import scale_by_torch_momentum
from rudax.optim._torch_chain import DecayMask, torch_chain
from rudax.optim._validation import check_learning_rate


class ScaleByTorchRMSState(NamedTuple):
    """State of ``scale_by_torch_rms``; field names are torch's ``RMSprop`` state keys."""

    square_avg: Any  # like params: moving average of g**2
    grad_avg: Any  # like params: moving average of g when centered, else None


def scale_by_torch_rms(
    alpha: float | jax.Array = 0.99, eps: float | jax.Array = 1e-8, centered: bool = False
) -> optax.GradientTransformation:
    """Scales gradients by torch's RMSprop denominator (no momentum, no learning rate).

    ::

        v = alpha * v + (1 - alpha) * g**2
        a = alpha * a + (1 - alpha) * g           (centered)
        u = g / (sqrt(v - a**2) + eps)  if centered  else  g / (sqrt(v) + eps)

    Where rounding makes ``v - a**2`` negative (it is >= 0 in exact arithmetic) torch takes
    the root of a negative number and returns NaN; here it is clamped at 0.

    Args:
      alpha: decay of the moving averages, in [0, 1).
      eps: added to the root, >= 0.
      centered: normalize by the estimated variance instead of the second moment.

    Returns:
      An ``optax.GradientTransformation`` whose state is a ``ScaleByTorchRMSState``.
    """
    check_in_range("alpha", alpha, 0.0, 1.0)
    check_non_negative("eps", eps)
    check_bool("centered", centered)
    alpha, eps = as_weak(alpha), as_weak(eps)

    def init_fn(params: Any) -> ScaleByTorchRMSState:
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return ScaleByTorchRMSState(square_avg=zeros(), grad_avg=zeros() if centered else None)

    def update_fn(
        updates: Any, state: ScaleByTorchRMSState, params: Any = None
    ) -> tuple[Any, ScaleByTorchRMSState]:
        del params

        def leaf(g: jax.Array, v: jax.Array, *a: jax.Array) -> tuple:
            v = alpha * v + (1 - alpha) * g * g
            a = tuple(alpha * x + (1 - alpha) * g for x in a)  # empty unless centered
            variance = jnp.maximum(v - a[0] * a[0], 0) if centered else v
            return g / (jnp.sqrt(variance) + eps), v, *a

        names = ("square_avg", *(["grad_avg"] if centered else []))
        new_updates, square_avg, *centered_avg = map_in_compute_dtype(
            leaf,
            updates,
            *(getattr(state, n) for n in names),
            owner="scale_by_torch_rms",
            names=names,
        )
        grad_avg = centered_avg[0] if centered else None
        return new_updates, ScaleByTorchRMSState(square_avg, grad_avg)

    return transformation(init_fn, update_fn)


@static_arguments("centered", "moment_dtype", "mask", when_zero=("momentum",))
def rmsprop(
    learning_rate: optax.ScalarOrSchedule,
    alpha: float | jax.Array = 0.99,
    eps: float | jax.Array = 1e-8,
    weight_decay: float | jax.Array = 0.0,
    momentum: float | jax.Array = 0.0,
    centered: bool = False,
    *,
    moment_dtype: DTypeLike | None = None,
    mask: DecayMask = None,
) -> optax.GradientTransformation:
    """RMSprop with torch's rules: ``eps`` outside the root, momentum before the learning rate.

    With ``lr_t`` the learning rate at this update::

        g = g + weight_decay * p                  (L2)
        v = alpha * v + (1 - alpha) * g**2
        a = alpha * a + (1 - alpha) * g           (centered)
        avg = sqrt(v - a**2) + eps  if centered  else  sqrt(v) + eps
        b = momentum * b + g / avg                (momentum > 0; b starts at 0)
        p = p - lr_t * b                          (momentum > 0)
        p = p - lr_t * g / avg                    (otherwise)

    This is ``torch.optim.RMSprop`` (without ``maximize``). ``optax.rmsprop`` defaults to
    ``decay=0.9``, puts ``eps`` inside the root, has no weight decay, and applies momentum
    after the learning rate. Rounding that makes ``v - a**2`` negative gives NaN in torch and
    is clamped at 0 here.

    Args:
      learning_rate: a number >= 0, or a schedule mapping the update count (0 at the first
        update) to the learning rate; it is evaluated once per update.
      alpha: decay of the moving averages, in [0, 1) (torch accepts any value >= 0).
      eps: added to the root, >= 0.
      weight_decay: L2 coefficient added to the gradient; >= 0.
      momentum: decay of the momentum buffer, in [0, 1) (torch accepts any value >= 0).
      centered: normalize by the estimated variance instead of the second moment.
      moment_dtype: storage dtype of the averages and the momentum buffer, e.g. ``jnp.float32``
        for bf16 parameters; None keeps each parameter's dtype. Each update is computed in the
        wider of this and the gradient's dtype and returned in the parameter's dtype.
      mask: which parameters decay, as in ``optax.add_decayed_weights``: a pytree of bools
        like the parameters (or a prefix of it), or a callable of the parameters returning
        one. A False leaf still gets its step, without decay (torch's parameter group with
        ``weight_decay=0``). None decays all.

    Returns:
      An ``optax.GradientTransformation``: ``chain(add_decayed_weights, scale_by_torch_rms,
      scale_by_torch_momentum, scale_by_learning_rate)``; a coefficient equal to 0 makes its
      transform a no-op (no momentum buffer without momentum).

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.array([1.0, -2.0])}
      >>> tx = ro.rmsprop(0.01, alpha=0.75)
      >>> updates, state = tx.update({"w": jnp.array([2.0, -2.0])}, tx.init(params), params)
      >>> new_params = optax.apply_updates(params, updates)  # p - 0.01 * g / sqrt(0.25 * g**2)
      >>> [round(x, 6) for x in new_params["w"].tolist()]
      [0.98, -1.98]

    References:
      Hinton, `Neural Networks for Machine Learning, lecture 6e
      <https://www.cs.toronto.edu/~tijmen/csc321/slides/lecture_slides_lec6.pdf>`_, 2012;
      Graves, `Generating Sequences With Recurrent Neural Networks
      <https://arxiv.org/abs/1308.0850>`_, 2013 (centered); PyTorch, ``torch.optim.RMSprop``.
    """
    check_learning_rate(learning_rate)
    check_non_negative("weight_decay", weight_decay)
    check_in_range("momentum", momentum, 0.0, 1.0)
    # torch's momentum buffer starts at 0 and adds g / avg: its first value is g / avg, as
    # SGD's buffer (without dampening) starts at its first input, so SGD's transform is reused.
    return torch_chain(
        [scale_by_torch_rms(alpha, eps, centered), scale_by_torch_momentum(momentum)],
        learning_rate,
        weight_decay,
        moment_dtype,
        name="rmsprop",
        mask=mask,
    )
