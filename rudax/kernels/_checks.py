"""Argument checks shared by rudax.kernels' ops and block-size dataclasses.

rudax.kernels does not import rudax.optim (the arrows point kernels <- optim), so its ops check
their scalars here rather than with ``rudax/optim/_validation.py``. Every error is a
ValueError or TypeError that names the argument and shows its value. Checks of arrays that
belong to one op (shapes and dtypes of its operands) stay beside that op.

A value that is a tracer (a hyperparameter computed inside ``jit``) cannot be inspected and
passes the checks that allow traced values; ``check_static_positive`` is for arguments that
shape the program and must be Python numbers.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The values of every kernel op's ``impl`` argument (see ``_compat.resolve_impl``).
IMPLS = ("auto", "pallas", "xla")


def check_impl(impl: Any) -> None:
    """ValueError unless impl is ``"auto"``, ``"pallas"`` or ``"xla"``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl=}")


def check_bool(name: str, value: Any) -> None:
    """TypeError unless value is a Python bool (flags shape the program: no arrays)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {name}={value!r}")


def check_block(block: Any, block_type: type) -> None:
    """TypeError unless block is None or an instance of ``block_type``."""
    if block is not None and not isinstance(block, block_type):
        raise TypeError(
            f"block must be a rudax.kernels.{block_type.__name__} or None, got {block=}"
        )


def check_power_of_two(name: str, value: Any) -> None:
    """A block-size field: an int (not a bool) that is a positive power of two."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a positive power of two, got {name}={value!r}")


def check_positive_int(name: str, value: Any) -> None:
    """An int (not a bool) >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")


def concrete_float(name: str, value: Any) -> float | None:
    """value as a Python float; None for a tracer; TypeError for a non-number or non-scalar."""
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | jax.Array):
        raise TypeError(f"{name} must be a real number, got {name}={value!r}")
    if np.ndim(value) != 0:
        raise TypeError(f"{name} must be a scalar, got shape {np.shape(value)}: {name}={value!r}")
    return float(value)


def check_range(name: str, value: Any, low: float, high: float | None = None) -> None:
    """low <= value (< high when given), finite; tracers pass unchecked."""
    v = concrete_float(name, value)
    if v is None:
        return
    if not (math.isfinite(v) and v >= low and (high is None or v < high)):
        bound = f"in [{low}, {high})" if high is not None else f"a finite number >= {low}"
        raise ValueError(f"{name} must be {bound}, got {name}={value!r}")


def check_static_positive(name: str, value: Any) -> float:
    """A Python number, finite and > 0 (it is static: it becomes part of the program)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {name}={value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {name}={value!r}")
    return float(value)


def check_count(count: Any) -> None:
    """A 1-based step: an integer scalar >= 1 (a Python int or an integer array); tracers pass."""
    if isinstance(count, jax.core.Tracer):
        return
    if isinstance(count, bool) or not (
        isinstance(count, numbers.Integral)
        or (isinstance(count, np.ndarray | jax.Array) and jnp.issubdtype(count.dtype, jnp.integer))
    ):
        raise TypeError(f"count must be an integer (the 1-based step), got {count=}")
    if np.ndim(count) != 0:
        raise TypeError(f"count must be a scalar, got shape {np.shape(count)}: {count=}")
    if int(count) < 1:
        raise ValueError(f"count must be >= 1 (the 1-based step), got {count=}")
