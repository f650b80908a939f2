"""Writes the checkpoints that an older rudax wrote, for ``test_old_formats.py`` to restore.

The files in ``formats_2_3/`` were written by rudax at commit d23ac91, the last that saved one
orbax item per record part (meta formats 2 and 3), with:

    git worktree add /tmp/rudax-old d23ac91
    PYTHONPATH=/tmp/rudax-old python -m tests.checkpoint.golden.make /tmp/formats_2_3

Step 2 is a default save (format 2), step 3 a ``zeros_as_metadata`` save (format 3, its
AdamW moments and accumulator listed as zeros). Rerunning this with today's rudax writes
today's format instead: the point of the files is that they were not.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import rudax.checkpoint as rc
import rudax.optim as ro


def record() -> rc.TrainingRecord:
    """The record both steps hold: fixed values, no randomness but a fixed PRNG key."""
    params = {
        "w": jnp.arange(32, dtype=jnp.bfloat16).reshape(8, 4) / 8,
        "b": jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32),
        "embed": {"table": jnp.arange(12, dtype=jnp.int32).reshape(3, 4)},
    }
    tx = ro.adamw(1e-3)
    float_params = {k: v for k, v in params.items() if k != "embed"}
    accumulator = ro.GradientAccumulator.init(float_params)
    state = {
        "rng": jax.random.key(7),
        "order": np.arange(6, dtype=np.int64),
        "epoch": 3,
        "name": "golden",
    }
    return rc.TrainingRecord.capture(
        model=params,
        optimizer=tx.init(float_params),
        accumulator=accumulator,
        state=state,
        config={"d_model": 4, "lr": 1e-3},
    )


def main(directory: str) -> None:
    with rc.Checkpointer(directory) as ckpt:
        ckpt.save(2, record())
    with rc.Checkpointer(directory, zeros_as_metadata=True) as ckpt:
        ckpt.save(3, record())


if __name__ == "__main__":
    main(sys.argv[1])
