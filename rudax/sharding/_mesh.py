"""A training program's mesh: ``data=2,fsdp=4`` parsed, built, and the train state placed on it.

What every program that trains over ``data`` x ``fsdp`` does around its ``jax.shard_map``
step, one process or several (``jax.distributed``):

- ``parse_mesh`` / ``mesh_text``: the ``--mesh`` flag's ``axis=size`` pairs and back;
- ``make_mesh``: the mesh of all the job's devices in process order, so that process ``p``'s
  devices hold a contiguous block of each batch's rows (the rows it reads itself); on one
  process's CPU that many devices are simulated if JAX has not started yet;
- ``state_shardings`` / ``place``: where each leaf of the train state lives: FSDP storage
  (``rudax.sharding.ShardedParameter`` and everything shaped like it: masters, moments,
  accumulated gradients) split over ``fsdp``, the rest replicated. ``place`` also takes what
  every process holds whole (a model loaded whole, an RNG key), which ``jax.device_put``
  refuses onto other processes' devices: it becomes one replicated global array (``replicate``);
- ``batch_sharding`` / ``put_batch``: a batch's rows split over every mesh axis, made from
  each process's own rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rudax.sharding._fsdp import shard_specs

__all__ = [
    "MESH_AXES",
    "batch_sharding",
    "local_rows",
    "make_mesh",
    "mesh_text",
    "parse_mesh",
    "place",
    "put_batch",
    "replicate",
    "state_shardings",
]

# The axes a program's mesh may have, in the order they are laid out: the batch's rows over
# ``data`` (replicas of the model), then over ``fsdp`` (each device a 1/F shard of it).
MESH_AXES = ("data", "fsdp")


def parse_mesh(text: str, *, axes: Sequence[str] = MESH_AXES) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}``, axes in ``axes``' order.

    Raises:
      ValueError: naming the text, for an axis not in ``axes``, one given twice, or a size
        that is not an int >= 1 (a program turns it into its flag's error).

    Example:
      >>> from rudax.sharding import parse_mesh
      >>> parse_mesh("fsdp=4,data=2")
      {'data': 2, 'fsdp': 4}
    """
    axes = tuple(axes)
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or name not in axes:
            raise ValueError(
                f"expected axis=size pairs with axes {axes}, e.g. data=2,fsdp=4; got {text!r}"
            )
        if name in sizes:
            raise ValueError(f"axis {name!r} given twice in {text!r}")
        try:
            sizes[name] = int(size)
        except ValueError:
            raise ValueError(f"{name} size must be an int, got {text!r}") from None
        if sizes[name] < 1:
            raise ValueError(f"{name} size must be >= 1, got {text!r}")
    return {axis: sizes[axis] for axis in axes if axis in sizes}


def mesh_text(spec: Mapping[str, int]) -> str:
    """``{"data": 2, "fsdp": 4}`` -> ``"data=2,fsdp=4"``, as the flag is written."""
    return ",".join(f"{axis}={size}" for axis, size in spec.items())


def make_mesh(spec: Mapping[str, int]) -> Mesh:
    """The mesh of ``spec``'s axes and sizes over every device of the job, in process order.

    Process ``p``'s devices come as one contiguous block (sorted by process, then id), so a
    batch's rows split over the mesh give process ``p`` rows ``[p * b, (p + 1) * b)``: the rows
    it reads itself. On one process, if JAX's backend has not started, ``prod(sizes)`` CPU
    devices are asked for (``jax_num_cpu_devices``; a GPU's count is what it is).

    Raises:
      ValueError: the job's device count is not the product of the sizes; the message names
        both and the processes.

    Example:
      >>> import jax
      >>> from rudax.sharding import make_mesh
      >>> mesh = make_mesh({"data": 2, "fsdp": jax.device_count() // 2})
      >>> mesh.axis_names
      ('data', 'fsdp')
    """
    n = math.prod(spec.values())
    # jax.process_count() would start the backend: ask jax.distributed instead. Several
    # processes have their devices already (a launcher gives each its share).
    if not jax.distributed.is_initialized():
        try:  # before the backend starts; afterwards the device count is what it is
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:
            pass
    if jax.device_count() != n:
        raise ValueError(
            f"{mesh_text(spec)} needs {n} devices, the run has {jax.device_count()} "
            f"({jax.process_count()} process(es), {jax.devices()[0].platform})"
        )
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(tuple(spec.values())), tuple(spec))


