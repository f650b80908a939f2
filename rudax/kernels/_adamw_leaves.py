"""AdamW over many leaves with one set of per-step scalars, and a whole-step skip.

``rudax.optim.fused_adamw`` updates every parameter array of a model in one step: the scalars
(learning rate, bias corrections, clip coefficient) are computed once for all leaves, then one
``adamw_update`` pass runs per leaf (``_adamw.py``).

Skipping a step (``skip=``, for a step whose gradients are not finite) is a select inside the
same pass: where the flag is set, every output element is its input (the update ``-0.0``).
Not a ``lax.cond`` around the pass: XLA materializes both branches' outputs of a conditional
and cannot alias them to donated inputs, and on a GPU the predicate of a conditional is
copied to the host every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.typing import ArrayLike

from rudax._validation import check_bool
from rudax.kernels._adamw import AdamWBlock, as_operands, prepare_step, update_leaf


def adamw_update_leaves(
    params: Sequence[ArrayLike],
    grads: Sequence[ArrayLike],
    exp_avgs: Sequence[ArrayLike],
    exp_avg_sqs: Sequence[ArrayLike],
    masters: Sequence[ArrayLike | None],
    *,
    count: ArrayLike,
    learning_rate: ArrayLike,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    weight_decay: ArrayLike = 1e-2,
    grad_scale: ArrayLike | None = None,
    skip: bool | jax.Array | None = None,
    impl: str = "auto",
    interpret: bool = False,
    block: AdamWBlock | None = None,
    apply: bool = False,
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], list[jax.Array | None]]:
    """``adamw_update`` over many leaves with one set of scalars, and an optional skip.

    Leaf ``i`` gets ``adamw_update(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
    masters[i], ...)`` (see it for the rule). With ``skip`` True, each leaf's pass instead
    selects, element by element::

        update = -0.0 (param's dtype); exp_avg, exp_avg_sq, master returned bit for bit

    so ``param + update`` keeps every bit of ``param``, ``-0.0`` included. This is how
    ``rudax.optim.fused_adamw`` skips a non-finite step without a ``lax.cond``.

    Args:
      params: the stored parameters, each as ``adamw_update``'s ``param``.
      grads: one gradient per parameter.
      exp_avgs: one first moment per parameter.
      exp_avg_sqs: one second moment per parameter.
      masters: one fp32 master or None per parameter.
      count: this update's 1-based step ``t``, >= 1, for every leaf.
      learning_rate: the learning rate of this step, >= 0.
      b1: decay of the first moment, in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: added to the bias-corrected root of the second moment, >= 0.
      weight_decay: decoupled decay, >= 0; a number equal to 0 drops the term.
      grad_scale: multiplies every gradient first, or None.
      skip: None (apply), or a bool scalar (an array under ``jit``): True skips the step.
      impl: ``"auto"``, ``"pallas"`` or ``"xla"``.
      interpret: run the Pallas kernel in interpret mode, on any backend (for tests).
      block: the kernel's ``AdamWBlock``; None for the default.
      apply: return each new parameter, ``optax.apply_updates``' ``param + update`` in the
        parameter's dtype, instead of the update: one pass writes the parameter, moments
        and master, over their inputs on the Pallas path (in place where donated).

    Returns:
      ``(updates, exp_avgs, exp_avg_sqs, masters)`` (with ``apply``, the new parameters
      first), four lists with one entry per leaf as ``adamw_update`` returns them.
      ``adamw_update``'s errors, prefixed ``leaf i:`` for an array when there are several
      leaves; a ValueError if the sequences' lengths differ.

    Example:
      >>> import jax.numpy as jnp
      >>> from rudax.kernels._adamw_leaves import adamw_update_leaves
      >>> p, g, zeros = jnp.array([-0.0, 1.0]), jnp.array([jnp.nan, 1.0]), jnp.zeros(2)
      >>> updates, *_ = adamw_update_leaves(
      ...     [p], [g], [zeros], [zeros], [None], count=1, learning_rate=0.1,
      ...     skip=jnp.array(True))
      >>> (p + updates[0]).tolist()
      [-0.0, 1.0]

    References:
      See ``adamw_update``.
    """
    sequences = (params, grads, exp_avgs, exp_avg_sqs, masters)
    if len({len(x) for x in sequences}) != 1:
        raise ValueError(
            "params, grads, exp_avgs, exp_avg_sqs and masters must have one entry per leaf, "
            f"got lengths {tuple(len(x) for x in sequences)}"
        )
    leaves = [
        as_operands(*arrays, where=f"leaf {i}: " if len(params) > 1 else "")
        for i, arrays in enumerate(zip(*sequences, strict=True))
    ]
    hyper = (count, learning_rate, b1, b2, eps, weight_decay, grad_scale)
    size = sum(operands[0].size for operands in leaves)
    scalars, static = prepare_step(
        *hyper, skip, impl=impl, interpret=interpret, block=block, size=size
    )
    check_bool("apply", apply, allow_numpy=False)
    outs = [update_leaf(scalars, *operands, apply=apply, **static) for operands in leaves]
    return (
        [o[0] for o in outs],
        [o[1] for o in outs],
        [o[2] for o in outs],
        [o[3] for o in outs],
    )
