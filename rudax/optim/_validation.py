"""Checks that belong to rudax.optim: learning rates, inner transformations, stored parameters,
and the one check that gradients, parameters and state are pytrees alike (``check_tree_like``).

The generic checks (scalars, ranges, ints, flags, dtypes, floating leaves) are in
``rudax/_validation.py``, shared with rudax.layers and rudax.kernels. Each check raises a
ValueError or TypeError that names the argument and shows its value, so a typo in a config is
found at construction time, not as a NaN a thousand steps later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rudax._validation import STORAGE_DTYPES, check_non_negative


def check_learning_rate(learning_rate: Any, name: str = "learning_rate") -> None:
    """A learning rate is a number >= 0 or a schedule (a callable of the update count)."""
    if callable(learning_rate):
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


def _shape(x: Any) -> tuple[int, ...]:
    # .shape first: jax.ShapeDtypeStruct and tracers have it; Python scalars do not.
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _keys(tree: Any, is_leaf: Callable[[Any], bool] | None) -> list[str]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return [jax.tree_util.keystr(path) for path, _ in flat]


def tree_mismatch(
    name: str, tree: Any, ref_name: str, reference: Any, *, none_is_leaf: bool = False
) -> str | None:
    """What differs between two pytrees' structures or leaf shapes, as a message; None if alike.

    ``check_tree_like``'s comparison; see it for the arguments.
    """
    # With none_is_leaf, None is a leaf on both sides: a None in reference (no parameter) and
    # one in tree (no master) then hold the same place, and either may meet the other's leaf.
    is_leaf = (lambda x: x is None) if none_is_leaf else None
    ref_def = jax.tree.structure(reference, is_leaf=is_leaf)
    tree_def = jax.tree.structure(tree, is_leaf=is_leaf)
    # jaxlib 0.10 ships its _jax module without stubs: mypy cannot resolve jax's PyTreeDef
    # alias, so it refuses the comparison PyTreeDef defines.
    if tree_def != ref_def:  # type: ignore[operator]
        want, have = _keys(reference, is_leaf), _keys(tree, is_leaf)
        want_set, have_set = set(want), set(have)
        missing = [k for k in want if k not in have_set]
        extra = [k for k in have if k not in want_set]
        if missing or extra:
            return (
                f"{name} do not match {ref_name}' tree: missing leaves {missing[:3]}, "
                f"unexpected leaves {extra[:3]}"
            )
        return (
            f"{name} have {ref_name}' leaves but different containers: expected "
            f"{ref_def}, got {tree_def}"
        )
    flat_ref = jax.tree_util.tree_flatten_with_path(reference, is_leaf=is_leaf)[0]
    flat_tree = jax.tree.leaves(tree, is_leaf=is_leaf)
    for (path, r), x in zip(flat_ref, flat_tree, strict=True):
        key = jax.tree_util.keystr(path)
        if x is None:
            continue
        if r is None:
            return f"{name}{key} has shape {_shape(x)}, {ref_name}{key} is None"
        if _shape(x) != _shape(r):
            return f"{name}{key} has shape {_shape(x)}, {ref_name}{key} has shape {_shape(r)}"
    return None


def check_tree_like(
    owner: str,
    name: str,
    tree: Any,
    ref_name: str,
    reference: Any,
    *,
    none_is_leaf: bool = False,
) -> None:
    """ValueError unless ``tree`` has ``reference``'s pytree structure and each leaf its shape.

    The one check every rudax.optim transform makes on what ``update`` receives: gradients
    against parameters, each state tree against the gradients or parameters. Without it a
    (1, 3) gradient or moment for a (4, 3) parameter broadcasts silently, and a transposed one
    fails with jax's bare broadcasting message. The message names ``owner``, ``name`` (say
    ``"gradients"`` or ``"state.exp_avg"``), the pytree path and both shapes, or the leaves
    missing from or unexpected in ``tree``. Shapes are static, so under ``jit`` this runs once
    at trace time and adds nothing to the compiled step.

    Args:
      owner: the transformation, first in the message.
      name: what ``tree`` is.
      tree: the pytree to check.
      ref_name: what ``reference`` is.
      reference: the pytree ``tree`` must be like.
      none_is_leaf: a None in ``tree`` may stand for any leaf of ``reference`` (fused AdamW's
        masters: None for a leaf without one).
    """
    message = tree_mismatch(name, tree, ref_name, reference, none_is_leaf=none_is_leaf)
    if message is not None:
        raise ValueError(f"{owner}: {message}")


def check_gradients(owner: str, updates: Any, params: Any) -> None:
    """``check_tree_like`` of the gradients against the parameters, when there are any."""
    if params is not None:
        check_tree_like(owner, "gradients", updates, "params", params)
