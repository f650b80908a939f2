"""Checks that belong to rudax.optim: learning rates, inner transformations, stored parameters.

The generic checks (scalars, ranges, ints, flags, dtypes, floating leaves) are in
``rudax/_validation.py``, shared with rudax.layers and rudax.kernels. Each check raises a
ValueError or TypeError that names the argument and shows its value, so a typo in a config is
found at construction time, not as a NaN a thousand steps later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from rudax._validation import STORAGE_DTYPES, check_non_negative


def check_learning_rate(learning_rate: Any, name: str = "learning_rate") -> None:
    """A learning rate is a number >= 0 or a schedule (a callable of the update count)."""
    if isinstance(learning_rate, Callable):
        return
    check_non_negative(name, learning_rate)


def check_transformation(name: str, value: Any) -> None:
    """TypeError unless value looks like an optax transformation (init and update callables)."""
    if not (callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))):
        raise TypeError(
            f"{name} must be an optax.GradientTransformation (with init and update), "
            f"got {name}={value!r}"
        )


def check_storage_dtypes(owner: str, params: Any) -> None:
    """TypeError naming, by its path, the first parameter not stored in bf16, fp16 or fp32.

    For the optimizers that keep fp32 masters (``owner`` prefixes the message): integer
    buffers and keys have no master and no update, so they belong outside the optimized tree.
    """
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jax.numpy.result_type(p)
        if dtype not in STORAGE_DTYPES:
            raise TypeError(
                f"{owner}: parameter {jax.tree_util.keystr(path)} has dtype={dtype}; "
                "supported storage dtypes are bfloat16, float16 and float32. Leave other "
                "leaves (integer buffers, keys) out of the optimized tree, e.g. with "
                "nnx.state(model, nnx.Param) or optax.masked."
            )
