"""Gradient clipping by L2 norm, with torch's ``clip_grad_norm_`` rule.

Both transforms scale gradients by ``min(max_norm / (norm + 1e-6), 1)``, the coefficient of
``torch.nn.utils.clip_grad_norm_``. optax's ``clip_by_global_norm`` instead scales by
``max_norm / norm`` only when ``norm >= max_norm``: the two agree below the threshold and differ
by the 1e-6 above it (torch's clipped norm lands just under ``max_norm``). rudax follows torch
so that ported training runs clip identically.

Norms are computed in fp32 whatever the gradients' dtype: a bf16 sum of squares drops the
small leaves' contributions, and an fp16 one overflows once the norm passes 256. Each gradient
is scaled in fp32 (at least) and rounded once back to its own dtype. A non-finite norm is not
repaired: NaN propagates into every output, and an infinite norm gives a zero coefficient (so
NaN wherever a gradient was infinite), as in torch. Pair clipping with
``rudax.optim.skip_nonfinite`` or ``dynamic_loss_scale`` to skip such steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rudax._validation import check_floating_leaves, check_positive
from rudax.optim._base import transformation
from rudax.optim._validation import check_gradients

# torch adds this to the norm before dividing, so a zero gradient never divides by zero.
_NORM_EPS = 1e-6


class ClipByGlobalNormState(NamedTuple):
    """State of ``clip_by_global_norm``: the norm seen by the last update, for logging."""

    global_norm: jax.Array  # shape=(), float32: the pre-clip global L2 norm of the last update


def _sum_of_squares(g: jax.Array) -> jax.Array:
    g = jnp.asarray(g).astype(jnp.float32)
    return jnp.sum(g * g)


def clip_coefficient(norm: jax.Array, max_norm: Any) -> jax.Array:
    """torch's clip coefficient ``min(max_norm / (norm + 1e-6), 1)``, an fp32 scalar.

    min() lets a NaN norm through rather than hiding it. Shared with ``fused_adamw``, which
    computes the norm itself and passes the coefficient into its update kernel.
    """
    return jnp.minimum(jnp.asarray(max_norm, jnp.float32) / (norm + _NORM_EPS), 1.0)


def _scale(g: jax.Array, coefficient: jax.Array) -> jax.Array:
    g = jnp.asarray(g)
    # At least fp32; not jnp.promote_types, which refuses bf16 + fp32 under strict promotion.
    compute_dtype = g.dtype if jnp.finfo(g.dtype).bits >= 32 else jnp.float32
    return (g.astype(compute_dtype) * coefficient.astype(compute_dtype)).astype(g.dtype)


def clip_leaf_by_norm(g: jax.Array, max_norm: Any) -> jax.Array:
    """One leaf clipped to L2 norm ``max_norm`` by torch's rule, in its own dtype.

    The per-leaf step of ``clip_per_parameter``, shared with ``fp32_master``'s option.
    """
    return _scale(g, clip_coefficient(jnp.sqrt(_sum_of_squares(g)), max_norm))


def clip_by_global_norm(max_norm: float | jax.Array) -> optax.GradientTransformation:
    """Scales all gradients together so that their global L2 norm is at most ``max_norm``.

    With the global norm taken over every leaf as if concatenated into one vector::

        norm = sqrt(sum_leaves sum(g ** 2))                  (in fp32)
        g <- g * min(max_norm / (norm + 1e-6), 1)

    This is ``torch.nn.utils.clip_grad_norm_``. optax's ``clip_by_global_norm`` uses
    ``g * max_norm / norm`` when ``norm >= max_norm`` (no 1e-6) and leaves ``g`` as is
    otherwise. The state keeps the pre-clip norm of the last update, the value torch's
    function returns, for logging. A non-finite norm propagates (see the module docstring).

    Args:
      max_norm: the largest global norm let through; finite and > 0.

    Returns:
      An ``optax.GradientTransformation`` whose state is a ``ClipByGlobalNormState``. Outputs
      keep each gradient's dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.optim as ro
      >>> tx = ro.clip_by_global_norm(1.0)
      >>> grads = {"w": jnp.array([3.0, 4.0])}
      >>> clipped, state = tx.update(grads, tx.init(grads))
      >>> float(state.global_norm), [round(float(x), 4) for x in clipped["w"]]
      (5.0, [0.6, 0.8])

    References:
      Pascanu et al., `On the difficulty of training Recurrent Neural Networks
      <https://arxiv.org/abs/1211.5063>`_, 2013; PyTorch, ``torch.nn.utils.clip_grad_norm_``.
    """
    check_positive("max_norm", max_norm)

    def init_fn(params: Any) -> ClipByGlobalNormState:
        del params
        return ClipByGlobalNormState(global_norm=jnp.zeros((), jnp.float32))

    def update_fn(
        updates: Any, state: ClipByGlobalNormState, params: Any = None
    ) -> tuple[Any, ClipByGlobalNormState]:
        del state
        check_floating_leaves("clip_by_global_norm: gradient", updates)
        check_gradients("clip_by_global_norm", updates, params)
        squares = [_sum_of_squares(g) for g in jax.tree.leaves(updates)]
        norm = jnp.sqrt(sum(squares, start=jnp.zeros((), jnp.float32)))
        coefficient = clip_coefficient(norm, max_norm)
        updates = jax.tree.map(lambda g: _scale(g, coefficient), updates)
        return updates, ClipByGlobalNormState(global_norm=norm)

    return transformation(init_fn, update_fn)


def clip_per_parameter(max_norm: float | jax.Array) -> optax.GradientTransformation:
    """Scales each gradient leaf on its own so that its L2 norm is at most ``max_norm``.

    For every leaf ``g`` separately::

        norm_g = sqrt(sum(g ** 2))                           (in fp32)
        g <- g * min(max_norm / (norm_g + 1e-6), 1)

    This is ``torch.nn.utils.clip_grad_norm_`` called on each parameter alone; optax's nearest
    is ``clip_by_block_rms``, which bounds the RMS rather than the norm. A non-finite norm
    propagates into its own leaf only.

    Args:
      max_norm: the largest L2 norm let through for any one leaf; finite and > 0.

    Returns:
      An ``optax.GradientTransformation`` with an empty state. Outputs keep each gradient's
      dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.optim as ro
      >>> tx = ro.clip_per_parameter(1.0)
      >>> grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.5])}
      >>> clipped, _ = tx.update(grads, tx.init(grads))
      >>> [round(float(x), 4) for x in clipped["a"]], float(clipped["b"][0])
      ([0.6, 0.8], 0.5)

    References:
      PyTorch, ``torch.nn.utils.clip_grad_norm_``.
    """
    check_positive("max_norm", max_norm)

    def update_fn(
        updates: Any, state: optax.EmptyState, params: Any = None
    ) -> tuple[Any, optax.EmptyState]:
        check_floating_leaves("clip_per_parameter: gradient", updates)
        check_gradients("clip_per_parameter", updates, params)
        return jax.tree.map(lambda g: clip_leaf_by_norm(g, max_norm), updates), state

    return transformation(optax.init_empty_state, update_fn)
