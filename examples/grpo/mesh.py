"""``examples.grpo --mesh``: the trainer's per-token log-probs over the mesh, for
``rudax.post_train.rollout``'s check of the sampler.

Over a mesh the policy's base is stored as the step holds it (sharded over ``fsdp``, or
replicated over ``data``), so its forward runs inside ``jax.shard_map`` as the training
step's does: each device on its rows, the log-probs gathered back whole onto every process
(every process samples, rewards and checks the same generation; each then trains on its own
rows of it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

import rudax.models as rm
import rudax.sharding as rs
from examples.policy.rows import pad_rows


def mesh_score(session: Any, temperature: float) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """``rollout``'s ``score`` for ``session``'s policy over its mesh: ``[B, T]`` per-token
    log-probs at ``temperature`` of a whole batch's rows (any ``B``), NumPy."""
    mesh = session.mesh
    axes = tuple(mesh.axis_names)

    def local(adapters: Any, rngs: Any, base: Any, batch: Any) -> jax.Array:
        model = nnx.merge(session.graphdef, adapters, rngs, base, copy=True)
        return rm.causal_lm_token_logprobs(model, batch, temperature=temperature)

    @jax.jit
    def run(adapters: Any, rngs: Any, base: Any, batch: Any) -> jax.Array:
        specs = lambda tree: jax.tree.map(lambda s: s.spec, rs.state_shardings(tree, mesh))
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(specs(adapters), P(), specs(base), P(axes)),
            out_specs=P(axes),
        )(adapters, rngs, base, batch)

    def score(batch: dict[str, np.ndarray]) -> np.ndarray:
        rows = len(batch["tokens"])
        padded = -(-rows // mesh.size) * mesh.size  # each device an equal share of rows
        whole = pad_rows(batch, padded)
        placed = rs.put_batch(rs.local_rows(whole), mesh, padded)
        out = run(session.adapters, session.rngs, session.base, placed)
        return np.asarray(multihost_utils.process_allgather(out, tiled=True))[:rows]

    return score
