"""Argument checks shared by rudax.optim, rudax.layers and rudax.kernels.

Each check raises a ValueError or TypeError that names the argument and shows its value, so a
typo in a config fails where the object is built, not as a NaN or a shape error deep inside a
jitted step. This module is a leaf (it imports only jax and numpy), so every subpackage can use
it without an arrow between subpackages. Checks that belong to one subpackage stay there:
learning rates and inner transformations in ``rudax/optim/_validation.py``, a layer's input in
``rudax/layers/_validation.py``, an op's operands beside the op.

Scalars come in three kinds, chosen by each call site's ``accept``:

* ``"traced"``: a hyperparameter that may be computed inside ``jit``. Python and NumPy numbers
  and scalar arrays are checked; a tracer cannot be inspected and passes unchecked.
* ``"concrete"``: a value a module stores as a Python float. Tracers are refused.
* ``"static"``: a value that becomes part of the compiled program (a ``jit`` static argument):
  Python and NumPy numbers only, no arrays.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal, overload

import jax
import jax.core
import numpy as np

# The values of every kernel's ``impl`` argument (``rudax.kernels._compat.resolve_impl``).
IMPLS = ("auto", "pallas", "xla")

# The dtypes rudax stores floating parameters, moments and masters in.
STORAGE_DTYPES = (np.dtype(jax.numpy.bfloat16), np.dtype(np.float16), np.dtype(np.float32))

Accept = Literal["traced", "concrete", "static"]
# The kinds under which a check returns a float, never None (the overloads say so).
Untraced = Literal["concrete", "static"]


@overload
def as_float(name: str, value: Any, *, accept: Untraced) -> float: ...
@overload
def as_float(name: str, value: Any, *, accept: Accept = ...) -> float | None: ...
def as_float(name: str, value: Any, *, accept: Accept = "traced") -> float | None:
    """value as a Python float, or None for a tracer under ``accept="traced"``.

    A TypeError for anything but a real scalar of the kind ``accept`` allows (see the module
    docstring).
    """
    if accept == "static":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {name}={value!r}")
        return float(value)
    _check_not_narrow(name, value)
    if accept == "traced" and isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {name}={value!r}")
    if isinstance(value, numbers.Real):
        return float(value)
    if not isinstance(value, np.ndarray | jax.Array):
        raise TypeError(f"{name} must be a real number, got {name}={value!r}")
    if accept == "concrete":
        if isinstance(value, jax.core.Tracer) or value.ndim != 0:
            raise TypeError(f"{name} must be a concrete scalar, got {name}={value!r}")
    elif value.ndim != 0:
        raise TypeError(f"{name} must be a scalar, got shape {value.shape}: {name}={value!r}")
    return float(value)


def _check_not_narrow(name: str, value: Any) -> None:
    """TypeError for a bf16/fp16 scalar (concrete or traced: its dtype is known either way).

    Such a hyperparameter has lost its value already (0.999 is 1.0 in bfloat16). It arrives
    so from ``optax.inject_hyperparams``, which casts hyperparameters to the parameters' dtype;
    under ``jax.jit`` the rounded value is a tracer no range check can see.
    """
    dtype = getattr(value, "dtype", None)
    if dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        return
    if np.dtype(dtype).itemsize >= 4:
        return
    raise TypeError(
        f"{name} is a {np.dtype(dtype).name} scalar ({name}={value!r}), rounded to 8 or 11 "
        "significant bits (0.999 becomes 1.0 in bfloat16); give hyperparameters in float32. "
        "optax.inject_hyperparams casts them to the parameters' dtype unless given "
        "hyperparam_dtype=jnp.float32; rudax.optim.inject_hyperparams keeps them in float32"
    )


@overload
def check_finite(name: str, value: Any, *, accept: Untraced) -> float: ...
@overload
def check_finite(name: str, value: Any, *, accept: Accept = ...) -> float | None: ...
def check_finite(name: str, value: Any, *, accept: Accept = "traced") -> float | None:
    """A finite real scalar; returns it as a float (None for a tracer under "traced")."""
    v = as_float(name, value, accept=accept)
    if v is not None and not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {name}={value!r}")
    return v


@overload
def check_in_range(
    name: str,
    value: Any,
    low: float,
    high: float | None = ...,
    *,
    low_inclusive: bool = ...,
    high_inclusive: bool = ...,
    accept: Untraced,
) -> float: ...
@overload
def check_in_range(
    name: str,
    value: Any,
    low: float,
    high: float | None = ...,
    *,
    low_inclusive: bool = ...,
    high_inclusive: bool = ...,
    accept: Accept = ...,
) -> float | None: ...
def check_in_range(
    name: str,
    value: Any,
    low: float,
    high: float | None = None,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = False,
    accept: Accept = "traced",
) -> float | None:
    """A finite scalar with low <= value < high (no upper bound for ``high=None``).

    The bounds are inclusive as the flags say, and the message shows them as given
    (``low=0`` reads ``>= 0``, ``low=0.0`` reads ``>= 0.0``). Returns value as a float (None
    for a tracer under ``accept="traced"``).
    """
    v = as_float(name, value, accept=accept)
    if v is None:
        return None
    above = v >= low if low_inclusive else v > low
    below = high is None or (v <= high if high_inclusive else v < high)
    if not (math.isfinite(v) and above and below):
        if high is None:
            bound = f"a finite number {'>=' if low_inclusive else '>'} {low}"
        else:
            bound = "in " + ("[" if low_inclusive else "(") + f"{low}, {high}"
            bound += "]" if high_inclusive else ")"
        raise ValueError(f"{name} must be {bound}, got {name}={value!r}")
    return v


@overload
def check_non_negative(name: str, value: Any, *, accept: Untraced) -> float: ...
@overload
def check_non_negative(name: str, value: Any, *, accept: Accept = ...) -> float | None: ...
def check_non_negative(name: str, value: Any, *, accept: Accept = "traced") -> float | None:
    """A finite scalar >= 0; returns it as a float (None for a tracer under "traced")."""
    return check_in_range(name, value, 0, accept=accept)


@overload
def check_positive(name: str, value: Any, *, accept: Untraced) -> float: ...
@overload
def check_positive(name: str, value: Any, *, accept: Accept = ...) -> float | None: ...
def check_positive(name: str, value: Any, *, accept: Accept = "traced") -> float | None:
    """A finite scalar > 0; returns it as a float (None for a tracer under "traced")."""
    return check_in_range(name, value, 0, low_inclusive=False, accept=accept)


def check_int(name: str, value: Any) -> None:
    """TypeError unless value is an int (a Python or NumPy integer, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")


def check_positive_int(name: str, value: Any) -> None:
    """An int >= 1."""
    check_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")


def check_power_of_two(name: str, value: Any) -> None:
    """An int that is a positive power of two (a block size, a warp count)."""
    check_int(name, value)
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a positive power of two, got {name}={value!r}")


def check_power_of_two_fields(block: Any) -> None:
    """``check_power_of_two`` on every field of a dataclass of block sizes, in field order."""
    for field in dataclasses.fields(block):
        check_power_of_two(field.name, getattr(block, field.name))


def check_bool(name: str, value: Any, *, allow_numpy: bool = True) -> None:
    """A bool; a NumPy bool too unless ``allow_numpy`` is False.

    rudax.kernels passes ``allow_numpy=False`` for its flags, which are ``jit`` static
    arguments: Python bools only.
    """
    if not isinstance(value, (bool | np.bool_) if allow_numpy else bool):
        raise TypeError(f"{name} must be a bool, got {name}={value!r}")


def check_impl(impl: Any) -> None:
    """ValueError unless impl is ``"auto"``, ``"pallas"`` or ``"xla"``."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl=}")


@overload
def float_dtype(
    name: str, dtype: Any, *, allow_none: Literal[False], none_in_message: bool = ...
) -> np.dtype: ...
@overload
def float_dtype(
    name: str, dtype: Any, *, allow_none: bool = ..., none_in_message: bool = ...
) -> np.dtype | None: ...
def float_dtype(
    name: str, dtype: Any, *, allow_none: bool = True, none_in_message: bool = False
) -> np.dtype | None:
    """dtype as a floating NumPy dtype (None passes if allowed); TypeError otherwise.

    ``none_in_message`` makes the error read "a floating dtype or None" (rudax.optim's
    wording, where None keeps each parameter's dtype).
    """
    expected = "a floating dtype or None" if none_in_message else "a floating dtype"
    if dtype is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be {expected}, got {name}=None")
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name} must be {expected}, got {name}={dtype!r}") from e
    if not jax.numpy.issubdtype(dt, jax.numpy.floating):
        raise TypeError(f"{name} must be {expected}, got {name}={dtype!r}")
    return dt


def check_floating_leaves(what: str, tree: Any, *, allow_complex: bool = False) -> list[Any]:
    """The leaves of tree; a TypeError naming, by its path, the first not floating.

    With ``allow_complex``, complex leaves pass too (the optimizers that follow torch's
    real-view rule for complex parameters).
    """
    kinds = (jax.numpy.floating, jax.numpy.complexfloating) if allow_complex else ()
    leaves = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = jax.numpy.result_type(leaf)
        if allow_complex and any(jax.numpy.issubdtype(dtype, k) for k in kinds):
            leaves.append(leaf)
            continue
        if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
            expected = "a floating or complex dtype" if allow_complex else "a floating dtype"
            hint = ""
            if jax.numpy.issubdtype(dtype, jax.numpy.complexfloating):
                hint = " (complex parameters are not supported here)"
            raise TypeError(
                f"{what} {jax.tree_util.keystr(path)} must have {expected}, got dtype={dtype}{hint}"
            )
        leaves.append(leaf)
    return leaves
