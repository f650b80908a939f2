"""How a torch-style optimizer is assembled from its direction, weight decay and learning rate.

torch's SGD, Adam, Adagrad and RMSprop add ``weight_decay * p`` to the gradient before their
buffers see it (L2); AdamW and Muon shrink the parameters after the direction is computed
(decoupled). Both are ``add_decayed_weights`` placed on one side of the direction or the
other, followed by the learning rate: ``torch_chain`` builds that chain once for all of them,
under the moment-dtype rule of ``rudax/optim/_precision.py``.

The chain has the same transforms, and so the same state structure, whatever the values of
its hyperparameters: ``optax.inject_hyperparams`` builds the optimizer once with concrete
arrays (init) and once with tracers (update), and the plain and the injected optimizer must
have one state layout. A term whose coefficient is known to be 0 costs nothing: its transform
stays in the chain and skips its arithmetic.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import numpy as np
import optax
from jax.typing import DTypeLike

from rudax.optim._compat import flatten_up_to
from rudax.optim._precision import as_weak, scale_by_learning_rate, with_moment_dtype

# What ``mask=`` takes: optax's meaning (``optax.add_decayed_weights``, ``optax.masked``).
DecayMask = Any | Callable[[Any], Any] | None


def static_nonzero(value: Any) -> bool:
    """False only for a Python or NumPy number equal to 0, which lets a factory drop a term.

    An array, even a concrete one, counts as non-zero: ``optax.inject_hyperparams`` builds the
    optimizer once with concrete arrays (init) and once with tracers (update), and both must
    give the same state structure.
    """
    return not (isinstance(value, numbers.Real) and value == 0)


def known_zero(value: Any) -> bool:
    """True for a number or a concrete (not traced) scalar array equal to 0.

    What an ``init`` may ask of a hyperparameter: ``optax.inject_hyperparams`` calls the
    factory with concrete arrays there, so a momentum injected as 0 is known to be 0 at init
    and the state can go without its buffer.
    """
    if isinstance(value, jax.core.Tracer) or callable(value):
        return False
    if isinstance(value, numbers.Real):
        return value == 0
    return np.ndim(value) == 0 and bool(np.asarray(value) == 0)


def _check_mask_leaf(owner: str, path: Any, keep: Any) -> bool:
    if not isinstance(keep, bool | np.bool_):
        raise TypeError(
            f"{owner}: mask{jax.tree_util.keystr(path)} must be a Python bool (True: decay this "
            f"parameter), got {keep!r}"
        )
    return bool(keep)


def add_decayed_weights(
    weight_decay: Any, mask: DecayMask = None, *, owner: str
) -> optax.GradientTransformation:
    """``u + weight_decay * p`` on the parameters ``mask`` selects; ``u`` elsewhere.

    ``mask`` has optax's meaning: None decays every parameter; otherwise a pytree of bools
    with the parameters' structure or a prefix of it (a bool covers its whole subtree), or a
    callable that returns one given the parameters. Masked-out leaves pass through unchanged,
    which is torch's parameter group with ``weight_decay=0``. Unlike ``optax.masked`` around a
    whole optimizer, only the decay is masked: the leaves still get the optimizer's step.

    The state is ``optax.EmptyState()`` with or without a mask and whatever the coefficient,
    and a coefficient that is a number equal to 0 skips the arithmetic.

    Args:
      weight_decay: the coefficient; a number, an array or a tracer.
      mask: None, a pytree of bools or a callable of the parameters.
      owner: the optimizer's name, for the errors.

    Returns:
      An ``optax.GradientTransformation`` that needs ``params`` when it decays.
    """
    if mask is not None and not callable(mask):
        # Checked at construction too, so a typo fails before any data is loaded.
        for path, keep in jax.tree_util.tree_flatten_with_path(mask)[0]:
            _check_mask_leaf(owner, path, keep)
    weight_decay = as_weak(weight_decay)

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if not static_nonzero(weight_decay):
            return updates, state
        if params is None:
            raise ValueError(
                f"{owner}: weight decay needs the parameters: call update(grads, state, params)"
            )
        decay = lambda u, p: u + weight_decay * p
        if mask is None:
            return jax.tree.map(decay, updates, params), state
        flags = decay_flags(mask, params, owner=owner)
        leaves, treedef = jax.tree.flatten(updates)
        pairs = zip(flags, leaves, jax.tree.leaves(params), strict=True)
        return jax.tree.unflatten(treedef, [decay(u, p) if f else u for f, u, p in pairs]), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def decay_flags(mask: DecayMask, params: Any, *, owner: str) -> list[bool]:
    """Whether each leaf of ``params`` (in flattening order) decays, by optax's ``mask=`` rule.

    ``mask`` is None (every leaf), a pytree of bools with the parameters' structure or a
    prefix of it (a bool covers its whole subtree), or a callable of ``params`` returning one,
    as ``add_decayed_weights`` reads it; Adan's proximal step and fused AdamW's kernel, whose
    decay is not the additive ``u + wd p``, read it too. A mask of the wrong structure is a
    ValueError, a leaf that is not a bool a TypeError naming its path; both name ``owner``.
    """
    if mask is None:
        return [True] * len(jax.tree.leaves(params))
    tree = mask(params) if callable(mask) else mask
    try:
        subtrees = flatten_up_to(tree, params)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{owner}: mask must have the parameters' tree structure or a prefix of it "
            f"(a pytree of bools, or a callable of params returning one): {e}"
        ) from None
    keeps = [
        _check_mask_leaf(owner, path, k)
        for path, k in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    return [keep for keep, sub in zip(keeps, subtrees, strict=True) for _ in jax.tree.leaves(sub)]


def torch_chain(
    direction: Sequence[optax.GradientTransformation],
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: Any,
    moment_dtype: DTypeLike | None,
    *,
    name: str,
    decoupled: bool = False,
    mask: DecayMask = None,
    allow_complex: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Chains a direction with torch's weight decay and the learning rate.

    ::

        chain(add_decayed_weights, *direction, scale_by_learning_rate)   (L2: the default)
        chain(*direction, add_decayed_weights, scale_by_learning_rate)   (decoupled)

    so the decoupled update is ``p - lr_t * (u + weight_decay * p)``, torch's
    ``p *= 1 - lr_t * weight_decay`` followed by ``p -= lr_t * u``. The decay is a no-op when
    ``weight_decay`` is a number equal to 0, and spares the leaves ``mask`` leaves out. The
    caller validates the hyperparameters.

    Args:
      direction: the transforms that turn gradients into the unscaled step.
      learning_rate: a number or a schedule of the update count.
      weight_decay: the decay coefficient.
      moment_dtype: the buffers' storage dtype, or None (see ``with_moment_dtype``).
      name: the optimizer's name, for the errors (``with_moment_dtype``'s ``owner``).
      decoupled: place the decay after the direction instead of before it.
      mask: which parameters decay (see ``add_decayed_weights``).
      allow_complex: whether complex parameters are taken (see ``with_moment_dtype``).

    Returns:
      The chain, wrapped in ``with_moment_dtype``.
    """
    decay = [add_decayed_weights(weight_decay, mask, owner=name)]
    transforms = [*direction, *decay] if decoupled else [*decay, *direction]
    return with_moment_dtype(
        optax.chain(*transforms, scale_by_learning_rate(learning_rate)),
        moment_dtype,
        owner=name,
        allow_complex=allow_complex,
    )
