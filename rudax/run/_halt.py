"""Stopping a run that has gone wrong, before it overwrites what was right.

Two checks a training loop makes, each raising ``TrainingHalted`` naming the update and the
checkpoint that stays the latest:

* ``check_loss``: a non-finite training loss (read on the host anyway, for the progress
  bar): the weights it was computed with, or the batch, are broken, and an optimizer without
  a skip would now write NaN into every weight;
* ``check_finite``: non-finite weights before a checkpoint is saved: a checkpoint of NaN
  weights would push an intact one out of the ``keep`` window. One small jitted reduction
  per save, naming the first bad parameter by its pytree path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["TrainingHalted", "check_finite", "check_loss"]


class TrainingHalted(Exception):
    """The run cannot go on: its loss or weights are not finite, or no update is applied."""


@jax.jit
def _finite_leaves(tree: Any) -> jax.Array:
    # sum(x * 0) is NaN exactly when some element is inf or NaN: one plain float reduction
    # per leaf (as rudax.optim.all_finite), not a cascade of boolean ones.
    return jnp.stack(
        [
            jnp.isfinite(jnp.sum(jnp.asarray(x) * 0, dtype=jnp.float32))
            for x in jax.tree.leaves(tree)
        ]
    )


def check_finite(params: Any, *, step: int, latest: Callable[[], int | None]) -> None:
    """Raises ``TrainingHalted`` naming the first parameter with an inf or NaN.

    Args:
      params: the parameters about to be checkpointed.
      step: the update they are the result of.
      latest: returns the newest checkpoint on disk, named in the message as the one to go
        back to; called only when there is something to report.

    Example:
      >>> import jax.numpy as jnp
      >>> from rudax.run import TrainingHalted, check_finite
      >>> params = {"w": jnp.ones(3), "b": jnp.array([0.0, jnp.inf])}
      >>> try:
      ...     check_finite(params, step=4, latest=lambda: None)
      ... except TrainingHalted as e:
      ...     print(str(e).split(";")[0])
      update 4: parameter params['b'] is not finite (inf or NaN)
    """
    finite = jax.device_get(_finite_leaves(params))
    if finite.all():
        return
    # An nnx.Param's array is its .value: the path users know ends at the parameter.
    paths = [
        jax.tree_util.keystr(p).removesuffix(".value")
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    bad = [path for path, ok in zip(paths, finite.tolist(), strict=True) if not ok]
    more = f", and {len(bad) - 1} more" if len(bad) > 1 else ""
    raise TrainingHalted(
        f"update {step}: parameter params{bad[0]} is not finite (inf or NaN){more}; not "
        f"saving checkpoint {step}, {_kept(latest())}. A learning rate too high is the usual "
        "cause"
    )


def check_loss(loss: float, *, step: int, latest: Callable[[], int | None]) -> None:
    """Raises ``TrainingHalted`` if the training loss of update ``step`` is not finite.

    Called every update, so ``latest`` (as for ``check_finite``) lists the checkpoints only
    when the loss is not finite: listing them reads the directory.

    Example:
      >>> from rudax.run import TrainingHalted, check_loss
      >>> check_loss(2.5, step=7, latest=lambda: 5)  # finite: nothing happens
      >>> try:
      ...     check_loss(float("nan"), step=8, latest=lambda: 5)
      ... except TrainingHalted as e:
      ...     print(str(e).split(";")[0])
      update 8: the training loss is nan
    """
    if math.isfinite(loss):
        return
    raise TrainingHalted(
        f"update {step}: the training loss is {loss}; stopping before anything of it is "
        f"saved ({_kept(latest())}). Token ids outside the vocabulary (damaged data) or a "
        "learning rate too high are the usual causes"
    )


def _kept(latest: int | None) -> str:
    if latest is None:
        return "no checkpoint was written yet"
    return f"checkpoint {latest} is the latest and is kept"
