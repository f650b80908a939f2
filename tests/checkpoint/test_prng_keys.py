"""Typed PRNG keys (``jax.random.key``, flax ``nnx.Rngs``) are saved and restored bitwise.

Before issue 11 a record holding one was refused at capture; now the key data is stored
and the key comes back as a typed key of the same implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.checkpoint as rc
from tests.checkpoint._assertions import assert_bitwise_equal

IMPLS = ["threefry2x32", "rbg"]


def _assert_same_keys(restored, expected):
    """Same tree; every key leaf a typed key of the same impl and bits; the rest bitwise."""
    la, ta = jax.tree.flatten(restored)
    lb, tb = jax.tree.flatten(expected)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if isinstance(y, jax.Array) and jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key):
            assert isinstance(x, jax.Array) and x.dtype == y.dtype, (x, y)
            assert jax.random.key_impl(x) == jax.random.key_impl(y)
            assert_bitwise_equal(jax.random.key_data(x), jax.random.key_data(y))
        else:
            assert_bitwise_equal(x, y)


def _record(impl, where, seed=0):
    keys = {
        "one": jax.random.key(seed, impl=impl),
        "many": jax.random.split(jax.random.key(seed + 1, impl=impl), 3),
    }
    parts = {"model": {"w": jnp.arange(3.0)}, "optimizer": (), "state": {"pos": 4}}
    if where == "state":
        parts["state"] = {"pos": 4, "rng": keys}
    else:
        parts[where] = {"w": jnp.arange(3.0), "rng": keys} if where == "model" else keys
    return rc.TrainingRecord.capture(**parts)


def _fresh(record):
    def zero(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(
                jnp.zeros_like(jax.random.key_data(x)), impl=jax.random.key_impl(x)
            )
        return jnp.zeros_like(x) if isinstance(x, jax.Array) else x

    return jax.tree.map(zero, record)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["model", "optimizer", "state"])
@pytest.mark.parametrize("impl", IMPLS)
def test_typed_keys_round_trip_bitwise(tmp_path, impl, where, async_save):
    record = _record(impl, where)
    with rc.Checkpointer(tmp_path, async_save=async_save) as ckpt:
        ckpt.save(1, record)
        ckpt.wait()
        restored = ckpt.restore(_fresh(record))
    _assert_same_keys(restored, record)


@pytest.mark.parametrize("impl", IMPLS)
def test_keys_restore_into_an_abstract_template(tmp_path, impl):
    record = _record(impl, "state")
    like = jax.eval_shape(lambda: record)
    like = like._replace(state=dict(like.state, pos=0))  # Python leaves stay Python
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        restored = ckpt.restore(like)
    _assert_same_keys(restored, record)
    # The restored keys draw what the saved ones draw.
    draw = jax.random.normal(restored.state["rng"]["one"], (4,))
    assert_bitwise_equal(draw, jax.random.normal(record.state["rng"]["one"], (4,)))


def test_a_template_key_of_another_impl_names_the_path(tmp_path):
    record = _record("threefry2x32", "state")
    other = _record("rbg", "state")
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        with pytest.raises(
            ValueError,
            match=r"record\.state\['rng'\]\['many'\]: saved shape \(3,\) dtype key<fry>, "
            r"template shape \(3,\) dtype key<rbg>",
        ):
            ckpt.restore(other)


def test_the_dtype_table_is_this_jax_s():
    from rudax.checkpoint import _keys

    for name, impl in _keys.KEY_IMPLS.items():
        assert str(jax.eval_shape(lambda i=impl: jax.random.key(0, impl=i)).dtype) == name


class _Model(nnx.Module):
    def __init__(self, *, rngs_seed):
        self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(rngs_seed))

    def __call__(self, x):
        return self.dropout(self.linear(x))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_flax_model_with_dropout_round_trips_whole(tmp_path, async_save):
    model = _Model(rngs_seed=1)
    x = jnp.ones((2, 4))
    model(x)  # the dropout stream has advanced once
    state = nnx.state(model)
    record = rc.TrainingRecord.capture(model=state, optimizer=())
    with rc.Checkpointer(tmp_path, async_save=async_save) as ckpt:
        ckpt.save(1, record)
        ckpt.wait()
        fresh = _Model(rngs_seed=7)
        restored = ckpt.restore(record._replace(model=nnx.state(fresh)))
    _assert_same_keys(restored.model, state)
    nnx.update(fresh, restored.model)
    for _ in range(3):  # the same masks, call after call
        assert_bitwise_equal(np.asarray(fresh(x)), np.asarray(model(x)))
