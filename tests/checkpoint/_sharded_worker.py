"""One process of the multi-process checkpoint test (run by ``run_processes``, 2 x 2 devices).

Every process builds its own part of an FSDP training record over a 4-device "fsdp" mesh that
spans both processes (``ShardedParameter.from_local`` and
``jax.make_array_from_process_local_data``: no process ever forms a full value), runs one
``fp32_master(adamw)`` update, and saves the record through one ``Checkpointer`` on the shared
directory. The test process imports ``record_values``, ``make_tx`` and ``STEP`` to compute the
same record on one device.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AX = "fsdp"
STEP = 7
SHAPES = {"w": (3, 3), "b": (3,)}  # 9 elements: 3 per rank (3 padding); 3: 1 per rank (1)
DTYPES = {"w": np.float32, "b": "bfloat16"}


def make_tx():
    import rudax.optim as ro

    return ro.fp32_master(ro.adamw(1e-2, weight_decay=0.1))


def record_values():
    """The logical values every process holds its part of: {name: NumPy array}."""
    import jax.numpy as jnp

    values = {
        name: (np.arange(np.prod(shape), dtype=np.float32) * 0.75 - 2.0).reshape(shape)
        for name, shape in SHAPES.items()
    }
    values["b"] = values["b"].astype(jnp.bfloat16)
    values["r"] = np.linspace(-1.0, 1.0, 6, dtype=np.float32)  # replicated
    values["order"] = np.arange(16, dtype=np.int32).reshape(8, 2)[::-1].copy()  # rows sharded
    return values


def update(params, opt_state):
    """One update with the parameters as their own gradient: elementwise, no communication."""
    import optax

    tx = make_tx()
    updates, opt_state = tx.update(params, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def zero_rows(process):
    """The rows of the "zeros" test's two extra leaves a process holds (2 ranks x 2 rows)."""
    zero = np.zeros((4, 2), np.int32)
    half = zero if process == 0 else np.full((4, 2), 5, np.int32)  # nonzero in process 1 only
    return zero, half


def main(directory, zeros=False):
    import rudax.checkpoint as rc
    import rudax.sharding as rs

    if jax.device_count() != 4 or jax.process_count() != 2:
        raise ValueError(f"needs 2 processes x 2 devices, got {jax.devices()}")
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices), (AX,))
    mine = [r for r, d in enumerate(devices) if d.process_index == jax.process_index()]
    values = record_values()

    asked = []

    def shards(name):
        flat = values[name].reshape(-1)

        def get(rank):
            asked.append(rank)
            k = -(-flat.size // 4)
            return flat[rank * k : (rank + 1) * k]  # unpadded: from_local pads

        return get

    params = {
        name: rs.ShardedParameter.from_local(
            shards(name), shape, mesh, AX, dtype=values[name].dtype
        )
        for name, shape in SHAPES.items()
    }
    params["r"] = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P()), values["r"], values["r"].shape
    )
    rows = values["order"].reshape(4, 2, 2)[mine].reshape(-1, 2)  # 2 rows per rank
    order = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P(AX, None)), rows, values["order"].shape
    )
    params, opt_state = jax.jit(update)(params, make_tx().init(params))
    state = {"order": order, "epoch": 2}
    if zeros:  # two more leaves: zero everywhere, and zero in process 0's shards only
        spec = NamedSharding(mesh, P(AX, None))
        for name, rows in zip(("zero", "half"), zero_rows(jax.process_index()), strict=True):
            state[name] = jax.make_array_from_process_local_data(spec, rows, (8, 2))
    record = rc.TrainingRecord.capture(model=params, optimizer=opt_state, state=state)
    # Each process can see only its own shards: a host gather would need a collective.
    leaves = [x for x in jax.tree.leaves(record) if isinstance(x, jax.Array)]
    sharded = sum(not x.is_fully_addressable for x in leaves)
    with rc.Checkpointer(directory, zeros_as_metadata=zeros) as ckpt:
        ckpt.save(STEP, record)
    return {
        "process_index": jax.process_index(),
        "ranks": mine,
        "asked": sorted(set(asked)),
        "leaves": len(leaves),
        "not_fully_addressable": sharded,
    }
