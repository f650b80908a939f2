"""rudax.sharding.collectives on 8 simulated CPU devices, against single-device equivalents.

Each collective runs in ``jax.shard_map`` with ``out_specs=P("data")``, so the 8 ranks' outputs
come back stacked along a new leading axis. The reference builds the same stack on one device
with plain jnp (concatenate, split, index, reduce), and the gradients of ``sum(w * out)`` (a
different cotangent on every rank) are compared with ``jax.grad`` of the reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.sharding as rs

N = 8
C = rs.collectives

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")


def _mesh(kind):
    if kind == "explicit":
        return jax.make_mesh((N,), ("data",))
    return jax.sharding.Mesh(np.array(jax.devices()[:N]), ("data",))


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return _mesh(request.param)


def _per_rank(mesh, fn, *, replicated_input=False, check_vma=True):
    """x -> the ranks' fn outputs stacked on axis 0; x is split on axis 0 unless replicated."""
    if replicated_input:
        body = lambda x: fn(x)[None]
        in_spec = P()
    else:
        body = lambda x_1xS: fn(x_1xS[0])[None]
        in_spec = P("data")
    return jax.shard_map(
        body, mesh=mesh, in_specs=in_spec, out_specs=P("data"), check_vma=check_vma
    )


def _check(mesh, fn, reference, x, *, replicated_input=False, rtol=0.0, check_vma=True):
    """Forward values and gradients of sum(w * out) against the single-device reference."""
    x = jnp.asarray(x)
    sharded = _per_rank(mesh, fn, replicated_input=replicated_input, check_vma=check_vma)
    x_placed = jax.device_put(x, NamedSharding(mesh, P() if replicated_input else P("data")))
    expected = reference(x)
    w = jax.random.normal(jax.random.key(1), expected.shape, expected.dtype)
    w_placed = jax.device_put(w, NamedSharding(mesh, P("data")))

    # One compilation for both: the forward value and the pullback of w.
    @jax.jit
    def forward_and_grad(v):
        out, pullback = jax.vjp(sharded, v)
        return out, pullback(w_placed)[0]

    out, grad = forward_and_grad(x_placed)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=rtol, atol=0)
    grad_ref = jax.grad(lambda v: jnp.sum(w * reference(v)))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(grad_ref), rtol=max(rtol, 1e-6))


def _grad_of_sum(mesh, fn, x):
    """The gradient of the sum of every rank's outputs (a cotangent of 1 everywhere)."""
    sharded = _per_rank(mesh, fn)
    x_placed = jax.device_put(x, NamedSharding(mesh, P("data")))
    return np.asarray(jax.jit(jax.grad(lambda v: jnp.sum(sharded(v))))(x_placed))


def _stack(y):
    return jnp.broadcast_to(y, (N, *y.shape))


SHAPES_DIMS = [((4, 3), 0), ((4, 3), -1), ((2, 3, 4), 1)]


@pytest.mark.parametrize(("shape", "dim"), SHAPES_DIMS)
def test_all_gather_matches_concatenate(mesh, shape, dim):
    x = jax.random.normal(jax.random.key(0), (N, *shape))
    _check(
        mesh,
        lambda b: C.all_gather(b, "data", dim=dim),
        lambda v: _stack(jnp.concatenate(list(v), axis=dim)),
        x,
    )


@pytest.mark.parametrize(("shape", "dim"), SHAPES_DIMS)
def test_scatter_matches_split(mesh, shape, dim):
    shape = list(shape)
    shape[dim] *= N
    x = jax.random.normal(jax.random.key(0), shape)
    _check(
        mesh,
        lambda v: C.scatter(v, "data", dim=dim),
        lambda v: jnp.stack(jnp.split(v, N, axis=dim)),
        x,
        replicated_input=True,
    )


def test_scatter_then_all_gather_is_identity_with_identity_gradient(mesh):
    x = jax.random.normal(jax.random.key(0), (3, 2 * N))
    _check(
        mesh,
        lambda v: C.all_gather(C.scatter(v, "data", dim=-1), "data", dim=-1),
        lambda v: _stack(v),
        x,
        replicated_input=True,
        rtol=1e-6,
    )


