"""Adan: adaptive Nesterov momentum, as the authors' PyTorch code (sail-sg/Adan) computes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.tree_util import tree_flatten_with_path
from jax.typing import DTypeLike

from rudax._validation import check_in_range, check_non_negative
from rudax.optim._base import safe_increment, transformation
from rudax.optim._compat import flatten_up_to
from rudax.optim._inject import static_arguments
from rudax.optim._precision import as_weak, map_in_compute_dtype, with_moment_dtype
from rudax.optim._torch_chain import DecayMask, decay_flags, static_nonzero
from rudax.optim._torch_chain import _check_mask_leaf as check_mask_leaf
from rudax.optim._validation import check_learning_rate


class ScaleByAdanState(NamedTuple):
    """State of ``scale_by_adan``."""

    # shape=(), int32: updates applied so far.
    # Named as optax names its counts, so optax.tree.get(state, "count") finds it; mypy
    # reports the field for overriding tuple.count (a method), as optax's states override it.
    count: jax.Array  # type: ignore[assignment]
    m: optax.Updates  # EMA of gradients, moment_dtype
    v: optax.Updates  # EMA of gradient differences g_t - g_{t-1}, moment_dtype
    n: optax.Updates  # EMA of (g_t + b2 (g_t - g_{t-1}))^2, moment_dtype
    prev_grad: optax.Updates  # g_{t-1}, moment_dtype; unused by the first update


def scale_by_adan(
    b1: float | jax.Array = 0.98,
    b2: float | jax.Array = 0.92,
    b3: float | jax.Array = 0.99,
    eps: float | jax.Array = 1e-8,
    *,
    moment_dtype: DTypeLike | None = None,
) -> optax.GradientTransformation:
    """Rescales gradients into Adan's bias-corrected Nesterov direction (no learning rate).

    With ``d_t = g_t - g_{t-1}`` (``d_1 = 0``: the first step's previous gradient is the
    current one) and ``c_i = 1 - b_i**t``::

        m_t = b1 m_{t-1} + (1 - b1) g_t
        v_t = b2 v_{t-1} + (1 - b2) d_t
        n_t = b3 n_{t-1} + (1 - b3) (g_t + b2 d_t)**2
        u_t = (m_t / c1 + b2 v_t / c2) / (sqrt(n_t) / sqrt(c3) + eps)

    Args:
      b1: decay of the gradient EMA (the paper's ``1 - beta1``).
      b2: decay of the gradient-difference EMA (the paper's ``1 - beta2``).
      b3: decay of the squared-term EMA (the paper's ``1 - beta3``).
      eps: added to the denominator outside the square root.
      moment_dtype: storage dtype of ``m, v, n`` and the previous gradient, e.g. ``jnp.float32``
        for bf16 parameters; None keeps each parameter's dtype. Each update is computed in the
        wider of this and the gradient's dtype and returned in the parameter's dtype.

    Returns:
      An ``optax.GradientTransformation`` whose state is a ``ScaleByAdanState``.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.optim as ro
      >>> tx = ro.scale_by_adan()
      >>> g = jnp.array([0.5, -2.0])
      >>> u, _ = tx.update(g, tx.init(g))
      >>> u.round(4)  # the first step is g / (|g| + eps)
      Array([ 1., -1.], dtype=float32)

    References:
      Xie et al., `Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep
      Models <https://arxiv.org/abs/2208.06677>`_, 2022; https://github.com/sail-sg/Adan.
    """
    for name, value in (("b1", b1), ("b2", b2), ("b3", b3)):
        check_in_range(name, value, 0.0, 1.0)
    check_non_negative("eps", eps)
    b1, b2, b3, eps = (as_weak(x) for x in (b1, b2, b3, eps))

    def init_fn(params: optax.Params) -> ScaleByAdanState:
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return ScaleByAdanState(
            count=jnp.zeros([], jnp.int32), m=zeros(), v=zeros(), n=zeros(), prev_grad=zeros()
        )

    def update_fn(
        updates: Any, state: ScaleByAdanState, params: Any = None
    ) -> tuple[Any, ScaleByAdanState]:
        del params
        first = state.count == 0
        count = safe_increment(state.count)
        # Bias corrections in fp32 whatever the moment dtype: 1 - b**t for b near 1 needs more
        # than bf16's 8 mantissa bits.
        t = count.astype(jnp.float32)
        c1, c2, c3 = (1.0 - b**t for b in (b1, b2, b3))

        def leaf(g, m, v, n, prev):
            d = jnp.where(first, jnp.zeros_like(g), g - prev)
            m = b1 * m + (1.0 - b1) * g
            v = b2 * v + (1.0 - b2) * d
            nesterov_g = g + b2 * d
            n = b3 * n + (1.0 - b3) * (nesterov_g * nesterov_g)
            denom = jnp.sqrt(n) / jnp.sqrt(c3).astype(g.dtype) + eps
            u = (m / c1.astype(g.dtype) + b2 * v / c2.astype(g.dtype)) / denom
            return u, m, v, n, g

        u, m, v, n, g = map_in_compute_dtype(
            leaf,
            updates,
            state.m,
            state.v,
            state.n,
            state.prev_grad,
            owner="scale_by_adan",
            names=("m", "v", "n", "prev_grad"),
        )
        return u, ScaleByAdanState(count=count, m=m, v=v, n=n, prev_grad=g)

    return with_moment_dtype(
        transformation(init_fn, update_fn), moment_dtype, owner="scale_by_adan"
    )


class AdanScheduleState(NamedTuple):
    # Not named ``count``: ScaleByAdanState.count is the one optax.tree.get(state, "count")
    # finds. Present only when the learning rate is a schedule.
    schedule_count: jax.Array  # shape=(), int32: updates so far, to evaluate the schedule


def _on_real_view(fn: Callable[..., jax.Array], *xs: jax.Array) -> jax.Array:
    """fn(*xs) elementwise, a complex leaf's real and imaginary parts as two real numbers.

    torch's rule for complex parameters (``torch.view_as_real``). Complex arithmetic would
    give the same values up to rounding and signed zeros, not bit for bit: ``-lr * u`` is
    ``(-lr re - 0 im) + (-lr im + 0 re) i`` and the division a complex one.
    """
    if not jnp.issubdtype(xs[0].dtype, jnp.complexfloating):
        return fn(*xs)
    return jax.lax.complex(fn(*map(jnp.real, xs)), fn(*map(jnp.imag, xs)))


def _scale_by_learning_rate_and_proximal_decay(
    learning_rate: Any, weight_decay: Any, mask: DecayMask
) -> optax.GradientTransformation:
    """Turns a direction u into the update giving (p - lr u) / (1 + lr * weight_decay).

    Adan's default (``no_prox=False``) decay is the proximal step of the L2 penalty, applied
    after the gradient step; it shrinks by ``1 / (1 + lr wd)`` where AdamW's shrinks by
    ``1 - lr wd``. As an additive update: ``(-lr u - lr wd p) / (1 + lr wd)``, and ``-lr u``
    on the leaves ``mask`` spares. One transform for both, so the learning rate is evaluated
    once per update with one count.
    """
    scheduled = callable(learning_rate)

    def init_fn(params: Any) -> AdanScheduleState | optax.EmptyState:
        del params
        return AdanScheduleState(jnp.zeros([], jnp.int32)) if scheduled else optax.EmptyState()

    # state: init_fn's, an AdanScheduleState exactly when the learning rate is a schedule.
    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        decays = static_nonzero(weight_decay)
        if decays and params is None:
            raise ValueError(
                "adan's weight decay needs params: call tx.update(grads, state, params)"
            )
        if scheduled:
            lr = learning_rate(state.schedule_count)
            state = AdanScheduleState(safe_increment(state.schedule_count))
            # optax.scale_by_schedule's rounding: the rate in the update's dtype first.
            step = lambda u: jnp.asarray(-lr, dtype=u.dtype) * u
        else:
            lr = learning_rate
            step = lambda u: -lr * u  # a weak scalar: computed in the update's dtype
        if not decays:
            return jax.tree.map(lambda u: _on_real_view(step, u), updates), state
        treedef = jax.tree.structure(updates)
        flags = decay_flags(mask, params, owner="adan")

        def leaf(u, p, decay):
            if not decay:
                return _on_real_view(step, u)
            c = jnp.asarray(lr * weight_decay, dtype=jnp.real(u).dtype)
            proximal = lambda x, q: (step(x) - c * q) / (1 + c)
            return _on_real_view(proximal, u, p.astype(u.dtype))

        us, ps = flatten_up_to(updates, updates), flatten_up_to(updates, params)
        new = [leaf(u, p, d) for u, p, d in zip(us, ps, flags, strict=True)]
        return jax.tree.unflatten(treedef, new), state

    return transformation(init_fn, update_fn)


@static_arguments("moment_dtype", "mask")
def adan(
    learning_rate: optax.ScalarOrSchedule,
    b1: float | jax.Array = 0.98,
    b2: float | jax.Array = 0.92,
    b3: float | jax.Array = 0.99,
    eps: float | jax.Array = 1e-8,
    weight_decay: float | jax.Array = 0.0,
    *,
    moment_dtype: DTypeLike | None = None,
    mask: DecayMask = None,
) -> optax.GradientTransformation:
    """Adan (Xie et al. 2022), matching the authors' PyTorch ``Adan`` with ``no_prox=False``.

    With ``u_t`` the direction of :func:`scale_by_adan` (bias-corrected EMAs of the gradient,
    of the gradient difference and of the squared Nesterov gradient ``g_t + b2 (g_t - g_{t-1})``;
    the first step takes ``g_0 = g_1``), each update is::

        p_t = (p_{t-1} - lr_t u_t) / (1 + lr_t weight_decay)

    **Beta convention.** ``b1, b2, b3`` are decay rates, as in the official code and in
    optax: the paper writes ``beta_i = 1 - b_i``, so the paper's ``beta1 = 0.02`` is
    ``b1 = 0.98``, and its ``(1 - beta2)`` weight of the difference term is ``b2``. Defaults are
    the official ``betas=(0.98, 0.92, 0.99)``.

    **Versus** ``optax.adan`` (0.2.8): it has the same beta convention and bias corrections but
    weights the difference term by ``1 - b2`` (0.08) where the paper and the official code use
    ``b2`` (0.92), so trajectories agree on the first update and differ from the second (they
    coincide at ``b2=0.5``); it adds ``eps_root=1e-8`` inside the square root (ours has none);
    and its weight decay is ``p (1 - lr wd) - lr u`` (the official ``no_prox=True``) where ours
    is the official default, the proximal ``(p - lr u) / (1 + lr wd)``. With ``b2=0.5``,
    ``eps_root=0`` and ``weight_decay=0`` the two are equal. torch has no Adan; the official
    code's ``max_grad_norm`` is left to ``clip_by_global_norm`` chained in front.

    A complex parameter follows torch's rule for complex parameters: every step above runs on
    its real view (``torch.view_as_real``), elementwise on the real and imaginary parts as on
    two real parameters, and its buffers are complex. The state holds one update count,
    ``ScaleByAdanState.count`` (``optax.tree.get(state, "count")``); a learning-rate schedule
    keeps its own as ``schedule_count``.

    Args:
      learning_rate: a float >= 0 or a schedule of the update count.
      b1: decay of the gradient EMA (paper ``1 - beta1``), in [0, 1).
      b2: decay of the gradient-difference EMA (paper ``1 - beta2``), in [0, 1).
      b3: decay of the squared-term EMA (paper ``1 - beta3``), in [0, 1).
      eps: added to the denominator outside the square root, >= 0.
      weight_decay: proximal (decoupled) L2 strength, >= 0.
      moment_dtype: storage dtype of ``m, v, n`` and the previous gradient, e.g. ``jnp.float32``
        for bf16 parameters; None keeps each parameter's dtype. Each update is computed in the
        wider of this and the gradient's dtype and returned in the parameter's dtype.
      mask: which parameters decay, as in ``optax.add_decayed_weights``: a pytree of bools
        like the parameters (or a prefix of it), or a callable of the parameters returning
        one. A False leaf still gets its step, without decay (``p_t = p_{t-1} - lr_t u_t``,
        the official code's parameter group with ``weight_decay=0``). None decays all.

    Returns:
      An ``optax.GradientTransformation``: ``chain(scale_by_adan, the learning rate with the
      proximal decay)``, the decay a no-op when ``weight_decay`` is 0. Its ``update`` needs
      ``params`` when it decays.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.array([1.0, -2.0, 3.0])}
      >>> tx = ro.adan(1e-1, weight_decay=0.02)
      >>> state = tx.init(params)
      >>> grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)  # about p - lr sign(g), shrunk
      >>> [round(float(x), 4) for x in params["w"]]
      [0.8982, -1.8962, 2.8942]

    References:
      Xie et al., `Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep
      Models <https://arxiv.org/abs/2208.06677>`_, 2022 (Algorithm 1, with the official
      code's bias corrections); https://github.com/sail-sg/Adan ``adan.py``.
    """
    check_learning_rate(learning_rate)
    check_non_negative("weight_decay", weight_decay)
    if mask is not None and not callable(mask):
        # Checked at construction too, so a typo fails before any data is loaded.
        for path, keep in tree_flatten_with_path(mask)[0]:
            check_mask_leaf("adan", path, keep)
    # moment_dtype=None inside: the outer with_moment_dtype applies it to the whole chain.
    return with_moment_dtype(
        optax.chain(
            scale_by_adan(b1, b2, b3, eps),
            _scale_by_learning_rate_and_proximal_decay(
                as_weak(learning_rate), as_weak(weight_decay), mask
            ),
        ),
        moment_dtype,
        owner="adan",
    )
