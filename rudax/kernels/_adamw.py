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
are masked (``_blocks.py``), so no padded copy is made. The per-step scalars, checked and
computed once outside the pass, and the arithmetic are in ``_adamw_step.py``; the entry that
updates many leaves with one set of scalars, and can skip a step, in ``_adamw_leaves.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import ArrayLike

from rudax._validation import STORAGE_DTYPES, check_power_of_two_fields
from rudax.kernels import _auto, _compat, _platform
from rudax.kernels._adamw_step import (
    NUM_SCALARS,
    adamw_step,
    check_hyperparameters,
    check_skip,
    step_scalars,
    unpack_scalars,
)
from rudax.kernels._blocks import block_size_for, check_block, load_block, tail_mask
from rudax.kernels._rounding import round_by_cast, round_to


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
        check_power_of_two_fields(self)


# --- the operands' checks -----------------------------------------------------------------


# param, grad, exp_avg, exp_avg_sq as arrays, then the master or None.
Operands = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None]


def as_operands(
    param: ArrayLike,
    grad: ArrayLike,
    exp_avg: ArrayLike,
    exp_avg_sq: ArrayLike,
    master: ArrayLike | None,
    where: str = "",
) -> Operands:
    """The operands as arrays, checked; each error names the operand (after ``where``)."""
    given = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, x in given.items():
        if x is None:  # only the master may be absent
            raise TypeError(f"{where}{name} must be an array, got {name}=None")
    named = {name: jnp.asarray(x) for name, x in given.items()}
    if master is not None:
        named["master"] = jnp.asarray(master)
    shape = named["param"].shape
    for name, x in named.items():
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{where}{name} must have a floating dtype, got {name}.dtype={x.dtype}")
        if x.shape != shape:
            raise ValueError(
                f"{where}{name} must have param's shape {shape}, got {name}.shape={x.shape}"
            )
    for name in ("param", "exp_avg", "exp_avg_sq"):
        if named[name].dtype not in STORAGE_DTYPES:
            raise TypeError(
                f"{where}{name} must be bfloat16, float16 or float32, got "
                f"{name}.dtype={named[name].dtype}"
            )
    if "master" in named and named["master"].dtype != jnp.float32:
        raise TypeError(f"{where}master must be float32, got master.dtype={named['master'].dtype}")
    return (
        named["param"],
        named["grad"],
        named["exp_avg"],
        named["exp_avg_sq"],
        named.get("master"),
    )


# --- Pallas kernels -------------------------------------------------------------------------


def _update_kernel(
    s_ref,
    param_ref,
    grad_ref,
    m_ref,
    v_ref,
    *refs,
    num_elements,
    block_size,
    has_master,
    apply,
    **flags,
) -> None:
    if has_master:
        w_ref, update_ref, m_out_ref, v_out_ref, w_out_ref = refs
    else:
        update_ref, m_out_ref, v_out_ref = refs
    mask = tail_mask(num_elements, block_size)
    s = unpack_scalars(s_ref)
    f32 = lambda ref: load_block(ref, mask).astype(jnp.float32)
    # Triton leaves a cast pair alone; XLA would be free to drop it (see _rounding.py).
    param = load_block(param_ref, mask)
    update, m, v, new_master = adamw_step(
        s,
        param,
        f32(grad_ref),
        f32(m_ref),
        f32(v_ref),
        f32(w_ref) if has_master else None,
        rounding=round_by_cast,
        **flags,
    )
    # With apply, the new parameter instead of the update: optax.apply_updates' p + u in the
    # parameter's dtype, written over the parameter (aliased), so p is written once.
    _compat.store(update_ref, param + update if apply else update, mask=mask)
    _compat.store(m_out_ref, m.astype(m_out_ref.dtype), mask=mask)
    _compat.store(v_out_ref, v.astype(v_out_ref.dtype), mask=mask)
    if new_master is not None:  # exactly when has_master
        _compat.store(w_out_ref, new_master, mask=mask)


# --- the Pallas and XLA paths -------------------------------------------------------------


def _update_reference(scalars, param, grad, exp_avg, exp_avg_sq, master, *, apply=False, **flags):
    """The XLA path: the kernel's math on whole arrays, rounding with ``round_to``."""
    s = unpack_scalars(scalars)
    f32 = lambda x: x.astype(jnp.float32)
    update, m, v, new_master = adamw_step(
        s, param, f32(grad), f32(exp_avg), f32(exp_avg_sq), master, rounding=round_to, **flags
    )
    first = param + update if apply else update  # optax.apply_updates' sum, in param's dtype
    return first, m.astype(exp_avg.dtype), v.astype(exp_avg_sq.dtype), new_master


