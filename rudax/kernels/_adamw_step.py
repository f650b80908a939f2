"""One fused AdamW step: its per-step scalars (checked, then computed once) and its arithmetic.

Both paths of ``adamw_update`` (``_adamw.py``) run ``adamw_step``: the kernel on one block of
each operand, the XLA path on whole arrays. What is the same for every element of a step (the
learning rate, the bias corrections, the clip coefficient, the skip flag) is computed once per
step by ``step_scalars``, outside both paths, and handed to them as one small fp32 vector: the
kernel reads it as one operand instead of a dozen scalar ones.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from rudax._validation import check_in_range
from rudax.kernels._rounding import adopt_replaced, storage_update

# The per-step scalars, in the order the kernel reads them from one small fp32 array (padded
# to a power of two, a Triton block shape). "skip" is 1.0 for a skipped step, else 0.0.
SCALARS = (
    "grad_scale",
    "neg_lr",
    "inv_bc1",
    "inv_bc2_sqrt",
    "b1",
    "one_minus_b1",
    "b2",
    "one_minus_b2",
    "eps",
    "weight_decay",
    "skip",
)
NUM_SCALARS = pl.next_power_of_2(len(SCALARS))


def _check_count(count: object) -> None:
    """A 1-based step: an integer scalar >= 1 (a Python int or an integer array); tracers pass."""
    if isinstance(count, jax.core.Tracer):
        return
    if isinstance(count, numbers.Integral) and not isinstance(count, bool):
        step = int(count)
    elif isinstance(count, np.ndarray | jax.Array) and jnp.issubdtype(count.dtype, jnp.integer):
        if count.ndim != 0:
            raise TypeError(f"count must be a scalar, got shape {count.shape}: {count=}")
        step = int(count)
    else:
        raise TypeError(f"count must be an integer (the 1-based step), got {count=}")
    if step < 1:
        raise ValueError(f"count must be >= 1 (the 1-based step), got {count=}")


def check_hyperparameters(count, learning_rate, b1, b2, eps, weight_decay, grad_scale) -> None:
    """``adamw_update``'s hyperparameters, each named in its error; tracers pass unchecked."""
    _check_count(count)
    check_in_range("learning_rate", learning_rate, 0.0)
    check_in_range("b1", b1, 0.0, 1.0)
    check_in_range("b2", b2, 0.0, 1.0)
    check_in_range("eps", eps, 0.0)
    check_in_range("weight_decay", weight_decay, 0.0)
    if grad_scale is not None:
        check_in_range("grad_scale", grad_scale, 0.0)


def check_skip(skip: Any) -> jax.Array | None:
    """None, or ``skip`` as a bool scalar array (``adamw_update_leaves``' flag)."""
    if skip is None:
        return None
    if not isinstance(skip, bool | np.bool_ | np.ndarray | jax.Array):
        raise TypeError(f"skip must be a bool scalar or None, got {skip=}")
    skip = jnp.asarray(skip)
    if skip.dtype != jnp.bool_ or skip.shape != ():
        raise TypeError(
            f"skip must be a bool scalar or None, got dtype={skip.dtype}, shape={skip.shape}"
        )
    return skip


def _log(decay: Any) -> Any:
    """log(decay), in float64 when decay is a number (log(0) = -inf), as rudax.optim.adam."""
    if not isinstance(decay, jax.core.Tracer) and np.ndim(decay) == 0:
        decay = float(decay)
        return math.log(decay) if decay > 0 else -math.inf
    return jnp.log(decay)


def _one_minus(decay: Any) -> Any:
    # 1 - b in float64 for a number, as ``(1 - b1) * g`` with a Python float b1 computes it.
    return 1.0 - float(decay) if not isinstance(decay, jax.core.Tracer) else 1 - decay


