"""What rudax.optim needs from JAX beyond its public API, in one place per JAX version.

jax 0.10.2 (these machines) and 0.11.2 (the GPU machines) both have it where it is read here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

# jax's own conversion, the one that makes a Python float weak in ``jnp.asarray(0.9)``. Its
# private annotation allows any ArrayLike out; on the array ``weakly_typed`` gives it, it
# returns an array.
_convert_element_type: Callable[..., Any] | None
try:
    from jax._src.lax.lax import _convert_element_type
except ImportError:  # pragma: no cover - a JAX that moved it
    _convert_element_type = None


def weakly_typed(x: jax.Array) -> jax.Array:
    """x with JAX's weak type: in ``x * m`` it takes ``m``'s dtype, as a Python float does.

    A hyperparameter ``optax.inject_hyperparams`` passes is a float32 array (a tracer inside
    ``jit``); weakly typed, ``b2 * v`` on a bf16 ``v`` computes exactly what the plain
    optimizer's Python float computes, instead of promoting (or, under strict promotion,
    failing). Without JAX's private conversion, x is returned as it is: still correct under
    standard promotion, only not bit-identical to the plain optimizer in narrow dtypes.
    """
    if _convert_element_type is None:  # pragma: no cover
        return x
    return _convert_element_type(x, None, weak_type=True)


def flatten_up_to(prefix: Any, tree: Any) -> list[Any]:
    """``jax.tree.structure(prefix).flatten_up_to(tree)``: tree's subtrees at prefix's leaves.

    A ValueError (or TypeError) if ``prefix``'s structure is not a prefix of ``tree``'s, with
    jaxlib's message ("Dict key mismatch; expected keys: ..."), which the callers show.
    ``jax.tree.map(f, prefix, tree)`` makes the same check but raises its own error about a
    "tree_map tree", so the method is called here. jaxlib 0.10 ships its ``_jax`` module
    without stubs, so mypy cannot resolve ``PyTreeDef`` and knows none of its methods.
    """
    return jax.tree.structure(prefix).flatten_up_to(tree)  # type: ignore[attr-defined]
