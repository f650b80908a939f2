"""The one place where rudax.checkpoint reaches into JAX below its public API.

A restored leaf whose template named no placement must come back *uncommitted* (see
``_sharded.place_unplaced``), and JAX has no public call that makes an uncommitted array of
buffers that already exist: ``jnp.asarray``/``jax.device_put`` of host data copy it into new
device memory, ``jax.make_array_from_single_device_arrays`` commits. The copy is what a
restore of such leaves used to pay on top of orbax's own read, about 0.5 s per GB on this
project's CPU machine (fresh memory is slow on its VM), 0.7x plain orbax's throughput in all.

``uncommitted`` wraps the buffers orbax placed in a new ``ArrayImpl`` marked uncommitted:
the constructor jax's own ``device_put`` result handlers call, with the same signature
``(aval, sharding, arrays, committed)`` in jax 0.10.2 and 0.11.2. Where it is missing or
refuses, it falls back to the copy, correct and slower; ``tests/checkpoint/test_compat.py``
asserts that the buffers are shared, so a JAX release that breaks this fails a test rather
than slowing restores unnoticed.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

_ArrayImpl: Any
try:
    from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # a JAX that moved it: the copy below
    _ArrayImpl = None


def default_device() -> Any:  # a jax.Device (pyright reads jax.Device as a variable)
    """The device ``jnp.asarray`` puts a new array on here (``jax.default_device`` aware)."""
    return next(iter(jax.numpy.zeros((), np.uint8).devices()))


def uncommitted(x: jax.Array) -> jax.Array:
    """x as an uncommitted array on the same device, its buffers shared where JAX allows."""
    if not x.committed:
        return x
    if _ArrayImpl is not None and isinstance(x, _ArrayImpl):
        try:
            return _ArrayImpl(x.aval, x.sharding, x._arrays, committed=False)  # pyright: ignore[reportAttributeAccessIssue]
        except (TypeError, AttributeError):
            pass
    # jnp.asarray keeps a committed array committed; through the host it is a new one.
    return jax.numpy.asarray(np.asarray(x))
