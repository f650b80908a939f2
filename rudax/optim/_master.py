"""FP32 master weights: run any optimizer in fp32 for parameters stored in bf16, fp16 or fp32.

The wrapper keeps an fp32 copy of every parameter (the master) and hands the inner optimizer
fp32 gradients, fp32 parameters and therefore fp32 state. The updates it returns are in each
parameter's storage dtype and are built so that ``optax.apply_updates(params, updates)`` stores
exactly ``master.astype(param.dtype)``, bit for bit.

Why that takes care: ``apply_updates`` computes ``round(p + u)`` in ``p``'s dtype. With
``t = round(master)`` the target, ``u = round(t - p)`` is exact (so ``p + u == t``) whenever the
difference fits in the storage dtype, which Sterbenz's lemma guarantees for every step that
keeps an element's sign and changes it by less than a factor of two: all small steps, the ones
master weights exist for. A step that flips an element's sign or changes its magnitude by more
than a factor of two can need more bits than bf16's 8 (say ``p = -1``, ``t = 1.0078125``: no
bf16 ``u`` gives ``p + u == t``); no update in the storage dtype can hit ``t`` then. In random
bf16 trials that happened for about half of the sign flips and of the shrinks below half, and
for 0.03% of the growths beyond 2x. For those elements the
master is set to the value ``apply_updates`` will store, ``round(p + u)``: that one step is
rounded to storage precision (an error below one storage ulp of the step), and the stored
parameters equal the rounded master on every step.

Every rounding to the storage dtype goes through ``round_to``, built from
``lax.reduce_precision``, instead of a float32 -> bf16 -> float32 cast pair: XLA's GPU backend
may delete such a pair (openxla/xla#41605, "excess precision"), which would let the value the
caller adds differ from the one checked here. ``reduce_precision`` exists so that it cannot be.
XLA on CPU flushes float32 subnormals (bf16 values below 2**-126) to zero; the invariant held
in that range in our tests too, but arithmetic there is not IEEE, so it is not guaranteed.
``round_to`` and the per-leaf ``storage_update`` live in ``rudax/kernels/_rounding.py``, shared
with the fused AdamW kernel (kernels cannot import rudax.optim).

Parameters replaced outside the optimizer. Since the stored parameters equal the rounded
masters bit for bit after every update, an element where they differ was written by someone
else: pretrained weights loaded after ``tx.init``, as every fine-tuning script does. Each
update therefore first adopts such elements (``adopt_replaced``: ``master = float32(param)``
there) and only then hands the masters to the inner optimizer, so its weight decay and step
act on the loaded values instead of writing the stale init back. Normal training never
triggers it, and its results are bit for bit what they were without it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rudax._validation import check_floating_leaves, check_positive
from rudax.kernels._rounding import adopt_replaced, storage_update
from rudax.optim._base import transformation_with_extra_args
from rudax.optim._clipping import clip_leaf_by_norm
from rudax.optim._compat import flatten_up_to
from rudax.optim._validation import (
    check_gradients,
    check_storage_dtypes,
    check_transformation,
    check_tree_like,
)


class Fp32MasterState(NamedTuple):
    """State of ``fp32_master``."""

    master: Any  # like params, every leaf float32: the parameters at full precision
    inner_state: Any  # the inner optimizer's state, built on and updated with the masters


def fp32_master(
    inner: optax.GradientTransformation,
    *,
    gradient_scale: float | jax.Array | None = None,
    clip_per_parameter: float | jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Keeps fp32 master weights and runs ``inner`` on them for bf16, fp16 or fp32 parameters.

    With ``p`` the stored parameter and ``w`` its fp32 master (``w = float32(p)`` at init)::

        w = float32(p)  where bits(round_to_dtype(w)) != bits(p)   (p replaced since init)
        g = float32(grad) / gradient_scale                   (if gradient_scale is given)
        g = g * min(clip_per_parameter / (norm(g) + 1e-6), 1)   (per leaf, if given)
        d, inner_state = inner.update(g, inner_state, w)     (all in fp32)
        w = w + d
        u = round_to_dtype(round_to_dtype(w) - p)            (in p's dtype; -0.0 if no change)

    so that ``optax.apply_updates(p, u) == w.astype(p.dtype)`` bit for bit. In the rare step
    where an element's change is not representable in its storage dtype (a sign flip or a
    change by more than 2x; see ``rudax/optim/_master.py``), that element's master is rounded
    to the stored value. torch has no such wrapper (its AMP keeps fp32 parameters and casts
    per op); this is the master-weights scheme of Micikevicius et al.

    The first line makes the masters follow parameters replaced outside the optimizer (weights
    loaded after ``init``): the loaded values are what ``inner`` sees and what the update
    starts from. Its cost is one rounding, one compare and one select per element, fused by
    XLA with the reads of ``p`` and ``w`` that the update makes anyway: no extra pass over
    memory and no extra buffer (measured on CPU with 4M bf16 parameters and ``adamw``: the
    same compiled fusions and scratch size, step time within noise, median ratio 1.002).
    An update changed after this wrapper (say ``chain(fp32_master(...), optax.scale(0.5))``)
    breaks ``p == round(w)``; the masters then follow the stored parameters every step and
    keep no precision of their own.

    Args:
      inner: the optimizer to run in fp32, e.g. ``rudax.optim.adamw(1e-3)``. It sees fp32
        gradients and the fp32 masters as ``params``, so all its state is fp32.
      gradient_scale: divides the fp32 gradients before clipping, e.g. a static loss scale.
        A Python or concrete number must be finite and > 0 (ValueError otherwise). A traced
        value (the wrapper built inside ``jit``) cannot be checked: zero or a non-finite scale
        then gives non-finite gradients; wrap with ``skip_nonfinite`` to skip those steps.
      clip_per_parameter: if given, each fp32 gradient leaf is clipped to this L2 norm with
        torch's ``clip_grad_norm_`` rule, as ``rudax.optim.clip_per_parameter``; > 0.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an ``Fp32MasterState``;
      ``update`` requires ``params`` and returns updates in each parameter's dtype. Extra
      keyword arguments are passed on to ``inner``. Every parameter leaf must be bf16, fp16
      or fp32; any other dtype (integer buffers, keys) is a TypeError naming its path, as is a
      gradient that is not floating (an int, or a complex one whose imaginary part a cast
      would drop). Gradients or masters unlike the parameters (another tree, another shape)
      are a ValueError naming the path and both shapes.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.ones((2,), jnp.bfloat16)}
      >>> tx = ro.fp32_master(optax.sgd(1e-4))
      >>> state = tx.init(params)
      >>> for _ in range(100):  # each step is below bf16's resolution at 1.0
      ...     updates, state = tx.update({"w": jnp.ones((2,), jnp.bfloat16)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> round(float(state.master["w"][0]), 4), float(params["w"][0])
      (0.99, 0.98828125)

    References:
      Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
      2018.
    """
    check_transformation("inner", inner)
    if gradient_scale is not None:
        check_positive("gradient_scale", gradient_scale)
    if clip_per_parameter is not None:
        check_positive("clip_per_parameter", clip_per_parameter)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> Fp32MasterState:
        check_storage_dtypes("fp32_master", params)
        # A copy even for fp32 leaves: a master aliasing its parameter would make donating
        # (params, opt_state) to a jitted step donate one buffer twice.
        master = jax.tree.map(lambda p: jnp.array(p, dtype=jnp.float32, copy=True), params)
        return Fp32MasterState(master=master, inner_state=inner.init(master))

    def update_fn(
        updates: Any, state: Fp32MasterState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Fp32MasterState]:
        if params is None:
            raise ValueError("fp32_master: update needs params (the stored parameters)")
        check_storage_dtypes("fp32_master", params)
        # Not cast blindly to fp32: an int gradient is a bug upstream, a complex one would
        # lose its imaginary part.
        check_floating_leaves("fp32_master: gradient", updates)
        check_gradients("fp32_master", updates, params)
        check_tree_like("fp32_master", "state.master", state.master, "params", params)
        grads = jax.tree.map(lambda g: jnp.asarray(g).astype(jnp.float32), updates)
        if gradient_scale is not None:
            scale = jnp.asarray(gradient_scale).astype(jnp.float32)
            grads = jax.tree.map(lambda g: g / scale, grads)
        if clip_per_parameter is not None:
            grads = jax.tree.map(lambda g: clip_leaf_by_norm(g, clip_per_parameter), grads)
        param_leaves, treedef = jax.tree.flatten(params)
        # Before the inner optimizer reads them: weights loaded after init are the masters now.
        masters = [
            adopt_replaced(w, jnp.asarray(p))
            for w, p in zip(flatten_up_to(params, state.master), param_leaves, strict=True)
        ]
        inner_updates, inner_state = inner.update(
            grads, state.inner_state, jax.tree.unflatten(treedef, masters), **extra_args
        )
        pairs = [
            storage_update(w, jnp.asarray(p), d)
            for w, p, d in zip(
                masters,
                param_leaves,
                flatten_up_to(params, inner_updates),
                strict=True,
            )
        ]
        new_updates = jax.tree.unflatten(treedef, [u for u, _ in pairs])
        master = jax.tree.unflatten(treedef, [w for _, w in pairs])
        return new_updates, Fp32MasterState(master=master, inner_state=inner_state)

    return transformation_with_extra_args(init_fn, update_fn)
