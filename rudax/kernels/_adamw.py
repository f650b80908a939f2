"""Fused AdamW: one pass over a parameter, its gradient, moments and fp32 master.

An optimizer step is memory-bound: per parameter it reads the gradient, the parameter, two
moments (and an fp32 master) and writes them back, a few flops apart. Run as optax's chain of
transforms it costs a pass per transform; ``adamw_update`` reads each array once and writes
the update, the moments and the master once. With ``global_norm_and_finite``
(``_global_norm.py``) for clipping and skipping, a whole step reads the gradients twice.

The kernel runs per leaf: one launch per parameter array, over flat 1-D blocks (a free
reshape of a contiguous array). Concatenating all leaves into one buffer would save the
launches (a few microseconds each) but copy every array twice per step, which is the traffic
a fused step exists to avoid. The last block of a leaf may overhang it; its loads and stores
are masked (``_blocks.py``), so no padded copy is made. The per-step scalars (learning rate,
bias corrections, clip coefficient, skip flag) are computed once outside and read from one
small array.

Skipping a step (``adamw_update_leaves(..., skip=)``, for a step whose gradients are not
finite) is a select inside the same pass: where the flag is set, every output element is its
input (the update ``-0.0``). Not a ``lax.cond`` around the pass: XLA materializes both
branches' outputs of a conditional and cannot alias them to donated inputs, and on a GPU the
predicate of a conditional is copied to the host every step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from rudax.kernels import _compat
from rudax.kernels._blocks import block_size_for, load_block, tail_mask
from rudax.kernels._checks import (
    check_block,
    check_count,
    check_power_of_two,
    check_range,
)
from rudax.kernels._rounding import round_by_cast, round_to, storage_update

_STORAGE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

# The per-step scalars, in the order the kernel reads them from one small fp32 array (padded
# to a power of two, a Triton block shape). "skip" is 1.0 for a skipped step, else 0.0.
_SCALARS = (
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
_NUM_SCALARS = pl.next_power_of_2(len(_SCALARS))


@dataclasses.dataclass(frozen=True)
class AdamWBlock:
    """Block sizes of the ``adamw_update`` kernel.

    Attributes:
      size: elements per program, a power of two. A smaller leaf uses one block of its size
        rounded up to a power of two.
      num_warps: warps per program on the GPU, a power of two.
    """

    # 1024 elements over 4 warps is 8 per thread: enough loads in flight to saturate HBM on
    # an elementwise pass of five arrays without spilling registers.
    size: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_power_of_two(field.name, getattr(self, field.name))


# --- validation -----------------------------------------------------------------------------


def _check_arrays(param, grad, exp_avg, exp_avg_sq, master, where: str = "") -> None:
    named = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if master is not None:
        named["master"] = master
    for name, x in named.items():
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{where}{name} must have a floating dtype, got {name}.dtype={x.dtype}")
        if x.shape != param.shape:
            raise ValueError(
                f"{where}{name} must have param's shape {param.shape}, got {name}.shape={x.shape}"
            )
    if param.dtype not in _STORAGE_DTYPES:
        raise TypeError(
            f"{where}param must be bfloat16, float16 or float32, got param.dtype={param.dtype}"
        )
    for name in ("exp_avg", "exp_avg_sq"):
        if named[name].dtype not in _STORAGE_DTYPES:
            raise TypeError(
                f"{where}{name} must be bfloat16, float16 or float32, got "
                f"{name}.dtype={named[name].dtype}"
            )
    if master is not None and master.dtype != jnp.float32:
        raise TypeError(f"{where}master must be float32, got master.dtype={master.dtype}")


def _check_hyperparameters(count, learning_rate, b1, b2, eps, weight_decay, grad_scale) -> None:
    check_count(count)
    check_range("learning_rate", learning_rate, 0.0)
    check_range("b1", b1, 0.0, 1.0)
    check_range("b2", b2, 0.0, 1.0)
    check_range("eps", eps, 0.0)
    check_range("weight_decay", weight_decay, 0.0)
    if grad_scale is not None:
        check_range("grad_scale", grad_scale, 0.0)


def _check_skip(skip: Any) -> jax.Array | None:
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


# --- the math, shared by the kernel and the reference -------------------------------------


def _log(decay: Any) -> Any:
    """log(decay), in float64 when decay is a number (log(0) = -inf), as rudax.optim.adam."""
    if not isinstance(decay, jax.core.Tracer) and np.ndim(decay) == 0:
        decay = float(decay)
        return math.log(decay) if decay > 0 else -math.inf
    return jnp.log(decay)


def _one_minus(decay: Any) -> Any:
    # 1 - b in float64 for a number, as ``(1 - b1) * g`` with a Python float b1 computes it.
    return 1.0 - float(decay) if not isinstance(decay, jax.core.Tracer) else 1 - decay


def _step_scalars(
    count: Any,
    learning_rate: Any,
    b1: Any,
    b2: Any,
    eps: Any,
    weight_decay: Any,
    grad_scale: Any,
    skip: jax.Array | None,
) -> jax.Array:
    """The per-step scalars of ``_SCALARS`` as one fp32 vector, computed as rudax.optim.adamw.

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
    vector = [jnp.asarray(values[name]).astype(jnp.float32) for name in _SCALARS]
    vector += [jnp.zeros((), jnp.float32)] * (_NUM_SCALARS - len(_SCALARS))
    return jnp.stack(vector)


