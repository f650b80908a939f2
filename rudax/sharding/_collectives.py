"""Differentiable collectives over one mesh axis, for use inside ``jax.shard_map``.

Every op's gradient is the gradient of the *sum of the ranks' local losses*: each rank computes
a loss from its own outputs, and the gradients are those of their sum. Under that convention

* ``all_gather`` (tiled) transposes to a tiled reduce-scatter, and the reverse;
* ``scatter`` of a value replicated on every rank transposes to a gather of the slices'
  cotangents (each rank's slice is used only by that rank);
* ``broadcast`` transposes to a sum of the cotangents onto ``root`` (zero elsewhere);
* ``all_reduce`` "sum" and "mean" transpose to themselves; "max" sends the summed cotangent to
  the ranks holding the maximum, split equally among ties (``jnp.max``'s convention).

JAX's own transposes give the first four (``lax.all_gather`` and ``lax.psum_scatter`` are each
other's transpose; slicing at ``lax.axis_index`` of an unvarying value and ``lax.psum`` of a
masked value transpose through shard_map's replication tracking). ``lax.pmax`` has no
differentiation rule, so "max" has a ``custom_vjp``.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from rudax._validation import check_int
from rudax.sharding._compat import varying_axes

AxisName = Any  # a mesh axis name (usually a str) as passed to ``jax.shard_map``'s specs
ReduceOp = Literal["sum", "mean", "max"]

REDUCE_OPS = ("sum", "mean", "max")


def _axis_size(axis_name: AxisName) -> int:
    """The size of a bound mesh axis; ValueError outside a ``shard_map`` binding it."""
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(f"axis_name must be a non-empty str, got {axis_name=!r}")
    try:
        return lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not a bound mesh axis: call the collective inside "
            "jax.shard_map over a mesh with that axis name"
        ) from e


def _normalize_dim(dim: Any, ndim: int) -> int:
    """dim in [-ndim, ndim) as a non-negative index; ValueError naming dim and ndim."""
    check_int("dim", dim)
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"dim must be in [{-ndim}, {ndim}) for an input of ndim={ndim}, got {dim=}"
        )
    return int(dim) % ndim


def all_gather(x: jax.Array, axis_name: AxisName, *, dim: int = 0) -> jax.Array:
    """Concatenates every rank's ``x`` along ``dim``, in the mesh axis's rank order.

    ``out = concatenate([x_0, x_1, ..., x_{N-1}], axis=dim)`` on every rank (tiled: ``dim``
    grows N times, no new axis). The backward pass is a tiled reduce-scatter: rank ``r``'s
    gradient is the ``r``-th slice, along ``dim``, of the sum of all ranks' cotangents.

    Args:
      x: this rank's block; every rank's must have the same shape and dtype.
      axis_name: the mesh axis to gather over (bound by ``jax.shard_map``).
      dim: the dimension to concatenate along; negative counts from the end.

    Returns:
      An array like ``x`` with ``dim`` N times longer, N the axis size.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> from rudax.sharding.collectives import all_gather
      >>> n = jax.device_count()
      >>> mesh = Mesh(jax.devices(), ("data",))
      >>> x = jax.device_put(jnp.arange(n * 2.0).reshape(n, 2), NamedSharding(mesh, P("data")))
      >>> f = jax.shard_map(
      ...     lambda b: all_gather(b, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")
      ... )
      >>> bool((f(x)[:n] == x).all())
      True

    References:
      PyTorch ``torch.distributed.all_gather_into_tensor``; JAX ``lax.all_gather(tiled=True)``.
    """
    x = jnp.asarray(x)
    d = _normalize_dim(dim, x.ndim)
    _axis_size(axis_name)
    return lax.all_gather(x, axis_name, axis=d, tiled=True)


def scatter(x: jax.Array, axis_name: AxisName, *, dim: int = 0) -> jax.Array:
    """This rank's equal, contiguous slice of ``x`` along ``dim``.

    ``out = x[..., r*k:(r+1)*k, ...]`` (along ``dim``), with ``r`` the rank's index on the axis
    and ``k = x.shape[dim] // N``. ``x`` is meant to hold the same value on every rank (a
    replicated input); its gradient is then the gather of every rank's slice cotangent.

    Args:
      x: the full value, the same on every rank.
      axis_name: the mesh axis to split over (bound by ``jax.shard_map``).
      dim: the dimension to split; negative counts from the end. Its size must divide by N.

    Returns:
      An array like ``x`` with ``dim`` N times shorter.

    Raises:
      ValueError: ``x.shape[dim]`` does not divide by the axis size.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from rudax.sharding.collectives import scatter
      >>> n = jax.device_count()
      >>> mesh = Mesh(jax.devices(), ("data",))
      >>> x = jnp.arange(n * 3.0)
      >>> f = jax.shard_map(
      ...     lambda v: scatter(v, "data"), mesh=mesh, in_specs=P(), out_specs=P("data")
      ... )
      >>> bool((f(x) == x).all())
      True

    References:
      Megatron-LM's ``scatter_to_tensor_model_parallel_region`` (forward split, backward
      gather); PyTorch ``torch.distributed.scatter`` takes its slices from one root instead.
    """
    x = jnp.asarray(x)
    d = _normalize_dim(dim, x.ndim)
    n = _axis_size(axis_name)
    if x.shape[d] % n:
        raise ValueError(
            f"scatter: x.shape[{dim}]={x.shape[d]} (dim={dim}, shape={x.shape}) does not divide "
            f"by the size {n} of mesh axis {axis_name!r}"
        )
    k = x.shape[d] // n
    # axis_index makes the slice vary over the axis; shard_map's replication tracking then
    # transposes the slice of an unvarying x into a sum (the gather) of the slices' cotangents.
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis_name) * k, k, axis=d)


def broadcast(x: jax.Array, axis_name: AxisName, *, root: int) -> jax.Array:
    """Every rank gets rank ``root``'s ``x``.

    ``out = x_root`` on every rank. The backward pass sums every rank's cotangent onto
    ``root``; the other ranks' ``x`` did not reach any output, so their gradient is zero.

    Args:
      x: this rank's value; every rank's must have the same shape and dtype (numeric).
      axis_name: the mesh axis to broadcast over (bound by ``jax.shard_map``).
      root: the index, on that axis, of the rank whose value is sent: ``0 <= root < N``.

    Returns:
      ``x`` of rank ``root``, with ``x``'s shape and dtype.

    Raises:
      ValueError: ``root`` is outside ``[0, N)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> from rudax.sharding.collectives import broadcast
      >>> n = jax.device_count()
      >>> mesh = Mesh(jax.devices(), ("data",))
      >>> x = jax.device_put(jnp.arange(float(n)), NamedSharding(mesh, P("data")))
      >>> f = jax.shard_map(
      ...     lambda v: broadcast(v, "data", root=n - 1),
      ...     mesh=mesh, in_specs=P("data"), out_specs=P("data"),
      ... )
      >>> bool((f(x) == n - 1).all())
      True

    References:
      PyTorch ``torch.distributed.broadcast``.
    """
    x = jnp.asarray(x)
    check_int("root", root)
    n = _axis_size(axis_name)
    if not 0 <= root < n:
        raise ValueError(f"root must be in [0, {n}) for mesh axis {axis_name!r}, got {root=}")
    # A masked psum rather than a gather-and-index: it moves x once, not N times, and its
    # transpose (psum, then the same mask) is exactly "sum the cotangents onto root".
    is_root = lax.axis_index(axis_name) == root
    return lax.psum(jnp.where(is_root, x, jnp.zeros_like(x)), axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _pmax(x: jax.Array, axis_name: AxisName) -> jax.Array:
    return lax.pmax(x, axis_name)


def _pmax_fwd(x: jax.Array, axis_name: AxisName) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    out = lax.pmax(x, axis_name)
    return out, (x, out)


def _pmax_bwd(axis_name: AxisName, res: tuple[jax.Array, jax.Array], ct: jax.Array):
    x, out = res
    # Every rank's output is the maximum, so the summed cotangent belongs to the ranks that
    # hold it, split equally among ties, as jnp.max splits it among tied elements.
    is_max = (x == out).astype(ct.dtype)
    ties = lax.psum(is_max, axis_name)
    # With replication tracking (shard_map's default check_vma=True) and an x that varies over
    # the axis, the output is unvarying and its cotangent arrives already summed over the ranks
    # (the transpose of the implicit pvary before each rank's use). Without tracking the
    # cotangent is per rank and is summed here. For an unvarying x the psum gives N times the
    # (already summed) cotangent and all N ranks tie, so x's gradient is that cotangent.
    if axis_name not in varying_axes(x):
        ct = lax.psum(ct, axis_name)
    return (ct * is_max / ties,)


_pmax.defvjp(_pmax_fwd, _pmax_bwd)


def all_reduce(x: jax.Array, axis_name: AxisName, *, op: ReduceOp = "sum") -> jax.Array:
    """Elementwise sum, mean or maximum of every rank's ``x``, on every rank.

    ``out = op(x_0, ..., x_{N-1})`` elementwise. Gradients (of the sum of the ranks' losses):
    "sum" gives every rank the sum of the cotangents, "mean" that sum over N, and "max" gives
    the sum of the cotangents to the ranks holding the maximum, divided by their count where
    several tie (``jnp.max``'s rule), and zero to the others.

    Args:
      x: this rank's value; every rank's must have the same shape and dtype.
      axis_name: the mesh axis to reduce over (bound by ``jax.shard_map``).
      op: "sum", "mean" or "max".

    Returns:
      The reduction, with ``x``'s shape and dtype, the same on every rank.

    Raises:
      ValueError: ``op`` is not one of "sum", "mean", "max".

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> from rudax.sharding.collectives import all_reduce
      >>> n = jax.device_count()
      >>> mesh = Mesh(jax.devices(), ("data",))
      >>> x = jax.device_put(jnp.arange(float(n)), NamedSharding(mesh, P("data")))
      >>> f = jax.shard_map(
      ...     lambda v: all_reduce(v, "data", op="max"),
      ...     mesh=mesh, in_specs=P("data"), out_specs=P(),
      ... )
      >>> float(f(x)[0]) == n - 1
      True

    References:
      PyTorch ``torch.distributed.all_reduce`` (``ReduceOp.SUM``, ``AVG``, ``MAX``); torch's
      autograd-aware ``torch.distributed.nn.all_reduce`` supports only the sum's gradient.
    """
    if not isinstance(op, str) or op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op=!r}")
    x = jnp.asarray(x)
    _axis_size(axis_name)
    if op == "sum":
        return lax.psum(x, axis_name)
    if op == "mean":
        return lax.pmean(x, axis_name)
    return _pmax(x, axis_name)
