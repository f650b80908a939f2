"""L-BFGS with torch's update rule and a strong-Wolfe line search.

One ``update`` is one L-BFGS iteration: a direction from the two-loop recursion over the
stored (s, y) pairs, then one line search along it. torch's ``LBFGS.step(closure)`` runs up to
``max_iter`` such iterations per call; here the caller loops (a Python loop of jitted steps or
``jax.lax.fori_loop``), so a training step stays one compiled function of fixed cost.

The direction follows ``torch.optim.LBFGS``: a pair is stored only when its curvature
``y.s > 1e-10``, the initial inverse Hessian is ``(s.y / y.y) I`` from the newest stored pair,
and the first iteration's step is scaled by ``min(1, 1 / |g|_1)``. optax's ``scale_by_lbfgs``
stores every pair (so a negative-curvature pair from a failed line search or from stochastic
gradients enters the approximation) and scales the first step by the L2 norm instead.

The line search is optax's ``scale_by_zoom_linesearch`` (Nocedal and Wright, Algorithms 3.5 and
3.6) configured as a strong-Wolfe search and wrapped so that a zero or ascent direction costs
no function evaluation and moves nothing (``rudax/optim/_linesearch.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from rudax._validation import (
    check_floating_leaves,
    check_non_negative,
    check_positive_int,
    float_dtype,
)
from rudax.optim._inject import check_not_injected, static_arguments
from rudax.optim._linesearch import check_wolfe_constants, scale_by_strong_wolfe
from rudax.optim._precision import compute_dtype, scale_by_learning_rate
from rudax.optim._validation import check_gradients, check_learning_rate, check_tree_like

# torch's threshold for keeping an (s, y) pair: below it the pair would make the inverse-Hessian
# approximation indefinite or blow up 1 / (y.s). Absolute, as in torch.
_MIN_CURVATURE = 1e-10

_LINE_SEARCHES = ("strong_wolfe", None)


class ScaleByLBFGSState(NamedTuple):
    """State of ``scale_by_lbfgs``: torch's L-BFGS memory as fixed-shape arrays.

    The pairs live in a ring buffer so that jit sees one shape forever; the newest pair sits at
    ``(num_pairs - 1) % history_size``.
    """

    # shape=(), int32: iterations taken (torch's n_iter).
    # Named as optax names its counts, so optax.tree.get(state, "count") finds it; mypy
    # reports the field for overriding tuple.count (a method), as optax's states override it.
    count: jax.Array  # type: ignore[assignment]
    stopped: jax.Array  # shape=(), bool: the last update was zero (|g|_inf small or no descent)
    prev_params: optax.Params  # like params, in the history dtype: params at the last iteration
    prev_grads: optax.Updates  # like params, in the history dtype: gradients at the last iteration
    s_history: optax.Updates  # leaves shape=(history_size, *leaf.shape): steps s_i = x_{i+1} - x_i
    y_history: optax.Updates  # leaves shape=(history_size, *leaf.shape): y_i = g_{i+1} - g_i
    rho: jax.Array  # shape=(history_size,), float32 (float64 for float64 history): 1 / (y_i . s_i)
    num_pairs: jax.Array  # shape=(), int32: pairs stored so far, counting overwritten ones
    h_diag: jax.Array  # shape=(), like rho: initial inverse Hessian scale s.y / y.y, newest pair


def _scalar_dtype(tree: Any) -> jnp.dtype:
    """float32 for dot products of fp32/bf16/fp16 leaves, float64 only for float64 leaves."""
    is_f64 = any(jnp.result_type(x) == jnp.float64 for x in jax.tree.leaves(tree))
    return jnp.dtype(jnp.float64 if is_f64 else jnp.float32)


def _vdot(a: Any, b: Any, dtype: jnp.dtype) -> jax.Array:
    """The dot product of two pytrees seen as flat vectors, accumulated in dtype."""
    terms = jax.tree.map(lambda x, y: jnp.vdot(x.astype(dtype), y.astype(dtype)), a, b)
    return sum(jax.tree.leaves(terms), jnp.zeros((), dtype))


def _axpy(alpha: jax.Array, x: Any, y: Any) -> Any:
    """alpha * x + y per leaf, alpha cast to each leaf's dtype (strict promotion)."""
    return jax.tree.map(lambda xi, yi: alpha.astype(yi.dtype) * xi + yi, x, y)


