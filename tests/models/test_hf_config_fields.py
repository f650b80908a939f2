"""LlamaConfig.from_hf on hand-written config.json fields: each refusal names the field and
its value, and an absent field takes transformers' default.

The cases test_llama_config.py does not already hold: a field a Llama checkpoint may carry
that would change what the model computes (a window, attention dropout, a partial or other
RoPE), a damaged or ambiguous one (two dtypes, two RoPE spellings that disagree, a missing
size), and the defaults transformers' config classes fill in.
"""

import dataclasses

import jax.numpy as jnp
import pytest

import rudax.layers as rl
from rudax.models import LlamaConfig
from tests.models._reference import LLAMA3

LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    dtype="float32",
)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(architectures=["MistralForCausalLM"]), r"architectures=\['MistralForCausalLM'\]"),
        (dict(sliding_window=8), "sliding_window=8 is a field rudax.models does not implement"),
        (dict(attention_dropout=0.1), "attention_dropout=0.1 is not supported"),
        (
            dict(num_key_value_heads=3),
            "config.json: num_key_value_heads=3 must divide num_attention_heads=4",
        ),
        (dict(hidden_size=None), "hidden_size is missing"),
        (dict(dtype=None), "no dtype or torch_dtype field: pass param_dtype"),
        (dict(torch_dtype="bfloat16"), "dtype and torch_dtype disagree"),
        (
            dict(rope_scaling={"type": "linear", "factor": 2.0}),
            "rope_type='linear' is not implemented",
        ),
        (
            dict(rope_parameters={**LLAMA3, "mscale": 1.0}),
            "rope field mscale=1.0 is not implemented",
        ),
        (
            dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}),
            "llama3' needs low_freq_factor",
        ),
        (
            dict(rope_parameters={**LLAMA3, "high_freq_factor": 0.5}),
            "high_freq_factor must be > low_freq_factor",
        ),
        (
            dict(rope_theta=10.0, rope_parameters={"rope_theta": 20.0}),
            "rope_theta=10.0 but rope_parameters has rope_theta=20.0",
        ),
        (
            dict(rope_scaling={**LLAMA3}, rope_parameters={**LLAMA3, "factor": 4.0}),
            "disagree on factor",
        ),
        (
            dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
            "partial_rotary_factor=0.5 is not supported",
        ),
    ],
)
def test_unsupported_config_fields_are_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf({**LLAMA, **overrides})


def test_absent_fields_take_transformers_defaults():
    c = LlamaConfig.from_hf(LLAMA)
    assert (c.num_key_value_heads, c.max_position_embeddings, c.rms_norm_eps) == (4, 2048, 1e-6)
    assert (c.rope_theta, c.rope_scaling, c.tie_word_embeddings) == (10000.0, None, False)
    assert (c.head_dim, c.qkv_bias, c.o_bias, c.mlp_bias) == (8, False, False, False)
    # Llama 3's original context defaults to max_position_embeddings, v4's "type" key works.
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    c = LlamaConfig.from_hf({**LLAMA, "max_position_embeddings": 512, "rope_scaling": scaling})
    assert c.rope_scaling == rl.Llama3RopeScaling(8.0, 1.0, 4.0, 512)
    assert LlamaConfig.from_hf(LLAMA, param_dtype="bfloat16").param_dtype == jnp.bfloat16


def test_qwen2_windows_are_refused_and_its_off_fields_accepted():
    qwen = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    off = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28)
    c = LlamaConfig.from_hf({**qwen, **off})
    assert c.qkv_bias and not c.o_bias and c.sliding_window is None
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):
        LlamaConfig.from_hf({**qwen, **off, "use_sliding_window": True})
    with pytest.raises(ValueError, match=r"layer_types=.*sliding_attention.*not supported"):
        LlamaConfig.from_hf({**qwen, "layer_types": ["sliding_attention"]})
    with pytest.raises(ValueError, match=r"attention_bias=.* rudax.models does not implement"):
        LlamaConfig.from_hf({**qwen, "attention_bias": True})  # not a Qwen2 field


def test_token_id_fields_transformers_writes_are_accepted_and_kept():
    # A real 135M checkpoint written by transformers 5 was refused over "unk_token_id": 0.
    ids = dict(unk_token_id=0, bos_token_id=0, eos_token_id=[0, 2], sep_token_id=None)
    c = LlamaConfig.from_hf({**LLAMA, **ids})
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (0, (0, 2), None)
    plain = LlamaConfig.from_hf(LLAMA)
    assert dataclasses.replace(c, bos_token_id=None, eos_token_id=None) == plain
