"""FSDP of a LoRALinear with adapter dropout (the QLoRA recipe's dropout 0.05): its RNG state is
kept whole and replicated, each rank draws masks of its own, and the count advances once per
call on every rank. Against one device: in eval mode the outputs are the one-device ones, and
in training each rank's mask is the one the layer draws from the rank-folded key.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.layers as rl
import rudax.sharding as rs
from tests.layers._random import normal

N = 8
AX = "fsdp"
D = 16

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")


def _model():
    model = nnx.Dict(q_proj=rl.Linear(D, D, rngs=nnx.Rngs(0)))
    rl.apply_lora(model, ["q_proj"], rank=4, alpha=8.0, dropout=0.5, rngs=nnx.Rngs(1))
    model["q_proj"].lora_b[...] = normal((4, D), 3)  # B as after training
    return model


def _sharded_call(model, x, mesh):
    """One shard_map call: parameters sharded on AX, RNG state in and out replicated."""
    graph, rngs, params = nnx.split(model, nnx.RngState, ...)

    def local(p, r, x):
        m = nnx.merge(graph, r, p)
        y = m["q_proj"](x)
        return y, nnx.state(m, nnx.RngState)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(AX), P(), P(AX)), out_specs=(P(AX), P()))
    y, rngs_after = jax.jit(f)(params, rngs, jax.device_put(x, NamedSharding(mesh, P(AX))))
    nnx.update(model, rngs_after)
    return np.asarray(y)


def test_dropout_lora_shards_and_each_rank_draws_its_own_mask():
    mesh = jax.make_mesh((N,), (AX,), devices=jax.devices()[:N])
    ref, model = _model(), _model()
    ctx = rs.ShardingContext(mesh, AX)
    model["q_proj"] = ctx.lora(model["q_proj"])
    # The same row on every rank: only the masks can make the ranks' outputs differ.
    x = jnp.tile(normal((1, D), 7), (N, 1))

    y = _sharded_call(model, x, mesh)
    count = model["q_proj"].rng_variables[0]
    assert isinstance(count, nnx.RngCount) and int(count[...]) == 1  # advanced once
    key = model["q_proj"].rng_variables[1]
    assert isinstance(key, nnx.RngKey)
    # Rank r's output is the layer's own under the key folded with r, at count 0.
    for rank in range(N):
        layer = _model()["q_proj"]
        layer.dropout.rngs.key[...] = jax.random.fold_in(key[...], rank)
        np.testing.assert_allclose(y[rank], layer(x[rank : rank + 1])[0], rtol=1e-6, atol=1e-6)
    assert len({np.asarray(y[r]).tobytes() for r in range(N)}) == N  # masks of their own

    y2 = _sharded_call(model, x, mesh)  # the next call draws new masks
    assert int(count[...]) == 2 and not np.array_equal(y, y2)

    # Eval mode reaches the layer rebuilt at each call: no dropout, the one-device outputs;
    # and train mode again draws.
    model.eval()
    ref.eval()
    y_eval = _sharded_call(model, x, mesh)
    np.testing.assert_allclose(y_eval, ref["q_proj"](x), rtol=1e-6, atol=1e-6)
    assert int(count[...]) == 2  # no key drawn in eval mode
    model.train()
    assert not np.array_equal(_sharded_call(model, x, mesh), y_eval)
    assert int(count[...]) == 3
