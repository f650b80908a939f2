"""Fused AdamW: clipping, the non-finite skip, fp32 masters and AdamW in two passes.

``fused_adamw`` computes what ``skip_nonfinite(fp32_master(chain(clip_by_global_norm,
adamw)))`` computes, but as two reads of the gradients instead of one per transform: the
global norm and the finite check together (``rudax.kernels.global_norm_and_finite``), then one
pass per parameter array over parameter, gradient, moments and master
(``rudax.kernels.adamw_update``). The kernels and the reasons for this layout are described in
``rudax/kernels/_adamw.py`` and ``_adamw_leaves.py``.

The skip is not ``skip_nonfinite``'s ``lax.cond``: the finite flag goes into the update pass
as one more per-step scalar, and each element selects its old value when it is set. A
conditional around the pass would make XLA materialize both branches' full-size outputs and
give up donation and fusion (2.5x slower than the unfused chain on a CPU), and on a GPU its
predicate would be read back by the host every step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

import rudax.kernels as rk
from rudax._validation import (
    check_bool,
    check_floating_leaves,
    check_impl,
    check_in_range,
    check_non_negative,
    check_positive,
    float_dtype,
)
from rudax.kernels._adamw_leaves import adamw_update_leaves
from rudax.kernels._blocks import check_block
from rudax.optim._apply import register_in_place
from rudax.optim._base import safe_increment, transformation_with_extra_args
from rudax.optim._clipping import clip_coefficient
from rudax.optim._compat import flatten_up_to
from rudax.optim._inject import check_not_injected, static_arguments
from rudax.optim._precision import as_weak
from rudax.optim._torch_chain import DecayMask, decay_flags
from rudax.optim._torch_chain import _check_mask_leaf as check_mask_leaf
from rudax.optim._validation import (
    check_gradients,
    check_learning_rate,
    check_storage_dtypes,
    check_tree_like,
)


class FusedAdamWState(NamedTuple):
    """State of ``fused_adamw``; a skipped update changes only the last three fields."""

    # shape=(), int32: applied updates (not skipped ones), saturating.
    # Named as optax names its counts, so optax.tree.get(state, "count") finds it; mypy
    # reports the field for overriding tuple.count (a method), as optax's states override it.
    count: jax.Array  # type: ignore[assignment]
    exp_avg: Any  # like params: first moment m, float32 (param dtype if master_dtype is None)
    exp_avg_sq: Any  # like params: second moment v, likewise
    master: Any  # like params: float32 copy of each bf16/fp16 leaf, None for the others
    global_norm: jax.Array  # shape=(), float32: pre-clip global L2 norm of the last gradients
    skipped: jax.Array  # shape=(), bool: True if the last update was skipped
    num_skipped: jax.Array  # shape=(), int32: updates skipped since init


def _refuse_complex(what: str, tree: Any) -> None:
    """A TypeError naming the first complex leaf, and the optimizer that takes it."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"fused_adamw: {what} {jax.tree_util.keystr(path)} has dtype={dtype}: the fused "
                "kernels store bfloat16, float16 or float32 only. rudax.optim.adamw takes "
                "complex parameters (torch's real-view rule); chain it with "
                "clip_by_global_norm, fp32_master and skip_nonfinite for the same update."
            )


