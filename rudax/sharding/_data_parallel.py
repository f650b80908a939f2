"""Data parallelism over one mesh axis: replicas start equal and average token-weighted gradients.

``DataParallel`` holds no arrays; its methods are called *inside* the user's own
``jax.shard_map`` over the same mesh, where each device runs one replica on its slice of the
batch. That is how a JAX user writes a data-parallel train step, and it keeps the collectives
inside the one jitted program with the loss and the optimizer.

What can and cannot differ between replicas inside one SPMD program: every replica traces the
same function, so the tree structure, each leaf's shape and dtype, which leaves are tied and
which gradients are None are identical on all ranks by construction; only array *values*
differ. Those static properties can only disagree *before* the arrays are placed, between
per-replica trees on the host: ``check_replicas`` checks them there. Inside ``shard_map`` the
methods check what is left to check: that the axis is bound and has the mesh's size, and that
``root`` is a rank.

``shard_map``'s default ``check_vma=True`` types every value as varying or invariant over each
axis. ``jax.grad`` with respect to a replicated (invariant) parameter then returns the gradient
already summed over ranks, so ``reduce`` sums only the gradients that still vary over the axis.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import chex
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from rudax._validation import check_floating_leaves, check_int, check_non_negative
from rudax.sharding._compat import varying_axes

_HALF = (np.dtype(jnp.bfloat16), np.dtype(np.float16))


# A gradient pytree whose leaves may be None (what they do: ``MissingGradientPolicy``); a
# chex.ArrayTree has no None leaves.
GradientTree: TypeAlias = (
    chex.Array | Iterable["GradientTree"] | Mapping[Any, "GradientTree"] | None
)


class MissingGradientPolicy(enum.Enum):
    """What ``DataParallel.reduce`` does with a gradient leaf that is None.

    REJECT: a ValueError naming the leaf's path. ZERO: the leaf counts as a zero gradient on
    every rank; since None-ness is static in SPMD (missing on one rank means missing on all),
    the reduced gradient is zero everywhere and the leaf stays None (absent) in the output.

    "Missing on some ranks only" cannot arise inside one SPMD program: a parameter one rank's
    batch does not touch gets a zero gradient from ``jax.grad`` there (never None), which is
    exactly what ZERO would count. None leaves come from trees built by hand or filtered.
    """

    REJECT = "reject"
    ZERO = "zero"


def _bit_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"uint{8 * dtype.itemsize}")


def _broadcast_leaf(x: jax.Array, axis_name: str, root: int) -> jax.Array:
    """root's value of x on every rank, bit for bit (-0.0 and NaN payloads included).

    A masked psum of the raw bits: only root contributes, so the integer sum is root's bits
    exactly, where a float psum of ``where(is_root, x, 0)`` would turn -0.0 into 0.0. It costs
    one all-reduce of x's size, where an all-gather would move N times that.
    """
    x = jnp.asarray(x)
    is_root = jax.lax.axis_index(axis_name) == root
    if x.dtype == np.bool_:
        bits = x.astype(jnp.uint8)
    else:
        bits = jax.lax.bitcast_convert_type(x, _bit_dtype(x.dtype))
    bits = jax.lax.psum(jnp.where(is_root, bits, jnp.zeros_like(bits)), axis_name)
    if x.dtype == np.bool_:
        return bits.astype(jnp.bool_)
    return jax.lax.bitcast_convert_type(bits, x.dtype)


class DataParallel:
    """Replicated parameters over the mesh axis ``axis_name``; gradients averaged by token count.

    Each rank computes ``grads_r = d(loss_sum_r)/d(params)`` on its own batch and counts its
    tokens ``w_r`` over the accumulation window; ``reduce`` returns on every rank::

        g = sum_r grads_r / sum_r w_r

    the gradient of the global token-mean loss, whatever the per-rank token counts (an equal
    ``pmean`` of per-rank mean gradients is only that when every rank has the same count).
    torch's ``DistributedDataParallel`` averages per-rank gradients equally (divides by the
    world size) and broadcasts rank 0's parameters and buffers at construction; here the
    weighting is explicit and the broadcast is ``initialize`` / ``initialize_with_buffers``.

    Args:
      mesh: a ``jax.sharding.Mesh`` (from ``jax.make_mesh`` or ``Mesh(devices, names)``).
      axis_name: the mesh axis the replicas run along.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> import rudax.sharding as rs
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> dp = rs.DataParallel(mesh, "data")
      >>> def step(w, x, mask):
      ...     loss_sum = lambda w: jnp.sum(mask * (x @ w) ** 2)
      ...     return dp.reduce(jax.grad(loss_sum)(w), jnp.sum(mask))
      >>> n = jax.device_count()
      >>> x = jax.device_put(jnp.ones((2 * n, 3)), NamedSharding(mesh, P("data")))
      >>> mask = jax.device_put(jnp.ones((2 * n,)), NamedSharding(mesh, P("data")))
      >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
      ...                           out_specs=P()))
      >>> f(jnp.ones((3,)), x, mask).shape
      (3,)

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
      VLDB 2020.
    """

    def __init__(self, mesh: jax.sharding.Mesh, axis_name: str = "data") -> None:
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {mesh=}")
        if axis_name not in mesh.axis_names:
            raise ValueError(
                f"axis_name must be one of the mesh's axes {mesh.axis_names}, got {axis_name=}"
            )
        self.mesh = mesh
        self.axis_name = axis_name
        self.size = int(mesh.shape[axis_name])

    def __repr__(self) -> str:
        return f"DataParallel(axis_name={self.axis_name!r}, size={self.size})"

    def _check_axis(self, method: str) -> None:
        try:
            size = jax.lax.axis_size(self.axis_name)
        except NameError as e:
            raise ValueError(
                f"DataParallel.{method} runs inside jax.shard_map over a mesh with axis "
                f"{self.axis_name!r}; that axis is not bound here"
            ) from e
        if size != self.size:
            raise ValueError(
                f"DataParallel.{method}: axis {self.axis_name!r} has size {size} here, but the "
                f"DataParallel was built for a mesh where it has size {self.size}"
            )

    def _check_root(self, root: Any) -> None:
        check_int("root", root)
        if not 0 <= root < self.size:
            raise ValueError(
                f"root must be a rank in [0, {self.size}) of axis {self.axis_name!r}, got {root=}"
            )

    def check_replicas(self, replicas: Sequence[chex.ArrayTree]) -> None:
        """Checks, on the host, that per-replica trees agree before they are placed on devices.

        One tree per rank; each must have replica 0's tree paths, leaf shapes and dtypes, and
        the same tied structure (leaves that are one object in replica 0 are one object in
        every replica, and only those).

        Args:
          replicas: a sequence of ``self.size`` pytrees, e.g. parameters loaded per rank.

        Returns:
          None. A ValueError names the replica, the first differing path and both values.
        """
        if len(replicas) != self.size:
            raise ValueError(
                f"replicas must hold one tree per rank of axis {self.axis_name!r} "
                f"({self.size}), got {len(replicas)}"
            )
        flat0, tree0 = jax.tree_util.tree_flatten_with_path(replicas[0])
        paths0 = [jax.tree_util.keystr(p) for p, _ in flat0]
        ties0 = _ties([x for _, x in flat0])
        for r, rep in enumerate(replicas[1:], start=1):
            flat, tree = jax.tree_util.tree_flatten_with_path(rep)
            paths = [jax.tree_util.keystr(p) for p, _ in flat]
            for a, b in zip(paths0, paths, strict=False):
                if a != b:
                    raise ValueError(f"replica {r} has leaf {b} where replica 0 has {a}")
            # jaxlib 0.10 ships its _jax module without stubs: mypy cannot resolve jax's
            # PyTreeDef alias, so it refuses the comparison PyTreeDef defines.
            if len(paths) != len(paths0) or tree != tree0:  # type: ignore[operator]
                raise ValueError(
                    f"replica {r} has tree structure {tree}, replica 0 has {tree0} "
                    f"({len(paths)} vs {len(paths0)} leaves)"
                )
            for path, (_, a), (_, b) in zip(paths0, flat0, flat, strict=True):
                for what, fn in (("shape", np.shape), ("dtype", jnp.result_type)):
                    if fn(a) != fn(b):
                        raise ValueError(
                            f"replica {r} {path}: {what} {fn(b)}, replica 0 has {fn(a)}"
                        )
            ties = _ties([x for _, x in flat])
            for i, (t0, t) in enumerate(zip(ties0, ties, strict=True)):
                if t0 != t:
                    raise ValueError(
                        f"replica {r} {paths0[i]}: tied to {paths0[t]}, "
                        f"replica 0 ties it to {paths0[t0]}"
                    )

    def initialize(self, params: chex.ArrayTree, *, root: int = 0) -> chex.ArrayTree:
        """Inside ``shard_map``: every rank's floating leaves replaced by root's, bit for bit.

        Integer and bool leaves (step counters, RNG key data, masks) are returned untouched;
        ``initialize_with_buffers`` broadcasts them too. Every output leaf that was broadcast is
        invariant over the axis, so ``out_specs=P()`` can return it as replicated.

        Args:
          params: this rank's pytree of arrays.
          root: the rank (index along ``axis_name``) whose values everyone gets.

        Returns:
          params with floating leaves equal to root's on every rank. ValueError if ``root`` is
          not a rank or the axis is not bound with the mesh's size.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import NamedSharding, PartitionSpec as P
          >>> import rudax.sharding as rs
          >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
          >>> dp = rs.DataParallel(mesh)
          >>> n = jax.device_count()  # one row per replica, each different
          >>> w = jax.device_put(jnp.arange(n * 2.0).reshape(n, 2), NamedSharding(mesh, P("data")))
          >>> init = jax.shard_map(lambda w: dp.initialize(w[0]), mesh=mesh,
          ...                      in_specs=P("data"), out_specs=P())
          >>> jax.jit(init)(w)
          Array([0., 1.], dtype=float32)
        """
        return self._initialize(params, root, "initialize", buffers=False)

    def initialize_with_buffers(self, params: chex.ArrayTree, *, root: int = 0) -> chex.ArrayTree:
        """``initialize`` that also broadcasts integer and bool leaves from ``root``.

        Args:
          params: this rank's pytree of arrays.
          root: the rank whose values everyone gets.

        Returns:
          params with every leaf equal to root's on every rank.
        """
        return self._initialize(params, root, "initialize_with_buffers", buffers=True)

    def _initialize(
        self, params: chex.ArrayTree, root: int, method: str, *, buffers: bool
    ) -> chex.ArrayTree:
        self._check_root(root)
        self._check_axis(method)

        def leaf(x: Any) -> Any:
            floating = jnp.issubdtype(jnp.result_type(x), jnp.inexact)
            return _broadcast_leaf(x, self.axis_name, root) if floating or buffers else x

        return jax.tree.map(leaf, params)

    def reduce(
        self,
        grads: GradientTree,
        local_weight: ArrayLike,
        *,
        missing: MissingGradientPolicy = MissingGradientPolicy.REJECT,
    ) -> GradientTree:
        """Inside ``shard_map``: the global gradient sum over the global token count.

        With ``grads_r`` rank r's gradient of its local loss *sum* and ``w_r`` its token count
        for the whole accumulation window::

            g = psum(grads_r) / psum(w_r)

        Under ``shard_map``'s default ``check_vma=True``, a gradient that is invariant over
        the axis (``jax.grad`` with respect to parameters passed with ``in_specs=P()``) has
        already been summed over the ranks by JAX's transpose of the implicit ``pvary``; it is
        taken as the global sum and only divided. A gradient varying over the axis (or any
        gradient under ``check_vma=False``) is this rank's and is summed with ``psum``. Both
        conventions give the same result for the same loss.

        The all-reduce runs in each gradient's own dtype (as torch DDP's does: bf16 gradients
        move as bf16); the division is done in float32 and the result is cast back. For a sum
        kept in float32 across ranks, use ``reduce_fp32``.

        Args:
          grads: this rank's gradients, floating leaves (None leaves: see ``missing``).
          local_weight: this rank's token (or sample) count, a scalar (int or float, may be
            traced). A global count of zero gives non-finite gradients.
          missing: what a None gradient leaf does (``MissingGradientPolicy``).

        Returns:
          grads' tree, each leaf the global token-mean gradient in its own dtype, the same on
          every rank (invariant over the axis).
        """
        return self._reduce(grads, local_weight, missing, "reduce", fp32=False)

    def reduce_fp32(
        self,
        grads: GradientTree,
        local_weight: ArrayLike,
        *,
        missing: MissingGradientPolicy = MissingGradientPolicy.REJECT,
    ) -> GradientTree:
        """``reduce`` with the all-reduce and the result in float32.

        For half-precision gradients, or fp32 gradients accumulated for half-precision
        parameters (``GradientAccumulator``): each leaf is cast to float32 *before* the sum, so
        the cross-rank sum does not round to bf16, and the result feeds ``fp32_master``
        directly. Costs twice the communication of a bf16 ``reduce``.

        Args:
          grads: this rank's gradients, floating leaves.
          local_weight: this rank's token count for the window.
          missing: what a None gradient leaf does.

        Returns:
          grads' tree, every leaf float32.
        """
        return self._reduce(grads, local_weight, missing, "reduce_fp32", fp32=True)

    def _reduce(
        self,
        grads: GradientTree,
        local_weight: ArrayLike,
        missing: MissingGradientPolicy,
        method: str,
        *,
        fp32: bool,
    ) -> GradientTree:
        if not isinstance(missing, MissingGradientPolicy):
            raise TypeError(f"missing must be a MissingGradientPolicy, got {missing=}")
        if missing is MissingGradientPolicy.REJECT:
            for path, g in jax.tree_util.tree_flatten_with_path(grads, is_leaf=_is_none)[0]:
                if g is None:
                    raise ValueError(
                        f"DataParallel.{method}: gradient {jax.tree_util.keystr(path)} is "
                        "None; pass missing=MissingGradientPolicy.ZERO to count it as zero "
                        "(it then stays absent)"
                    )
        check_floating_leaves("gradient", grads)
        weight = _as_weight(local_weight)
        self._check_axis(method)
        # An invariant weight is every rank's count, so psum (which multiplies it by N under
        # check_vma) is the right total either way.
        total = jax.lax.psum(weight, self.axis_name)
        tracking = self.axis_name in varying_axes(jax.lax.axis_index(self.axis_name))
        local = lambda g: not tracking or self.axis_name in varying_axes(g)

        def leaf(g: jax.Array) -> jax.Array:
            g = jnp.asarray(g)
            g = g.astype(jnp.float32) if fp32 else g
            # Under check_vma, jax.grad of a replicated (invariant) parameter already psums its
            # cotangent (the transpose of the implicit pvary); summing again would count it N
            # times. Without check_vma nothing is tracked and every gradient is local.
            s = jax.lax.psum(g, self.axis_name) if local(g) else g
            out = s.astype(jnp.float32) / total
            return out if fp32 else out.astype(g.dtype)

        return jax.tree.map(leaf, grads)


def _is_none(x: Any) -> bool:
    return x is None


def _ties(leaves: list[Any]) -> list[int]:
    """For each leaf, the index of the first leaf that is the same object."""
    first: dict[int, int] = {}
    return [first.setdefault(id(x), i) for i, x in enumerate(leaves)]


def _as_weight(weight: Any) -> jax.Array:
    if isinstance(weight, jax.core.Tracer | jax.Array | np.ndarray):
        dtype = jnp.result_type(weight)
        if np.ndim(weight) != 0 or not (
            jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
        ):
            raise TypeError(
                f"local_weight must be an int or float scalar, got shape {np.shape(weight)} "
                f"dtype {dtype}"
            )
        if not isinstance(weight, jax.core.Tracer):
            check_non_negative("local_weight", weight)
        return jnp.asarray(weight).astype(jnp.float32)
    check_non_negative("local_weight", weight)
    # float() first: a token count past 2**31 must not go through int32.
    return jnp.asarray(float(weight), jnp.float32)
