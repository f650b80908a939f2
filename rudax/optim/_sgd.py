"""SGD with ``torch.optim.SGD``'s momentum, dampening and Nesterov rules.

optax's ``trace`` has torch's momentum only without dampening: its buffer starts at zero and
every step adds ``g``, whereas torch starts the buffer at the first gradient and then adds
``(1 - dampening) * g``. The two agree when ``dampening == 0``; one transform,
``scale_by_torch_momentum``, keeps a single code path for both.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from rudax._validation import check_bool, check_in_range, check_non_negative
from rudax.optim._base import safe_increment, transformation
from rudax.optim._inject import static_arguments
from rudax.optim._precision import as_weak, map_in_compute_dtype
from rudax.optim._torch_chain import DecayMask, known_zero, static_nonzero, torch_chain
from rudax.optim._validation import check_learning_rate


class ScaleByTorchMomentumState(NamedTuple):
    """State of ``scale_by_torch_momentum``."""

    # shape=(), int32: completed updates; 0 selects the first-step rule.
    # Named as optax names its counts, so optax.tree.get(state, "count") finds it; mypy
    # reports the field for overriding tuple.count (a method), as optax's states override it.
    count: jax.Array  # type: ignore[assignment]
    momentum_buffer: Any  # like params: torch's "momentum_buffer"; None when momentum is 0


def scale_by_torch_momentum(
    momentum: float | jax.Array, dampening: float | jax.Array = 0.0, nesterov: bool = False
) -> optax.GradientTransformation:
    """torch's SGD momentum buffer (no learning rate, no weight decay).

    ::

        b = g                                     (first update: no dampening)
        b = momentum * b + (1 - dampening) * g    (later updates)
        u = g + momentum * b  if nesterov  else  b

    A momentum known to be 0 when the state is initialised (a number, or the concrete array
    ``optax.inject_hyperparams`` passes to ``init``) keeps no buffer and passes gradients
    through: whether the buffer exists is fixed at init, so inject a non-zero momentum there
    to change it later.

    Args:
      momentum: the buffer's decay, in [0, 1).
      dampening: the fraction of the gradient not added to the buffer, in [0, 1].
      nesterov: use Nesterov momentum; requires ``momentum > 0`` and ``dampening == 0``.

    Returns:
      An ``optax.GradientTransformation`` whose state is a ``ScaleByTorchMomentumState``.
    """
    _check_momentum(momentum, dampening, nesterov)
    momentum, dampening = as_weak(momentum), as_weak(dampening)

    def init_fn(params: Any) -> ScaleByTorchMomentumState:
        return ScaleByTorchMomentumState(
            count=jnp.zeros((), jnp.int32),
            momentum_buffer=None if known_zero(momentum) else jax.tree.map(jnp.zeros_like, params),
        )

    def update_fn(
        updates: Any, state: ScaleByTorchMomentumState, params: Any = None
    ) -> tuple[Any, ScaleByTorchMomentumState]:
        del params
        count = safe_increment(state.count)
        if state.momentum_buffer is None:
            return updates, ScaleByTorchMomentumState(count, None)
        first = state.count == 0

        def leaf(g: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
            b = jnp.where(first, g, momentum * b + (1 - dampening) * g)
            return (g + momentum * b if nesterov else b), b

        new_updates, buffer = map_in_compute_dtype(
            leaf,
            updates,
            state.momentum_buffer,
            owner="scale_by_torch_momentum",
            names=("momentum_buffer",),
        )
        return new_updates, ScaleByTorchMomentumState(count, buffer)

    return transformation(init_fn, update_fn)


def _check_momentum(momentum: Any, dampening: Any, nesterov: Any) -> None:
    check_in_range("momentum", momentum, 0.0, 1.0)
    check_in_range("dampening", dampening, 0.0, 1.0, high_inclusive=True)
    check_bool("nesterov", nesterov)
    # torch's rule: without momentum Nesterov is plain SGD, with dampening it is ill-defined.
    if nesterov and not static_nonzero(momentum):
        raise ValueError(f"nesterov=True requires momentum > 0, got {momentum=}")
    if nesterov and static_nonzero(dampening):
        raise ValueError(f"nesterov=True requires dampening == 0, got {dampening=}")


@static_arguments("nesterov", "moment_dtype", "mask", when_zero=("momentum",))
def sgd(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float | jax.Array = 0.0,
    dampening: float | jax.Array = 0.0,
    nesterov: bool = False,
    weight_decay: float | jax.Array = 0.0,
    *,
    moment_dtype: DTypeLike | None = None,
    mask: DecayMask = None,
) -> optax.GradientTransformation:
    """Stochastic gradient descent with torch's momentum, dampening and Nesterov rules.

        With ``lr_t`` the learning rate at this update::

            g = g + weight_decay * p                  (L2)
            b = g                                     (first update, when momentum > 0)
            b = momentum * b + (1 - dampening) * g    (later updates)
            g = g + momentum * b  if nesterov  else  b
            p = p - lr_t * g

        This is ``torch.optim.SGD`` (without ``maximize``). ``optax.sgd`` differs when
        ``dampening > 0`` (optax has no dampening, and torch does not dampen the first step) and
        has no weight decay. Without momentum there is no buffer in the state. A complex parameter
    follows torch's rule too: SGD is linear, so its real view and the complex number agree.

        Args:
          learning_rate: a number >= 0, or a schedule mapping the update count (0 at the first
            update) to the learning rate; it is evaluated once per update.
          momentum: the buffer's decay, in [0, 1) (torch accepts any value >= 0; from 1 up the
            buffer grows without bound).
          dampening: the fraction of each later gradient not added to the buffer, in [0, 1].
          nesterov: Nesterov momentum; requires ``momentum > 0`` and ``dampening == 0``.
          weight_decay: L2 coefficient added to the gradient; >= 0.
          moment_dtype: storage dtype of the momentum buffer, e.g. ``jnp.float32`` for bf16
            parameters; None keeps each parameter's dtype. Each update is computed in the wider of
            this and the gradient's dtype and returned in the parameter's dtype.
          mask: which parameters decay, as in ``optax.add_decayed_weights``: a pytree of bools
            like the parameters (or a prefix of it), or a callable of the parameters returning
            one. A False leaf still gets its step, without decay (torch's parameter group with
            ``weight_decay=0``). None decays all.

        Returns:
          An ``optax.GradientTransformation``: ``chain(add_decayed_weights,
          scale_by_torch_momentum, scale_by_learning_rate)``; a coefficient equal to 0 makes its
          transform a no-op (no buffer without momentum).

        Example:
          >>> import jax.numpy as jnp
          >>> import optax
          >>> import rudax.optim as ro
          >>> params = {"w": jnp.array([1.0, -2.0])}
          >>> tx = ro.sgd(0.1, momentum=0.9, dampening=0.5)
          >>> state = tx.init(params)
          >>> for _ in range(2):
          ...     updates, state = tx.update({"w": jnp.array([1.0, 1.0])}, state, params)
          ...     params = optax.apply_updates(params, updates)
          >>> [round(x, 6) for x in params["w"].tolist()]  # buffer 1.0, then 0.9 + 0.5 = 1.4
          [0.76, -2.24]

        References:
          Sutskever et al., `On the importance of initialization and momentum in deep learning
          <https://proceedings.mlr.press/v28/sutskever13.html>`_, 2013; PyTorch,
          ``torch.optim.SGD``.
    """
    check_learning_rate(learning_rate)
    check_non_negative("weight_decay", weight_decay)
    _check_momentum(momentum, dampening, nesterov)
    return torch_chain(
        [scale_by_torch_momentum(momentum, dampening, nesterov)],
        learning_rate,
        weight_decay,
        moment_dtype,
        name="sgd",
        mask=mask,
    )
