"""Which examples a batch holds: an endless sequence of epochs, each a permutation of the
file's examples drawn from the seed and the epoch. Batch ``i`` is a pure function of the
file, the seed and ``i``, so a resumed run reads what the uninterrupted one would have."""

from __future__ import annotations

import numpy as np


def batch_indices(n: int, seed: int, i: int, size: int) -> list[int]:
    """The indices (into ``n`` examples) of batch ``i`` of ``size`` examples.

    Example:
      >>> sorted(batch_indices(4, 0, 0, 4)) == [0, 1, 2, 3]  # the first epoch, whole
      True
    """
    out = []
    for k in range(i * size, (i + 1) * size):
        order = np.random.default_rng([seed, k // n]).permutation(n)
        out.append(int(order[k % n]))
    return out
