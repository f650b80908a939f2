"""Empty rows: padding a batch of shared-prefix rows to a fixed count, scoring nothing."""

from __future__ import annotations

import numpy as np

import rudax.post_train as rp

# what an empty row holds where it is not 0: no label, no completion
_FILL = {"labels": rp.IGNORE_INDEX, "completion": -1}


def pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """``batch`` with empty rows added up to ``rows``: each step then compiles once, a mesh
    gets an equal share of rows per device, and the padding scores nothing.

    Example:
      >>> import numpy as np
      >>> out = pad_rows({"labels": np.ones((1, 2), np.int32)}, 2)
      >>> out["labels"].tolist()
      [[1, 1], [-100, -100]]
    """
    have = len(next(iter(batch.values())))
    return {
        k: np.concatenate([v, np.full((rows - have, *v.shape[1:]), _FILL.get(k, 0), v.dtype)])
        for k, v in batch.items()
    }
