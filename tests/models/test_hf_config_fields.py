"""LlamaConfig.from_hf on hand-written config.json fields: each refusal names the field and
its value, and an absent field takes transformers' default for the model_type.

The cases test_llama_config.py does not already hold: a field a Llama checkpoint may carry
that would change what the model computes (a window, attention dropout, a partial or other
RoPE, another family's option), a damaged or ambiguous one (two dtypes, two RoPE spellings
that disagree, a missing size, a bool or integer of another JSON type), an unknown field
(loaded, one warning), and the defaults transformers' config classes fill in
(test_hf_config_policy.py walks every field of those classes).
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
        (
            dict(sliding_window=8),
            "sliding_window=8 is not an option of model_type='llama' .* use model_type='mistral'",
        ),
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
        (
            dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": True}),
            "partial_rotary_factor=True is not supported",  # True == 1.0 was let through
        ),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is not supported"),
        (dict(layer_types=["full_attention"] * 2), r"one entry for each of num_hidden_layers=1"),
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
    qwen["num_key_value_heads"] = 4  # Qwen2Config's default is 32
    off = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28)
    c = LlamaConfig.from_hf({**qwen, **off})
    assert c.qkv_bias and not c.o_bias and c.sliding_window is None
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):
        LlamaConfig.from_hf({**qwen, **off, "use_sliding_window": True})
    with pytest.raises(ValueError, match=r"layer_types=.*sliding_attention.*not supported"):
        LlamaConfig.from_hf({**qwen, "layer_types": ["sliding_attention"]})
    with pytest.raises(
        ValueError, match="attention_bias=True is not an option of model_type='qwen2'"
    ):
        LlamaConfig.from_hf({**qwen, "attention_bias": True})  # Llama's, not Qwen2's


def test_token_id_fields_transformers_writes_are_accepted_and_kept():
    # A real 135M checkpoint written by transformers 5 was refused over "unk_token_id": 0.
    ids = dict(unk_token_id=0, bos_token_id=0, eos_token_id=[0, 2], sep_token_id=None)
    c = LlamaConfig.from_hf({**LLAMA, **ids})
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (0, (0, 2), None)
    plain = LlamaConfig.from_hf(LLAMA)  # LlamaConfig's defaults: bos 1, eos 2
    assert (plain.bos_token_id, plain.eos_token_id, plain.pad_token_id) == (1, 2, None)
    assert dataclasses.replace(c, bos_token_id=1, eos_token_id=2) == plain


def test_each_model_type_takes_its_own_transformers_defaults():
    # A Mixtral without rope_theta and rms_norm_eps was read with Llama's 1e4 and 1e-6
    # (transformers: 1e6 and 1e-5), a Mistral without sliding_window with no window (4096).
    sizes = {**LLAMA, "num_key_value_heads": 4}
    del sizes["architectures"]
    mixtral = LlamaConfig.from_hf({**sizes, "model_type": "mixtral"})
    assert (mixtral.rope_theta, mixtral.rms_norm_eps, mixtral.sliding_window) == (1e6, 1e-5, None)
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (8, 2)
    mistral = LlamaConfig.from_hf({**sizes, "model_type": "mistral"})
    assert (mistral.sliding_window, mistral.max_position_embeddings) == (4096, 131072)
    assert (
        LlamaConfig.from_hf({**sizes, "model_type": "mistral", "sliding_window": None}).window
        is None
    )
    qwen = LlamaConfig.from_hf({**sizes, "model_type": "qwen2"})
    assert (qwen.max_position_embeddings, qwen.bos_token_id, qwen.eos_token_id) == (
        32768,
        None,
        None,
    )


def test_an_unknown_field_is_loaded_with_one_warning_naming_it():
    hf = {**LLAMA, "_model_name_or_path": "/models/smol.gguf", "some_new_knob": 3}
    with pytest.warns(UserWarning) as caught:
        c = LlamaConfig.from_hf(hf)
    assert len(caught) == 1
    assert str(caught[0].message).startswith("config.json: some_new_knob=3: not a field of")
    assert c == LlamaConfig.from_hf(LLAMA)


@pytest.mark.parametrize(
    ("model_type", "overrides", "match"),
    [
        ("llama", dict(num_local_experts=4), "num_local_experts=4 is not an option of .*'llama'"),
        ("mistral", dict(use_sliding_window=True), "use_sliding_window=True is not an option"),
        ("mistral", dict(mlp_bias=True), "mlp_bias=True is not an option of .*'mistral'"),
    ],
)
def test_another_families_option_is_refused_unless_off(model_type, overrides, match):
    hf = {**LLAMA, "architectures": None, "model_type": model_type, "num_key_value_heads": 4}
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf({**hf, **overrides})
    off = {key: {True: False}.get(value, None) for key, value in overrides.items()}
    assert LlamaConfig.from_hf({**hf, **off}) == LlamaConfig.from_hf(hf)


# A bool field must be a JSON bool, an integer field a JSON integer, a number a JSON number:
# "false" was read as true, 0 as false.
MIXTRAL = {**LLAMA, "architectures": None, "model_type": "mixtral", "num_key_value_heads": 4}
QWEN2 = {**MIXTRAL, "model_type": "qwen2"}
MISTRAL = {**MIXTRAL, "model_type": "mistral"}


@pytest.mark.parametrize(
    ("base", "overrides", "match"),
    [
        (LLAMA, dict(attention_bias="false"), r"attention_bias='false' must be true or false"),
        (LLAMA, dict(attention_bias=0), r"attention_bias=0 must be true or false \(a JSON bool"),
        (LLAMA, dict(mlp_bias="false"), "mlp_bias='false' must be true or false"),
        (LLAMA, dict(mlp_bias=None), "mlp_bias=None must be true or false"),
        (LLAMA, dict(tie_word_embeddings="true"), "tie_word_embeddings='true' must be true or"),
        (LLAMA, dict(rope_interleaved="false"), "rope_interleaved='false' must be true or false"),
        (QWEN2, dict(use_sliding_window="false"), "use_sliding_window='false' must be true or"),
        (MIXTRAL, dict(output_router_logits=1), "output_router_logits=1 must be true or false"),
        (LLAMA, dict(head_dim="8"), "head_dim must be an int, got head_dim='8'"),
        (LLAMA, dict(head_dim=8.0), "head_dim must be an int, got head_dim=8.0"),
        (LLAMA, dict(vocab_size=True), "vocab_size must be an int, got vocab_size=True"),
        (LLAMA, dict(num_key_value_heads=2.0), "num_key_value_heads must be an int, got .*=2.0"),
        (LLAMA, dict(max_position_embeddings="2048"), "max_position_embeddings must be an int"),
        (MISTRAL, dict(sliding_window="8"), "sliding_window must be an int, got .*='8'"),
        (MISTRAL, dict(sliding_window=True), "sliding_window must be an int, got .*=True"),
        (MIXTRAL, dict(num_local_experts=4.0), "num_local_experts must be an int, got .*=4.0"),
        (MIXTRAL, dict(num_experts_per_tok=True), "num_experts_per_tok must be an int"),
        (LLAMA, dict(attention_dropout=False), "attention_dropout=False must be a number"),
        (MIXTRAL, dict(router_jitter_noise="0"), "router_jitter_noise='0' must be a number"),
        (LLAMA, dict(rms_norm_eps="1e-6"), "rms_norm_eps must be a number, got '1e-6'"),
        (LLAMA, dict(rope_theta=True), "rope_theta must be a number, got True"),
    ],
)
def test_a_field_of_the_wrong_json_type_is_refused_by_name(base, overrides, match):
    with pytest.raises(TypeError, match=match):
        LlamaConfig.from_hf({**base, **overrides})


def test_head_dim_zero_is_named():
    # reported as a ZeroDivisionError; refused by name (this test passes on the old code too)
    with pytest.raises(ValueError, match=r"config\.json: head_dim must be > 0, got head_dim=0"):
        LlamaConfig.from_hf({**LLAMA, "head_dim": 0})
