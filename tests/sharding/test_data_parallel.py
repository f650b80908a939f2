"""rudax.sharding.DataParallel against the same computation on one device, written plainly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.sharding as rs

N = 8
pytestmark = pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")

MESHES = {
    "make_mesh": lambda: jax.make_mesh((N,), ("data",)),
    "Mesh": lambda: jax.sharding.Mesh(np.array(jax.devices()[:N]), ("data",)),
}


@pytest.fixture(params=sorted(MESHES))
def mesh(request):
    return MESHES[request.param]()


def _put(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P("data")))


REPLICATED = P()


def _per_rank(fn, mesh, *args, out_specs=REPLICATED):
    """fn on each rank's slice of args (leading axis N, one row per rank, squeezed)."""

    def body(*xs):
        return fn(*jax.tree.map(lambda x: x[0], xs))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=out_specs))
    return f(*jax.tree.map(lambda x: _put(mesh, x), args))


# --- the key test: unequal token counts give the global token-mean gradient ------

COUNTS = np.array([1, 4, 0, 2, 3, 4, 1, 2])  # tokens per rank; one rank has none
L, D, H = 4, 3, 5  # padded tokens per rank, features, hidden units


def _mlp_token_losses(params, x_TxD, y_T):
    h = jnp.tanh(x_TxD @ params["layer"]["w"] + params["layer"]["b"])
    return (h @ params["out"] - y_T) ** 2


def _data():
    rng = np.random.default_rng(0)
    params = {
        "layer": {
            "w": jnp.asarray(rng.normal(size=(D, H)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(H,)), jnp.float32),
        },
        "out": jnp.asarray(rng.normal(size=(H,)), jnp.float32),
    }
    x_NxLxD = rng.normal(size=(N, L, D)).astype(np.float32)
    y_NxL = rng.normal(size=(N, L)).astype(np.float32)
    mask_NxL = (np.arange(L)[None, :] < COUNTS[:, None]).astype(np.float32)
    # Padding must not leak: give it values that would change the gradient if it did.
    x_NxLxD[mask_NxL == 0] = 1e3
    return params, x_NxLxD, y_NxL, mask_NxL


# How the parameters enter shard_map: replicated (check_vma: their gradient arrives already
# summed over ranks), cast to varying (each rank's gradient is local), or untracked.
CONVENTIONS = {
    "replicated": (True, lambda p: p),
    "varying": (True, lambda p: jax.lax.pcast(p, "data", to="varying")),
    "no_check_vma": (False, lambda p: p),
}


@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
@pytest.mark.parametrize("weight_dtype", [jnp.float32, jnp.int32])
def test_reduce_unequal_counts_matches_single_device_token_mean(mesh, convention, weight_dtype):
    params, x_NxLxD, y_NxL, mask_NxL = _data()
    dp = rs.DataParallel(mesh, "data")
    check_vma, enter = CONVENTIONS[convention]

    def step(params, x_LxD, y_L, mask_L):
        loss_sum = lambda p: jnp.sum(mask_L * _mlp_token_losses(p, x_LxD, y_L))
        grads = jax.grad(loss_sum)(enter(params))
        return dp.reduce(grads, jnp.sum(mask_L).astype(weight_dtype))

    specs = (P(), P("data"), P("data"), P("data"))
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=check_vma))
    flat = lambda a: _put(mesh, a.reshape(N * L, *a.shape[2:]))
    args = (params, flat(x_NxLxD), flat(y_NxL), flat(mask_NxL))
    got = f(*args)

    valid = mask_NxL.reshape(-1) == 1
    x_TxD, y_T = x_NxLxD.reshape(-1, D)[valid], y_NxL.reshape(-1)[valid]
    assert x_TxD.shape[0] == COUNTS.sum()
    want = jax.grad(lambda p: jnp.mean(_mlp_token_losses(p, x_TxD, y_T)))(params)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6), got, want)
    f(*args)
    assert f._cache_size() == 1


