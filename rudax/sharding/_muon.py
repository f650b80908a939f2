"""fsdp_muon: Muon on FSDP shards, each matrix orthogonalized whole on one device.

Muon's update is elementwise (momentum, Nesterov look-ahead, weight decay, learning rate, the
AdamW fallback) except for Newton-Schulz, which needs each matrix whole. Under FSDP every
device holds a flat, padded 1/N of every parameter (``ShardedParameter``), so the elementwise
steps run on the shards as they are, and only the Newton-Schulz input moves:

    per shape S, its n matrices dealt round-robin: matrix i to device (c + i) % N, round i // N
    X[r, j]  = this device's shard of the matrix device j takes in round r     (R, N, k)
    Y        = all_to_all(X)         Y[r, i] = device i's shard of my matrix   (R, N, k)
    O        = NS(Y.reshape(R, N*k)[:, :size].reshape(R, *S)), padded again    (R, N, k)
    back     = all_to_all(O)         back[r, j] = my shard of device j's result

``c`` counts the matrices dealt before S, so a shape whose count is not a multiple of N
leaves its last round's matrices on the devices after the previous shape's, and the devices
without one in that round skip Newton-Schulz (``lax.cond``): each device orthogonalizes
about 1/N of the matrices. A layer of layers stored stacked (storage ``(L, N*k)``) is one
matrix. Each device sends and receives about the size of its own matrices, twice, instead
of all-gathering every matrix to every device.

Why here and not ``rudax.optim.muon(mesh=...)``: rudax.optim is the layer below, it knows
arrays and pytrees but no mesh and no storage layout; the flat padded layout and the
collectives that undo it are rudax.sharding's (``ShardedParameter``). So the update rule
stays written once, in ``rudax.optim._muon``, which reads its leaves through a
``MatrixStorage``; this module gives the FSDP one, and rudax.sharding imports rudax.optim,
never the other way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from rudax.optim._inject import static_arguments
from rudax.optim._muon import (
    _SCALE_BY_MUON_STATIC,
    NS_COEFFICIENTS,
    MaskSpec,
    MatrixStorage,
    _muon,
)
from rudax.optim._torch_chain import DecayMask
from rudax.sharding._sharded_parameter import ShardedParameter, _axis_size, shard_size


@dataclasses.dataclass(frozen=True)
class _Group:
    """The matrices of one shape: ``units[i]`` is (leaf, row or None), on ``devices[i]``."""

    shape: tuple[int, ...]
    units: list[tuple[int, int | None]]
    devices: list[int]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class FSDPMatrices(MatrixStorage):
    """Muon's matrices held as ``ShardedParameter``s over ``axis_name`` of ``mesh``.

    A ``ShardedParameter`` is one leaf: its matrix has its logical shape, a stack of them
    ``(L, *logical_shape)``. Any other leaf is a whole array, orthogonalized as it is (as
    ``rudax.optim.muon`` does, on every device that holds it).
    """

    def __init__(self, mesh: Mesh, axis_name: str):
        self.num_shards = _axis_size(mesh, axis_name)
        self.mesh = mesh
        self.axis_name = axis_name

    def is_leaf(self, x: Any) -> bool:
        return isinstance(x, ShardedParameter)

    def shape(self, x: Any) -> tuple[int, ...]:
        if isinstance(x, ShardedParameter):
            return (*x.local.shape[:-1], *x.logical_shape)
        return tuple(jnp.shape(x))

    def check(self, path: Any, x: Any) -> None:
        if not isinstance(x, ShardedParameter):
            return
        where = f"params{jax.tree_util.keystr(path)}"
        if x.axis_name != self.axis_name or x.num_shards != self.num_shards:
            raise ValueError(
                f"{where} is sharded over axis {x.axis_name!r} in {x.num_shards} slices; "
                f"fsdp_muon orthogonalizes over axis_name={self.axis_name!r}, of size "
                f"{self.num_shards} in its mesh: pass the mesh and axis the model was sharded "
                "with (rudax.sharding.ShardingContext)"
            )
        storage = tuple(x.local.shape)
        width = x.num_shards * x.shard_size
        if len(storage) not in (1, 2) or storage[-1] != width:
            raise ValueError(
                f"{where}: a ShardedParameter of logical_shape={x.logical_shape} over "
                f"{x.num_shards} slices is stored ({width},) or, stacked, (L, {width}); got "
                f"storage shape {storage}"
            )

    def orthogonalize(
        self, tree: Any, newton_schulz: Callable[[jax.Array], jax.Array], dtype: Any
    ) -> Any:
        leaves, treedef = jax.tree.flatten(tree, is_leaf=self.is_leaf)
        out = list(leaves)
        sharded = [i for i, x in enumerate(leaves) if isinstance(x, ShardedParameter)]
        for i, x in enumerate(leaves):
            if not isinstance(x, ShardedParameter):
                out[i] = newton_schulz(x)
        if sharded:
            stores = [leaves[i].local for i in sharded]
            specs = tuple(P(*([None] * (s.ndim - 1)), self.axis_name) for s in stores)
            groups = self._deal([leaves[i] for i in sharded])
            body = lambda *local: self._orthogonalize_local(local, groups, newton_schulz, dtype)
            done = jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=specs)(*stores)
            for i, local in zip(sharded, done, strict=True):
                out[i] = dataclasses.replace(leaves[i], local=local)
        return jax.tree.unflatten(treedef, out)

    def _deal(self, params: list[ShardedParameter]) -> list[_Group]:
        """The matrices grouped by shape (first seen first), dealt to the devices in turn."""
        units: dict[tuple[int, ...], list[tuple[int, int | None]]] = {}
        for j, p in enumerate(params):
            if p.size == 0:
                continue  # an empty matrix's update is empty: nothing to orthogonalize
            rows: list[int | None] = [None] if p.local.ndim == 1 else list(range(p.local.shape[0]))
            units.setdefault(p.logical_shape, []).extend((j, r) for r in rows)
        groups, dealt = [], 0
        for shape, members in units.items():
            devices = [(dealt + i) % self.num_shards for i in range(len(members))]
            groups.append(_Group(shape, members, devices))
            dealt += len(members)
        return groups

    def _orthogonalize_local(
        self,
        local: tuple[jax.Array, ...],
        groups: list[_Group],
        newton_schulz: Callable[[jax.Array], jax.Array],
        dtype: Any,
    ) -> tuple[jax.Array, ...]:
        """One device's part, inside ``shard_map``: its shards in, its shards of NS out."""
        n, axis = self.num_shards, self.axis_name
        me = lax.axis_index(axis)
        done: dict[tuple[int, int | None], jax.Array] = {}
        for g in groups:
            k = shard_size(g.size, n)
            count = len(g.units)
            rounds, full = -(-count // n), count // n
            # Cast before sending: Newton-Schulz's first step is this cast (half the bytes
            # for bf16), so the values are those one device orthogonalizes.
            slots: list[jax.Array | None] = [None] * (rounds * n)
            for i, (j, row) in enumerate(g.units):
                shard = local[j] if row is None else local[j][row]
                slots[(i // n) * n + g.devices[i]] = shard.astype(dtype)
            zero = jnp.zeros((k,), dtype)
            x = jnp.stack([zero if s is None else s for s in slots]).reshape(rounds, n, k)
            mine = lax.all_to_all(x, axis, 1, 1, tiled=True)
            whole = mine.reshape(rounds, n * k)[:, : g.size].reshape(rounds, *g.shape)
            parts = []
            if full:
                parts.append(newton_schulz(whole[:full]))
            if count > full * n:
                # The last round holds count % n matrices: the other devices received only
                # zeros, and skip the work (their result is never read back).
                has_one = np.zeros(n, bool)
                has_one[g.devices[full * n :]] = True
                last = lax.cond(jnp.asarray(has_one)[me], newton_schulz, lambda m: m, whole[full])
                parts.append(last[None])
            o = jnp.concatenate(parts).astype(dtype).reshape(rounds, g.size)
            o = jnp.pad(o, ((0, 0), (0, n * k - g.size))).reshape(rounds, n, k)
            back = lax.all_to_all(o, axis, 1, 1, tiled=True)
            for i, unit in enumerate(g.units):
                done[unit] = back[i // n, g.devices[i]]
        outs = []
        for j, x in enumerate(local):
            zero = jnp.zeros(x.shape[-1:], dtype)
            if x.ndim == 1:
                outs.append(done.get((j, None), zero))
            else:
                rows = [done.get((j, r), zero) for r in range(x.shape[0])]
                outs.append(jnp.stack(rows) if rows else jnp.zeros(x.shape, dtype))
        return tuple(outs)


@static_arguments(*_SCALE_BY_MUON_STATIC, "muon_mask", "mask", "mesh", "axis_name")
def fsdp_muon(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: float | jax.Array = 0.1,
    momentum: float | jax.Array = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    *,
    mesh: Mesh,
    axis_name: str = "fsdp",
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float | jax.Array = 1e-7,
    adjust_lr_fn: str | None = None,
    matrix_layout: str = "in_out",
    stacked: bool = False,
    muon_mask: MaskSpec = None,
    adamw_learning_rate: optax.ScalarOrSchedule | None = None,
    adamw_b1: float | jax.Array = 0.9,
    adamw_b2: float | jax.Array = 0.999,
    adamw_eps: float | jax.Array = 1e-8,
    adamw_weight_decay: float | jax.Array | None = None,
    ns_dtype: DTypeLike = jnp.bfloat16,
    moment_dtype: DTypeLike | None = None,
    mask: DecayMask = None,
) -> optax.GradientTransformation:
    """``rudax.optim.muon`` on FSDP-sharded parameters, each matrix orthogonalized on one device.

    The update is ``rudax.optim.muon``'s on the logical (unsharded) parameters: Muon
    (``torch.optim.Muon``'s rule) on the matrices ``muon_mask`` selects, torch-style AdamW
    on the rest, decay by ``mask``::

        p_t = p_{t-1} (1 - lr_t wd) - lr_t r NS(M_t)     M_t: momentum (Nesterov) of g_t

    A parameter is a ``ShardedParameter`` (``rudax.sharding.ShardingContext``,
    ``rudax.models.shard``): flat, padded, 1/N on each device of ``axis_name``, counted as
    one leaf with its logical shape (``muon_mask`` and ``mask`` give one bool per
    ``ShardedParameter``). Everything but Newton-Schulz is elementwise and runs on the shards,
    so the state (momentum, AdamW's moments) is sharded like the parameters, 1/N per device.
    Newton-Schulz needs each matrix whole: the matrices of each shape are dealt to the
    devices round-robin, an ``all_to_all`` gives each device whole the matrices it was dealt,
    it orthogonalizes them, and a second ``all_to_all`` returns each device its shards. Each
    device runs Newton-Schulz on about 1/N of the matrices (a shape's leftover matrices, its
    count mod N, go to the devices after the previous shape's), not on all of them.

    With ``stacked=True`` a stack of layers' parameters (storage ``(L, N*k)``, layers stored
    stacked) is L matrices, each dealt on its own. A leaf that is not a ``ShardedParameter``
    is taken whole, as ``rudax.optim.muon`` takes it. A mesh with other axes (``data``) runs
    the same Newton-Schulz on each of their slices. Call ``update`` inside or outside
    ``jax.jit``, on the global sharded arrays (not inside ``shard_map``): it runs its own.

    Args:
      learning_rate: Muon's learning rate, a float >= 0 or a schedule of the update count.
      weight_decay: Muon's decoupled weight decay (``rudax.optim.muon``'s).
      momentum: EMA decay of the momentum buffer, in [0, 1).
      nesterov: use Nesterov momentum.
      ns_steps: Newton-Schulz iterations, 1 to 99.
      mesh: the ``jax.sharding.Mesh`` the parameters are sharded over (Auto or Explicit axes).
      axis_name: the mesh axis they are sharded over, as ``ShardingContext``'s.
      ns_coefficients, eps, adjust_lr_fn, matrix_layout, stacked, muon_mask,
        adamw_learning_rate, adamw_b1, adamw_b2, adamw_eps, adamw_weight_decay, ns_dtype,
        moment_dtype, mask: as in ``rudax.optim.muon``, with its defaults.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``rudax.optim.muon``'s state (on the
      shards); its ``update`` needs ``params``. A Muon ``ShardedParameter`` over another axis
      or shard count than ``mesh``'s ``axis_name`` is a ValueError naming its path, and so is
      one whose logical shape is not a matrix (or a stack of them with ``stacked=True``).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import rudax.optim as ro, rudax.sharding as rs
      >>> mesh = jax.sharding.Mesh(jax.devices(), ("fsdp",))
      >>> full = {"w": jnp.ones((6, 5)), "b": jnp.zeros(5)}
      >>> grads = {"w": jnp.arange(30.0).reshape(6, 5), "b": jnp.ones(5)}
      >>> shard = lambda tree: jax.tree.map(lambda x: rs.ShardedParameter.from_full(x, mesh), tree)
      >>> tx = rs.fsdp_muon(0.02, mesh=mesh, ns_dtype=jnp.float32)  # "w" to Muon, "b" to AdamW
      >>> state = tx.init(shard(full))
      >>> updates, state = jax.jit(tx.update)(shard(grads), state, shard(full))
      >>> updates["w"].local.shape  # 30 values padded to 32, 4 on each of 8 devices
      (32,)
      >>> ref = ro.muon(0.02, ns_dtype=jnp.float32)  # one device, whole matrices
      >>> want, _ = ref.update(grads, ref.init(full), full)
      >>> bool(np.allclose(updates["w"].unshard(), want["w"], atol=1e-6))
      True

    References:
      Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024; Liu et al.,
      `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025 (their
      distributed Muon gathers each matrix over the data-parallel group); Rajbhandari et
      al., `ZeRO <https://arxiv.org/abs/1910.02054>`_, 2020.
    """
    return _muon(
        learning_rate,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        ns_coefficients=ns_coefficients,
        eps=eps,
        adjust_lr_fn=adjust_lr_fn,
        matrix_layout=matrix_layout,
        stacked=stacked,
        muon_mask=muon_mask,
        adamw_learning_rate=adamw_learning_rate,
        adamw_b1=adamw_b1,
        adamw_b2=adamw_b2,
        adamw_eps=adamw_eps,
        adamw_weight_decay=adamw_weight_decay,
        ns_dtype=ns_dtype,
        moment_dtype=moment_dtype,
        mask=mask,
        storage=FSDPMatrices(mesh, axis_name),
        owner="fsdp_muon",
    )