def step_scalars(
    count: Any,
    learning_rate: Any,
    b1: Any,
    b2: Any,
    eps: Any,
    weight_decay: Any,
    grad_scale: Any,
    skip: jax.Array | None,
) -> jax.Array:
    """The per-step scalars of ``SCALARS`` as one fp32 vector, computed as rudax.optim.adamw.

    The bias corrections are ``-expm1(t * log(b))`` with the log in float64 (``1 - b2**t`` in
    fp32 cancels badly at t=1); their reciprocals leave one division per element.
    """
    t = jnp.asarray(count).astype(jnp.float32)
    values = {
        "grad_scale": 1.0 if grad_scale is None else grad_scale,
        "neg_lr": -jnp.asarray(learning_rate).astype(jnp.float32),
        "inv_bc1": 1.0 / -jnp.expm1(t * _log(b1)),
        "inv_bc2_sqrt": 1.0 / jnp.sqrt(-jnp.expm1(t * _log(b2))),
        "b1": b1,
        "one_minus_b1": _one_minus(b1),
        "b2": b2,
        "one_minus_b2": _one_minus(b2),
        "eps": eps,
        "weight_decay": weight_decay,
        "skip": 0.0 if skip is None else skip,
    }
    vector = [jnp.asarray(values[name]).astype(jnp.float32) for name in SCALARS]
    vector += [jnp.zeros((), jnp.float32)] * (NUM_SCALARS - len(SCALARS))
    return jnp.stack(vector)


def unpack_scalars(scalars: Any) -> dict[str, jax.Array]:
    """``step_scalars``'s vector (an array, or a kernel's ref to it) by name."""
    return {name: scalars[i] for i, name in enumerate(SCALARS)}


def adamw_step(
    s: dict[str, jax.Array],
    param: jax.Array,
    grad: jax.Array,
    exp_avg: jax.Array,
    exp_avg_sq: jax.Array,
    master: jax.Array | None,
    *,
    rounding: Any,
    scaled: bool,
    decay: bool,
    skippable: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """(update in param's dtype, fp32 exp_avg, fp32 exp_avg_sq, new master) of one block.

    ``param`` comes in its stored dtype, everything else in fp32. The operations and their
    order are rudax.optim's chain (clip_by_global_norm, then scale_by_torch_adam,
    add_decayed_weights, scale_by_learning_rate), so the two agree to the bit wherever the
    compiler does not contract a multiply and an add into one FMA.

    With ``skippable``, a set ``skip`` scalar selects every input back and the update
    ``-0.0``: IEEE's exact additive identity, so ``param + update`` keeps every bit of
    ``param`` (``+0.0`` would turn a ``-0.0`` parameter into ``+0.0``). Selects, not
    arithmetic, since NaN * 0 is NaN.

    A ``master`` that ``param`` is not the rounding of (weights replaced outside the optimizer)
    is first replaced by ``param`` (``adopt_replaced``), so the decay and the step act on the
    parameter the caller holds; a skipped step still returns the master it was given.
    """
    apply = s["skip"] == 0.0  # used only when skippable
    if master is None:
        weight = param.astype(jnp.float32)
    else:
        weight = adopt_replaced(master, param, rounding=rounding)
    g = grad * s["grad_scale"] if scaled else grad
    m = s["b1"] * exp_avg + s["one_minus_b1"] * g
    v = s["b2"] * exp_avg_sq + s["one_minus_b2"] * g * g
    if skippable:
        # Selected before the direction uses them, so that XLA computes the direction from
        # the moments it writes instead of recomputing them from the old ones (which would
        # keep the old buffers alive and cost a copy of each when they are donated).
        m = jnp.where(apply, m, exp_avg)
        v = jnp.where(apply, v, exp_avg_sq)
    u = (m * s["inv_bc1"]) / (jnp.sqrt(v) * s["inv_bc2_sqrt"] + s["eps"])
    if decay:
        u = u + s["weight_decay"] * weight
    step = s["neg_lr"] * u
    new_master: jax.Array | None = None
    if master is None:
        update = step.astype(param.dtype)
    else:
        # ``weight`` is the adopted master; a skipped step returns the one it was given.
        update, new_master = storage_update(weight, param, step, rounding=rounding)
        if skippable:
            new_master = jnp.where(apply, new_master, master)
    if skippable:
        update = jnp.where(apply, update, jnp.asarray(-0.0, update.dtype))
    return update, m, v, new_master