def _two_loop(
    grads: Any,
    s_history: Any,
    y_history: Any,
    rho: jax.Array,
    h_diag: jax.Array,
    num_pairs: jax.Array,
) -> Any:
    """H g for the L-BFGS inverse-Hessian approximation H (Nocedal and Wright, Algorithm 7.4).

    Only the stored pairs are visited (a dynamic trip count), so an early iteration does not
    pay for a mostly empty history of 100 pairs.
    """
    history_size = rho.shape[0]
    n = jnp.minimum(num_pairs, history_size)
    newest = num_pairs - 1

    def pair(i):  # i = 0 is the newest pair, read in the gradients' (compute) dtypes
        idx = (newest - i) % history_size
        take = lambda h, g: jax.lax.dynamic_index_in_dim(h, idx, keepdims=False).astype(g.dtype)
        return (
            jax.tree.map(take, s_history, grads),
            jax.tree.map(take, y_history, grads),
            rho[idx],
        )

    def newest_to_oldest(i, carry):
        q, alphas = carry
        s, y, r = pair(i)
        alpha = r * _vdot(s, q, rho.dtype)
        return _axpy(-alpha, y, q), alphas.at[i].set(alpha)

    q, alphas = jax.lax.fori_loop(0, n, newest_to_oldest, (grads, jnp.zeros_like(rho)))
    r = jax.tree.map(lambda x: h_diag.astype(x.dtype) * x, q)

    def oldest_to_newest(j, r):
        i = n - 1 - j
        s, y, rho_i = pair(i)
        beta = rho_i * _vdot(y, r, rho.dtype)
        return _axpy(alphas[i] - beta, s, r)

    return jax.lax.fori_loop(0, n, oldest_to_newest, r)


def _check_trees(updates: Any, state: ScaleByLBFGSState, params: Any) -> None:
    """The gradients and every tree of the memory against the parameters' tree and shapes."""
    check_gradients("lbfgs", updates, params)
    for name in ("prev_params", "prev_grads"):
        check_tree_like("lbfgs", f"state.{name}", getattr(state, name), "params", params)
    for name in ("s_history", "y_history"):
        # Each of the history_size rows is one step shaped like the parameters.
        rows = jax.tree.map(
            lambda h: jax.ShapeDtypeStruct(h.shape[1:], h.dtype), getattr(state, name)
        )
        check_tree_like("lbfgs", f"state.{name}[i]", rows, "params", params)


