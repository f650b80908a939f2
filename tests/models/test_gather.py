"""rudax.models.gather_adapters / gather_adapters_into (an FSDP model's adapters whole, on
8 simulated CPU devices; several processes: tests/finetune/test_mesh.py) and
checkpoint_digest."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
import rudax.models as rm
import rudax.sharding as rs

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

CONFIG = rm.LlamaConfig.tiny(64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)


def _prepare(model):
    rl.apply_lora(model, ["q_proj", "down_proj"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))


def _trained():
    """A LoRA model whose adapters (B included) all differ from their initial values."""
    model = rm.LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0))
    _prepare(model)
    state = nnx.state(model, rl.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(state))))
    nnx.update(
        model, jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), state)
    )
    return model


def _adapters(model):
    return {
        k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, rl.LoRAParam))
    }


@pytest.mark.parametrize("scan_layers", [False, True])
def test_gather_adapters_gives_the_whole_adapters_of_an_fsdp_model(scan_layers):
    model = _trained()
    want = _adapters(model)
    copy = nnx.clone(model)
    copy.scan_layers = scan_layers
    mesh = rs.make_mesh({"data": 2, "fsdp": 4})
    sharded = rm.shard(copy, rs.ShardingContext(mesh, "fsdp"))
    whole = rm.gather_adapters(sharded, _prepare)
    assert not whole.scan_layers  # peft's files name each layer's adapters
    got = _adapters(whole)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))
    # no base weights: the model was built abstractly
    kernel = whole.model.layers[0].self_attn.q_proj.base.kernel.get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct)


def test_gather_adapters_into_writes_a_trained_sharded_copy_back():
    model = _trained()
    want = _adapters(model)
    fresh = rm.LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0))
    _prepare(fresh)
    mesh = rs.make_mesh({"fsdp": 8})
    rm.gather_adapters_into(fresh, rm.shard(model, rs.ShardingContext(mesh, "fsdp")))
    got = _adapters(fresh)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))


def test_checkpoint_digest_follows_the_weights_not_the_formatting(tmp_path):
    model = rm.LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0))
    rm.save_pretrained(model, tmp_path / "a")
    digest = rm.checkpoint_digest(tmp_path / "a")
    assert len(digest) == 64 and digest == rm.checkpoint_digest(tmp_path / "a")
    config = tmp_path / "a" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()), indent=4, sort_keys=False))
    assert rm.checkpoint_digest(tmp_path / "a") == digest  # formatting aside
    other = rm.LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(1))
    rm.save_pretrained(other, tmp_path / "b")
    assert rm.checkpoint_digest(tmp_path / "b") != digest
    # one changed value in the weights
    nnx.update(
        model, jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1), nnx.state(model, nnx.Param))
    )
    rm.save_pretrained(model, tmp_path / "c")
    assert rm.checkpoint_digest(tmp_path / "c") != digest
