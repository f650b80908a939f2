"""A strong-Wolfe line search for quasi-Newton directions, on optax's zoom line search.

optax's ``scale_by_zoom_linesearch`` is Nocedal and Wright's bracketing-and-zoom search, the
algorithm family of torch's ``_strong_wolfe``; here it accepts steps by the strong Wolfe
conditions, with the approximate decrease test of Hager and Zhang only where fp32 cannot tell
values apart. This module adds what a torch user expects around
it: a direction that is zero or not a descent direction (L-BFGS has converged, or its gradient
changed sign under the search) takes no step and costs no function evaluation, and missing
extra arguments fail with an error that says how to pass them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from rudax._validation import check_in_range, check_positive_int
from rudax.optim._inject import check_not_injected, static_arguments
from rudax.optim._precision import as_weak, compute_dtype
from rudax.optim._validation import check_gradients, check_tree_like

# Near a minimum, f(x + t u) - f(x) drops below the objective's rounding error (about 1e-7 |f|
# in fp32) before the gradient does, and an exact sufficient-decrease test then rejects every
# step: the iterates stall at a distance of about sqrt(eps) from the minimiser. Within this
# relative band around f(x), Hager and Zhang's approximate test on the slope replaces it.
_APPROX_DECREASE_RTOL = 1e-6


def check_wolfe_constants(c1: Any, c2: Any) -> None:
    """0 < c1 < c2 < 1: otherwise no step need satisfy both strong Wolfe conditions.

    A traced constant (``optax.inject_hyperparams`` under ``jit``) cannot be compared; the
    check then holds at ``init``, where the injected values are concrete.
    """
    low = check_in_range("c1", c1, 0.0, 1.0, low_inclusive=False)
    high = check_in_range("c2", c2, 0.0, 1.0, low_inclusive=False)
    if low is not None and high is not None and not low < high:
        raise ValueError(f"c2 must be larger than c1, got {c1=}, {c2=}")


def _vdot(a: Any, b: Any) -> jax.Array:
    """g.u in fp32: only its sign is used, to decide whether to search at all."""
    terms = jax.tree.map(
        lambda x, y: jnp.vdot(x.astype(jnp.float32), jnp.asarray(y).astype(jnp.float32)), a, b
    )
    return sum(jax.tree.leaves(terms), jnp.zeros((), jnp.float32))


@static_arguments("max_linesearch_steps")
def scale_by_strong_wolfe(
    c1: float | jax.Array = 1e-4,
    c2: float | jax.Array = 0.9,
    *,
    max_linesearch_steps: int = 25,
) -> optax.GradientTransformationExtraArgs:
    """Scales a descent direction ``u`` by a step ``t`` satisfying the strong Wolfe conditions.

    With ``f`` the objective, ``x`` the parameters and ``g = grad f(x)``, the returned update is
    ``t u`` with, when the search succeeds::

        f(x + t u) <= f(x) + c1 t g.u                      (sufficient decrease)
        |grad f(x + t u).u| <= c2 |g.u|                    (strong curvature)

    Where the new value is within ``1e-6 |f(x)|`` of ``f(x)``, too close for fp32 to resolve
    the decrease, sufficient decrease may instead be Hager and Zhang's approximate test
    ``grad f(x + t u).u <= (1 - 2 c1) |g.u|`` (torch gets a similar tolerance from rounding
    ``f + c1 t g.d`` to fp32). Without it, fp32 runs stall about sqrt(eps) from the minimum.

    The search tries ``t = 1`` first, doubles ``t`` until it brackets an acceptable step, then
    zooms in by cubic (else quadratic, else bisection) interpolation: optax's
    ``scale_by_zoom_linesearch`` with ``slope_rtol=c1``, ``curv_rtol=c2``,
    ``approx_dec_rtol=1e-6`` and initial guess 1. It gives up after ``max_linesearch_steps``
    evaluations, or when the bracket is shorter than 1e-5 (in units of ``t``) and some trial
    had sufficient decrease; it then takes a trial with sufficient decrease if there was one,
    else the last trial, and no step if every trial was non-finite.
    If ``g.u >= 0`` (a zero direction included) or is NaN, the update is zero, ``f`` is not
    evaluated, and the state records ``value`` and ``grad`` at ``x``.

    Differences from torch's ``_strong_wolfe``: torch extrapolates by cubic interpolation in
    ``[t + 0.01 (t - t_prev), 10 t]`` instead of doubling, zooms by a two-point cubic with a
    10% boundary safeguard, stops when ``|bracket| * max|u| < tolerance_change``, and on
    failure returns the bracket's lowest point.

    Args:
      c1: sufficient-decrease constant, in (0, 1).
      c2: curvature constant, in (c1, 1).
      max_linesearch_steps: most objective evaluations per search.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is optax's
      ``ScaleByZoomLinesearchState``. ``update(updates, state, params, *, value, grad,
      value_fn, **fn_kwargs)`` takes the objective's value and gradient at ``params``, the
      objective ``value_fn(params, **fn_kwargs) -> scalar``, and its extra inputs. The state's
      ``value`` and ``grad`` are at the new parameters, for ``optax.value_and_grad_from_state``.
      For bf16 or fp16 parameters the search (its step ``t``, the values and slopes) runs in
      float32 and ``value_fn`` is evaluated at the trial points rounded to the parameters'
      dtypes; the state's ``grad`` keeps the parameters' dtypes.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import rudax.optim as ro
      >>> f = lambda x: jnp.sum((x - 3.0) ** 2)
      >>> tx = optax.chain(optax.scale(-1.0), ro.scale_by_strong_wolfe())
      >>> x = jnp.zeros(2)
      >>> state = tx.init(x)
      >>> value, grad = jax.value_and_grad(f)(x)
      >>> updates, state = tx.update(grad, state, x, value=value, grad=grad, value_fn=f)
      >>> print(x + updates)
      [3. 3.]

    References:
      Nocedal and Wright, Numerical Optimization, 2nd ed., 2006, Algorithms 3.5 and 3.6.
      Hager and Zhang, A new conjugate gradient method with guaranteed descent and an efficient
      line search, SIAM J. Optim. 16(1), 2005 (the approximate Wolfe conditions).
    """
    check_not_injected("scale_by_strong_wolfe", dict(max_linesearch_steps=max_linesearch_steps))
    check_wolfe_constants(c1, c2)
    check_positive_int("max_linesearch_steps", max_linesearch_steps)
    zoom = optax.scale_by_zoom_linesearch(
        max_linesearch_steps=max_linesearch_steps,
        slope_rtol=as_weak(c1),
        curv_rtol=as_weak(c2),
        approx_dec_rtol=_APPROX_DECREASE_RTOL,
        initial_guess_strategy="one",
    )

    def init_fn(params: optax.Params) -> Any:
        # The search's step and value in float32 for bf16 and fp16 parameters, its stored
        # gradient in the parameters' dtypes (what optax.value_and_grad_from_state returns).
        wide = _widen(params)
        if not jax.tree.leaves(wide):
            # optax.tree.map_params's stand-in for the parameters, a pytree without leaves:
            # optax's init would read the first leaf's dtype. The stand-in marks ``grad``.
            stand_in: Any = zoom.init(jnp.zeros((), jnp.float32))
            return stand_in._replace(grad=params)
        state: Any = zoom.init(wide)
        return state._replace(grad=optax.tree.cast_like(state.grad, params))

    def update_fn(
        updates: optax.Updates,
        state: Any,
        params: optax.Params | None = None,
        *,
        value: jax.Array | None = None,
        grad: optax.Updates | None = None,
        value_fn: Callable[..., jax.Array] | None = None,
        **fn_kwargs: Any,
    ) -> tuple[optax.Updates, Any]:
        given = {"params": params, "value": value, "grad": grad, "value_fn": value_fn}
        missing = [name for name, v in given.items() if v is None]
        if missing:
            raise TypeError(
                f"the strong-Wolfe line search needs {missing} in update: call "
                "tx.update(grads, state, params, value=loss, grad=grads, value_fn=loss_fn, "
                "**loss_fn_kwargs), or build lbfgs with line_search=None"
            )
        objective = cast(Callable[..., jax.Array], value_fn)  # not None: checked above
        check_gradients("scale_by_strong_wolfe", updates, params)
        check_tree_like("scale_by_strong_wolfe", "grad", grad, "params", params)
        slope = _vdot(updates, grad)

        def search(state):
            # optax's search keeps its step and value in the first parameter's dtype and mixes
            # them with the others: bf16 steps, and a promotion strict mode refuses. It runs on
            # the parameters, direction and gradient widened to float32 instead, and evaluates
            # the objective at the trial points rounded back to the parameters' dtypes.
            narrow = _widen(params) is not params
            fn = _at_stored_dtypes(objective, params) if narrow else objective
            wide_value = jnp.asarray(value).astype(state.value.dtype)
            new_updates, new_state = zoom.update(
                _widen(updates), state, _widen(params), value=wide_value, grad=_widen(grad),
                value_fn=fn, **fn_kwargs,
            )  # fmt: skip
            searched: Any = new_state  # optax types it as any OptState
            new_state = searched._replace(grad=optax.tree.cast_like(searched.grad, state.grad))
            return optax.tree.cast_like(new_updates, updates), new_state

        def skip(state):
            new_state = state._replace(
                learning_rate=jnp.zeros_like(state.learning_rate),
                value=jnp.asarray(value).astype(state.value.dtype),
                grad=optax.tree.cast_like(grad, state.grad),
                info=state.info._replace(
                    num_linesearch_steps=jnp.zeros_like(state.info.num_linesearch_steps)
                ),
            )
            return jax.tree.map(jnp.zeros_like, updates), new_state

        return jax.lax.cond(slope < 0.0, search, skip, state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _widen(tree: Any) -> Any:
    """Each leaf in the wider of its dtype and float32; ``tree`` itself if none is narrower."""
    leaves, treedef = jax.tree.flatten(tree)
    wide = [jnp.asarray(x).astype(compute_dtype(jnp.result_type(x), jnp.float32)) for x in leaves]
    if all(w.dtype == jnp.result_type(x) for w, x in zip(wide, leaves, strict=True)):
        return tree
    return jax.tree.unflatten(treedef, wide)


def _at_stored_dtypes(value_fn: Callable[..., jax.Array], params: Any) -> Callable[..., jax.Array]:
    """value_fn of the widened parameters, rounded back to the dtypes of ``params``.

    ``functools.wraps`` keeps ``value_fn``'s signature, from which optax picks the extra
    keyword arguments that are the objective's.
    """

    @functools.wraps(value_fn)
    def fn(wide: Any, **kwargs: Any) -> jax.Array:
        return value_fn(optax.tree.cast_like(wide, params), **kwargs)

    return fn
