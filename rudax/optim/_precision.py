"""The dtype rule every rudax optimizer follows: buffers stored narrow, arithmetic done wide.

An optimizer's ``moment_dtype`` argument sets where its buffers (moments, momentum, sums of
squares, Adan's previous gradient) are stored; None keeps each parameter's own dtype. Then,
leaf by leaf:

* the update is computed in the wider of the gradient's dtype and the buffer dtype, so fp32
  gradients (unscaled by ``dynamic_loss_scale``, summed by ``GradientAccumulator``) meeting
  bf16 parameters lose nothing, and no expression mixes dtypes under strict promotion;
* new buffer values are rounded once, back to the buffer dtype;
* the update is returned in the parameter's dtype (the gradient's when ``params`` is None), so
  ``optax.apply_updates`` needs no implicit cast.

``with_moment_dtype`` applies the rule around a whole chain (the buffer dtype at init, the
weight decay and learning rate in the compute dtype, the updates' dtype at the end);
``map_in_compute_dtype`` applies it inside a transform to its buffers. Hyperparameters enter
the arithmetic through ``as_weak`` as Python floats, which JAX types weakly: ``b1 * m`` keeps
``m``'s dtype where a NumPy or JAX float32 scalar would promote it, or fail under strict
promotion.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from rudax._validation import check_floating_leaves, float_dtype
from rudax.optim._compat import flatten_up_to, weakly_typed
from rudax.optim._validation import check_gradients, check_tree_like


def as_weak(value: Any) -> Any:
    """A concrete scalar as a Python float; a tracer weakly typed; a schedule or a bool as it is.

    A tracer (a hyperparameter ``optax.inject_hyperparams`` passes inside ``jit``) is only
    known when the update runs; made weakly typed (``weakly_typed``), it enters the arithmetic
    as the Python float of the plain optimizer would, in each buffer's own dtype.
    """
    if isinstance(value, bool) or callable(value):
        return value
    if isinstance(value, jax.core.Tracer):
        floating = jnp.issubdtype(value.dtype, jnp.floating) and value.ndim == 0
        return weakly_typed(value) if floating else value
    if isinstance(value, numbers.Real) or (
        isinstance(value, np.ndarray | jax.Array) and np.ndim(value) == 0
    ):
        return float(value)
    return value


def scale_by_learning_rate(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    """``optax.scale_by_learning_rate`` with a number made weakly typed (see ``as_weak``).

    A schedule's value is cast to each update's dtype by optax itself.
    """
    return optax.scale_by_learning_rate(as_weak(learning_rate))


def compute_dtype(*dtypes: Any) -> jnp.dtype:
    """The widest of floating dtypes: float32 for bfloat16 with float16 or float32.

    Asked under standard promotion on purpose: strict promotion rightly refuses to guess a
    common dtype, but here the wider one is the stated rule.
    """
    with jax.numpy_dtype_promotion("standard"):
        return jnp.dtype(jnp.result_type(*dtypes))


def _real_view(z: jax.Array) -> jax.Array:
    """torch.view_as_real: a complex array as floats with a trailing axis (real, imaginary)."""
    return jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1)


def _as_complex(r: jax.Array) -> jax.Array:
    """torch.view_as_complex, the inverse of ``_real_view``."""
    return jax.lax.complex(r[..., 0], r[..., 1])


def map_in_compute_dtype(
    fn: Callable[..., tuple],
    updates: Any,
    *buffers: Any,
    owner: str,
    names: Sequence[str],
) -> tuple:
    """Runs a transform's per-leaf arithmetic under the rule; returns (updates, *buffers).

    For each leaf, ``fn(g, *b)`` gets the gradient and the buffers (trees like ``updates``)
    cast to the widest of their dtypes and returns ``(u, *new_b)``; each new buffer is cast
    back to its stored dtype, ``u`` stays in the compute dtype (``with_moment_dtype`` casts it
    to the parameter's dtype once, after the learning rate). A complex leaf is computed on its
    real view, as torch computes it: ``fn`` sees float arrays with a trailing axis of 2 (real,
    imaginary parts) and what it returns becomes complex again.

    Each buffer is first checked to be like ``updates`` (``check_tree_like``): a ValueError
    names ``owner``, the buffer as ``state.<name>`` (``names`` in the buffers' order), the path
    and both shapes, where a stale or wrongly built state would otherwise broadcast.
    """
    for name, buffer in zip(names, buffers, strict=True):
        check_tree_like(owner, f"state.{name}", buffer, "gradients", updates)
    treedef = jax.tree.structure(updates)

    def leaf(g: Any, *stored: jax.Array) -> tuple:
        g = jnp.asarray(g)
        dtype = compute_dtype(g.dtype, *(b.dtype for b in stored))
        args = [x.astype(dtype) for x in (g, *stored)]
        if jnp.issubdtype(dtype, jnp.complexfloating):
            # torch's rule for a complex parameter: the optimizer runs on its real view
            # (torch.view_as_real), real and imaginary parts as two real numbers. Only the
            # arithmetic sees the view: the buffers stay complex, like the parameter.
            u, *new = (_as_complex(r) for r in fn(*(_real_view(x) for x in args)))
        else:
            u, *new = fn(*args)
        return u, *(n.astype(b.dtype) for n, b in zip(new, stored, strict=True))

    columns = [flatten_up_to(updates, tree) for tree in (updates, *buffers)]
    rows = [leaf(*xs) for xs in zip(*columns, strict=True)]
    return tuple(
        jax.tree.unflatten(treedef, [row[i] for row in rows]) for i in range(1 + len(buffers))
    )


def _stored_dtype(param_dtype: Any, stored: jnp.dtype | None) -> jnp.dtype:
    """A buffer's dtype: ``stored``, made complex for a complex parameter (float32 ->
    complex64, float64 -> complex128, bf16 and fp16 -> complex64, the narrowest complex)."""
    if stored is None:
        return jnp.dtype(param_dtype)
    if jnp.issubdtype(param_dtype, jnp.complexfloating):
        return compute_dtype(stored, jnp.complex64)
    return stored


def with_moment_dtype(
    inner: optax.GradientTransformation,
    moment_dtype: DTypeLike | None,
    *,
    owner: str,
    allow_complex: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` with its buffers in ``moment_dtype`` and its arithmetic in the wider dtype.

    ``inner.init`` sees the parameters cast to ``moment_dtype`` (as they are when it is None),
    so every buffer it allocates like them has the buffer dtype. ``inner.update`` sees each
    gradient and parameter cast to the compute dtype, the wider of the gradient's dtype and the
    buffer dtype, so weight decay and the learning rate run in it too; the updates it returns
    are cast to each parameter's dtype (the gradient's when ``params`` is None). Transforms in
    ``inner`` that keep buffers compute with ``map_in_compute_dtype``.

    Args:
      inner: the transformation to run.
      moment_dtype: a floating dtype, or None for each parameter's own dtype.
      owner: the optimizer's name, for the errors.
      allow_complex: take complex parameters and gradients (torch's real-view rule, see
        ``map_in_compute_dtype``); a complex buffer has the complex dtype of ``moment_dtype``'s
        precision. False makes a complex leaf a TypeError naming ``owner`` and its path.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``inner``'s state; extra keyword
      arguments go to ``inner``. A parameter or gradient leaf without a floating (or, if
      allowed, complex) dtype is a TypeError naming its path; gradients unlike the
      parameters (another tree or another shape) are a ValueError naming the path and both
      shapes (``check_tree_like``).
    """
    float_dtype("moment_dtype", moment_dtype, none_in_message=True)
    stored = None if moment_dtype is None else jnp.dtype(moment_dtype)
    inner = optax.with_extra_args_support(inner)

    check = lambda what, tree: check_floating_leaves(
        f"{owner}: {what}", tree, allow_complex=allow_complex
    )

    def init_fn(params: Any) -> Any:
        check("parameter", params)
        if stored is not None:
            params = jax.tree.map(
                lambda p: jnp.asarray(p).astype(_stored_dtype(jnp.result_type(p), stored)), params
            )
        return inner.init(params)

    def update_fn(
        updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        check("gradient", updates)
        if params is not None:
            check("parameter", params)
            check_gradients(owner, updates, params)
        out_dtypes = jax.tree.map(jnp.result_type, updates if params is None else params)
        dtypes = jax.tree.map(
            lambda g, out: compute_dtype(jnp.result_type(g), _stored_dtype(out, stored)),
            updates,
            out_dtypes,
        )
        cast = lambda tree: jax.tree.map(lambda x, d: jnp.asarray(x).astype(d), tree, dtypes)
        new_updates, state = inner.update(
            cast(updates), state, None if params is None else cast(params), **extra_args
        )
        return jax.tree.map(lambda u, d: u.astype(d), new_updates, out_dtypes), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
