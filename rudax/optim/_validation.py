"""Checks of user-given hyperparameters, shared by every factory in rudax.optim.

Each check raises a ValueError or TypeError that names the argument and shows its value, so a
typo in a config is found at construction time, not as a NaN a thousand steps later. Values
that are tracers (a hyperparameter computed inside jit) cannot be inspected and pass through.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def _concrete_float(name: str, value: Any) -> float | None:
    """Returns value as a Python float, None for a tracer; TypeError for a non-number."""
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | jax.Array):
        raise TypeError(f"{name} must be a real number, got {name}={value!r}")
    if np.ndim(value) != 0:
        raise TypeError(f"{name} must be a scalar, got shape {np.shape(value)}: {name}={value!r}")
    return float(value)


def check_finite(name: str, value: Any) -> None:
    v = _concrete_float(name, value)
    if v is not None and not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {name}={value!r}")


def check_non_negative(name: str, value: Any) -> None:
    v = _concrete_float(name, value)
    if v is not None and not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {name}={value!r}")


def check_positive(name: str, value: Any) -> None:
    v = _concrete_float(name, value)
    if v is not None and not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {name}={value!r}")


def check_in_range(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = False,
) -> None:
    """Checks low <= value < high (bounds inclusive as the flags say)."""
    v = _concrete_float(name, value)
    if v is None:
        return
    above = v >= low if low_inclusive else v > low
    below = v <= high if high_inclusive else v < high
    if not (math.isfinite(v) and above and below):
        interval = (
            ("[" if low_inclusive else "(") + f"{low}, {high}" + ("]" if high_inclusive else ")")
        )
        raise ValueError(f"{name} must be in {interval}, got {name}={value!r}")


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {name}={value!r}")


def check_learning_rate(learning_rate: Any, name: str = "learning_rate") -> None:
    """A learning rate is a number >= 0 or a schedule (a callable of the update count)."""
    if isinstance(learning_rate, Callable):
        return
    check_non_negative(name, learning_rate)


def check_float_dtype(name: str, dtype: Any) -> None:
    """None (keep the parameter's dtype) or a floating dtype such as jnp.float32."""
    if dtype is None:
        return
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name} must be a floating dtype or None, got {name}={dtype!r}") from e
    if not jax.numpy.issubdtype(dt, jax.numpy.floating):
        raise TypeError(f"{name} must be a floating dtype or None, got {name}={dtype!r}")


def check_floating_leaves(what: str, tree: Any) -> None:
    """TypeError naming, by its path, the first leaf of tree without a floating dtype."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = jax.numpy.result_type(leaf)
        if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
            raise TypeError(
                f"{what} {jax.tree_util.keystr(path)} must have a floating dtype, got dtype={dtype}"
            )


def check_transformation(name: str, value: Any) -> None:
    """TypeError unless value looks like an optax transformation (init and update callables)."""
    if not (callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))):
        raise TypeError(
            f"{name} must be an optax.GradientTransformation (with init and update), "
            f"got {name}={value!r}"
        )
