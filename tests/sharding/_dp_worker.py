"""One process of the multi-process DataParallel test (run by ``_multiprocess.run_processes``).

The key test of ``test_data_parallel.py`` across processes: a 1-D mesh over every process's
devices, unequal token counts per rank, replicas that start different. Each process places
only its own ranks' rows with ``jax.make_array_from_process_local_data``; ``initialize`` and
``reduce`` run inside ``jax.shard_map``, so their collectives cross the process boundary.
The test process imports ``data`` and ``token_losses`` to compute the one-device reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

COUNTS = np.array([1, 4, 0, 3])  # tokens per global rank; one rank has none
L, D, H = 4, 3, 5  # padded tokens per rank, features, hidden units
ROOT = 2  # a rank of the second process: process 0's replicas must take it across processes


def token_losses(params, x_TxD, y_T):
    h = jnp.tanh(x_TxD @ params["layer"]["w"] + params["layer"]["b"])
    return (h @ params["out"] - y_T) ** 2


def data():
    """Root's parameters and the global batch (rank-major), the same in every process."""
    rng = np.random.default_rng(0)
    params = {
        "layer": {
            "w": rng.normal(size=(D, H)).astype(np.float32),
            "b": rng.normal(size=(H,)).astype(np.float32),
        },
        "out": rng.normal(size=(H,)).astype(np.float32),
    }
    n = len(COUNTS)
    x_NxLxD = rng.normal(size=(n, L, D)).astype(np.float32)
    y_NxL = rng.normal(size=(n, L)).astype(np.float32)
    mask_NxL = (np.arange(L)[None, :] < COUNTS[:, None]).astype(np.float32)
    # Padding must not leak: give it values that would change the gradient if it did.
    x_NxLxD[mask_NxL == 0] = 1e3
    return params, x_NxLxD, y_NxL, mask_NxL


def _replica(params, rank):
    """Rank's parameters before initialize: root's, or visibly different ones."""
    if rank == ROOT:
        return params
    return jax.tree.map(lambda p: p + np.float32(rank + 1), params)


def _local(x):
    return np.asarray(x.addressable_shards[0].data).tolist()


def main():
    import rudax.sharding as rs

    n = len(COUNTS)
    if jax.device_count() != n:
        raise ValueError(f"this worker needs {n} devices in all, got {jax.device_count()}")
    # Process-major rank order, so process p's ranks are a contiguous block of rows.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    ranks = [r for r, d in enumerate(devices) if d.process_index == jax.process_index()]
    assert ranks == list(range(ranks[0], ranks[-1] + 1)), ranks

    params, x_NxLxD, y_NxL, mask_NxL = data()
    sharding = NamedSharding(mesh, P("data"))

    def place(global_NxX):
        per_rank = global_NxX.shape[0] // n
        local = global_NxX[ranks[0] * per_rank : (ranks[-1] + 1) * per_rank]
        return jax.make_array_from_process_local_data(sharding, local, global_NxX.shape)

    reps_N = jax.tree.map(lambda *xs: np.stack(xs), *[_replica(params, r) for r in range(n)])
    reps_N = jax.tree.map(place, reps_N)
    flat = lambda a: a.reshape(n * L, *a.shape[2:])
    batch = tuple(place(flat(a)) for a in (x_NxLxD, y_NxL, mask_NxL))
    dp = rs.DataParallel(mesh, "data")

    def step(reps, x_LxD, y_L, mask_L):
        params = dp.initialize(jax.tree.map(lambda p: p[0], reps), root=ROOT)
        loss_sum = lambda p: jnp.sum(mask_L * token_losses(p, x_LxD, y_L))
        weight = jnp.sum(mask_L)
        # Invariant parameters: jax.grad already sums over ranks. Varying: reduce sums.
        invariant = dp.reduce(jax.grad(loss_sum)(params), weight)
        varying = jax.lax.pcast(params, "data", to="varying")
        local = dp.reduce(jax.grad(loss_sum)(varying), weight.astype(jnp.int32))
        return params, invariant, local

    specs = (P("data"), P("data"), P("data"), P("data"))
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=P()))
    params_out, invariant, varying = f(reps_N, *batch)
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "promotion": jax.config.jax_numpy_dtype_promotion,
        "local_devices": jax.local_device_count(),
        "params": jax.tree.map(_local, params_out),
        "grads_invariant": jax.tree.map(_local, invariant),
        "grads_varying": jax.tree.map(_local, varying),
    }