def _refuse_complex(what: str, tree: Any) -> None:
    """A TypeError naming the first complex leaf, and what to pass instead."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"lbfgs: {what} {jax.tree_util.keystr(path)} has dtype={dtype}: L-BFGS takes "
                "real parameters only. torch.optim.LBFGS optimizes a complex parameter as its "
                "real view; do the same: optimize jnp.stack([z.real, z.imag], axis=-1) and "
                "rebuild z = jax.lax.complex(x[..., 0], x[..., 1]) in the loss."
            )


@static_arguments("history_size", "history_dtype")
def scale_by_lbfgs(
    history_size: int = 100,
    *,
    tolerance_grad: float | jax.Array = 1e-7,
    tolerance_change: float | jax.Array = 1e-9,
    history_dtype: DTypeLike | None = None,
) -> optax.GradientTransformation:
    """Multiplies gradients by torch's L-BFGS inverse-Hessian approximation.

    With ``x_k`` the parameters and ``g_k`` the incoming gradients at iteration ``k``::

        s = x_k - x_{k-1};  y = g_k - g_{k-1}
        if y.s > 1e-10:  store (s, y), dropping the oldest past history_size;  gamma = s.y / y.y
        u = H_k g_k                      (two-loop recursion, H_0 = gamma I, gamma = 1 at first)
        u = min(1, 1 / |g_0|_1) g_0      at k = 0 (torch's first step size)
        u = 0, state unchanged           if max|g_k| <= tolerance_grad (torch returns early)
        u = 0                            if -g_k.H_k g_k > -tolerance_change (no descent)

    The output is a positive multiple of the gradient's preconditioned direction; chain it with
    ``optax.scale_by_learning_rate`` (which flips the sign) and a line search, as ``lbfgs``
    does. ``s`` is measured from the parameters passed to ``update``, so whatever later
    transforms did to the step is what the memory sees.

    Args:
      history_size: number of (s, y) pairs kept, torch's ``history_size``.
      tolerance_grad: the update is zero once the gradient's largest magnitude is at most this.
      tolerance_change: the update is zero when the directional derivative ``g.d`` is above
        ``-tolerance_change`` (torch's "directional derivative below tolerance").
      history_dtype: storage dtype of the stored pairs and the previous iterate and gradient,
        e.g. ``jnp.float32`` for bf16 parameters; None keeps each parameter's dtype. Each
        update is computed in the wider of this and the gradient's dtype and returned in the
        parameter's dtype.

    Returns:
      An ``optax.GradientTransformation`` with a ``ScaleByLBFGSState``; ``update`` needs
      ``params``. Outputs have the parameters' dtypes.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import rudax.optim as ro
      >>> tx = optax.chain(ro.scale_by_lbfgs(history_size=5), optax.scale(-0.5))
      >>> params = jnp.array([1.0, -2.0])
      >>> state = tx.init(params)
      >>> updates, state = tx.update(2.0 * params, state, params)
      >>> print(updates)
      [-0.16666667  0.33333334]

    References:
      Nocedal and Wright, Numerical Optimization, 2nd ed., 2006, Algorithms 7.4 and 7.5.
      torch.optim.LBFGS, https://pytorch.org/docs/stable/generated/torch.optim.LBFGS.html
    """
    check_not_injected(
        "scale_by_lbfgs", dict(history_size=history_size, history_dtype=history_dtype)
    )
    check_positive_int("history_size", history_size)
    check_non_negative("tolerance_grad", tolerance_grad)
    check_non_negative("tolerance_change", tolerance_change)
    float_dtype("history_dtype", history_dtype, none_in_message=True)

    def init_fn(params: optax.Params) -> ScaleByLBFGSState:
        # optax.tree.map_params initializes on a stand-in for the parameters, a pytree without
        # leaves, to find the state's parameter-shaped trees; only a real empty tree is refused.
        stand_in = type(params).__name__ == "_ParamsPlaceholder"
        if not jax.tree.leaves(params) and not stand_in:
            raise ValueError(f"lbfgs: params has no array leaves, got params={params!r}")
        _refuse_complex("parameter", params)
        check_floating_leaves("lbfgs: parameter", params)
        dtype = lambda p: jnp.result_type(p) if history_dtype is None else history_dtype
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), dtype(p)), params)
        stacked = jax.tree.map(lambda x: jnp.zeros((history_size, *x.shape), x.dtype), zeros)
        scalar_dtype = _scalar_dtype(zeros)
        return ScaleByLBFGSState(
            count=jnp.zeros((), jnp.int32),
            stopped=jnp.zeros((), jnp.bool_),
            prev_params=zeros,
            prev_grads=zeros,
            s_history=stacked,
            y_history=stacked,
            rho=jnp.zeros((history_size,), scalar_dtype),
            num_pairs=jnp.zeros((), jnp.int32),
            h_diag=jnp.ones((), scalar_dtype),
        )

    def update_fn(
        updates: optax.Updates, state: ScaleByLBFGSState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ScaleByLBFGSState]:
        if params is None:
            raise ValueError("lbfgs: update needs params (the memory stores parameter steps)")
        _refuse_complex("gradient", updates)
        _refuse_complex("parameter", params)
        check_floating_leaves("lbfgs: gradient", updates)
        _check_trees(updates, state, params)
        # The moment-dtype rule of rudax/optim/_precision.py: the memory keeps its dtype, each
        # leaf is computed in the wider of it and the gradient's, updates take the parameters'.
        dtypes = jax.tree.map(
            lambda g, h: compute_dtype(jnp.result_type(g), h.dtype), updates, state.prev_grads
        )
        widen = lambda tree: jax.tree.map(lambda x, d: jnp.asarray(x).astype(d), tree, dtypes)
        to_memory = lambda tree: jax.tree.map(
            lambda x, h: x.astype(h.dtype), tree, state.prev_grads
        )
        to_params = lambda tree: jax.tree.map(
            lambda u, p: u.astype(jnp.result_type(p)), tree, params
        )
        grads = widen(updates)
        dtype = state.rho.dtype
        g_inf = jnp.max(
            jnp.stack([jnp.max(jnp.abs(g)).astype(dtype) for g in jax.tree.leaves(grads)])
        )
        converged = g_inf <= jnp.asarray(tolerance_grad, dtype)

        def stop(state):
            zeros = to_params(jax.tree.map(jnp.zeros_like, grads))
            return zeros, state._replace(stopped=jnp.ones((), jnp.bool_))

        def iterate(state):
            x = widen(params)
            s = jax.tree.map(jnp.subtract, x, widen(state.prev_params))
            y = jax.tree.map(jnp.subtract, grads, widen(state.prev_grads))
            ys = _vdot(y, s, dtype)
            accept = (state.count > 0) & (ys > _MIN_CURVATURE)
            slot = state.num_pairs % history_size
            write = lambda h, v: h.at[slot].set(jnp.where(accept, v.astype(h.dtype), h[slot]))
            s_history = jax.tree.map(write, state.s_history, s)
            y_history = jax.tree.map(write, state.y_history, y)
            rho = write(state.rho, 1.0 / jnp.where(accept, ys, 1.0))
            h_diag = jnp.where(accept, ys / _vdot(y, y, dtype), state.h_diag)
            num_pairs = state.num_pairs + accept.astype(jnp.int32)

            direction = _two_loop(grads, s_history, y_history, rho, h_diag, num_pairs)
            # torch's gtd = g.d with d = -H g, before any step size.
            no_descent = -_vdot(grads, direction, dtype) > -jnp.asarray(tolerance_change, dtype)
            g_l1 = sum(jnp.sum(jnp.abs(g)).astype(dtype) for g in jax.tree.leaves(grads))
            first_scale = jnp.where(state.count == 0, jnp.minimum(1.0, 1.0 / g_l1), 1.0)
            scale = jnp.where(no_descent, 0.0, first_scale).astype(dtype)
            out = to_params(jax.tree.map(lambda d: scale.astype(d.dtype) * d, direction))
            return out, ScaleByLBFGSState(
                count=state.count + 1,
                stopped=no_descent,
                prev_params=to_memory(x),
                prev_grads=to_memory(grads),
                s_history=s_history,
                y_history=y_history,
                rho=rho,
                num_pairs=num_pairs,
                h_diag=h_diag,
            )

        return jax.lax.cond(converged, stop, iterate, state)

    # Called eagerly, the loops and the cond above would be traced and compiled anew on every
    # update; under an outer jit this inner one is inlined and costs nothing.
    return optax.GradientTransformation(init_fn, jax.jit(update_fn))


@static_arguments("history_size", "line_search", "max_linesearch_steps", "history_dtype")
def lbfgs(
    learning_rate: optax.ScalarOrSchedule = 1.0,
    *,
    history_size: int = 100,
    line_search: str | None = "strong_wolfe",
    c1: float | jax.Array = 1e-4,
    c2: float | jax.Array = 0.9,
    max_linesearch_steps: int = 25,
    tolerance_grad: float | jax.Array = 1e-7,
    tolerance_change: float | jax.Array = 1e-9,
    history_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
    """L-BFGS as ``torch.optim.LBFGS``, one iteration per ``update``, with a strong-Wolfe search.

    Each ``update`` is one iteration of torch's inner loop::

        d = -H g                 (scale_by_lbfgs: two-loop recursion over the stored pairs)
        t0 = lr, and min(1, 1 / |g|_1) lr at the first iteration
        t = strong-Wolfe line search along d from t0     (line_search="strong_wolfe")
        t = t0                                           (line_search=None)
        update = t d

    and is zero when ``max|g| <= tolerance_grad`` or ``g.d > -tolerance_change``.

    How the loss is passed: as in ``optax.lbfgs``, the line search evaluates the objective
    itself, so ``update`` takes ``value`` and ``grad`` at ``params`` and ``value_fn``, the loss
    as a function of the parameters; any other keyword argument is passed on to ``value_fn``
    (a batch, say: ``value_fn(params, batch=batch)``). For a deterministic objective,
    ``optax.value_and_grad_from_state(value_fn)(params, state=opt_state)`` reuses the value and
    gradient the line search computed at the new parameters instead of recomputing them. With
    ``line_search=None`` the update needs only the gradients, like any optax optimizer.

    torch's ``step(closure)`` runs up to ``max_iter=20`` iterations; here one call is one
    iteration, so ``max_iter`` iterations are a loop over ``update`` (see the example). Once the
    gradient is below ``tolerance_grad`` every further update is zero, so a fixed-length loop
    stops moving where torch's would exit. ``optax.tree.get(opt_state, "stopped")`` says
    whether the last update was zero for either tolerance.

    Differences from torch: the default ``line_search`` is ``"strong_wolfe"`` (torch's is None,
    a fixed step ``lr``); torch's loop exits on a small loss or
    parameter change (``tolerance_change``) and on ``max_eval`` have no counterpart, since
    there is no inner loop; the line search is optax's zoom search (see
    ``scale_by_strong_wolfe`` for how it differs from torch's). Differences from
    ``optax.lbfgs``: pairs with curvature ``y.s <= 1e-10`` are not stored, the first step is
    scaled by the L1 rather than the L2 norm, and the defaults are torch's (``history_size=100``).

    Args:
      learning_rate: the step length tried first (torch's ``lr``), a float or a schedule.
      history_size: number of (s, y) pairs kept.
      line_search: ``"strong_wolfe"`` or None (fixed step ``learning_rate``).
      c1: sufficient-decrease constant of the line search, in (0, 1).
      c2: curvature constant of the line search, in (c1, 1).
      max_linesearch_steps: most objective evaluations per line search.
      tolerance_grad: the update is zero once ``max|g| <= tolerance_grad``.
      tolerance_change: the update is zero when ``g.d > -tolerance_change``.
      history_dtype: storage dtype of the L-BFGS memory, e.g. ``jnp.float32`` for bf16
        parameters; None keeps each parameter's dtype (see ``scale_by_lbfgs``).

    Returns:
      An ``optax.GradientTransformationExtraArgs``: ``update(grads, state, params, *, value,
      grad, value_fn, **fn_kwargs)`` with the line search, ``update(grads, state, params)``
      without. Parameters must be real: a complex leaf is a TypeError naming its path (torch's
      LBFGS optimizes a complex parameter as its real view; pass that view instead). Under
      ``inject_hyperparams`` the floats (``learning_rate``, ``c1``, ``c2``, the tolerances) may
      be injected; ``history_size``, ``line_search``, ``max_linesearch_steps`` and
      ``history_dtype`` shape the program and are static (``rudax.optim.inject_hyperparams``
      knows them; pass them as ``static_args`` to ``optax.inject_hyperparams``).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import rudax.optim as ro
      >>> def loss(x):  # Rosenbrock
      ...     return (1.0 - x[0]) ** 2 + 100.0 * (x[1] - x[0] ** 2) ** 2
      >>> tx = ro.lbfgs()
      >>> value_and_grad = optax.value_and_grad_from_state(loss)
      >>> @jax.jit
      ... def step(x, opt_state):  # torch's step(closure) with max_iter=20
      ...     def body(_, carry):
      ...         x, opt_state = carry
      ...         value, grad = value_and_grad(x, state=opt_state)
      ...         updates, opt_state = tx.update(
      ...             grad, opt_state, x, value=value, grad=grad, value_fn=loss
      ...         )
      ...         return optax.apply_updates(x, updates), opt_state
      ...     return jax.lax.fori_loop(0, 20, body, (x, opt_state))
      >>> x = jnp.array([-1.2, 1.0])
      >>> opt_state = tx.init(x)
      >>> for _ in range(3):
      ...     x, opt_state = step(x, opt_state)
      >>> print(jnp.round(x, 4))
      [1. 1.]

    References:
      Liu and Nocedal, On the limited memory BFGS method for large scale optimization,
      Mathematical Programming 45, 1989.
      Nocedal and Wright, Numerical Optimization, 2nd ed., 2006, Algorithms 3.5, 3.6, 7.4, 7.5.
      torch.optim.LBFGS, https://pytorch.org/docs/stable/generated/torch.optim.LBFGS.html
    """
    check_not_injected(
        "lbfgs",
        dict(
            history_size=history_size,
            max_linesearch_steps=max_linesearch_steps,
            history_dtype=history_dtype,
        ),
    )
    check_learning_rate(learning_rate)
    if line_search not in _LINE_SEARCHES:
        raise ValueError(f"line_search must be 'strong_wolfe' or None, got {line_search=}")
    # Checked even without a line search, so a typo is caught before it is switched on.
    check_wolfe_constants(c1, c2)
    check_positive_int("max_linesearch_steps", max_linesearch_steps)
    transforms = [
        scale_by_lbfgs(
            history_size,
            tolerance_grad=tolerance_grad,
            tolerance_change=tolerance_change,
            history_dtype=history_dtype,
        ),
        scale_by_learning_rate(learning_rate),
    ]
    if line_search == "strong_wolfe":
        transforms.append(scale_by_strong_wolfe(c1, c2, max_linesearch_steps=max_linesearch_steps))
    return optax.chain(*transforms)
