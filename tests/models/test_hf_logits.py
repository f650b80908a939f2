"""from_pretrained and save_pretrained against transformers' logits, both directions (fp32).

Tiny random Llama / Qwen2 checkpoints are made here by transformers' ``save_pretrained``
(nothing downloaded) with random norms and biases and 15x the default init std, so that
attention depends on position (RoPE) and a mixed-up norm or bias shows; rudax's logits on
the same token ids must be within max |difference| / max |logit| <= 1e-5 of transformers'.
The other way, a model trained a few steps in rudax (no parameter at its init value) and
written by ``save_pretrained`` must compute the same logits in
``AutoModelForCausalLM.from_pretrained``, and read back into rudax as the same model.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

import rudax.layers as rl
import rudax.optim as ro
from rudax.models import (
    LlamaConfig,
    LlamaForCausalLM,
    causal_lm_loss_sum,
    from_pretrained,
    save_pretrained,
)
from tests.models._reference import LLAMA3, T, V
from tests.models._reference import hf_model as _hf_model
from tests.models._reference import ours as _ours
from tests.models._reference import rel_err as _rel_err
from tests.models._reference import theirs as _theirs

# ------------------------------------------------------------------ transformers -> rudax


def _v4_spelling(directory):
    """Rewrites a v5 config.json as transformers v4 wrote it: rope_theta + rope_scaling."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    config["torch_dtype"] = config.pop("dtype")
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("kind", "overrides", "save_kw"),
    [
        ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False), {}),
        ("llama", dict(tie_word_embeddings=True), {}),  # multi-head attention, tied head
        ("llama", dict(num_key_value_heads=1), dict(max_shard_size="20KB")),  # 5 shards
        ("llama", dict(num_key_value_heads=2, rope_parameters=LLAMA3), {}),
        ("llama", dict(num_key_value_heads=2, rope_parameters=LLAMA3), "v4"),
        ("qwen2", dict(num_key_value_heads=2), {}),  # q/k/v biases
    ],
    ids=["gqa-untied", "mha-tied", "mqa-sharded", "llama3-rope", "llama3-rope-v4", "qwen2"],
)
def test_from_pretrained_logits_equal_transformers(tmp_path, kind, overrides, save_kw):
    if "rope_parameters" in overrides:  # L = 256 < the context, as transformers requires
        overrides = {**overrides, "max_position_embeddings": 1024}
    hf_model = _hf_model(kind, **overrides)
    hf_model.save_pretrained(tmp_path, **(save_kw if isinstance(save_kw, dict) else {}))
    if save_kw == "v4":
        _v4_spelling(tmp_path)
    if "max_shard_size" in save_kw:
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = from_pretrained(tmp_path)
    c = model.config
    assert c.param_dtype == np.float32 and model.dtype == np.float32
    assert c.num_key_value_heads == overrides.get("num_key_value_heads", 4)
    assert c.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert c.qkv_bias == (kind == "qwen2") and c.model_type == kind
    assert (c.rope_scaling is not None) == ("rope_parameters" in overrides)
    want = _theirs(hf_model)
    assert _rel_err(_ours(model), want) <= 1e-5
    if c.rope_scaling is not None:
        # The rewrite matters at these shapes: plain RoPE's logits are far from transformers'.
        plain = LlamaForCausalLM(dataclasses.replace(c, rope_scaling=None), rngs=nnx.Rngs(0))
        plain = nnx.merge(nnx.graphdef(plain), nnx.state(model))
        assert _rel_err(_ours(plain), want) > 1e-3


def test_a_bf16_checkpoint_loads_for_fp32_compute(tmp_path):
    hf_model = _hf_model(num_key_value_heads=2).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, param_dtype=jnp.float32)  # bf16 -> fp32 is exact
    assert model.dtype == np.float32
    assert model.model.layers[0].self_attn.q_proj.kernel.dtype == jnp.float32
    # Read back by transformers in fp32, not hf_model.float(): .to(bfloat16) also rounded the
    # model's RoPE inv_freq buffer, which a fresh load recomputes in fp32.
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert _rel_err(_ours(model), _theirs(reference.eval())) <= 1e-5


# ------------------------------------------------------------------ rudax -> transformers


def _train_a_few_steps(config, steps=3):
    """A model trained here with AdamW on a repeated batch: no parameter at its init value."""
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(1))
    graph, params = nnx.split(model)
    tx = ro.adamw(3e-2)
    rows = np.random.default_rng(1).integers(0, V, size=(4, T + 1), dtype=np.int32)
    batch = {"tokens": rows[:, :-1], "labels": rows[:, 1:]}

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: causal_lm_loss_sum(nnx.merge(graph, p), batch)[0])(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return nnx.merge(graph, params)


_F32 = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    param_dtype=jnp.float32,
)


@pytest.mark.parametrize(
    "overrides",
    [
        # A tied head with Llama 3's RoPE.
        dict(
            tie_word_embeddings=True,
            rope_scaling=rl.Llama3RopeScaling(8.0, 1.0, 4.0, 8),
            max_position_embeddings=32,
        ),
        dict(tie_word_embeddings=False, qkv_bias=True, model_type="qwen2"),  # biases
    ],
    ids=["tied-llama3", "untied-qwen2"],
)
def test_save_pretrained_of_a_trained_model_loads_in_transformers(tmp_path, overrides):
    config = LlamaConfig(**_F32, **overrides)
    model = _train_a_few_steps(config)
    for _, node in nnx.iter_graph(model):  # trained: the norms and biases left their init
        if isinstance(node, rl.RMSNorm):
            assert not np.all(np.asarray(node.scale[...]) == 1.0)
    save_pretrained(model, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    want = "Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"
    assert type(hf_model).__name__ == want and hf_model.dtype == torch.float32
    assert _rel_err(_ours(model), _theirs(hf_model)) <= 1e-5
    # Round trip: from_pretrained builds the same model.
    loaded = from_pretrained(tmp_path)
    assert loaded.config == config
    assert _rel_err(_ours(loaded), _ours(model)) <= 1e-6


def test_save_pretrained_then_from_pretrained_is_bit_exact_in_bf16(tmp_path):
    config = LlamaConfig(**{**_F32, "param_dtype": jnp.bfloat16}, eos_token_id=7)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(2))
    save_pretrained(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    # Both spellings: transformers 5 reads dtype, 4.x torch_dtype.
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"
    assert written["eos_token_id"] == 7
    loaded = from_pretrained(tmp_path)
    assert loaded.config == config
    ours = dict(nnx.to_flat_state(nnx.state(model)))
    theirs = dict(nnx.to_flat_state(nnx.state(loaded)))
    assert ours.keys() == theirs.keys()
    for path, var in theirs.items():
        got, want = np.asarray(var.get_value()), np.asarray(ours[path].get_value())
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want, err_msg=str(path))
