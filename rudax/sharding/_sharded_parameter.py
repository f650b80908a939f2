"""ShardedParameter: one logical parameter stored flat, padded and split evenly over a mesh axis.

FSDP (ZeRO-3) keeps 1/N of every parameter on each device and gathers the whole value only for
the moment it is used. The layout here is the simplest that makes that cheap: the parameter is
flattened in row-major order, zero-padded at the end to a multiple of N, and rank ``r`` holds
the contiguous elements ``[r*k, (r+1)*k)`` with ``k = ceil(size / N)``. Gathering is then one
tiled all-gather and a slice; its transpose is one reduce-scatter, and since every element of
the flat vector belongs to exactly one rank, an elementwise optimizer (AdamW, SGD, ...) can run
on the shards directly with no communication.

A ``ShardedParameter`` is a pytree whose only leaf is the flat storage: outside ``shard_map`` a
global array of shape ``(N*k,)`` placed with ``PartitionSpec(axis_name)``, inside it this
rank's ``(k,)`` slice. The logical shape, the axis name and N are static metadata.

Layers stored stacked (``rudax.layers.stack_layers``) hold L parameters of one shape in one
array: ``from_full(value, ..., stacked=True)`` pads and splits each of the L on its own, so
the storage is ``(L, N*k)``, placed with ``PartitionSpec(None, axis_name)``. A
``lax.scan`` over the layers (``rudax.layers.scan_layers``) slices the leading axis away, and
each step gathers one layer's parameter, as a parameter of its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike, DTypeLike

from rudax._validation import check_int, float_dtype
from rudax.sharding._compat import vary_over_mesh
from rudax.sharding.collectives import all_gather


def _axis_size(mesh: Any, axis_name: Any) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}: {mesh=}")
    if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
        raise ValueError(
            f"axis_name must be one of the mesh's axes {mesh.axis_names}, got {axis_name=}"
        )
    return int(mesh.shape[axis_name])


def _check_shape(logical_shape: Any) -> tuple[int, ...]:
    if not isinstance(logical_shape, Sequence) or isinstance(logical_shape, str):
        raise TypeError(f"logical_shape must be a tuple of ints, got {logical_shape=}")
    for d in logical_shape:
        check_int("logical_shape[i]", d)
        if d < 0:
            raise ValueError(f"logical_shape must have non-negative sizes, got {logical_shape=}")
    return tuple(int(d) for d in logical_shape)


def shard_size(size: int, num_shards: int) -> int:
    """Elements per shard, ``ceil(size / num_shards)``, at least 1 so every slice is non-empty."""
    return max(1, -(-size // num_shards))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedParameter:
    """A logical parameter stored as N equal contiguous slices of its padded flat value.

    With ``size = prod(logical_shape)`` and ``k = ceil(size / N)``::

        flat    = concatenate([value.reshape(-1), zeros(N*k - size)])
        local_r = flat[r*k:(r+1)*k]                       (rank r's storage)
        gather  = all_gather(local, tiled)[:size].reshape(logical_shape)

    The gradient of ``gather`` is the reduce-scatter of the ranks' cotangents: the gradient of
    the *sum of the ranks' local losses* with respect to this rank's slice (no further
    all-reduce is needed). The padding is never read, so its gradient is exactly zero and an
    elementwise optimizer keeps it zero (weight decay of zero is zero).

    Args:
      local: the flat storage; the only pytree leaf (see the module docstring).
      logical_shape: the parameter's shape.
      axis_name: the mesh axis the slices are spread over.
      num_shards: N, that axis's size.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> import rudax.sharding as rs
      >>> mesh = jax.sharding.Mesh(jax.devices(), ("fsdp",))
      >>> w = rs.ShardedParameter.from_full(jnp.arange(15.0).reshape(5, 3), mesh, "fsdp")
      >>> f = jax.shard_map(
      ...     lambda p: p.gather()[None], mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp")
      ... )
      >>> f(w).shape[1:]
      (5, 3)

    References:
      Rajbhandari et al., `ZeRO: Memory Optimizations Toward Training Trillion Parameter
      Models <https://arxiv.org/abs/1910.02054>`_, 2020; PyTorch FSDP's ``FlatParameter``.
    """

    local: jax.Array
    logical_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    axis_name: str = dataclasses.field(metadata=dict(static=True))
    num_shards: int = dataclasses.field(metadata=dict(static=True))

    @property
    def size(self) -> int:
        """Number of logical elements."""
        return math.prod(self.logical_shape)

    @property
    def shard_size(self) -> int:
        """Elements per rank, k (padding included)."""
        return shard_size(self.size, self.num_shards)

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype."""
        return np.dtype(self.local.dtype)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The logical flat elements ``[start, stop)`` rank ``rank`` holds (stop may be < its k)."""
        return _shard_range(self.size, self.num_shards, rank)

    @property
    def stacked(self) -> bool:
        """Whether the storage holds a stack of parameters on a leading axis (``from_full``)."""
        return self.local.ndim == 2

    @classmethod
    def from_full(
        cls, value: ArrayLike, mesh: Mesh, axis_name: str = "fsdp", *, stacked: bool = False
    ) -> ShardedParameter:
        """Pads and splits a full value, placing slice r on rank r of ``axis_name``.

        ``stacked=True``: ``value``'s leading axis indexes L parameters of shape
        ``value.shape[1:]`` (the logical shape), each padded and split on its own: the
        storage is ``(L, N*k)``, split over its last axis.
        """
        n = _axis_size(mesh, axis_name)
        value = jnp.asarray(value)
        if not stacked:
            k = shard_size(value.size, n)
            flat = jnp.pad(value.reshape(-1), (0, n * k - value.size))
            local = jax.device_put(flat, NamedSharding(mesh, P(axis_name)))
            return cls(local, tuple(value.shape), axis_name, n)
        if value.ndim < 1:
            raise ValueError(f"stacked=True needs a leading axis, got shape {value.shape}")
        shape = tuple(value.shape[1:])
        size = math.prod(shape)
        k = shard_size(size, n)
        flat = jnp.pad(value.reshape(value.shape[0], size), ((0, 0), (0, n * k - size)))
        local = jax.device_put(flat, NamedSharding(mesh, P(None, axis_name)))
        return cls(local, shape, axis_name, n)

    @classmethod
    def from_local(
        cls,
        shards: Sequence[ArrayLike] | Mapping[int, ArrayLike] | Callable[[int], ArrayLike],
        logical_shape: Sequence[int],
        mesh: Mesh,
        axis_name: str = "fsdp",
        *,
        dtype: DTypeLike,
        layers: int | None = None,
    ) -> ShardedParameter:
        """Builds the parameter from per-rank slices, without ever forming the full value.

        ``shards[r]`` (or ``shards(r)``) is rank r's part of the row-major flattened value:
        the elements ``shard_range(r)``, optionally already zero-padded to k. Only the ranks
        on this process's devices are asked for, so a multi-process loader reads its own part.
        ``layers=L``: a stack of L parameters (``from_full(..., stacked=True)``'s layout),
        ``shards[r]`` then rank r's part of each, shape ``(L, stop - start)`` (or ``(L, k)``).
        """
        shape = _check_shape(logical_shape)
        n = _axis_size(mesh, axis_name)
        dtype = np.dtype(dtype)
        size = math.prod(shape)
        k = shard_size(size, n)
        get = shards if callable(shards) else shards.__getitem__
        if layers is not None:
            check_int("layers", layers)
            if layers < 1:
                raise ValueError(f"layers must be a positive int or None, got {layers=}")
        lead = () if layers is None else (layers,)

        def load(index: tuple[slice, ...] | None) -> np.ndarray:
            # jax types the index Optional ("TODO: Remove None from callback input type") but
            # asserts it is not None before calling: one slice per axis, the last one split.
            assert index is not None
            rank = (index[-1].start or 0) // k
            start, stop = _shard_range(size, n, rank)
            part = np.asarray(get(rank))
            if part.dtype != dtype:
                raise TypeError(f"shards[{rank}] has dtype {part.dtype}, expected {dtype=}")
            if part.shape not in ((*lead, stop - start), (*lead, k)):
                raise ValueError(
                    f"shards[{rank}] must have shape {(*lead, stop - start)} (or "
                    f"{(*lead, k)} padded) for logical_shape={shape} over {n} shards, got "
                    f"shape {part.shape}"
                )
            if np.any(part[..., stop - start :] != 0):
                raise ValueError(
                    f"shards[{rank}]: its padding (elements {stop - start}: of {k}, past the "
                    f"logical size {size}) must be zero"
                )
            return np.pad(part, [(0, 0)] * len(lead) + [(0, k - part.shape[-1])])

        spec = P(axis_name) if layers is None else P(None, axis_name)
        local = jax.make_array_from_callback((*lead, n * k), NamedSharding(mesh, spec), load)
        return cls(local, shape, axis_name, n)

    def gather(self, dtype: DTypeLike | None = None) -> jax.Array:
        """The logical value, inside ``shard_map`` over ``axis_name``.

        The result is typed as varying over the axis (shard_map's ``check_vma``): each rank's
        use of it is its own, and its cotangents are summed by the reduce-scatter alone. An
        invariant gather would add an all-reduce of the full gradient before the slice.

        ``dtype`` casts the slice *before* the all-gather, so the gather and its backward
        reduce-scatter move that dtype (half the bytes for bf16); the storage is unchanged.
        """
        dtype = float_dtype("dtype", dtype)
        n = lax.axis_size(self.axis_name) if _bound(self.axis_name) else None
        if n is None:
            raise ValueError(
                f"gather: axis_name={self.axis_name!r} is not bound; call it inside jax.shard_map "
                f"with in_specs=P({self.axis_name!r}) for the parameter"
            )
        if self.stacked:
            raise ValueError(
                f"gather: a stack of {self.local.shape[0]} parameters of logical_shape="
                f"{self.logical_shape} is gathered one at a time: scan over its leading axis "
                "(rudax.layers.scan_layers) and gather each slice"
            )
        if n != self.num_shards or self.local.shape != (self.shard_size,):
            raise ValueError(
                f"gather: parameter of logical_shape={self.logical_shape} was split into "
                f"{self.num_shards} slices of {self.shard_size}; inside shard_map the axis "
                f"{self.axis_name!r} has size {n} and the local slice has shape "
                f"{self.local.shape} (was it passed with in_specs=P({self.axis_name!r}))?"
            )
        local = self.local if dtype is None else self.local.astype(dtype)
        # varying over the mesh's other axes too: the gradient is then reduce-scattered
        # before it is summed over them, not summed whole and then cut
        flat = all_gather(vary_over_mesh(local), self.axis_name)
        return flat[: self.size].reshape(self.logical_shape)

    def unshard(self) -> np.ndarray:
        """The logical value on the host, outside ``shard_map`` (for tests and checkpoints);
        a stack's is ``(L, *logical_shape)``."""
        local = np.asarray(jax.device_get(self.local))
        return local[..., : self.size].reshape((*local.shape[:-1], *self.logical_shape))


def _bound(axis_name: str) -> bool:
    try:
        lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def _shard_range(size: int, num_shards: int, rank: int) -> tuple[int, int]:
    check_int("rank", rank)
    if not 0 <= rank < num_shards:
        raise ValueError(f"rank must be in [0, {num_shards}), got {rank=}")
    k = shard_size(size, num_shards)
    return min(rank * k, size), min((rank + 1) * k, size)
