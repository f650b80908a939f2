"""generate on an FSDP model (rudax.models.shard's form, or from_pretrained(..., mesh=)'s):
each layer gathered as it runs, inside shard_map over the model's mesh, the same tokens as
the model held whole on one device, greedy and sampled, dense and QLoRA, layers stacked or
not. Before, calling a sharded model outside shard_map failed on the unbound mesh axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
import rudax.sharding as rs
from rudax.models import (
    LlamaConfig,
    LlamaForCausalLM,
    from_pretrained,
    generate,
    save_pretrained,
    shard,
)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
PROMPTS = [[1, 2, 3, 4, 5], [7, 8]]


def _mesh(shape, names):
    return jax.sharding.Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _lora(model):
    rl.apply_lora(model, ["q_proj", "v_proj", "down_proj"], rank=4, alpha=8.0,
                  rngs=nnx.Rngs(1))  # fmt: skip
    # B away from zero, so the adapters change the tokens
    for _, node in nnx.iter_graph(model):
        if isinstance(node, rl.LoRALinear):
            b = node.lora_b
            b.set_value(0.3 * jax.random.normal(jax.random.key(2), b.shape, b.dtype))


# Two of the four (mesh, layout) pairs: each mesh and each layout once (CI's time).
@pytest.mark.parametrize(
    ("mesh_shape", "scan"),
    [(((8,), ("fsdp",)), False), (((2, 4), ("data", "fsdp")), True)],
    ids=["fsdp=8-per-layer", "data=2,fsdp=4-stacked"],
)
def test_an_fsdp_model_generates_the_whole_models_tokens(mesh_shape, scan):
    model = LlamaForCausalLM(LlamaConfig(**CONFIG), rngs=nnx.Rngs(0))
    _lora(model)
    model.scan_layers = scan
    model.eval()
    sharded = shard(model, rs.ShardingContext(_mesh(*mesh_shape), "fsdp"))
    for kw in (dict(), dict(temperature=0.8, top_k=20, num_samples=3, rng=jax.random.key(5))):
        want = generate(model, PROMPTS, 9, return_logprobs=True, **kw)
        got = generate(sharded, PROMPTS, 9, return_logprobs=True, **kw)
        assert got.tokens == want.tokens, kw
        for g, w in zip(got.logprobs, want.logprobs, strict=True):
            np.testing.assert_allclose(g, w, atol=2e-5, err_msg=str(kw))


def test_a_qlora_model_loaded_onto_the_mesh_generates_the_whole_loads_tokens(tmp_path):
    config = LlamaConfig(**CONFIG, param_dtype=jnp.bfloat16)
    save_pretrained(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), tmp_path)
    mesh = _mesh((2, 4), ("data", "fsdp"))
    kw = dict(quantize="nf4", dtype=jnp.float32)
    whole = from_pretrained(tmp_path, **kw)
    _lora(whole)  # adapters go on the layers one module each, then the layers are stacked
    whole.scan_layers = True
    loaded = from_pretrained(tmp_path, mesh=mesh, prepare=_lora, scan_layers=True, **kw)
    whole.eval()
    loaded.eval()
    want = generate(whole, PROMPTS, 12, return_logprobs=True)
    got = generate(loaded, PROMPTS, 12, return_logprobs=True)
    assert got.tokens == want.tokens
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)
    # the model is not modified: still sharded, 1/4 of each weight per device
    leaf = jax.tree.leaves(nnx.state(loaded))[0]
    assert leaf.sharding.spec[-1] == "fsdp"
