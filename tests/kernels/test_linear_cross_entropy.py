"""rudax.kernels.linear_cross_entropy: the chunked head + cross entropy against float64 NumPy
and plain autodiff of the full logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.kernels as rk
from rudax.kernels import _linear_cross_entropy

N, D, V = 7, 4, 11
IGNORE = -100


def _inputs(seed=0, n=N, ignored=()):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype(np.float32)
    table = rng.normal(size=(V, D)).astype(np.float32)
    labels = rng.integers(0, V, size=n).astype(np.int32)
    labels[list(ignored)] = IGNORE
    return x, table, labels


def _numpy(x, table, labels, ignore_index=IGNORE):
    """Loss sum, count and both gradients of the cross entropy of x @ table.T, in float64,
    over the tokens whose label is not ignore_index."""
    x, table = x.astype(np.float64), table.astype(np.float64)
    logits = x @ table.T
    m = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - m)
    lse = m[:, 0] + np.log(p.sum(axis=1))
    rows = np.flatnonzero(labels != ignore_index)
    loss = np.sum(lse[rows] - logits[rows, labels[rows]])
    d = p / p.sum(axis=1, keepdims=True)
    d[rows, labels[rows]] -= 1.0
    d[labels == ignore_index] = 0.0
    return loss, len(rows), d @ table, d.T @ x


def _value_and_grads(fn, x, table):
    """((loss, count), (dx, dtable)) of fn(x, table) -> (loss, count), jitted as a train
    step would be (one compilation, where eager autodiff would compile each piece)."""
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(x, table)


def _assert_matches_numpy(got, x, table, labels, ignore_index=IGNORE):
    (loss, count), (dx, dtable) = got
    ref_loss, ref_count, ref_dx, ref_dtable = _numpy(x, table, labels, ignore_index)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert count.dtype == jnp.int32 and count.shape == ()
    assert int(count) == ref_count
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dtable, ref_dtable, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("chunk", "ignored"),
    [(1, (1, 4)), (3, (1, 4)), (7, (1, 4)), (100, (1, 4)), (3, ())],
    ids=["chunk-1", "chunk-3", "chunk-N", "chunk-over-N", "chunk-3-none-ignored"],
)
def test_loss_count_and_gradients_match_numpy_for_every_chunking(chunk, ignored):
    x, table, labels = _inputs(ignored=ignored)
    got = _value_and_grads(
        lambda x, t: rk.linear_cross_entropy(x, t, labels, chunk=chunk), x, table
    )
    _assert_matches_numpy(got, x, table, labels)


@pytest.mark.parametrize(
    "ignored",
    [(3, 4, 5), (6, 7)],
    ids=["a-scanned-chunk", "the-remainder-chunk"],
)
def test_a_chunk_with_every_label_ignored_adds_nothing(ignored):
    # 8 tokens in chunks of 3: [0, 3) and [3, 6) run in the scan, [6, 8) is the remainder.
    x, table, labels = _inputs(1, n=8, ignored=ignored)
    # Features far from the others in the ignored rows: were they counted, the loss would
    # show it; they must not reach the loss nor dx, however large their logits.
    x[list(ignored)] *= 50.0
    got = _value_and_grads(lambda x, t: rk.linear_cross_entropy(x, t, labels, chunk=3), x, table)
    _assert_matches_numpy(got, x, table, labels)
    (_, count), (dx, _) = got
    assert int(count) == 8 - len(ignored)
    assert np.all(np.asarray(dx)[list(ignored)] == 0.0)


@pytest.mark.parametrize("chunk", [3, 100])
def test_every_label_ignored_gives_zero_loss_count_and_gradients(chunk):
    x, table, labels = _inputs(2, ignored=range(N))
    (loss, count), (dx, dtable) = _value_and_grads(
        lambda x, t: rk.linear_cross_entropy(x, t, labels, chunk=chunk), x, table
    )
    assert float(loss) == 0.0 and int(count) == 0
    assert count.dtype == jnp.int32
    np.testing.assert_array_equal(dx, np.zeros((N, D), np.float32))
    np.testing.assert_array_equal(dtable, np.zeros((V, D), np.float32))


def test_no_tokens_at_all():
    x, table, labels = np.zeros((0, D), np.float32), _inputs()[1], np.zeros(0, np.int32)
    (loss, count), (dx, dtable) = _value_and_grads(
        lambda x, t: rk.linear_cross_entropy(x, t, labels, chunk=4), x, table
    )
    assert float(loss) == 0.0 and int(count) == 0
    assert dx.shape == (0, D)
    np.testing.assert_array_equal(dtable, np.zeros((V, D), np.float32))


def test_custom_ignore_index():
    ignore_index = 2  # a vocabulary id, as a padding token's id would be
    x, table, labels = _inputs(3)
    labels[[0, 5]] = ignore_index  # -100 is now an ordinary (out-of-range) label: none here
    got = _value_and_grads(
        lambda x, t: rk.linear_cross_entropy(x, t, labels, chunk=3, ignore_index=ignore_index),
        x,
        table,
    )
    _assert_matches_numpy(got, x, table, labels, ignore_index)
    assert int(got[0][1]) == N - int(np.sum(labels == ignore_index))


_CHUNKED = lambda x, t, y: rk.linear_cross_entropy(x, t, y, chunk=3)


@pytest.mark.parametrize(
    ("fn", "bad_label"),
    [
        (_CHUNKED, V),
        (_CHUNKED, -1),
        (_CHUNKED, IGNORE + 1),
        (rk.linear_cross_entropy_reference, -1),
    ],
    ids=["V", "minus-one", "ignore-index-plus-one", "reference-minus-one"],
)
def test_a_label_out_of_range_makes_the_loss_nan_and_is_counted(fn, bad_label):
    # Not checkable under jit; never read out of bounds, nor wrapped around (-1 is not V - 1).
    x, table, labels = _inputs(4, ignored=(2,))
    labels[5] = bad_label
    loss, count = jax.jit(fn)(x, table, labels)
    assert np.isnan(loss)
    assert int(count) == N - 1


def test_a_label_out_of_range_makes_the_gradients_nan():
    # So that a finite check on the gradients skips the step even if nobody reads the loss.
    x, table, labels = _inputs(4)
    labels[5] = V
    (loss, _), (dx, dtable) = _value_and_grads(
        lambda x, t: rk.linear_cross_entropy(x, t, labels, chunk=3), x, table
    )
    assert np.isnan(loss) and np.isnan(dx[5]).all() and np.isnan(dtable).all()
    assert np.isfinite(np.delete(np.asarray(dx), 5, axis=0)).all()


def test_forward_without_gradient_and_under_jit_matches_numpy():
    x, table, labels = _inputs(5, ignored=(0,))
    ref_loss, ref_count = _numpy(x, table, labels)[:2]
    loss, count = rk.linear_cross_entropy(x, table, labels, chunk=3)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert int(count) == ref_count
    jitted = jax.jit(lambda x, t, y: rk.linear_cross_entropy(x, t, y, chunk=3))
    loss, count = jitted(x, table, labels)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert int(count) == ref_count


def test_reference_matches_numpy():
    x, table, labels = _inputs(6, ignored=(3,))
    got = _value_and_grads(lambda x, t: rk.linear_cross_entropy_reference(x, t, labels), x, table)
    _assert_matches_numpy(got, x, table, labels)


def test_cotangent_scales_both_gradients():
    x, table, labels = _inputs(7, ignored=(6,))

    loss = lambda x, t, scale: scale * rk.linear_cross_entropy(x, t, labels, chunk=2)[0]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for one, scaled in zip(grads(x, table, 1.0), grads(x, table, -2.5), strict=True):
        np.testing.assert_allclose(scaled, -2.5 * one, rtol=1e-6)


@pytest.mark.parametrize(
    ("x_dtype", "table_dtype", "compute", "tol"),
    [
        (jnp.bfloat16, jnp.bfloat16, None, 2**-7),
        (jnp.float32, jnp.float32, jnp.bfloat16, 2**-7),
        (jnp.bfloat16, jnp.float32, None, 2**-7),
        (jnp.float16, jnp.float16, None, 2**-10),
    ],
    ids=["bf16", "fp32-stored-bf16-compute", "bf16-x-fp32-table", "fp16"],
)
def test_half_precision_matches_plain_autodiff(x_dtype, table_dtype, compute, tol):
    # Gradients come back in the storage dtypes, as autodiff through the casts gives them.
    x, table, labels = _inputs(8, ignored=(2,))
    x, table = jnp.asarray(x, x_dtype), jnp.asarray(table, table_dtype)
    chunked = lambda x, t: rk.linear_cross_entropy(x, t, labels, chunk=3, dtype=compute)
    plain = lambda x, t: rk.linear_cross_entropy_reference(x, t, labels, dtype=compute)
    # Both in one jitted program: under jit XLA may skip rounding the logits to the compute
    # dtype before their fp32 cast (xla_allow_excess_precision, on by default), eager ops
    # round them, so the reference runs as the op does.
    vg = lambda f: jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
    both = jax.jit(lambda x, t: (vg(chunked)(x, t), vg(plain)(x, t)))
    ((loss, count), grads), ((ref_loss, ref_count), ref_grads) = both(x, table)
    # The logits are the same rounded matmul either way; only the fp32 sum's order differs.
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert int(count) == int(ref_count) == N - 1
    for got, want, storage in zip(grads, ref_grads, (x_dtype, table_dtype), strict=True):
        assert got.dtype == want.dtype == storage
        # Chunks sum dtable in fp32 and round once; plain autodiff rounds one matmul.
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
        )


@pytest.mark.parametrize("label_dtype", [np.int8, np.uint8])
def test_narrow_labels(label_dtype):
    # Widened to int32 before they meet ignore_index and V: -100 is no uint8 value, and a
    # vocabulary past 127 no int8 one.
    x, table, labels = _inputs(9, ignored=(1,) if label_dtype != np.uint8 else ())
    loss, count = rk.linear_cross_entropy(x, table, labels.astype(label_dtype), chunk=3)
    ref_loss, ref_count = _numpy(x, table, labels)[:2]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert int(count) == ref_count


def test_the_full_logits_are_never_formed():
    # 64 tokens, 50 classes: autodiff of the reference holds f32[64,50]; the chunked op only
    # ever a chunk of them, f32[8,50], in its gradient's forward pass and in its primal.
    x, table = jnp.ones((64, D)), jnp.ones((50, D))
    labels = jnp.zeros(64, jnp.int32)
    chunked = jax.make_jaxpr(
        jax.grad(lambda x, t: rk.linear_cross_entropy(x, t, labels, chunk=8)[0], argnums=(0, 1))
    )(x, table)
    forward = jax.make_jaxpr(lambda x, t: rk.linear_cross_entropy(x, t, labels, chunk=8))(x, table)
    plain = jax.make_jaxpr(
        jax.grad(lambda x, t: rk.linear_cross_entropy_reference(x, t, labels)[0], argnums=(0, 1))
    )(x, table)
    assert "f32[64,50]" in str(plain)
    for jaxpr in (chunked, forward):
        assert "f32[64,50]" not in str(jaxpr)
        assert "f32[8,50]" in str(jaxpr)


@pytest.mark.parametrize("grad", [True, False], ids=["gradient", "loss-only"])
def test_compiled_program_holds_about_one_chunk_of_logits(grad):
    # What XLA allocates, not what the jaxpr says: with the chunks unrolled in Python (as
    # examples/lm/loss.py had them) XLA's CPU schedule kept every chunk's logits alive at
    # once, about the full logits' bytes here; the scan holds one chunk's (1/8) and a little.
    n, v, chunk = 256, 128, 32
    x, table = jax.ShapeDtypeStruct((n, D), jnp.float32), jax.ShapeDtypeStruct((v, D), jnp.float32)
    labels = jnp.zeros(n, jnp.int32)
    loss = lambda x, t: rk.linear_cross_entropy(x, t, labels, chunk=chunk)[0]
    fn = jax.grad(loss, argnums=(0, 1)) if grad else loss
    temp = jax.jit(fn).lower(x, table).compile().memory_analysis().temp_size_in_bytes
    assert temp < 2 * chunk * v * 4, f"{temp} bytes of temporaries, {n * v * 4} for all logits"


def test_second_call_does_not_recompile():
    x, table, labels = _inputs(10, n=9, ignored=(4,))  # a shape no other test uses
    x2, table2, labels2 = _inputs(11, n=9, ignored=(0, 8))
    op = lambda x, t, y: rk.linear_cross_entropy(x, t, y, chunk=4)
    jitted = _linear_cross_entropy._linear_cross_entropy_jit
    before = jitted._cache_size()
    op(x, table, labels)
    assert jitted._cache_size() == before + 1
    op(x2, table2, labels2)
    assert jitted._cache_size() == before + 1, "the second call recompiled"

    step = jax.jit(jax.grad(lambda x, t, y: op(x, t, y)[0], argnums=(0, 1)))
    step(x, table, labels)
    step(x2, table2, labels2)
    assert step._cache_size() == 1, "the gradient recompiled for new values"


# Two devices: the simulated CPU devices of tests/conftest.py; a one-GPU machine has one.
TWO_DEVICES = pytest.mark.skipif(
    jax.device_count() < 2, reason="needs 2 devices (a one-GPU machine has 1)"
)


@TWO_DEVICES
@pytest.mark.parametrize("make_mesh", ["Mesh", "make_mesh"], ids=["auto-axes", "explicit-axes"])
def test_inside_shard_map_a_replicated_table_gets_the_summed_gradient(make_mesh):
    # Tokens split over `data`, the table replicated: each rank's loss and count are its
    # tokens' share, and the table's gradient must come out summed over the ranks, as on one
    # device. Rank 1's second chunk has every label ignored.
    if make_mesh == "Mesh":
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    else:
        mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    x, table, labels = _inputs(12, n=10, ignored=(1, 8, 9))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    x, table, labels = put(x, P("data")), put(table, P()), put(labels, P("data"))

    def ranked(x, table, labels):
        loss, count = rk.linear_cross_entropy(x, table, labels, chunk=3)
        return loss[None], count[None]

    sharded = jax.shard_map(
        ranked,
        mesh=mesh,
        in_specs=(P("data"), P(), P("data")),
        out_specs=(P("data"), P("data")),
    )

    def total(x, t):
        losses, counts = sharded(x, t, labels)
        return jnp.sum(losses), jnp.sum(counts)

    with jax.set_mesh(mesh):  # explicit axes: the sums over ranks need the mesh
        got = _value_and_grads(total, x, table)
    _assert_matches_numpy(got, np.asarray(x), np.asarray(table), np.asarray(labels))


@TWO_DEVICES
@pytest.mark.parametrize(
    ("x_spec", "table_spec", "name"),
    [(P("data"), P(), "features_NxD"), (P(), P(None, "data"), "table_VxD")],
    ids=["tokens-sharded", "table-sharded"],
)
def test_an_explicitly_sharded_operand_outside_shard_map_says_where_to_call_it(
    x_spec, table_spec, name
):
    # jax would fail deep inside the chunking (a reshape or a gather asking for out_sharding).
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    x, table, labels = _inputs(13, n=8)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    x, table = put(x, x_spec), put(table, table_spec)
    match = rf"{name} is sharded over an Explicit mesh axis .*inside jax.shard_map"
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
        jax.jit(lambda x, t: rk.linear_cross_entropy(x, t, labels)[0])(x, table)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            (np.ones((3, 4)), np.ones((5, 3)), np.zeros(3, np.int32)),
            {},
            ValueError,
            r"same D .* features_NxD.shape=\(3, 4\), table_VxD.shape=\(5, 3\)",
        ),
        (
            (np.ones((2, 3, 4)), np.ones((5, 4)), np.zeros((2, 3), np.int32)),
            {},
            ValueError,
            r"reshape leading batch axes into N first.*features_NxD.shape=\(2, 3, 4\)",
        ),
        (
            (np.ones((3, 4)), np.ones((0, 4)), np.zeros(3, np.int32)),
            {},
            ValueError,
            r"V >= 1 .*table_VxD.shape=\(0, 4\)",
        ),
        (
            (np.ones((3, 4)), np.ones((5, 4)), np.zeros(2, np.int32)),
            {},
            ValueError,
            r"labels_N must be integer ids of shape \(3,\), got labels_N.shape=\(2,\)",
        ),
        (
            (np.ones((3, 4)), np.ones((5, 4)), np.zeros(3)),
            {},
            ValueError,
            r"integer ids .*labels_N.dtype=float",
        ),
        (
            (np.ones((3, 4), np.int32), np.ones((5, 4)), np.zeros(3, np.int32)),
            {},
            TypeError,
            r"features_NxD must be floating, got features_NxD.dtype=int32",
        ),
        (
            (np.ones((3, 4)), np.ones((5, 4), np.int32), np.zeros(3, np.int32)),
            {},
            TypeError,
            r"table_VxD must be floating, got table_VxD.dtype=int32",
        ),
        (
            (np.ones((3, 4)), np.ones((5, 4)), np.zeros(3, np.int32)),
            {"chunk": 0},
            ValueError,
            r"chunk must be a positive int, got chunk=0",
        ),
        (
            (np.ones((3, 4)), np.ones((5, 4)), np.zeros(3, np.int32)),
            {"chunk": 2.0},
            TypeError,
            r"chunk must be an int, got chunk=2.0",
        ),
        (
            (np.ones((3, 4)), np.ones((5, 4)), np.zeros(3, np.int32)),
            {"ignore_index": -100.0},
            TypeError,
            r"ignore_index must be an int, got ignore_index=-100.0",
        ),
        (
            (np.ones((3, 4)), np.ones((5, 4)), np.zeros(3, np.uint32)),
            {},
            ValueError,
            r"ignore_index=-100 is not a value of labels_N.dtype=uint32",
        ),
        (
            (np.ones((3, 4)), np.ones((5, 4)), np.zeros(3, np.int32)),
            {"dtype": jnp.int32},
            TypeError,
            r"dtype must be a floating dtype",
        ),
    ],
    ids=[
        "different-D",
        "leading-batch-axes",
        "empty-vocabulary",
        "labels-length",
        "float-labels",
        "int-features",
        "int-table",
        "chunk-0",
        "float-chunk",
        "float-ignore-index",
        "unsigned-labels-negative-ignore-index",
        "int-compute-dtype",
    ],
)
def test_bad_input_names_the_argument(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        rk.linear_cross_entropy(*args, **kwargs)


def test_bf16_logits_are_rounded_in_every_program():
    """The logits are made in the compute dtype: bf16 here, rounded before the fp32 softmax,
    under jit too. XLA drops a bf16 round trip where it may (xla_allow_excess_precision), so
    without an explicit rounding the jitted loss was that of the fp32 logits: 2e-4 off."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 32)), jnp.bfloat16)
    table = jnp.asarray(rng.normal(size=(300, 32)), jnp.bfloat16)
    labels = jnp.asarray(rng.integers(0, 300, 16), jnp.int32)
    # float64 numpy of the definition: bf16 inputs, fp32 products, logits rounded to bf16.
    logits = np.asarray(x, np.float32) @ np.asarray(table, np.float32).T
    logits = logits.astype(ml_dtypes.bfloat16).astype(np.float64)
    top = logits.max(axis=1)
    lse = np.log(np.exp(logits - top[:, None]).sum(axis=1)) + top
    expected = np.sum(lse - logits[np.arange(16), np.asarray(labels)])
    ops = {
        "op": lambda a, b: rk.linear_cross_entropy(a, b, labels, chunk=4)[0],
        "reference": lambda a, b: rk.linear_cross_entropy_reference(a, b, labels)[0],
    }
    for name, op in ops.items():
        for run in (op, jax.jit(op)):
            np.testing.assert_allclose(float(run(x, table)), expected, rtol=1e-6, err_msg=name)