@functools.partial(
    jax.jit,
    static_argnames=("impl", "interpret", "block", "apply", "scaled", "decay", "skippable"),
)
def update_leaf(
    scalars,
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    master,
    *,
    impl,
    interpret,
    block,
    apply=False,
    **flags,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """One leaf's step on the resolved path, from ``prepare_step``'s scalars and arguments.

    With ``apply`` the first output is the new parameter, ``param + update`` in its dtype
    (``optax.apply_updates``' sum), and the Pallas kernel writes it, the moments and the
    master over their inputs (aliased: in place where the caller donates them).
    """
    shape, n = param.shape, param.size
    if n == 0:
        impl = "xla"  # nothing for a kernel to do, and no grid to launch
    has_master = master is not None
    operands = (param, grad, exp_avg, exp_avg_sq) + ((master,) if has_master else ())

    def xla(scalars, *operands):
        param, grad, exp_avg, exp_avg_sq = operands[:4]
        master = operands[4] if has_master else None
        update, m, v, new_master = _update_reference(
            scalars, param, grad, exp_avg, exp_avg_sq, master, apply=apply, **flags
        )
        return (update, m, v) if new_master is None else (update, m, v, new_master)

    def pallas(scalars, *operands):
        block_size = block_size_for(n, block.size)
        spec = pl.BlockSpec((block_size,), lambda i: (i,))
        kernel = functools.partial(
            _update_kernel,
            num_elements=n,
            block_size=block_size,
            has_master=has_master,
            apply=apply,
            **flags,
        )
        # Inputs (scalars, param, grad, m, v[, master]) to outputs (param, m, v[, master]).
        aliases = {1: 0, 3: 1, 4: 2} | ({5: 3} if has_master else {})
        outs = _compat.pallas_call(
            kernel,
            out_shape=[
                jax.ShapeDtypeStruct((n,), x.dtype) for i, x in enumerate(operands) if i != 1
            ],
            grid=(pl.cdiv(n, block_size),),
            in_specs=[pl.BlockSpec((NUM_SCALARS,), lambda i: (0,))] + [spec] * len(operands),
            out_specs=[spec] * (len(operands) - 1),
            interpret=interpret,
            num_warps=block.num_warps,
            name="adamw_update",
            input_output_aliases=aliases if apply else None,
        )(scalars, *(x.reshape(n) for x in operands))
        return tuple(x.reshape(shape) for x in outs)

    outs = _platform.run(impl, pallas, xla, scalars, *operands, name="adamw_update")
    return outs[0], outs[1], outs[2], outs[3] if has_master else None


# --- the public ops ---------------------------------------------------------------------------


def _flags(grad_scale: Any, weight_decay: Any, skip: jax.Array | None) -> dict[str, bool]:
    """``update_leaf``'s flags: which terms the step's program has.

    A gradient scale when one is given, the decay term unless ``weight_decay`` is a number equal
    to 0, the skip's selects when there is a skip flag.
    """
    decay = not (isinstance(weight_decay, numbers.Real) and weight_decay == 0)
    return dict(scaled=grad_scale is not None, decay=decay, skippable=skip is not None)


def prepare_step(
    count: Any,
    learning_rate: Any,
    b1: Any,
    b2: Any,
    eps: Any,
    weight_decay: Any,
    grad_scale: Any,
    skip: Any,
    *,
    impl: str,
    interpret: bool,
    block: AdamWBlock | None,
    size: int,
) -> tuple[jax.Array, dict[str, Any]]:
    """Checks a step's arguments; returns its scalars and ``update_leaf``'s static arguments.

    The hyperparameters as ``adamw_update`` takes them; ``skip`` as ``adamw_update_leaves``;
    ``size`` the step's parameter count (one leaf, or every leaf of the call), which picks
    the measured row of ``impl="auto"`` and of ``block=None`` on a GPU.
    """
    check_hyperparameters(count, learning_rate, b1, b2, eps, weight_decay, grad_scale)
    skip = check_skip(skip)
    check_block(block, AdamWBlock)
    resolved = _compat.resolve_impl(impl, interpret=interpret, kernel="adamw_update", size=size)
    if block is None:
        block = _auto.tuned_block(AdamWBlock, "adamw_update", size=size, dtype=None)
    scalars = step_scalars(count, learning_rate, b1, b2, eps, weight_decay, grad_scale, skip)
    static = dict(
        impl=resolved, interpret=interpret, block=block, **_flags(grad_scale, weight_decay, skip)
    )
    return scalars, static


def adamw_update(
    param: ArrayLike,
    grad: ArrayLike,
    exp_avg: ArrayLike,
    exp_avg_sq: ArrayLike,
    master: ArrayLike | None = None,
    *,
    count: ArrayLike,
    learning_rate: ArrayLike,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    weight_decay: ArrayLike = 1e-2,
    grad_scale: ArrayLike | None = None,
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
    ``param``'s dtype is exactly ``w`` rounded to it, bit for bit. A ``master`` that
    ``param`` is not the rounding of, bitwise (the parameter was replaced outside the
    optimizer), is first set to ``float32(param)``: a rounding, a compare and a select per
    element on operands the pass reads anyway. This is torch's
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
      impl: ``"auto"`` (the XLA path: on an H200 it ran 1.65x the Pallas kernel's speed),
        ``"pallas"`` or ``"xla"``
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
    operands = as_operands(param, grad, exp_avg, exp_avg_sq, master)
    hyper = (count, learning_rate, b1, b2, eps, weight_decay, grad_scale)
    scalars, static = prepare_step(
        *hyper, None, impl=impl, interpret=interpret, block=block, size=operands[0].size
    )
    return update_leaf(scalars, *operands, **static)


def adamw_update_reference(
    param: ArrayLike,
    grad: ArrayLike,
    exp_avg: ArrayLike,
    exp_avg_sq: ArrayLike,
    master: ArrayLike | None = None,
    *,
    count: ArrayLike,
    learning_rate: ArrayLike,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    weight_decay: ArrayLike = 1e-2,
    grad_scale: ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """``adamw_update`` in plain jnp on whole arrays: its XLA path (see it for the rule).

    Returns:
      ``(update, exp_avg, exp_avg_sq, master)`` as ``adamw_update``.
    """
    operands = as_operands(param, grad, exp_avg, exp_avg_sq, master)
    check_hyperparameters(count, learning_rate, b1, b2, eps, weight_decay, grad_scale)
    scalars = step_scalars(count, learning_rate, b1, b2, eps, weight_decay, grad_scale, None)
    return _update_reference(scalars, *operands, **_flags(grad_scale, weight_decay, None))