def _adamw_step(
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
    """
    apply = s["skip"] == 0.0  # used only when skippable
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
    weight = param.astype(jnp.float32) if master is None else master
    if decay:
        u = u + s["weight_decay"] * weight
    step = s["neg_lr"] * u
    if master is None:
        update, new_master = step.astype(param.dtype), None
    else:
        update, new_master = storage_update(master, param, step, rounding=rounding)
    if skippable:
        update = jnp.where(apply, update, jnp.asarray(-0.0, update.dtype))
        if master is not None:
            new_master = jnp.where(apply, new_master, master)
    return update, m, v, new_master


# --- Pallas kernels -------------------------------------------------------------------------


def _update_kernel(
    s_ref, param_ref, grad_ref, m_ref, v_ref, *refs, num_elements, block_size, has_master, **flags
) -> None:
    if has_master:
        w_ref, update_ref, m_out_ref, v_out_ref, w_out_ref = refs
    else:
        update_ref, m_out_ref, v_out_ref = refs
    mask = tail_mask(num_elements, block_size)
    s = {name: s_ref[i] for i, name in enumerate(_SCALARS)}
    f32 = lambda ref: load_block(ref, mask).astype(jnp.float32)
    # Triton leaves a cast pair alone; XLA would be free to drop it (see _rounding.py).
    update, m, v, new_master = _adamw_step(
        s,
        load_block(param_ref, mask),
        f32(grad_ref),
        f32(m_ref),
        f32(v_ref),
        f32(w_ref) if has_master else None,
        rounding=round_by_cast,
        **flags,
    )
    _compat.store(update_ref, update, mask=mask)
    _compat.store(m_out_ref, m.astype(m_out_ref.dtype), mask=mask)
    _compat.store(v_out_ref, v.astype(v_out_ref.dtype), mask=mask)
    if has_master:
        _compat.store(w_out_ref, new_master, mask=mask)


# --- the Pallas and XLA paths -------------------------------------------------------------


def _update_reference(scalars, param, grad, exp_avg, exp_avg_sq, master, **flags):
    """The XLA path: the kernel's math on whole arrays, rounding with ``round_to``."""
    s = {name: scalars[i] for i, name in enumerate(_SCALARS)}
    f32 = lambda x: x.astype(jnp.float32)
    update, m, v, new_master = _adamw_step(
        s, param, f32(grad), f32(exp_avg), f32(exp_avg_sq), master, rounding=round_to, **flags
    )
    return update, m.astype(exp_avg.dtype), v.astype(exp_avg_sq.dtype), new_master


@functools.partial(
    jax.jit, static_argnames=("impl", "interpret", "block", "scaled", "decay", "skippable")
)
def _update_leaf(
    scalars, param, grad, exp_avg, exp_avg_sq, master, *, impl, interpret, block, **flags
):
    shape, n = param.shape, param.size
    if impl == "xla" or n == 0:
        return _update_reference(scalars, param, grad, exp_avg, exp_avg_sq, master, **flags)
    has_master = master is not None
    operands = (param, grad, exp_avg, exp_avg_sq) + ((master,) if has_master else ())
    block_size = block_size_for(n, block.size)
    spec = pl.BlockSpec((block_size,), lambda i: (i,))
    kernel = functools.partial(
        _update_kernel,
        num_elements=n,
        block_size=block_size,
        has_master=has_master,
        **flags,
    )
    outs = _compat.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((n,), x.dtype) for i, x in enumerate(operands) if i != 1],
        grid=(pl.cdiv(n, block_size),),
        in_specs=[pl.BlockSpec((_NUM_SCALARS,), lambda i: (0,))] + [spec] * len(operands),
        out_specs=[spec] * (len(operands) - 1),
        interpret=interpret,
        num_warps=block.num_warps,
        name="adamw_update",
    )(scalars, *(x.reshape(n) for x in operands))
    outs = [x.reshape(shape) for x in outs]
    return outs[0], outs[1], outs[2], outs[3] if has_master else None


