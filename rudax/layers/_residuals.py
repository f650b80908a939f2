"""``saved_for_backward``: the residuals autodiff keeps between a forward and its backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = ["saved_for_backward"]


def saved_for_backward(loss: Callable[..., Any], params: Any, *args: Any) -> list[Any]:
    """What ``jax.vjp(loss, params)`` keeps for the backward, as ShapeDtypeStructs.

    Traced abstractly (``jax.make_jaxpr``), so nothing is computed: the activation memory of a
    step, per remat policy (``rudax.layers.remat``), before XLA compiles it. The backward
    closure's leaves are the residuals; those that are the inputs themselves (a weight used
    as is) or constants cost nothing more and are left out, and one array kept twice counts
    once.

    Args:
      loss: ``loss(params, *args)``.
      params: what the gradient is taken of (arrays or ShapeDtypeStructs).
      *args: the loss's other arguments.

    Returns:
      One ``jax.ShapeDtypeStruct`` per residual.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from rudax.layers import saved_for_backward
      >>> w = jax.ShapeDtypeStruct((4, 3), jnp.float32)
      >>> x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
      >>> [r.shape for r in saved_for_backward(lambda w, x: jnp.sin(x @ w).sum(), w, x)]
      [(8, 3)]
      >>> saved_for_backward(lambda w, x: (x @ w).sum(), w, x)  # x itself: nothing more
      []
    """

    def backward(p: Any, *a: Any) -> Any:
        return jax.vjp(lambda q: loss(q, *a), p)[1]

    jaxpr = jax.make_jaxpr(backward)(params, *args).jaxpr
    free = {id(v) for v in (*jaxpr.invars, *jaxpr.constvars)}
    seen: dict[int, Any] = {}
    for v in jaxpr.outvars:
        if hasattr(v, "val") or id(v) in free:  # a literal, an input, a constant
            continue
        seen.setdefault(id(v), jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype))
    return list(seen.values())
