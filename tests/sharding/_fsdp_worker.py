"""One process of the multi-process FSDP test (run by ``_multiprocess.run_processes``).

The tiny transformer of ``test_fsdp.py`` (same modules, seeds and loss), sharded over a 1-D
"fsdp" mesh of every process's devices and trained with ``fp32_master(adamw)``. Each process
places only its own ranks' rows of the batch; the parameters' gathers and the gradients'
reduce-scatters cross the process boundary. Every ``ShardedParameter`` is also rebuilt with
``from_local`` to check that a process is asked for, and given, only its own ranks' slices.
The test process imports ``STEPS``, ``ROWS`` and ``make_tx`` for its one-device reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AX = "fsdp"
STEPS = 3
ROWS = 8  # sequences in the global batch: 2 per rank on the 4-device mesh


def make_tx():
    import rudax.optim as ro

    return ro.fp32_master(ro.adamw(1e-2, weight_decay=0.1))


def batch():
    from tests.sharding import test_fsdp as tf

    return np.asarray(jax.random.randint(jax.random.key(7), (ROWS, tf.T + 1), 0, tf.V))


def _check_from_local(p, mesh):
    """Rebuilds p from its flat slices; returns the ranks this process was asked for."""
    import rudax.sharding as rs

    asked = []

    def shard(rank):
        asked.append(rank)
        # This process's slices, read from the placed array's own shards: no full value.
        (data,) = [
            s.data for s in p.local.addressable_shards if s.index[0].start // p.shard_size == rank
        ]
        start, stop = p.shard_range(rank)
        return np.asarray(data)[: stop - start]

    q = rs.ShardedParameter.from_local(shard, p.logical_shape, mesh, AX, dtype=p.dtype)
    for a, b in zip(p.local.addressable_shards, q.local.addressable_shards, strict=True):
        assert a.index == b.index and a.device == b.device, (a, b)
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    return sorted(asked)


def main():
    import rudax.sharding as rs
    from tests.sharding import test_fsdp as tf

    n = jax.device_count()
    if n != 4:
        raise ValueError(f"this worker needs 4 devices in all, got {n}")
    # Process-major rank order, so process p's ranks are a contiguous block of rows.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices), (AX,))
    ranks = [r for r, d in enumerate(devices) if d.process_index == jax.process_index()]

    sharded = tf._shard(rs.ShardingContext(mesh, AX), tf._transformer(lora=False))
    model = nnx.Dict(sharded)
    graph, params = nnx.split(model, nnx.Param)
    is_sharded = lambda x: isinstance(x, rs.ShardedParameter)
    sharded_leaves = jax.tree.leaves(params, is_leaf=is_sharded)
    asked = sorted({tuple(_check_from_local(p, mesh)) for p in sharded_leaves})

    total = ROWS * tf.T

    def loss_sum(m, ids_BxT1):
        logits = tf._forward(m, ids_BxT1[:, :-1])
        logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        target = jnp.take_along_axis(logp, ids_BxT1[:, 1:, None], axis=-1)
        return -jnp.sum(target) / total

    local = jax.shard_map(
        lambda p, ids: loss_sum(nnx.merge(graph, p), ids)[None],
        mesh=mesh,
        in_specs=P(AX),
        out_specs=P(AX),
    )
    tx = make_tx()

    @jax.jit
    def step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(lambda p: jnp.sum(local(p, ids)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ids = batch()
    per_rank = ROWS // n
    ids = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P(AX)),
        ids[ranks[0] * per_rank : (ranks[-1] + 1) * per_rank],
        ids.shape,
    )
    # Replicated on the mesh, as the step returns it, so every step reuses one compilation.
    state = jax.tree.map(
        lambda v: (
            v
            if isinstance(v.sharding, NamedSharding)
            else jax.device_put(np.asarray(v), NamedSharding(mesh, P()))
        ),
        tx.init(params),
    )
    losses = []
    for _ in range(STEPS):
        params, state, loss = step(params, state, ids)
        losses.append(float(loss))
    nnx.update(model, params)
    # Each slice lives on one process: gather every parameter's flat storage to every host.
    gathered = {}
    for name, m in sharded.items():
        for path, var in zip(m.paths, m.variables, strict=True):
            p = var.get_value()
            flat = np.asarray(multihost_utils.process_allgather(p.local, tiled=True))
            key = "/".join(str(k) for k in (name, *path))
            gathered[key] = flat[: p.size].reshape(p.logical_shape).tolist()
    return {
        "process_index": jax.process_index(),
        "ranks": ranks,
        "from_local_ranks": asked,  # the ranks from_local asked for, per parameter, deduplicated
        "compilations": step._cache_size(),
        "losses": losses,
        "params": gathered,
    }