@pytest.mark.parametrize("root", [0, N - 1])
def test_broadcast_sends_root_and_sums_cotangents_onto_it(mesh, root):
    x = jax.random.normal(jax.random.key(0), (N, 2, 3))
    _check(mesh, lambda b: C.broadcast(b, "data", root=root), lambda v: _stack(v[root]), x)
    # The gradient is zero off root, the sum of the ranks' cotangents on root (checked above
    # against the reference; this states it directly).
    grad = _grad_of_sum(mesh, lambda b: C.broadcast(b, "data", root=root), x)
    np.testing.assert_array_equal(np.delete(grad, root, axis=0), 0.0)
    np.testing.assert_array_equal(grad[root], float(N))


def test_broadcast_integers():
    mesh = _mesh("explicit")
    x = jnp.arange(N * 3, dtype=jnp.int32).reshape(N, 3)
    out = _per_rank(mesh, lambda b: C.broadcast(b, "data", root=2))(
        jax.device_put(x, NamedSharding(mesh, P("data")))
    )
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(np.asarray(x[2]), (N, 3)))


REDUCTIONS = {
    "sum": lambda v: jnp.sum(v, axis=0),
    "mean": lambda v: jnp.mean(v, axis=0),
    "max": lambda v: jnp.max(v, axis=0),
}


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
def test_all_reduce_matches_reduction(mesh, op):
    x = jax.random.normal(jax.random.key(0), (N, 2, 3))
    _check(
        mesh,
        lambda b: C.all_reduce(b, "data", op=op),
        lambda v: _stack(REDUCTIONS[op](v)),
        x,
        rtol=1e-6,
    )


def test_all_reduce_max_splits_gradient_among_tied_ranks(mesh):
    # Values 0..2 on 8 ranks: every column's maximum is held by several ranks.
    x = (jnp.arange(N * 4).reshape(N, 4) % 3).astype(jnp.float32)
    _check(
        mesh,
        lambda b: C.all_reduce(b, "data", op="max"),
        lambda v: _stack(jnp.max(v, axis=0)),
        x,
        rtol=1e-6,
    )
    grad = _grad_of_sum(mesh, lambda b: C.all_reduce(b, "data", op="max"), x)
    # Per column the N cotangents of 1 are shared equally by the ranks holding the maximum.
    is_max = np.asarray(x) == np.asarray(x).max(axis=0)
    np.testing.assert_allclose(np.asarray(grad), is_max * N / is_max.sum(axis=0), rtol=1e-6)


