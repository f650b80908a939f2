"""Checks that belong to rudax.layers: a layer's input and a dropout rate.

The generic checks (ints, flags, positive scalars, dtypes, ``impl``) are in
``rudax/_validation.py``, shared with rudax.optim and rudax.kernels. Each check raises a
ValueError or TypeError that names the argument and shows its value, so a wrong config fails
when the model is built, not as a shape error deep inside a jitted step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rudax._validation import check_in_range


def check_rate(name: str, value: Any) -> float:
    """A probability of dropping: 0 <= value < 1 (1 would drop everything and divide by 0)."""
    return check_in_range(name, value, 0, 1, accept="concrete")


def check_features(layer: str, x: jax.Array, features: int) -> None:
    """x must be a floating array whose last axis has the layer's input size."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{layer} expects a floating input, got x.dtype={x.dtype}")
    if x.ndim == 0 or x.shape[-1] != features:
        raise ValueError(
            f"{layer} expects x.shape[-1] == {features} (its input features), got x.shape={x.shape}"
        )