@static_arguments(
    "skip_nonfinite",
    "master_dtype",
    "hierarchical_stats",
    "impl",
    "interpret",
    "mask",
    "block",
    "norm_block",
)
def fused_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.999,
    eps: float | jax.Array = 1e-8,
    weight_decay: float | jax.Array = 1e-2,
    *,
    max_grad_norm: float | jax.Array | None = None,
    skip_nonfinite: bool = True,
    master_dtype: DTypeLike | None = jnp.float32,
    hierarchical_stats: bool = False,
    impl: str = "auto",
    interpret: bool = False,
    mask: DecayMask = None,
    block: rk.AdamWBlock | None = None,
    norm_block: rk.GlobalNormBlock | None = None,
) -> optax.GradientTransformationExtraArgs:
    """AdamW with global-norm clipping, a non-finite skip and fp32 masters, fused.

    With ``t`` the 1-based count of applied updates, ``lr_t`` the learning rate at update
    ``t - 1``, ``w`` each parameter's weight (its fp32 master for a bf16 or fp16 parameter, the
    parameter itself for fp32) and all arithmetic in fp32::

        norm = sqrt(sum over all gradient elements of g**2)
        if skip_nonfinite and any gradient element is inf or NaN:
            updates = -0.0; state unchanged but for global_norm, skipped, num_skipped
        else:
            g = g * min(max_grad_norm / (norm + 1e-6), 1)     (if max_grad_norm is given)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g**2
            w = w - lr_t * ((m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps)
                            + weight_decay * w)

    This is ``skip_nonfinite(fp32_master(chain(clip_by_global_norm(max_grad_norm),
    adamw(...))))`` from rudax.optim (torch's ``clip_grad_norm_`` and ``AdamW`` rules and
    defaults; ``optax.adamw``'s default ``weight_decay`` is 1e-4 and optax's clipping omits the
    1e-6), equal to fp32 rounding (a compiler may contract a multiply and an add into one FMA).
    For a bf16 or fp16 parameter the update makes ``optax.apply_updates(params, updates)``
    store exactly the master rounded to the parameter's dtype, bit for bit (the scheme of
    ``rudax.optim.fp32_master``). An fp32 parameter needs no master: it is its own, and its
    update is ``fp32_master``-free AdamW's. torch's ``AdamW(fused=True)`` fuses the step but
    leaves clipping (a separate ``clip_grad_norm_``) and skipping (``GradScaler``) outside.

    As in ``fp32_master``, a master whose parameter is not its rounding, bitwise, was
    replaced outside the optimizer (weights loaded after ``init``) and is set to the parameter
    before the step (``w = float32(p)`` there), so the decay and the step act on the loaded
    weights. That is one rounding, one compare and one select per element inside the update
    pass, on the parameter and master it reads anyway: no extra memory traffic (on CPU the
    same compiled fusions and scratch size, step time within noise). A skipped update leaves
    the masters as they were; the next applied one adopts.

    The gradients are read twice: once for the global norm and the finite check together
    (``rudax.kernels.global_norm_and_finite``), once by the per-array update kernel
    (``rudax.kernels.adamw_update``) with the moments and masters. The skip is a select
    inside that update pass, not a ``lax.cond``: no branch, no predicate read by the host.
    ``rudax.optim.update_and_apply(tx, grads, state, params)`` (what ``rudax.sharding``'s
    train steps call) makes that pass write the new parameters too, over the parameters,
    moments and masters it read (in place where the step donates them), instead of an update
    that ``optax.apply_updates`` reads back: on the Pallas path, one read and one write of
    each; the same bits as the two calls.

    Args:
      learning_rate: a number >= 0, or a schedule of the count of applied updates (0 at the
        first update; a skipped update does not advance it).
      b1: decay of the first moment, in [0, 1) (torch's ``betas[0]``).
      b2: decay of the second moment, in [0, 1) (torch's ``betas[1]``).
      eps: added to the bias-corrected root of the second moment; >= 0.
      weight_decay: decoupled decay coefficient, multiplied by the learning rate; >= 0.
      max_grad_norm: clip the gradients to this global L2 norm with torch's rule; finite and
        > 0, or None for no clipping.
      skip_nonfinite: skip the whole update when any gradient element is inf or NaN. If
        False, non-finite gradients flow into the moments and parameters, as in torch.
      master_dtype: ``jnp.float32``: fp32 masters for bf16 and fp16 parameters, fp32 moments
        for all. None: no masters, the moments stored in each parameter's dtype (still
        computed in fp32; ``rudax.optim.adamw`` would compute in bf16 for bf16 gradients).
      hierarchical_stats: compute the global norm and finite check as a two-level reduction
        with a bounded partial buffer (see ``rudax.kernels.global_norm_and_finite``).
      impl: ``"auto"`` (the XLA path: on an H200 the Pallas kernels ran at 0.61x its speed,
        ``docs/gpu_results.md``), ``"pallas"`` or ``"xla"``.
      interpret: run the Pallas kernels in interpret mode, on any backend (for tests).
      mask: which parameters decay, as in ``optax.add_decayed_weights``: a pytree of bools
        like the parameters (or a prefix of it), or a callable of the parameters returning
        one. A False leaf still gets its step, without the ``weight_decay * w`` term (torch's
        parameter group with ``weight_decay=0``). None decays all.
      block: the update kernel's ``rudax.kernels.AdamWBlock``; None for the one measured
        fastest on the GPU lowered for (``rudax/kernels/auto_table.json``), else the default.
      norm_block: the global norm kernel's ``rudax.kernels.GlobalNormBlock``, likewise.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a ``FusedAdamWState``.
      ``update`` requires ``params`` (and ignores extra keyword arguments); updates come in
      each parameter's dtype. Every parameter leaf must be bf16, fp16 or fp32 (a TypeError
      naming its path otherwise; a complex one too: the kernels are real-only, and
      ``rudax.optim.adamw`` takes complex parameters on torch's real view); the gradients and
      the state's moments and masters must have the parameters' tree and shapes (a ValueError
      naming the path and both shapes otherwise).

      Under ``inject_hyperparams`` the floats (``learning_rate``, the betas, ``eps``,
      ``weight_decay``, and ``max_grad_norm`` when it is a number) may be injected;
      ``skip_nonfinite``, ``master_dtype``, ``hierarchical_stats``, ``impl``, ``interpret``
      and ``mask`` are static (``rudax.optim.inject_hyperparams`` knows them). A schedule
      given to the injecting wrapper is evaluated at the wrapper's count, which counts skipped
      updates too; given to ``fused_adamw`` itself it follows the applied updates.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.array([1.0, -2.0], jnp.bfloat16)}
      >>> tx = ro.fused_adamw(0.1, weight_decay=0.5, max_grad_norm=1.0)
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.array([3.0, jnp.inf], jnp.bfloat16)}
      >>> updates, state = tx.update(grads, state, params)  # skipped: state unchanged
      >>> bool(state.skipped), int(state.count)
      (True, 0)
      >>> updates, state = tx.update({"w": jnp.array([3.0, 4.0], jnp.bfloat16)}, state, params)
      >>> optax.apply_updates(params, updates)["w"].tolist(), float(state.global_norm)
      ([0.8515625, -2.0], 5.0)

    References:
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019; Micikevicius et al., `Mixed Precision
      Training <https://arxiv.org/abs/1710.03740>`_, 2018; PyTorch, ``torch.optim.AdamW``
      and ``torch.nn.utils.clip_grad_norm_``.
    """
    check_not_injected("fused_adamw", dict(master_dtype=master_dtype, mask=mask))
    check_learning_rate(learning_rate)
    check_in_range("b1", b1, 0.0, 1.0)
    check_in_range("b2", b2, 0.0, 1.0)
    check_non_negative("eps", eps)
    check_non_negative("weight_decay", weight_decay)
    if max_grad_norm is not None:
        check_positive("max_grad_norm", max_grad_norm)
    check_bool("skip_nonfinite", skip_nonfinite)
    float_dtype("master_dtype", master_dtype, none_in_message=True)
    if master_dtype is not None and jnp.dtype(master_dtype) != jnp.float32:
        raise ValueError(f"master_dtype must be jnp.float32 or None, got {master_dtype=}")
    check_bool("hierarchical_stats", hierarchical_stats)
    check_impl(impl)
    check_bool("interpret", interpret)
    check_block(block, rk.AdamWBlock)
    check_block(norm_block, rk.GlobalNormBlock)
    if mask is not None and not callable(mask):
        # Checked at construction too, so a typo fails before any data is loaded.
        for path, keep in jax.tree_util.tree_flatten_with_path(mask)[0]:
            check_mask_leaf("fused_adamw", path, keep)
    b1, b2, eps, weight_decay = (as_weak(x) for x in (b1, b2, eps, weight_decay))
    with_masters = master_dtype is not None

    def needs_master(p: jax.Array) -> bool:
        return with_masters and jnp.result_type(p) != jnp.float32

    def init_fn(params: Any) -> FusedAdamWState:
        _refuse_complex("parameter", params)
        check_storage_dtypes("fused_adamw", params)
        moment_dtype = (lambda p: jnp.float32) if with_masters else jnp.result_type
        zeros = lambda: jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), moment_dtype(p)), params)
        # A copy: a master that aliased its parameter would make donating (params, state) to
        # a jitted step donate one buffer twice.
        master = jax.tree.map(
            lambda p: jnp.array(p, dtype=jnp.float32, copy=True) if needs_master(p) else None,
            params,
        )
        return FusedAdamWState(
            count=jnp.zeros((), jnp.int32),
            exp_avg=zeros(),
            exp_avg_sq=zeros(),
            master=master,
            global_norm=jnp.zeros((), jnp.float32),
            skipped=jnp.zeros((), jnp.bool_),
            num_skipped=jnp.zeros((), jnp.int32),
        )

    def update_fn(
        updates: Any, state: FusedAdamWState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, FusedAdamWState]:
        del extra_args  # optax's convention: arguments for other transforms pass through
        return step(updates, state, params, apply=False)

    def apply_fn(grads: Any, state: FusedAdamWState, params: Any) -> tuple[Any, FusedAdamWState]:
        return step(grads, state, params, apply=True)

    def step(
        updates: Any, state: FusedAdamWState, params: Any, *, apply: bool
    ) -> tuple[Any, FusedAdamWState]:
        """The update (or, with ``apply``, the new parameters) and the new state."""
        if params is None:
            raise ValueError("fused_adamw: update needs params (the stored parameters)")
        _refuse_complex("parameter", params)
        _refuse_complex("gradient", updates)
        check_storage_dtypes("fused_adamw", params)
        check_floating_leaves("fused_adamw: gradient", updates)
        check_gradients("fused_adamw", updates, params)
        for field in ("exp_avg", "exp_avg_sq", "master"):
            check_tree_like(
                "fused_adamw",
                f"state.{field}",
                getattr(state, field),
                "params",
                params,
                none_is_leaf=field == "master",
            )
        param_leaves, treedef = jax.tree.flatten(params)
        leaves = lambda tree: flatten_up_to(params, tree)
        grads = [jnp.asarray(g) for g in leaves(updates)]

        norm, finite = rk.global_norm_and_finite(
            grads, hierarchical=hierarchical_stats, impl=impl, interpret=interpret, block=norm_block
        )
        coefficient = None if max_grad_norm is None else clip_coefficient(norm, max_grad_norm)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        count = safe_increment(state.count)
        skipped = jnp.logical_not(finite) if skip_nonfinite else jnp.zeros((), jnp.bool_)
        exp_avgs, exp_avg_sqs, masters = (
            leaves(state.exp_avg), leaves(state.exp_avg_sq), leaves(state.master)
        )  # fmt: skip
        operands = [jnp.asarray(p) for p in param_leaves], grads, exp_avgs, exp_avg_sqs, masters
        # One kernel pass per leaf either way: the leaves mask spares form a second group whose
        # decay is the number 0, which the kernel leaves out (torch's weight_decay=0 group).
        flags = decay_flags(mask, params, owner="fused_adamw")
        outs: list[Any] = [None] * len(param_leaves)
        for decays, group_decay in ((True, weight_decay), (False, 0.0)):
            group = [i for i, flag in enumerate(flags) if flag == decays]
            if not group:
                continue
            results = adamw_update_leaves(
                *([xs[i] for i in group] for xs in operands),
                count=count,
                learning_rate=lr,
                b1=b1,
                b2=b2,
                eps=eps,
                weight_decay=group_decay,
                grad_scale=coefficient,
                skip=skipped if skip_nonfinite else None,
                impl=impl,
                interpret=interpret,
                block=block,
                apply=apply,
            )
            for j, i in enumerate(group):
                outs[i] = [column[j] for column in results]
        new_updates, exp_avg, exp_avg_sq, master = ([out[k] for out in outs] for k in range(4))
        new_count = jnp.where(skipped, state.count, count) if skip_nonfinite else count
        return jax.tree.unflatten(treedef, new_updates), FusedAdamWState(
            count=new_count,
            exp_avg=jax.tree.unflatten(treedef, exp_avg),
            exp_avg_sq=jax.tree.unflatten(treedef, exp_avg_sq),
            master=jax.tree.unflatten(treedef, master),
            global_norm=norm,
            skipped=skipped,
            num_skipped=state.num_skipped + skipped.astype(jnp.int32),
        )

    tx = transformation_with_extra_args(init_fn, update_fn)
    register_in_place(tx, apply_fn)
    return tx
