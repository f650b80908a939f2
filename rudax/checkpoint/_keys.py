"""Typed PRNG keys in a checkpoint: stored as their key data, restored as keys of their impl.

``jax.random.key`` and flax ``nnx.Rngs`` (dropout, any module holding RNG streams) make typed
key arrays, whose dtype (``key<fry>``) orbax cannot store. A record may hold them anywhere,
in any part: saving hands orbax, and the checksums, ``jax.random.key_data`` of each key (uint32,
the key's shape plus the impl's trailing dimension) and the layout row keeps the key's own
shape and dtype name, which names its impl. Restoring reads the data into the template key's
placement and wraps it with ``jax.random.wrap_key_data`` under that impl: the same bits, the
same random streams. A template key of another impl or shape is a layout error, as any other
dtype or shape difference.

The dtype names are JAX's (``str(key.dtype)``); the table below is this JAX's, checked
against each key at save and by a test, so a JAX that renames one fails loudly, not silently.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# {key dtype name: impl name for jax.random.key / wrap_key_data}: JAX's built-in impls.
KEY_IMPLS = {"key<fry>": "threefry2x32", "key<rbg>": "rbg", "key<urbg>": "unsafe_rbg"}


def is_key(x: Any) -> bool:
    """True for a typed key array or a ``ShapeDtypeStruct`` standing for one."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def dtype_name(dtype: Any) -> str:
    """The name a layout row gives a dtype: NumPy's, or JAX's for a key dtype."""
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return str(dtype)
    return str(np.dtype(dtype))


def check_key(where: str, leaf: Any) -> None:
    """TypeError naming where unless leaf is a key of a built-in impl this table knows."""
    name = str(leaf.dtype)
    impl = KEY_IMPLS.get(name)
    if impl is None:
        raise TypeError(
            f"{where} is a PRNG key array of dtype {name}, an impl a checkpoint does not know "
            f"(known: {sorted(KEY_IMPLS)}); store jax.random.key_data(key) instead"
        )
    if isinstance(leaf, jax.Array) and jax.random.key_impl(leaf) != impl:
        raise TypeError(
            f"{where} has dtype {name}, which rudax takes for impl {impl!r}, but its impl is "
            f"{jax.random.key_impl(leaf)!r}: this JAX names its key dtypes differently"
        )


@functools.cache
def _trailing(name: str) -> tuple[int, ...]:
    impl = KEY_IMPLS[name]
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape


def key_data(tree: Any) -> Any:
    """tree with each typed key leaf replaced by its key data: what orbax stores."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def _data_sharding(sharding: Any) -> Any:
    # A PartitionSpec shorter than the array leaves the trailing dimensions unsharded: the
    # key's spec places its data as the key is placed.
    if sharding is None or isinstance(
        sharding, jax.sharding.SingleDeviceSharding | jax.sharding.NamedSharding
    ):
        return sharding
    raise TypeError(
        f"a key template leaf placed with {type(sharding).__name__} cannot be restored; give "
        "it a NamedSharding, a SingleDeviceSharding or no placement"
    )


def data_template(tree: Any) -> Any:
    """A restore template with each key leaf replaced by one for its key data, same placement.

    A key ``jax.Array`` gives its own key data (committed as the key is, or not); a
    ``ShapeDtypeStruct`` of a key dtype gives one of the data's shape, the sharding's
    trailing dimensions unsharded.
    """

    def data(x: Any) -> Any:
        if not is_key(x):
            return x
        if isinstance(x, jax.Array):
            return jax.random.key_data(x)
        trailing = _trailing(str(x.dtype))
        sharding = _data_sharding(x.sharding)
        return jax.ShapeDtypeStruct((*x.shape, *trailing), np.dtype(np.uint32), sharding=sharding)

    return jax.tree.map(data, tree)


def rewrap(restored: Any, template: Any) -> Any:
    """restored with each leaf whose template leaf is a key wrapped as a key of its impl."""

    def wrap(t: Any, r: Any) -> Any:
        if not is_key(t):
            return r
        return jax.random.wrap_key_data(r, impl=KEY_IMPLS[str(t.dtype)])

    return jax.tree.map(wrap, template, restored)