# --- the public ops ---------------------------------------------------------------------------


def _static_nonzero(value: Any) -> bool:
    """False only for a Python or NumPy number equal to 0, which drops the decay term."""
    return not (isinstance(value, numbers.Real) and value == 0)


def adamw_update(
    param: jax.Array,
    grad: jax.Array,
    exp_avg: jax.Array,
    exp_avg_sq: jax.Array,
    master: jax.Array | None = None,
    *,
    count: int | jax.Array,
    learning_rate: float | jax.Array,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    grad_scale: float | jax.Array | None = None,
    impl: str = "auto",
    interpret: bool = False,
    block: AdamWBlock | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """One AdamW step of one parameter array, fused: every array read once and written once.

    With ``t = count`` (1-based), ``lr = learning_rate`` and ``w`` the fp32 weight (``master``
    if given, else ``param``), elementwise in fp32::

        g = grad * grad_scale                                   (if grad_scale is given)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        d = -lr * ((m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps) + weight_decay * w)

    and, without a master, ``update = d`` in ``param``'s dtype; with one, ``w = w + d`` and
    ``update`` is built as in ``rudax.optim.fp32_master`` so that ``param + update`` in
    ``param``'s dtype is exactly ``w`` rounded to it, bit for bit. This is torch's
    ``AdamW`` rule in rudax.optim's operation order (``rudax.optim.adamw``), whose results it
    matches to the bit on the XLA path; torch's own fused kernel computes
    ``p * (1 - lr * weight_decay) - lr * m_hat / denom`` instead, equal up to fp32 rounding.
    On a GPU, Triton may contract multiplies and adds into FMAs, so the Pallas path agrees
    with the XLA path to fp32 rounding; the storage guarantee holds on both.

    Args:
      param: the stored parameter, bfloat16, float16 or float32, any shape.
      grad: its gradient, any floating dtype, ``param``'s shape.
      exp_avg: the first moment, bfloat16, float16 or float32 (new values rounded to it).
      exp_avg_sq: the second moment, likewise.
      master: the fp32 master of a bf16 or fp16 ``param``, or None (``param`` is the weight).
      count: this update's 1-based step ``t``, >= 1 (an int or an int32 scalar).
      learning_rate: the learning rate of this step, >= 0 (a number or a scalar array).
      b1: decay of the first moment, in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: added to the bias-corrected root of the second moment, >= 0.
      weight_decay: decoupled decay, multiplied by the learning rate, >= 0; a number equal
        to 0 drops the term.
      grad_scale: multiplies the gradient first, e.g. a global-norm clipping coefficient.
      impl: ``"auto"`` (Pallas on a GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``
        (``adamw_update_reference``).
      interpret: run the Pallas kernel in interpret mode, on any backend (for tests).
      block: the kernels' ``AdamWBlock``; None for the default.

    Returns:
      ``(update, exp_avg, exp_avg_sq, master)``: the update in ``param``'s dtype, the new
      moments in their dtypes, the new master (None without one). Concrete hyperparameters
      are checked (ValueError or TypeError naming the argument); traced ones pass unchecked.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> p, g = jnp.array([1.0, -2.0]), jnp.array([0.5, 0.5])
      >>> zeros = jnp.zeros(2)
      >>> update, m, v, _ = rk.adamw_update(
      ...     p, g, zeros, zeros, count=1, learning_rate=0.1, weight_decay=0.5)
      >>> [round(x, 6) for x in (p + update).tolist()]
      [0.85, -2.0]

    References:
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019; PyTorch, ``torch.optim.AdamW``.
    """
    (update,), (m,), (v,), (w,) = adamw_update_leaves(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [master],
        count=count,
        learning_rate=learning_rate,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        grad_scale=grad_scale,
        impl=impl,
        interpret=interpret,
        block=block,
    )
    return update, m, v, w


def adamw_update_leaves(
    params: Sequence[jax.Array],
    grads: Sequence[jax.Array],
    exp_avgs: Sequence[jax.Array],
    exp_avg_sqs: Sequence[jax.Array],
    masters: Sequence[jax.Array | None],
    *,
    count: int | jax.Array,
    learning_rate: float | jax.Array,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    grad_scale: float | jax.Array | None = None,
    skip: bool | jax.Array | None = None,
    impl: str = "auto",
    interpret: bool = False,
    block: AdamWBlock | None = None,
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], list[jax.Array | None]]:
    """``adamw_update`` over many leaves with one set of scalars, and an optional skip.

    Leaf ``i`` gets ``adamw_update(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
    masters[i], ...)`` (see it for the rule). With ``skip`` True, each leaf's pass instead
    selects, element by element::

        update = -0.0 (param's dtype); exp_avg, exp_avg_sq, master returned bit for bit

    so ``param + update`` keeps every bit of ``param``, ``-0.0`` included. This is how
    ``rudax.optim.fused_adamw`` skips a non-finite step without a ``lax.cond``.

    Args:
      params: the stored parameters, each as ``adamw_update``'s ``param``.
      grads: one gradient per parameter.
      exp_avgs: one first moment per parameter.
      exp_avg_sqs: one second moment per parameter.
      masters: one fp32 master or None per parameter.
      count: this update's 1-based step ``t``, >= 1, for every leaf.
      learning_rate: the learning rate of this step, >= 0.
      b1: decay of the first moment, in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: added to the bias-corrected root of the second moment, >= 0.
      weight_decay: decoupled decay, >= 0; a number equal to 0 drops the term.
      grad_scale: multiplies every gradient first, or None.
      skip: None (apply), or a bool scalar (an array under ``jit``): True skips the step.
      impl: ``"auto"``, ``"pallas"`` or ``"xla"``.
      interpret: run the Pallas kernel in interpret mode, on any backend (for tests).
      block: the kernel's ``AdamWBlock``; None for the default.

    Returns:
      ``(updates, exp_avgs, exp_avg_sqs, masters)``, four lists with one entry per leaf as
      ``adamw_update`` returns them. ``adamw_update``'s errors, prefixed ``leaf i:`` for an
      array when there are several leaves; a ValueError if the sequences' lengths differ.

    Example:
      >>> import jax.numpy as jnp
      >>> from rudax.kernels._adamw import adamw_update_leaves
      >>> p, g, zeros = jnp.array([-0.0, 1.0]), jnp.array([jnp.nan, 1.0]), jnp.zeros(2)
      >>> updates, *_ = adamw_update_leaves(
      ...     [p], [g], [zeros], [zeros], [None], count=1, learning_rate=0.1,
      ...     skip=jnp.array(True))
      >>> (p + updates[0]).tolist()
      [-0.0, 1.0]

    References:
      See ``adamw_update``.
    """
    sequences = (params, grads, exp_avgs, exp_avg_sqs, masters)
    if len({len(x) for x in sequences}) != 1:
        raise ValueError(
            "params, grads, exp_avgs, exp_avg_sqs and masters must have one entry per leaf, "
            f"got lengths {tuple(len(x) for x in sequences)}"
        )
    leaves = []
    for i, arrays in enumerate(zip(*sequences, strict=True)):
        arrays = [None if x is None else jnp.asarray(x) for x in arrays]
        _check_arrays(*arrays, where=f"leaf {i}: " if len(params) > 1 else "")
        leaves.append(arrays)
    _check_hyperparameters(count, learning_rate, b1, b2, eps, weight_decay, grad_scale)
    skip = _check_skip(skip)
    check_block(block, AdamWBlock)
    resolved = _compat.resolve_impl(impl, interpret=interpret)
    scalars = _step_scalars(count, learning_rate, b1, b2, eps, weight_decay, grad_scale, skip)
    flags = dict(
        scaled=grad_scale is not None,
        decay=_static_nonzero(weight_decay),
        skippable=skip is not None,
    )
    block = AdamWBlock() if block is None else block
    outs = [
        _update_leaf(scalars, *arrays, impl=resolved, interpret=interpret, block=block, **flags)
        for arrays in leaves
    ]
    return tuple([o[i] for o in outs] for i in range(4))


def adamw_update_reference(
    param: jax.Array,
    grad: jax.Array,
    exp_avg: jax.Array,
    exp_avg_sq: jax.Array,
    master: jax.Array | None = None,
    *,
    count: int | jax.Array,
    learning_rate: float | jax.Array,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    grad_scale: float | jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """``adamw_update`` in plain jnp on whole arrays: its XLA path (see it for the rule).

    Returns:
      ``(update, exp_avg, exp_avg_sq, master)`` as ``adamw_update``.
    """
    arrays = [jnp.asarray(x) for x in (param, grad, exp_avg, exp_avg_sq)]
    master = None if master is None else jnp.asarray(master)
    _check_arrays(*arrays, master)
    _check_hyperparameters(count, learning_rate, b1, b2, eps, weight_decay, grad_scale)
    scalars = _step_scalars(count, learning_rate, b1, b2, eps, weight_decay, grad_scale, None)
    return _update_reference(
        scalars,
        *arrays,
        master,
        scaled=grad_scale is not None,
        decay=_static_nonzero(weight_decay),
        skippable=False,
    )