def test_reduce_precision(mesh):
    dp = rs.DataParallel(mesh)
    # Small integers: their bf16 sums are exact, so the one rounding is the final cast.
    g_N = np.arange(N * 3, dtype=np.float32).reshape(N, 3) - 7.0
    w_N = np.array([3.0, 1, 2, 5, 0, 4, 1, 7], np.float32)
    want = g_N.sum(0) / w_N.sum()

    both = lambda g, w: (dp.reduce(g, w), dp.reduce_fp32(g, w))
    bf16, fp32 = _per_rank(both, mesh, jnp.asarray(g_N, jnp.bfloat16), w_N)
    assert bf16.dtype == jnp.bfloat16 and fp32.dtype == jnp.float32
    np.testing.assert_array_equal(bf16, jnp.asarray(want, jnp.float32).astype(jnp.bfloat16))
    np.testing.assert_allclose(fp32, want, rtol=1e-6)
    # fp32-accumulated gradients (as GradientAccumulator keeps them) stay fp32.
    out = _per_rank(dp.reduce_fp32, mesh, g_N, w_N)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_reduce_missing_gradients(mesh):
    dp = rs.DataParallel(mesh)
    g_N = np.ones((N, 2), np.float32)
    w_N = np.ones((N,), np.float32)

    zero = lambda g, w: dp.reduce({"a": g, "b": None}, w, missing=rs.MissingGradientPolicy.ZERO)
    out = _per_rank(zero, mesh, g_N, w_N)
    assert out["b"] is None
    np.testing.assert_allclose(out["a"], [1.0, 1.0], rtol=1e-6)

    reject = lambda g, w: dp.reduce({"a": g, "b": [None]}, w)
    with pytest.raises(ValueError, match=r"\['b'\]\[0\].*None"):
        _per_rank(reject, mesh, g_N, w_N)
    bad = lambda g, w: dp.reduce(g, w, missing="zero")
    with pytest.raises(TypeError, match="missing must be a MissingGradientPolicy"):
        _per_rank(bad, mesh, g_N, w_N)


def test_reduce_nnx_state(mesh):
    dp = rs.DataParallel(mesh)
    grads = nnx.state(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Param)
    f = jax.jit(jax.shard_map(lambda g: dp.reduce(g, 2.0), mesh=mesh, in_specs=P(), out_specs=P()))
    out = f(grads)
    assert isinstance(out, nnx.State)
    # Invariant gradients are one global sum; an invariant weight 2 is every rank's: 2 * 8.
    jax.tree.map(lambda o, g: np.testing.assert_allclose(o, g / 16, rtol=1e-6), out, grads)


# --- initialize --------------------------------------------------------------------------


def _replicas():
    w_N = np.arange(N * 3, dtype=np.float32).reshape(N, 3) + 1.0
    w_N[5, 0] = -0.0  # a sign bit a float psum would lose
    return {
        "w": w_N,
        "h": jnp.asarray(w_N[:, :2], jnp.bfloat16),
        "step": np.arange(N, dtype=np.int32),
        "flag": np.arange(N) % 2 == 0,
    }


@pytest.mark.parametrize("buffers", [False, True])
def test_initialize_broadcasts_root(mesh, buffers):
    dp = rs.DataParallel(mesh)
    reps, root = _replicas(), 5
    init = dp.initialize_with_buffers if buffers else dp.initialize
    lead = lambda t: jax.tree.map(lambda x: x[None], t)
    out = _per_rank(lambda t: lead(init(t, root=root)), mesh, reps, out_specs=P("data"))
    for name in ("w", "h"):
        want = np.broadcast_to(np.asarray(reps[name][root]), reps[name].shape)
        np.testing.assert_array_equal(out[name], want)
        assert out[name].dtype == reps[name].dtype
    assert np.signbit(out["w"][:, 0]).all()
    for name in ("step", "flag"):
        want = np.broadcast_to(reps[name][root], reps[name].shape) if buffers else reps[name]
        np.testing.assert_array_equal(out[name], want)
        assert out[name].dtype == reps[name].dtype