def state_shardings(tree: Any, mesh: Mesh, *, axis: str = "fsdp") -> Any:
    """Where each leaf of a train state lives: a pytree of ``NamedSharding``.

    With ``axis`` in the mesh, FSDP storage (a flat ``ShardedParameter`` vector, or a stack of
    them for stacked layers) and every non-scalar leaf shaped like it are split over ``axis``
    (``rudax.sharding.shard_specs``); scalars, and on a mesh without ``axis`` everything, are
    replicated. Works on arrays, ``ShapeDtypeStruct`` and tracers (for
    ``with_sharding_constraint`` inside a step).
    """
    if axis not in mesh.axis_names:
        return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), shard_specs(tree, axis))


def replicate(x: Any, mesh: Mesh) -> jax.Array:
    """A value every process holds whole (the same on each) as one array replicated over all
    of ``mesh``'s devices, every process's: what a multi-process ``jit`` takes. A typed PRNG
    key goes as its raw data and comes back a key of the same implementation."""
    sharding = NamedSharding(mesh, P())
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.make_array_from_process_local_data(sharding, np.asarray(jax.random.key_data(x)))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def place(tree: Any, mesh: Mesh, *, axis: str = "fsdp") -> Any:
    """``tree``'s arrays put where ``state_shardings`` says.

    ``tx.init`` and ``GradientAccumulator.init`` leave fresh zeros on one device, and a
    restored checkpoint comes back unsharded: placed as the jitted steps return them, every
    update reuses the first one's compilation. A leaf this process holds whole that is to be
    replicated over other processes' devices too is ``replicate``d (``jax.device_put``
    refuses it).
    """

    def put(x: Any, sharding: NamedSharding) -> Any:
        if (
            isinstance(x, jax.Array)
            and x.is_fully_addressable
            and not sharding.is_fully_addressable
            and sharding.spec == P()
        ):
            return replicate(x, mesh)
        return jax.device_put(x, sharding)

    return jax.tree.map(put, tree, state_shardings(tree, mesh, axis=axis))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """A batch's layout: its rows (the leading axis) split over every mesh axis, in order."""
    return NamedSharding(mesh, P(tuple(mesh.axis_names)))


def local_rows(batch: Any) -> Any:
    """This process's rows of a whole batch, as ``put_batch`` takes them.

    Each leaf's rows ``[p * b, (p + 1) * b)``, ``b`` the rows per process and ``p`` this
    process's index: ``make_mesh``'s process order makes a process's devices a contiguous
    block of the batch's rows. One process: the whole batch.

    Example:
      >>> import numpy as np
      >>> from rudax.sharding import local_rows
      >>> local_rows({"tokens": np.arange(8).reshape(4, 2)})["tokens"].shape  # one process
      (4, 2)
    """
    p, n = jax.process_index(), jax.process_count()
    return jax.tree.map(lambda rows: rows[p * len(rows) // n : (p + 1) * len(rows) // n], batch)


def put_batch(local: Any, mesh: Mesh, rows: int) -> Any:
    """The global batch of ``rows`` rows, split as ``batch_sharding``, from each process's own
    rows ``local`` (a pytree of host arrays; ``make_mesh``'s process order makes a process's
    devices a contiguous block of rows). One process: ``local`` is the whole batch."""
    sharding = batch_sharding(mesh)
    return jax.tree.map(
        lambda part: jax.make_array_from_process_local_data(
            sharding, part, (rows, *np.shape(part)[1:])
        ),
        local,
    )
