"""Checks of layer constructor arguments and call inputs, shared by the modules of rudax.layers.

Each check raises a ValueError or TypeError that names the argument and shows its value, so a
wrong config fails when the model is built, not as a shape error deep inside a jitted step.
rudax.layers does not import rudax.optim (the two are siblings), hence its own small set.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# rudax.kernels' implementation switch; layers check it when built, not at their first call.
IMPLS = ("auto", "pallas", "xla")


def check_impl(impl: Any, interpret: Any) -> None:
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl=}")
    check_bool("interpret", interpret)


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {name}={value!r}")


def as_float(name: str, value: Any) -> float:
    """value as a Python float; TypeError for anything but a real scalar."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | jax.Array):
        raise TypeError(f"{name} must be a real number, got {name}={value!r}")
    if isinstance(value, jax.core.Tracer) or np.ndim(value) != 0:
        raise TypeError(f"{name} must be a concrete scalar, got {name}={value!r}")
    return float(value)


def check_positive(name: str, value: Any) -> float:
    v = as_float(name, value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {name}={value!r}")
    return v


def check_rate(name: str, value: Any) -> float:
    """A probability of dropping: 0 <= value < 1 (1 would drop everything and divide by 0)."""
    v = as_float(name, value)
    if not (0.0 <= v < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {name}={value!r}")
    return v


def float_dtype(name: str, dtype: Any, *, allow_none: bool = True) -> jnp.dtype | None:
    """dtype as a canonical floating jnp.dtype (None passes if allowed); TypeError otherwise."""
    if dtype is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be a floating dtype, got {name}=None")
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name} must be a floating dtype, got {name}={dtype!r}") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {name}={dtype!r}")
    return dt


def check_features(layer: str, x: jax.Array, features: int) -> None:
    """x must be a floating array whose last axis has the layer's input size."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{layer} expects a floating input, got x.dtype={x.dtype}")
    if x.ndim == 0 or x.shape[-1] != features:
        raise ValueError(
            f"{layer} expects x.shape[-1] == {features} (its input features), got x.shape={x.shape}"
        )
