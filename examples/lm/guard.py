"""Stopping a run that has gone wrong, before it overwrites what was right.

Three checks of ``examples.lm.train``, each raising ``TrainingHalted`` with the update:

* a non-finite training loss (read on the host anyway, for the progress bar): the weights it
  was computed with, or the batch, are broken, and an optimizer without a skip would now
  write NaN into every weight;
* non-finite weights before a checkpoint is saved: a checkpoint of NaN weights would push an
  intact one out of the ``--keep`` window. One small jitted reduction per save;
* ``limit`` updates in a row skipped by the optimizer (``rudax.optim.fused_adamw``'s or
  ``skip_nonfinite``'s non-finite skip): a run that no longer learns while it looks alive.
  The skip count is read from the optimizer state in the same device-to-host transfer as the
  loss, so it costs no synchronization of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import rudax.optim as ro

_SKIP_STATES = (ro.SkipNonfiniteState, ro.FusedAdamWState)


class TrainingHalted(Exception):
    """The run cannot go on: its loss or weights are not finite, or no update is applied."""


def num_skipped(opt_state: Any) -> jax.Array | None:
    """The optimizer's count of skipped updates (an int32 scalar), None if it never skips.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.optim as ro
      >>> from examples.lm.guard import num_skipped
      >>> params = {"w": jnp.zeros(2)}
      >>> int(num_skipped(ro.fused_adamw(1e-3).init(params))), num_skipped(ro.sgd(0.1).init(params))
      (0, None)
    """
    is_skip = lambda s: isinstance(s, _SKIP_STATES)
    for s in jax.tree.leaves(opt_state, is_leaf=is_skip):
        if is_skip(s):
            return s.num_skipped  # the outermost: a skip there leaves any inner one unchanged
    return None


class SkipWatch:
    """Counts the updates skipped in a row; raises ``TrainingHalted`` at ``limit`` of them.

    Args:
      limit: consecutive skipped updates that stop the run (``--max-skipped-updates``).
      num_skipped: the optimizer's count at the start (a resumed run's is not 0), or None
        for an optimizer that never skips (then ``update`` always returns False).
    """

    def __init__(self, limit: int, num_skipped: int | None) -> None:
        self.limit, self.seen, self.in_a_row = limit, num_skipped, 0

    def update(self, step: int, num_skipped: int | None) -> bool:
        """Whether update ``step`` was skipped, given the optimizer's count after it."""
        if num_skipped is None or self.seen is None:
            return False
        skipped = int(num_skipped) > self.seen
        self.seen = int(num_skipped)
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.in_a_row >= self.limit:
            first = step - self.in_a_row + 1
            which = f"update {step}" if first == step else f"updates {first} to {step}"
            raise TrainingHalted(
                f"{which}: {self.in_a_row} updates in a row were skipped by the optimizer "
                "because their gradients were not finite, so the run no longer learns; "
                f"stopping (--max-skipped-updates {self.limit}). Look for overflowing "
                "activations or a learning rate too high; the checkpoints are as they were"
            )
        return skipped


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
