"""How a torch-style optimizer is assembled from its direction, weight decay and learning rate.

torch's SGD, Adam, Adagrad and RMSprop add ``weight_decay * p`` to the gradient before their
buffers see it (L2); AdamW and Muon shrink the parameters after the direction is computed
(decoupled). Both are ``optax.add_decayed_weights`` placed on one side of the direction or the
other, followed by the learning rate: ``torch_chain`` builds that chain once for all of them,
under the moment-dtype rule of ``rudax/optim/_precision.py``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import optax

from rudax.optim._precision import as_weak, scale_by_learning_rate, with_moment_dtype


def static_nonzero(value: Any) -> bool:
    """False only for a Python or NumPy number equal to 0, which lets a factory drop a term.

    An array, even a concrete one, counts as non-zero: ``optax.inject_hyperparams`` builds the
    optimizer once with concrete arrays (init) and once with tracers (update), and both must
    give the same state structure.
    """
    return not (isinstance(value, numbers.Real) and value == 0)


def torch_chain(
    direction: Sequence[optax.GradientTransformation],
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: Any,
    moment_dtype: Any,
    *,
    name: str,
    decoupled: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Chains a direction with torch's weight decay and the learning rate.

    ::

        chain(add_decayed_weights, *direction, scale_by_learning_rate)   (L2: the default)
        chain(*direction, add_decayed_weights, scale_by_learning_rate)   (decoupled)

    so the decoupled update is ``p - lr_t * (u + weight_decay * p)``, torch's
    ``p *= 1 - lr_t * weight_decay`` followed by ``p -= lr_t * u``. The decay is left out when
    ``weight_decay`` is a number equal to 0. The caller validates the hyperparameters.

    Args:
      direction: the transforms that turn gradients into the unscaled step.
      learning_rate: a number or a schedule of the update count.
      weight_decay: the decay coefficient.
      moment_dtype: the buffers' storage dtype, or None (see ``with_moment_dtype``).
      name: the optimizer's name, for the errors (``with_moment_dtype``'s ``owner``).
      decoupled: place the decay after the direction instead of before it.

    Returns:
      The chain, wrapped in ``with_moment_dtype``.
    """
    decay = (
        [optax.add_decayed_weights(as_weak(weight_decay))] if static_nonzero(weight_decay) else []
    )
    transforms = [*direction, *decay] if decoupled else [*decay, *direction]
    return with_moment_dtype(
        optax.chain(*transforms, scale_by_learning_rate(learning_rate)), moment_dtype, owner=name
    )
