"""examples/lm/loss.py: the chunked head + cross entropy against NumPy and plain autodiff."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import examples.lm.loss as loss_lib
from examples.lm.loss import linear_cross_entropy_sum

N, D, V = 7, 4, 11


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype(np.float32)
    table = rng.normal(size=(V, D)).astype(np.float32)
    targets = rng.integers(0, V, size=N).astype(np.int32)
    return x, table, targets


def _numpy_loss_and_grads(x, table, targets):
    """The summed cross entropy of x @ table.T and its gradients, in float64 NumPy."""
    x, table = x.astype(np.float64), table.astype(np.float64)
    logits = x @ table.T
    m = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - m)
    lse = m[:, 0] + np.log(p.sum(axis=1))
    loss = np.sum(lse - logits[np.arange(len(targets)), targets])
    d = p / p.sum(axis=1, keepdims=True)
    d[np.arange(len(targets)), targets] -= 1.0
    return loss, d @ table, d.T @ x


def _plain(x, table, targets):
    """The formula examples.lm.model.loss_sum used before chunking: full logits, autodiff."""
    logits = jnp.einsum("nd,vd->nv", x, table).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.sum(lse - jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0])


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
def test_loss_and_gradients_match_numpy_for_every_chunking(chunk):
    x, table, targets = _inputs()
    loss, (dx, dtable) = jax.value_and_grad(
        lambda x, t: linear_cross_entropy_sum(x, t, targets, chunk=chunk), argnums=(0, 1)
    )(x, table)
    ref_loss, ref_dx, ref_dtable = _numpy_loss_and_grads(x, table, targets)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dtable, ref_dtable, rtol=1e-5, atol=1e-6)


def test_forward_without_gradient_and_under_jit_matches_numpy():
    x, table, targets = _inputs(1)
    ref_loss = _numpy_loss_and_grads(x, table, targets)[0]
    np.testing.assert_allclose(
        linear_cross_entropy_sum(x, table, targets, chunk=3), ref_loss, rtol=1e-6
    )
    jitted = jax.jit(linear_cross_entropy_sum, static_argnames=("chunk", "dtype"))
    np.testing.assert_allclose(jitted(x, table, targets, chunk=3), ref_loss, rtol=1e-6)


def test_cotangent_scales_both_gradients():
    x, table, targets = _inputs(2)
    grads = lambda scale: jax.grad(
        lambda x, t: scale * linear_cross_entropy_sum(x, t, targets, chunk=2), argnums=(0, 1)
    )(x, table)
    for one, scaled in zip(grads(1.0), grads(-2.5), strict=True):
        np.testing.assert_allclose(scaled, -2.5 * one, rtol=1e-6)


@pytest.mark.parametrize("storage", [jnp.bfloat16, jnp.float32])
def test_bf16_compute_matches_plain_autodiff(storage):
    # Gradients come back in the storage dtypes, as autodiff through the casts gives them.
    x, table, targets = _inputs(3)
    x, table = jnp.asarray(x, storage), jnp.asarray(table, storage)

    def plain(x, t):
        return _plain(x.astype(jnp.bfloat16), t.astype(jnp.bfloat16), targets)

    def chunked(x, t):
        return linear_cross_entropy_sum(x, t, targets, dtype=jnp.bfloat16, chunk=3)

    (loss, grads), (ref_loss, ref_grads) = (
        jax.value_and_grad(f, argnums=(0, 1))(x, table) for f in (chunked, plain)
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == want.dtype == storage
        # Chunks sum dtable in fp32 and round once; plain autodiff rounds one bf16 matmul.
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=2**-7
        )


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((np.ones((3, 4)), np.ones((5, 3)), np.zeros(3, np.int32)), {}, ValueError, "same D"),
        ((np.ones((3, 4)), np.ones((5, 4)), np.zeros(2, np.int32)), {}, ValueError, r"\(3,\)"),
        ((np.ones((3, 4)), np.ones((5, 4)), np.zeros(3)), {}, ValueError, "integer ids"),
        (
            (np.ones((3, 4), np.int32), np.ones((5, 4)), np.zeros(3, np.int32)),
            {},
            TypeError,
            r"x_NxD.dtype=int32",
        ),
        (
            (np.ones((3, 4)), np.ones((5, 4)), np.zeros(3, np.int32)),
            {"chunk": 0},
            ValueError,
            "chunk",
        ),
    ],
)
def test_bad_input_names_the_argument(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        linear_cross_entropy_sum(*args, **kwargs)


def test_doctests():
    assert doctest.testmod(loss_lib, raise_on_error=True).attempted > 0


def test_inside_shard_map_a_replicated_table_gets_the_summed_gradient():
    # Tokens split over `data`, the table replicated: each rank's loss is its tokens' share,
    # and the table's gradient must come out summed over the ranks, as on one device.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    rng = np.random.default_rng(4)
    x = rng.normal(size=(8, D)).astype(np.float32)
    table = rng.normal(size=(V, D)).astype(np.float32)
    targets = rng.integers(0, V, size=8).astype(np.int32)

    def ranked(x, table, targets):
        return linear_cross_entropy_sum(x, table, targets, chunk=3)[None]

    sharded = jax.shard_map(
        ranked, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P("data")
    )
    total = lambda x, t: jnp.sum(sharded(x, t, targets))
    loss, (dx, dtable) = jax.value_and_grad(total, argnums=(0, 1))(x, table)
    ref_loss, ref_dx, ref_dtable = _numpy_loss_and_grads(x, table, targets)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dtable, ref_dtable, rtol=1e-5, atol=1e-6)
