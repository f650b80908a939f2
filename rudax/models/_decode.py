"""``generate``'s compiled part: the prefill and the decode loop, one program per bucket.

``prefill`` runs the left-padded prompts once and writes their keys and values to the cache's
prompt block (shared by each prompt's samples); ``_decode`` then draws one token per sample
per step inside one ``lax.while_loop`` until every row has met a stop token or the budget is
spent. ``run`` is that program on the model as it is held; ``run_fsdp`` the same inside
``jax.shard_map`` over an FSDP model's mesh (``fsdp_placement`` finds it), each layer
gathered as it runs. Prompt length and budget are rounded up to powers of two (``bucket``),
so prompts of similar sizes share one compiled program.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import rudax.sharding as rs
from rudax.models._kv_cache import KVCache
from rudax.models._sampling import Mode, sample

__all__ = ["bucket", "fsdp_placement", "prefill", "run", "run_fsdp"]

_MIN_BUCKET = 16


def bucket(n: int) -> int:
    return max(_MIN_BUCKET, 1 << (n - 1).bit_length())


def prefill(
    model: Any, ids_BxP: jax.Array, lengths_B: jax.Array, *, steps: int, num_samples: int
) -> tuple[jax.Array, KVCache]:
    """The prompts run once: each sample's first logits ``[B * n, V]`` and the cache."""
    b, p = ids_BxP.shape
    pad_B = p - lengths_B
    slot = jnp.arange(p)[None, :]
    real_BxP = slot >= pad_B[:, None]
    positions = jnp.where(real_BxP, slot - pad_B[:, None], 0).astype(jnp.int32)
    cache = model.init_cache(b, p + steps, num_samples=num_samples)
    h, cache, _ = model.hidden_states(
        ids_BxP, positions=positions, segment_ids=real_BxP.astype(jnp.int32), cache=cache
    )
    # Left-padded, the last slot is every prompt's last token: the only logits needed.
    logits = model.lm_head(h[:, -1:])[:, 0]
    return jnp.repeat(logits, num_samples, axis=0), cache


def _decode(
    graphdef: Any,
    state: Any,
    ids_BxP: jax.Array,
    lengths_B: jax.Array,
    stops: jax.Array,
    max_new: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    steps: int,
    num_samples: int,
    mode: Mode,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    model = nnx.merge(graphdef, state)
    last, cache = prefill(model, ids_BxP, lengths_B, steps=steps, num_samples=num_samples)
    rows = last.shape[0]
    lengths = jnp.repeat(lengths_B, num_samples)  # prompt-major, as the cache's sample rows
    out = jnp.zeros((rows, steps), jnp.int32)
    logps = jnp.zeros((rows, steps), jnp.float32)
    done = jnp.zeros((rows,), bool)

    def cond(carry: Any) -> Any:
        step, _, _, done, _, _, _ = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry: Any) -> Any:
        step, out, logps, done, last_BxV, cache, key = carry
        key, sub = jax.random.split(key)
        token, logp = sample(last_BxV, sub, temperature, top_k, top_p, mode)
        token = jnp.where(done, 0, token)
        out = out.at[:, step].set(token)
        logps = logps.at[:, step].set(jnp.where(done, 0.0, logp))
        done = done | jnp.any(token[:, None] == stops[None, :], axis=-1)
        pos = (lengths + step).astype(jnp.int32)[:, None]
        logits, cache = model(token[:, None], positions=pos, cache=cache)
        return step + 1, out, logps, done, logits[:, -1], cache, key

    carry = (jnp.zeros((), jnp.int32), out, logps, done, last, cache, key)
    step, out, logps, _, _, _, _ = jax.lax.while_loop(cond, body, carry)
    return out, logps, step


_STATIC = ("graphdef", "steps", "num_samples", "mode")
run = jax.jit(_decode, static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "mesh", "axis"))
def run_fsdp(graphdef: Any, state: Any, *inputs: Any, mesh: Mesh, axis: str, **static: Any) -> Any:
    """``_decode`` of an FSDP model (``rudax.models.shard``'s form) over its mesh: every
    device runs the whole decode on the whole (replicated) prompts, each layer's parameters
    gathered when it is called, as in training. The devices compute the same tokens, so the
    result is replicated; the work is not split, only the parameters' memory is."""
    decode = functools.partial(_decode, graphdef, **static)
    specs = (rs.shard_specs(state, axis), *[P()] * len(inputs))
    # check_vma off: the gathered parameters are equal on every device, which the all-gather's
    # type does not say, so the replicated outputs could not be typed as such.
    run = jax.shard_map(decode, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
    return run(state, *inputs)


def fsdp_placement(model: nnx.Module) -> tuple[Mesh, str] | None:
    """The mesh and axis of an FSDP model's ``ShardedModule``s; None for a model held whole."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, rs.ShardedModule) and len(node.variables):
            storage = node.variables[0].get_value().local
            return storage.sharding.mesh, node.axis_name
    return None
