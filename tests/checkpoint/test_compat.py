"""rudax/checkpoint/_compat.py: uncommitting a restored array keeps its buffer.

A template leaf that names no placement used to be read into NumPy and copied into a new
device buffer by ``jnp.asarray``: 0.5 s per GB more than orbax's own read on this project's
CPU machine. It is now read onto the default device by orbax and uncommitted in place.
These tests pin both halves, so a JAX release that removes the private constructor fails
here instead of making restores slower without a word.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import rudax.checkpoint as rc
from rudax.checkpoint import _compat
from rudax.checkpoint import _sharded as sharded


def _pointer(x):
    return x.addressable_shards[0].data.unsafe_buffer_pointer()


def test_uncommitted_shares_the_buffer():
    x = jax.device_put(jnp.arange(12.0), jax.devices()[0])
    assert x.committed
    y = _compat.uncommitted(x)
    assert not y.committed
    assert y.sharding == x.sharding and y.dtype == x.dtype and y.shape == x.shape
    assert _pointer(y) == _pointer(x)
    np.testing.assert_array_equal(np.asarray(y), np.arange(12.0))
    assert _compat.uncommitted(y) is y  # already uncommitted: nothing to do


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_an_uncommitted_result_moves_next_to_committed_arguments():
    # What uncommitted is for: tx.init's count beside parameters on a mesh.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    w = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("d")))
    count = _compat.uncommitted(jax.device_put(jnp.int32(3), jax.devices()[0]))
    assert int(jax.jit(lambda w, c: w.sum() + c.astype(w.dtype))(w, count)) == 7
    committed = jax.device_put(jnp.int32(3), jax.devices()[0])
    with pytest.raises(ValueError, match="incompatible devices"):
        jax.jit(lambda w, c: w.sum() + c.astype(w.dtype))(w, committed)


def test_without_the_private_constructor_it_copies(monkeypatch):
    monkeypatch.setattr(_compat, "_ArrayImpl", None)
    x = jax.device_put(jnp.arange(5), jax.devices()[0])
    y = _compat.uncommitted(x)
    assert not y.committed
    np.testing.assert_array_equal(np.asarray(y), np.arange(5))


@pytest.mark.skipif(jax.device_count() < 3, reason="needs 3 devices")
def test_unplaced_leaves_are_read_onto_the_default_device():
    # The restore target orbax gets: a device array on the default device, not a NumPy
    # buffer that a copy then moves to the device.
    with jax.default_device(jax.devices()[2]):
        targets = sharded.restore_target(
            {"fresh": jnp.zeros(3), "struct": jax.ShapeDtypeStruct((2,), jnp.bfloat16)}
        )
    for t in targets.values():
        assert isinstance(t, jax.ShapeDtypeStruct)
        assert t.sharding == SingleDeviceSharding(jax.devices()[2])
    numpy_leaf = sharded.restore_target({"n": np.zeros(3, np.int8)})["n"]
    assert type(numpy_leaf) is np.ndarray and numpy_leaf.dtype == np.int8


@pytest.mark.skipif(jax.device_count() < 3, reason="needs 3 devices")
def test_restore_under_another_default_device(tmp_path):
    values = {"w": jnp.arange(6.0).reshape(2, 3), "count": jnp.int32(7)}
    record = rc.TrainingRecord.capture(model=values, optimizer=())
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        with jax.default_device(jax.devices()[2]):
            restored = ckpt.restore(record)
    for k, x in restored.model.items():
        assert not x.committed, k
        assert x.sharding == SingleDeviceSharding(jax.devices()[2]), k
        assert np.asarray(x).tobytes() == np.asarray(values[k]).tobytes(), k
