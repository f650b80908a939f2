"""The trainer's third halting check, beside ``rudax.run``'s ``check_loss`` and ``check_finite``:

* ``limit`` updates in a row skipped by the optimizer (``rudax.optim.fused_adamw``'s or
  ``skip_nonfinite``'s non-finite skip): a run that no longer learns while it looks alive.
  The skip count is read from the optimizer state in the same device-to-host transfer as the
  loss, so it costs no synchronization of its own.
"""

from __future__ import annotations

from typing import Any

import jax

import rudax.optim as ro
from rudax.run import TrainingHalted

_SKIP_STATES = (ro.SkipNonfiniteState, ro.FusedAdamWState)


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