# Without replication tracking (check_vma=False) JAX's transposes assume per-rank cotangents;
# "max" has its own rule and must agree there too, and on a replicated input (every rank ties).
CASES = {
    "all_gather": (lambda b: C.all_gather(b, "data", dim=-1), lambda v: _stack(jnp.hstack(v))),
    "broadcast": (lambda b: C.broadcast(b, "data", root=3), lambda v: _stack(v[3])),
    "sum": (lambda b: C.all_reduce(b, "data"), lambda v: _stack(jnp.sum(v, axis=0))),
    "mean": (lambda b: C.all_reduce(b, "data", op="mean"), lambda v: _stack(jnp.mean(v, 0))),
    "max": (lambda b: C.all_reduce(b, "data", op="max"), lambda v: _stack(jnp.max(v, 0))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_without_replication_tracking(name):
    fn, reference = CASES[name]
    x = (jnp.arange(N * 3).reshape(N, 3) % 4).astype(jnp.float32)  # ties for "max"
    _check(_mesh("auto"), fn, reference, x, rtol=1e-6, check_vma=False)


def test_scatter_without_replication_tracking():
    x = jax.random.normal(jax.random.key(0), (2 * N, 3))
    _check(
        _mesh("auto"),
        lambda v: C.scatter(v, "data"),
        lambda v: jnp.stack(jnp.split(v, N)),
        x,
        replicated_input=True,
        check_vma=False,
    )


@pytest.mark.parametrize("check_vma", [True, False])
def test_all_reduce_max_of_replicated_input_is_identity(check_vma):
    x = jax.random.normal(jax.random.key(0), (2, 3))
    _check(
        _mesh("auto"),
        lambda v: C.all_reduce(v, "data", op="max"),
        _stack,
        x,
        replicated_input=True,
        rtol=1e-6,
        check_vma=check_vma,
    )


def test_all_reduce_keeps_half_precision_dtype():
    mesh = _mesh("explicit")
    x = jax.random.normal(jax.random.key(0), (N, 4)).astype(jnp.bfloat16)
    for op in REDUCTIONS:
        out = _per_rank(mesh, lambda b, op=op: C.all_reduce(b, "data", op=op))(
            jax.device_put(x, NamedSharding(mesh, P("data")))
        )
        assert out.dtype == jnp.bfloat16, op


def test_compiles_once_per_shape(mesh):
    f = jax.jit(_per_rank(mesh, lambda b: C.all_gather(b, "data", dim=-1)))
    for seed in range(2):
        x = jax.random.normal(jax.random.key(seed), (N, 2, 3))
        f(jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert f._cache_size() == 1


# Bad input: each error is raised while tracing, before any collective runs.


def _trace(mesh, fn, shape, *, replicated_input=False):
    x = jnp.zeros(shape)
    spec = P() if replicated_input else P("data")
    _per_rank(mesh, fn, replicated_input=replicated_input)(
        jax.device_put(x, NamedSharding(mesh, spec))
    )


def test_scatter_rejects_dim_not_divisible_by_axis_size(mesh):
    with pytest.raises(ValueError, match=r"x\.shape\[-1\]=12 .*size 8 of mesh axis 'data'"):
        _trace(mesh, lambda v: C.scatter(v, "data", dim=-1), (2, 12), replicated_input=True)


@pytest.mark.parametrize("op_fn", [C.all_gather, C.scatter], ids=["all_gather", "scatter"])
def test_rejects_dim_out_of_range(mesh, op_fn):
    with pytest.raises(ValueError, match=r"dim must be in \[-2, 2\).*dim=2"):
        _trace(mesh, lambda v: op_fn(v, "data", dim=2), (N, 8), replicated_input=True)
    with pytest.raises(ValueError, match=r"dim=-3"):
        _trace(mesh, lambda v: op_fn(v, "data", dim=-3), (N, 8), replicated_input=True)
    with pytest.raises(TypeError, match=r"dim must be an int, got dim=1.0"):
        _trace(mesh, lambda v: op_fn(v, "data", dim=1.0), (N, 8), replicated_input=True)


@pytest.mark.parametrize("root", [-1, N, 100])
def test_broadcast_rejects_root_outside_axis(mesh, root):
    with pytest.raises(ValueError, match=rf"root must be in \[0, 8\).*root={root}"):
        _trace(mesh, lambda b: C.broadcast(b, "data", root=root), (N, 2))


def test_broadcast_rejects_non_int_root(mesh):
    with pytest.raises(TypeError, match="root must be an int"):
        _trace(mesh, lambda b: C.broadcast(b, "data", root=1.0), (N, 2))


@pytest.mark.parametrize("op", ["min", "SUM", "avg", None])
def test_all_reduce_rejects_unknown_op(op):
    with pytest.raises(ValueError, match=r"op must be one of \('sum', 'mean', 'max'\)"):
        C.all_reduce(jnp.zeros(2), "data", op=op)


def test_rejects_unbound_axis_name(mesh):
    with pytest.raises(ValueError, match="axis_name='model' is not a bound mesh axis"):
        _trace(mesh, lambda b: C.all_reduce(b, "model"), (N, 2))
    with pytest.raises(ValueError, match="axis_name='data' is not a bound mesh axis"):
        C.all_gather(jnp.zeros(2), "data")
    with pytest.raises(TypeError, match="axis_name must be a non-empty str"):
        _trace(mesh, lambda b: C.all_reduce(b, 0), (N, 2))
