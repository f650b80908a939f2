"""One harness that runs any optimizer against a plain numpy reference.

A reference is written in the test as a per-leaf numpy loop::

    def reference(p0: np.ndarray, grads: list[np.ndarray]) -> list[np.ndarray]:
        '''Returns the parameters after each of len(grads) updates.'''

The harness builds a pytree of several shapes (matrix, vector, scalar, a nested 3-D leaf),
feeds the same fixed gradient sequence to the optax-style transformation and to the
reference, and compares the parameter trajectories step by step, with and without jit, as a
nested dict and as a ``flax.nnx.State``. With jit it also asserts that the second and later
updates reuse the first compilation.

``assert_bf16_update`` is the shared check of the moment-dtype rule (``rudax/optim/_precision.py``)
on bf16 parameters; ``RUNS`` and ``halving`` are the run modes and the schedule the optimizer
tests share.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

Reference = Callable[[np.ndarray, list[np.ndarray]], list[np.ndarray]]
ExpectedUpdate = Callable[[dict, dict], dict]

RUNS = [
    pytest.param(True, "dict", id="jit-dict"),
    pytest.param(False, "dict", id="eager-dict"),
    pytest.param(True, "nnx_state", id="jit-nnx"),
    pytest.param(False, "nnx_state", id="eager-nnx"),
]


def halving(count):
    """0.1, halved every 2 updates; jnp only, so it runs under strict promotion."""
    return 0.1 * 0.5 ** (count // 2).astype(jnp.float32)


def rate(learning_rate, count: int) -> float:
    """A reference's learning rate at the 0-based update count: ``halving``'s, or the number."""
    return 0.1 * 0.5 ** (count // 2) if learning_rate is halving else learning_rate


SHAPES = {
    "dense": {"kernel": (5, 3), "bias": (3,)},
    "scale": (),
    "deep": {"block": {"w": (2, 3, 4)}},
}


def make_problem(num_steps: int, *, seed: int = 0, shapes=SHAPES) -> tuple[dict, list[dict]]:
    """Fixed fp32 parameters and a fixed sequence of gradients, as numpy pytrees."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    params = [rng.normal(size=s).astype(np.float32) for s in leaves]
    grads = [[rng.normal(size=s).astype(np.float32) for s in leaves] for _ in range(num_steps)]
    return (
        jax.tree.unflatten(treedef, params),
        [jax.tree.unflatten(treedef, g) for g in grads],
    )


def as_tree_kind(tree: dict, kind: str):
    if kind == "dict":
        return jax.tree.map(jnp.asarray, tree)
    if kind == "nnx_state":
        return nnx.State(jax.tree.map(jnp.asarray, tree))
    raise ValueError(f"unknown tree kind {kind!r}")


def run_optimizer(
    tx: optax.GradientTransformation,
    params: dict,
    grads: Sequence[dict],
    *,
    jit: bool,
    tree_kind: str = "dict",
) -> list[list[np.ndarray]]:
    """Applies tx for len(grads) updates; returns the flat parameter leaves after each."""
    p = as_tree_kind(params, tree_kind)
    state = tx.init(p)

    def step(p, state, g):
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    step_fn = jax.jit(step) if jit else step
    trajectory = []
    for i, g in enumerate(grads):
        p, state = step_fn(p, state, as_tree_kind(g, tree_kind))
        trajectory.append([np.asarray(x) for x in jax.tree.leaves(p)])
        if jit and i >= 1:
            assert step_fn._cache_size() == 1, (
                f"update recompiled at step {i}: {step_fn._cache_size()} compilations"
            )
    return trajectory


def assert_matches_reference(
    tx: optax.GradientTransformation,
    reference: Reference,
    *,
    num_steps: int = 6,
    jit: bool = True,
    tree_kind: str = "dict",
    rtol: float = 1e-5,
    atol: float = 1e-6,
    seed: int = 0,
    shapes=SHAPES,
) -> None:
    """Asserts tx's parameter trajectory equals the per-leaf numpy reference's."""
    params, grads = make_problem(num_steps, seed=seed, shapes=shapes)
    got = run_optimizer(tx, params, grads, jit=jit, tree_kind=tree_kind)

    paths_and_p0 = jax.tree_util.tree_flatten_with_path(params)[0]
    grad_leaves = [jax.tree.leaves(g) for g in grads]
    for i, (path, p0) in enumerate(paths_and_p0):
        want = reference(p0.copy(), [g[i].copy() for g in grad_leaves])
        assert len(want) == num_steps, f"reference returned {len(want)} steps, not {num_steps}"
        for step in range(num_steps):
            np.testing.assert_allclose(
                got[step][i],
                want[step],
                rtol=rtol,
                atol=atol,
                err_msg=f"{jax.tree_util.keystr(path)} after update {step + 1}",
            )


def first_update(reference: Reference) -> ExpectedUpdate:
    """The first update a per-leaf numpy reference makes, as ``assert_bf16_update`` wants it."""
    return lambda params, grads: jax.tree.map(lambda p, g: reference(p, [g])[0] - p, params, grads)


