"""rudax.models.shard: FSDP over 8 (simulated) devices gives the one-device loss and
gradients, for a tied dense model with LoRA adapters, a QLoRA model and a Mixtral, their
layers stored one module each or stacked (scan_layers)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.layers as rl
import rudax.sharding as rs
from rudax.models import LlamaConfig, LlamaForCausalLM, causal_lm_loss_sum, shard

N = 8
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def _model(kind):
    if kind == "mixtral":
        config = LlamaConfig(**COMMON, model_type="mixtral", num_local_experts=4,
                             output_router_logits=True)  # fmt: skip
    else:
        config = LlamaConfig(**COMMON, tie_word_embeddings=True)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    if kind in ("lora", "qlora"):
        quantize = "nf4" if kind == "qlora" else None
        rl.apply_lora(model, ["q_proj", "down_proj"], rank=4, alpha=8, quantize_base=quantize,
                      rngs=nnx.Rngs(1))  # fmt: skip
        for _, node in nnx.iter_graph(model):  # B non-zero, so the adapters count
            if isinstance(node, rl.LoRALinear):
                shape = node.lora_b.shape
                node.lora_b.set_value(0.1 * jax.random.normal(jax.random.key(7), shape))
    return model


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 96, (N, 12))
    labels = np.where(rng.random((N, 12)) < 0.8, np.roll(tokens, -1, axis=1), -100)
    segments = np.where(np.arange(12) < 10, 1, 0) * np.ones((N, 1), int)  # 2 padding slots
    return {"tokens": tokens, "labels": labels, "segment_ids": segments}


@pytest.mark.parametrize(
    ("kind", "scan"),
    [("dense", False), ("lora", False), ("qlora", False), ("mixtral", False),
     ("dense", True), ("qlora", True), ("mixtral", True)],
)  # fmt: skip
def test_sharded_loss_and_gradients_equal_one_device(kind, scan):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("fsdp",))
    model = _model(kind)
    # Stacked layers (scan_layers): each layer's slice of each variable is sharded on its
    # own, stored (L, N*k), and gathered one layer at a time inside the scan.
    model.scan_layers = scan
    sharded = shard(model, rs.ShardingContext(mesh, "fsdp"))
    q = sharded.model.layers.self_attn.q_proj if scan else sharded.model.layers[0].self_attn.q_proj
    assert type(q).__name__ == "ShardedModule"
    if scan:
        (storage,) = [v.get_value() for v in q.variables if isinstance(v, nnx.Param)][:1]
        assert storage.local.shape == (2, N * -(-storage.size // N))  # (L, N*k)
    assert not any(isinstance(n, rs.ShardedModule) for _, n in nnx.iter_graph(model))
    batch = _batch()
    trainable = rl.LoRAParam if kind in ("lora", "qlora") else nnx.Param

    graph, params, rest = nnx.split(sharded, trainable, ...)
    local = lambda p, r, b: jax.lax.psum(causal_lm_loss_sum(nnx.merge(graph, p, r), b)[0], "fsdp")
    total = lambda p, r, b: jax.shard_map(
        local, mesh=mesh, in_specs=(rs.shard_specs(p), rs.shard_specs(r), P("fsdp")),
        out_specs=P(),
    )(p, r, b)  # fmt: skip
    placed = jax.device_put(batch, NamedSharding(mesh, P("fsdp")))
    loss, grads = jax.jit(jax.value_and_grad(total))(params, rest, placed)

    # One device: the sum of the ranks' losses, each of its own row (a Mixtral's balancing
    # term is of each rank's own tokens).
    ref_graph, ref_params, ref_rest = nnx.split(model, trainable, ...)

    def per_rank(p, row):
        m = nnx.merge(ref_graph, p, ref_rest)
        return causal_lm_loss_sum(m, jax.tree.map(lambda a: a[None], row))[0]

    ref_total = lambda p: jnp.sum(jax.vmap(per_rank, in_axes=(None, 0))(p, batch))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(ref_total))(ref_params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)

    nnx.update(sharded, grads)
    got = {}
    for prefix, node in nnx.iter_graph(sharded):
        if isinstance(node, rs.ShardedModule):
            for path, var in zip(node.paths, node.variables, strict=True):
                if isinstance(var, trainable):
                    got[(*prefix, *path)] = var.get_value().unshard()
    want = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(ref_grads)}
    # a tied table is one leaf (under its first path) and is reached from both modules
    assert set(want) <= set(got) and len(jax.tree.leaves(params)) == len(want)
    # Bounds relative to each leaf's largest element: the sharded sums run in another order,
    # and an element near cancellation (the tied table's [66, 44], -8.66e-4 in a leaf of
    # 3.6) is off by 1.1e-6 on this machine's XLA:CPU, past an element-wise 1e-4.
    for path, value in want.items():
        atol = 2e-6 * np.abs(value).max()
        np.testing.assert_allclose(got[path], value, rtol=1e-4, atol=atol, err_msg=str(path))


def test_bad_arguments_are_named():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("fsdp",))
    ctx = rs.ShardingContext(mesh, "fsdp")
    with pytest.raises(TypeError, match=r"model must be a rudax\.models\.LlamaForCausalLM"):
        shard(nnx.List([]), ctx)
    model = _model("dense")
    with pytest.raises(TypeError, match=r"ctx must be a rudax\.sharding\.ShardingContext"):
        shard(model, mesh)