def test_initialize_output_is_replicated(mesh):
    # Broadcast leaves are invariant over the axis, so out_specs=P() accepts them.
    dp = rs.DataParallel(mesh)
    w_N = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    out = _per_rank(lambda w: dp.initialize(w, root=2), mesh, w_N, out_specs=P())
    np.testing.assert_array_equal(out, w_N[2])


# --- bad input ---------------------------------------------------------------------------


def test_bad_construction(mesh):
    with pytest.raises(ValueError, match=r"axis_name.*\('data',\).*'batch'"):
        rs.DataParallel(mesh, "batch")
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh"):
        rs.DataParallel(jax.devices(), "data")


@pytest.mark.parametrize(
    "root, error, match",
    [
        (N, ValueError, r"root must be a rank in \[0, 8\).*root=8"),
        (-1, ValueError, "root=-1"),
        (1.0, TypeError, "root must be an int"),
    ],
)
def test_bad_root(mesh, root, error, match):
    dp = rs.DataParallel(mesh)
    with pytest.raises(error, match=match):
        _per_rank(lambda w: dp.initialize(w, root=root), mesh, np.zeros((N, 2), np.float32))


def test_bad_axis_binding(mesh):
    dp = rs.DataParallel(mesh)
    with pytest.raises(ValueError, match=r"inside jax.shard_map.*'data'.*not bound"):
        dp.reduce({"a": jnp.ones(2)}, 1.0)
    # The same axis name on a smaller mesh: a world-size mismatch, not a silent wrong divisor.
    small = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    f = jax.shard_map(lambda g: dp.reduce(g, 1.0), mesh=small, in_specs=P(), out_specs=P())
    with pytest.raises(ValueError, match=r"has size 4 here.*size 8"):
        jax.jit(f)(jnp.ones(2))


def test_bad_gradients_and_weights(mesh):
    dp = rs.DataParallel(mesh)
    g_N = np.ones((N, 2), np.float32)
    cases = [
        (lambda g, w: dp.reduce({"k": g.astype(jnp.int32)}, w), TypeError, r"\['k'\].*floating"),
        (lambda g, w: dp.reduce(g, w[None]), TypeError, "local_weight must be .*scalar"),
        (lambda g, w: dp.reduce(g, -1.0), ValueError, "local_weight=-1.0"),
    ]
    for fn, error, match in cases:
        with pytest.raises(error, match=match):
            _per_rank(fn, mesh, g_N, np.ones((N,), np.float32))


def test_check_replicas(mesh):
    dp = rs.DataParallel(mesh)
    base = lambda: {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.int32)}
    dp.check_replicas([base() for _ in range(N)])
    with pytest.raises(ValueError, match=r"one tree per rank.*got 7"):
        dp.check_replicas([base() for _ in range(N - 1)])

    def with_change(**change):
        reps = [base() for _ in range(N)]
        reps[3] = {**reps[3], **change}
        return reps

    with pytest.raises(
        ValueError, match=r"replica 3 \['a'\]: shape \(3, 2\), replica 0 has \(2, 3\)"
    ):
        dp.check_replicas(with_change(a=np.zeros((3, 2), np.float32)))
    with pytest.raises(ValueError, match=r"replica 3 \['b'\]: dtype int16, replica 0 has int32"):
        dp.check_replicas(with_change(b=np.zeros(4, np.int16)))
    with pytest.raises(ValueError, match=r"replica 3 has leaf \['c'\] where replica 0 has \['b'\]"):
        reps = with_change()
        reps[3] = {"a": reps[3]["a"], "c": reps[3]["b"]}
        dp.check_replicas(reps)

    shared = np.zeros(4, np.float32)
    tied = lambda: {"emb": shared, "head": shared}
    untied = {"emb": np.zeros(4, np.float32), "head": np.zeros(4, np.float32)}
    with pytest.raises(ValueError, match=r"replica 1 \['head'\]: tied to \['head'\], .*\['emb'\]"):
        dp.check_replicas([tied(), untied] + [tied() for _ in range(N - 2)])
