"""from_pretrained and save_pretrained on the folders and models test_hf_files.py does not
try: redundant tensors transformers writes (accepted), damaged folders (refused, naming the
file and the fix), and models that have no checkpoint form (refused, writing nothing)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

import rudax.sharding as rs
from rudax.models import LlamaConfig, LlamaForCausalLM, from_pretrained, save_pretrained, shard

CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    param_dtype=jnp.float32,
)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)))


@pytest.fixture
def saved(tmp_path):
    """A tiny tied GQA model written by save_pretrained: (folder, model, its tensors)."""
    model = LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0))
    save_pretrained(model, tmp_path / "ckpt")
    with safe_open(tmp_path / "ckpt" / "model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tmp_path / "ckpt", model, tensors


def test_redundant_tensors_that_agree_are_accepted(saved):
    # A tied head written as well (transformers 4 wrote lm_head.weight), and RoPE's
    # inv_freq buffer (older transformers saved it; it is recomputed, never read).
    folder, model, tensors = saved
    embed = tensors["model.embed_tokens.weight"]
    inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
    freqs = (10000.0 ** (-np.arange(0, 8, 2) / 8)).astype(np.float32)
    tensors = {**tensors, "lm_head.weight": embed, inv_freq: freqs}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    np.testing.assert_array_equal(np.asarray(from_pretrained(folder)(IDS)), np.asarray(model(IDS)))


def test_a_tied_config_with_two_different_tables_is_refused(saved):
    # transformers computes with both tables then (it unties them, with a warning); one
    # shared table here would give other logits, so the folder is refused, naming both.
    folder, _, tensors = saved
    head = tensors["model.embed_tokens.weight"].copy()
    head[3, 5] += 1.0
    save_file({**tensors, "lm_head.weight": head}, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"ties the embeddings.*weight differs from (lm_head|model.embed_tokens)"
    ):
        from_pretrained(folder)


def test_damaged_folders_are_named(saved):
    folder, _, _ = saved
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"\['pytorch_model.bin'\]: rudax reads safetensors only"):
        from_pretrained(folder)
    (folder / "pytorch_model.bin").rename(folder / "model-1.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-2.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lists model-2.safetensors, which is not a file in"):
        from_pretrained(folder)
    (folder / "model-1.safetensors").rename(folder / "model-2.safetensors")
    with pytest.raises(
        ValueError, match=r"holds model.layers.0.*which model.safetensors.index.json puts in None"
    ):
        from_pretrained(folder)
    (folder / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config.json: not JSON"):
        from_pretrained(folder)


def test_save_pretrained_refuses_a_sharded_model_and_a_tokenizer_that_is_no_folder(saved, tmp_path):
    _, model, _ = saved
    ctx = rs.ShardingContext(jax.sharding.Mesh(jax.devices()[:1], ("fsdp",)))
    with pytest.raises(TypeError, match=r"lm_head is a ShardedModule.*no Hugging Face form"):
        save_pretrained(shard(model, ctx), tmp_path / "x")
    with pytest.raises(ValueError, match=r"tokenizer='.*nope.json' is not a folder"):
        save_pretrained(model, tmp_path / "x", tokenizer=tmp_path / "nope.json")
    assert not (tmp_path / "x").exists()