def assert_bf16_update(
    tx: optax.GradientTransformation,
    expected_update: ExpectedUpdate,
    *,
    grad_dtype=jnp.bfloat16,
    buffer_dtype,
    num_buffers: int,
    rtol: float = 2**-7,
    leaf_atol: float = 0.0,
    shapes=SHAPES,
) -> None:
    """Checks the moment-dtype rule on bf16 parameters over two jitted updates.

    The state's floating leaves are ``num_buffers`` buffers, all in ``buffer_dtype``, before
    and after; every update is bf16; the second update reuses the first compilation; the first
    update equals ``expected_update(params, grads)`` (numpy pytrees of the exact fp32 values of
    the inputs) rounded to bf16, within ``rtol`` and ``leaf_atol`` times the leaf's largest
    expected magnitude.
    """
    params, grads = make_problem(2, shapes=shapes)
    p = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
    g1, g2 = (jax.tree.map(lambda x: jnp.asarray(x, grad_dtype), g) for g in grads)

    def assert_buffers(state) -> None:
        floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
        assert len(floats) == num_buffers, f"{len(floats)} floating buffers, not {num_buffers}"
        assert all(x.dtype == buffer_dtype for x in floats), [x.dtype for x in floats]

    state = tx.init(p)
    assert_buffers(state)
    update = jax.jit(tx.update)
    updates, state = update(g1, state, p)

    as_f32 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
    want = jax.tree.leaves(expected_update(as_f32(p), as_f32(g1)))
    paths_and_updates = jax.tree_util.tree_flatten_with_path(updates)[0]
    for (path, u), w in zip(paths_and_updates, want, strict=True):
        assert u.dtype == jnp.bfloat16, f"{jax.tree_util.keystr(path)}: {u.dtype}"
        w = np.asarray(w).astype(jnp.bfloat16).astype(np.float32)
        np.testing.assert_allclose(
            np.asarray(u, np.float32),
            w,
            rtol=rtol,
            atol=leaf_atol * float(np.max(np.abs(w))),
            err_msg=jax.tree_util.keystr(path),
        )

    updates, state = update(g2, state, optax.apply_updates(p, updates))
    assert update._cache_size() == 1, "the second update recompiled"
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
    assert_buffers(state)


def conditionals(tx, params, grads, *, compiled: bool) -> int:
    """How many conditionals a jitted step of tx holds: jaxpr `cond`s, or compiled HLO ones."""

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    args = (params, tx.init(params), grads)
    if compiled:
        return step.lower(*args).compile().as_text().count("conditional(")
    return len(re.findall(r"\bcond\[", str(jax.make_jaxpr(step)(*args))))


def skip_by_cond(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """A non-finite skip written with lax.cond: the control that `conditionals` can see one."""

    def update(updates, state, params=None):
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(updates)]))

        def apply(updates, state):
            return inner.update(updates, state, params)

        def skip(updates, state):
            shapes, _ = jax.eval_shape(apply, updates, state)
            return jax.tree.map(lambda s: jnp.full(s.shape, -0.0, s.dtype), shapes), state

        return jax.lax.cond(finite, apply, skip, updates, state)

    return optax.GradientTransformation(inner.init, update)


REPLACED_SHAPES = {"dense": {"kernel": (3, 5), "bias": (7,)}, "scale": ()}


def _bit_view(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_follows_replaced_params(
    make_tx: Callable[[float], optax.GradientTransformation], dtype, *, num_steps: int = 5
) -> None:
    """Parameters replaced after ``tx.init`` (loaded weights) are what the optimizer updates.

    ``make_tx(learning_rate)`` builds the optimizer. With the state built on zeros and the
    parameters then replaced: one update at learning rate 0 keeps the replaced values (7.0),
    and ``num_steps`` jitted updates at a small learning rate stay near the replaced values
    and equal, bit for bit, the same updates of an optimizer built on them.
    """
    zeros = jax.tree.map(lambda s: jnp.zeros(s, dtype), REPLACED_SHAPES, is_leaf=_is_shape)
    sevens = jax.tree.map(lambda z: jnp.full_like(z, 7.0), zeros)
    tx = make_tx(0.0)
    updates, state = tx.update(jax.tree.map(jnp.ones_like, zeros), tx.init(zeros), sevens)
    for path, p in jax.tree_util.tree_flatten_with_path(optax.apply_updates(sevens, updates))[0]:
        assert p.dtype == dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.asarray(p, np.float32), 7.0, err_msg=f"{jax.tree_util.keystr(path)} reverted"
        )

    replaced, grads = make_problem(num_steps, seed=5, shapes=REPLACED_SHAPES)
    cast = lambda tree: jax.tree.map(lambda x: jnp.asarray(x + 3.0).astype(dtype), tree)
    replaced, grads = cast(replaced), [cast(g) for g in grads]
    tx = make_tx(1e-3)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    runs = []
    for state in (tx.init(zeros), tx.init(replaced)):  # built before, and after, the load
        params = replaced
        for g in grads:
            params, state = step(params, state, g)
        runs.append(params)
    for (path, p), fresh, p0 in zip(
        jax.tree_util.tree_flatten_with_path(runs[0])[0],
        jax.tree.leaves(runs[1]),
        jax.tree.leaves(replaced),
        strict=True,
    ):
        where = jax.tree_util.keystr(path)
        # Adam's steps are about the learning rate each: within 5e-3 plus rounding of 3 +- 3.
        np.testing.assert_allclose(
            np.asarray(p, np.float32), np.asarray(p0, np.float32), atol=0.1, err_msg=where
        )
        np.testing.assert_array_equal(_bit_view(p), _bit_view(fresh), err_msg=where)


def _is_shape(x) -> bool:
    return isinstance(x, tuple)
