"""One check that an optimizer factory works under ``inject_hyperparams``, optax's and rudax's.

``assert_injectable(factory, kwargs, params, ...)`` wraps ``factory`` in
``optax.inject_hyperparams(factory, static_args=...)`` and in ``rudax.optim.inject_hyperparams``
and asserts, for each wrapper:

* every float hyperparameter in ``kwargs`` (given or defaulted) is in ``state.hyperparams``,
  as float32, with its value; the structural arguments are not;
* the injected state has the plain optimizer's structure (``inner_state``);
* three jitted updates equal the plain optimizer's, bit for bit unless ``rtol`` is given
  (then relative to each leaf's largest element, see ``assert_trees_equal``);
* setting each float hyperparameter in the state to a new value changes the updates (so no
  hyperparameter is injected and then ignored), a new learning rate gives the updates of the
  plain optimizer built with it, and none of these changes recompiles the jitted update (one
  compilation in all).

The problem is ``0.5 |p - c|**2`` summed over the leaves, its gradients from ``jax.grad``;
``line_search=True`` passes L-BFGS's ``value``, ``grad`` and ``value_fn`` to ``update``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import rudax.optim as ro
from rudax.optim._inject import declared_static_arguments


def centers(params: Any) -> Any:
    """Fixed targets, one per leaf, a different value per element."""
    return jax.tree.map(
        lambda p: (jnp.cos(jnp.arange(p.size, dtype=jnp.float32) + 1.0).reshape(p.shape)).astype(
            p.dtype
        ),
        params,
    )


def loss(params: Any, targets: Any) -> jax.Array:
    terms = jax.tree.map(
        lambda p, c: 0.5 * jnp.sum(jnp.square((p - c).astype(jnp.float32))), params, targets
    )
    return sum(jax.tree.leaves(terms), jnp.zeros((), jnp.float32))


def make_step(
    tx: optax.GradientTransformation,
    targets: Any,
    *,
    line_search: bool,
    objective: Callable[[Any, Any], jax.Array] = loss,
) -> Callable:
    """A jitted ``(params, state) -> (params, state, updates)`` on ``objective(p, targets)``."""
    value_fn = lambda p: objective(p, targets)

    @jax.jit
    def step(params, state):
        value, grads = jax.value_and_grad(value_fn)(params)
        extra = dict(value=value, grad=grads, value_fn=value_fn) if line_search else {}
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state, updates

    return step


def run(step: Callable, params: Any, state: Any, num_steps: int) -> tuple[list, Any]:
    """num_steps updates: (the updates of each, the final state)."""
    trajectory = []
    for _ in range(num_steps):
        params, state, updates = step(params, state)
        trajectory.append(updates)
    return trajectory, state


def float_hyperparameters(factory: Callable, kwargs: dict[str, Any]) -> dict[str, float]:
    """The arguments of ``factory(**kwargs)`` that are Python floats, defaults included."""
    bound = inspect.signature(factory).bind(**kwargs)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if isinstance(v, float)}


def assert_trees_equal(got: Any, want: Any, *, rtol: float | None, what: str) -> None:
    """Leaf by leaf: the same dtype and bits, or with ``rtol``, ``max|a - b| <= rtol max|b|``.

    Norm-wise, not elementwise: an update element that is the difference of two larger terms
    (Adam's ``m / c1`` against the decay, say) has a relative error the terms' rounding
    amplifies, while the error relative to the leaf's scale stays at the coefficients' own.
    """
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        msg = f"{what}{jax.tree_util.keystr(path)}"
        assert a.dtype == b.dtype, f"{msg}: {a.dtype} != {b.dtype}"
        if rtol is None or not np.issubdtype(a.dtype, np.inexact) or a.size == 0:
            np.testing.assert_array_equal(a, b, err_msg=msg)
            continue
        a64, b64 = a.astype(np.complex128), b.astype(np.complex128)
        error, scale = np.max(np.abs(a64 - b64)), np.max(np.abs(b64))
        assert np.all(np.isfinite(a64) == np.isfinite(b64)), msg
        assert error <= rtol * scale, f"{msg}: max|a - b| = {error:.3g} > {rtol} * {scale:.3g}"


def wrappers(factory: Callable, optax_static_args: Sequence[str]) -> dict[str, Callable]:
    return {
        "optax": optax.inject_hyperparams(factory, static_args=tuple(optax_static_args)),
        "rudax": ro.inject_hyperparams(factory),
    }


def assert_injectable(
    factory: Callable,
    kwargs: dict[str, Any],
    params: Any,
    *,
    optax_static_args: Sequence[str],
    new_values: dict[str, float],
    rtol: float | None = None,
    line_search: bool = False,
    objective: Callable[[Any, Any], jax.Array] = loss,
    inert: Sequence[str] = (),
    num_steps: int = 3,
) -> None:
    """The checks in the module docstring; ``new_values`` gives each float's second value.

    ``inert`` names floats that this configuration does not use (L-BFGS's line-search
    constants without a line search): they are injected, read back and equal, but need not
    change the updates. ``objective(params, targets)`` replaces the quadratic.
    """
    targets = centers(params)
    make = lambda tx: make_step(tx, targets, line_search=line_search, objective=objective)
    floats = float_hyperparameters(factory, kwargs)
    assert set(new_values) == set(floats), (sorted(new_values), sorted(floats))
    plain_run = lambda **kw: run(
        make(factory(**kw)),
        params,
        factory(**kw).init(params),
        num_steps,
    )
    plain_updates, plain_state = plain_run(**kwargs)
    # The plain optimizer with the learning rate changed: two updates, as the injected run
    # below. Only the learning rate, the value users change at run time: a plain optimizer
    # per float (ten for Muon) was a compilation each, over two minutes of CI. Every other
    # float is still read back and must change the updates.
    plain_changed = {
        key: plain_run(**{**kwargs, key: v})[0][:2]
        for key, v in new_values.items()
        if key == "learning_rate"
    }
    for name, wrap in wrappers(factory, optax_static_args).items():
        tx = wrap(**kwargs)
        state = tx.init(params)
        hyper = state.hyperparams
        for key, value in floats.items():
            assert key in hyper, f"{name}: {key} not injected: {sorted(hyper)}"
            assert hyper[key].dtype == jnp.float32, f"{name}: {key} is {hyper[key].dtype}"
            assert float(hyper[key]) == float(np.float32(value)), (name, key, hyper[key])
        static = set(optax_static_args) | set(declared_static_arguments(factory))
        assert not static & set(hyper), f"{name}: structural {sorted(static & set(hyper))}"
        plain_tree = jax.tree.structure(factory(**kwargs).init(params))
        assert jax.tree.structure(state.inner_state) == plain_tree, name

        step = make(tx)
        got_updates, got_state = run(step, params, state, num_steps)
        assert_trees_equal(got_updates, plain_updates, rtol=rtol, what=f"{name}: updates")
        assert_trees_equal(
            got_state.inner_state, plain_state, rtol=rtol, what=f"{name}: inner_state"
        )

        for key, value in new_values.items():
            changed = state._replace(
                hyperparams={**state.hyperparams, key: jnp.asarray(value, jnp.float32)}
            )
            got, got_state = run(step, params, changed, 2)
            assert float(got_state.hyperparams[key]) == float(np.float32(value)), (name, key)
            if key in plain_changed:
                want = plain_changed[key]
                assert_trees_equal(got, want, rtol=rtol, what=f"{name}: {key}={value}: updates")
            if key in inert:
                continue
            # The value is used: the updates differ from those with the first value.
            before = jax.tree.leaves(plain_updates[:2])
            assert any(
                not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), before, strict=True)
            ), f"{name}: setting {key}={value} changed nothing"
        assert step._cache_size() == 1, f"{name}: {step._cache_size()} compilations"


def assert_bf16_keeps_fp32_hyperparameters(
    factory: Callable,
    kwargs: dict[str, Any],
    params: Any,
    *,
    rtol: float | None = None,
    line_search: bool = False,
    objective: Callable[[Any, Any], jax.Array] = loss,
) -> None:
    """rudax.optim.inject_hyperparams on bf16 params: fp32 hyperparameters, plain updates."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    targets = centers(params)
    make = lambda tx: make_step(tx, targets, line_search=line_search, objective=objective)
    tx = ro.inject_hyperparams(factory)(**kwargs)
    state = tx.init(params)
    for key, value in state.hyperparams.items():
        if jnp.issubdtype(value.dtype, jnp.floating):
            assert value.dtype == jnp.float32, f"{key}: {value.dtype}"
    got, got_state = run(make(tx), params, state, 2)
    for key in float_hyperparameters(factory, kwargs):
        assert got_state.hyperparams[key].dtype == jnp.float32, key
    plain = factory(**kwargs)
    want, _ = run(make(plain), params, plain.init(params), 2)
    assert_trees_equal(got, want, rtol=rtol, what="bf16 updates")
