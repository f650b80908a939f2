"""rudax.models.LlamaConfig against the config.json files transformers writes.

The reference is transformers itself (5.x here): its config classes' saved files must load,
and what ``to_hf`` writes must load back into transformers with the same architecture. The
4.4x spelling is checked on the Llama 3.1 8B file as that version wrote it
(examples/lm/hf_configs) and on hand-written v4 fields.
"""

import json
import math
import pathlib

import jax.numpy as jnp
import pytest
import transformers

import rudax.layers as rl
from rudax.models import LlamaConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]

# SmolLM2-135M's architecture as transformers 5 writes it (public values): tied embeddings,
# GQA 9/3, rope_parameters, dtype, token ids including unk_token_id (which an earlier reader
# refused), and the two fields nanotron's conversion adds.
SMOL_V5 = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dtype": "bfloat16",
    "eos_token_id": 0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": None,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_parameters": {"rope_theta": 100000, "rope_type": "default"},
    "tie_word_embeddings": True,
    "transformers_version": "5.0.0",
    "unk_token_id": 0,
    "use_cache": True,
    "vocab_size": 49152,
}


def _saved(tmp_path, config):
    """The config.json transformers' save_pretrained writes for ``config``."""
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def _tiny(**kw):
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return {**base, **kw}


def test_what_transformers_saves_loads(tmp_path):
    cases = {
        "llama": transformers.LlamaConfig(
            **_tiny(tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
        ),
        "llama3": transformers.LlamaConfig(
            **_tiny(
                max_position_embeddings=512,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 128,
                },
            )
        ),
        "qwen2": transformers.Qwen2Config(**_tiny()),
        "mistral": transformers.MistralConfig(**_tiny(sliding_window=16)),
        "mistral-no-window": transformers.MistralConfig(**_tiny(sliding_window=None)),
    }
    for name, hf_config in cases.items():
        folder = tmp_path / name
        hf = _saved(folder, hf_config)
        c = LlamaConfig.from_hf(hf, param_dtype=jnp.float32)
        assert c.model_type == hf_config.model_type, name
        assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (64, 32, 48), name
        assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 8), name
        assert c.tie_word_embeddings == hf_config.tie_word_embeddings, name
        assert c.rms_norm_eps == hf_config.rms_norm_eps, name
        assert c.qkv_bias == (name == "qwen2"), name
        assert c.sliding_window == (16 if name == "mistral" else None), name
        rope = hf_config.rope_parameters
        assert c.rope_theta == rope["rope_theta"], name
        if name == "llama3":
            assert c.rope_scaling == rl.Llama3RopeScaling(8.0, 1.0, 4.0, 128)
        else:
            assert c.rope_scaling is None, name
        if name == "llama":
            assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, None)


def test_to_hf_loads_into_transformers_with_the_same_architecture(tmp_path):
    configs = [
        LlamaConfig(**_tiny(tie_word_embeddings=True, eos_token_id=(2, 3))),
        LlamaConfig(
            **_tiny(max_position_embeddings=512, param_dtype=jnp.bfloat16),
            rope_scaling=rl.Llama3RopeScaling(8.0, 1.0, 4.0, 128),
            rope_theta=500000.0,
        ),
        LlamaConfig(**_tiny(head_dim=16)),  # heads wider than hidden_size // heads
        LlamaConfig(**_tiny(qkv_bias=True, o_bias=True, mlp_bias=True)),
        LlamaConfig(**_tiny(qkv_bias=True, model_type="qwen2")),
        LlamaConfig(**_tiny(sliding_window=16, model_type="mistral")),
    ]
    for i, c in enumerate(configs):
        hf = c.to_hf()
        assert LlamaConfig.from_hf(hf) == c
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(hf))
        loaded = transformers.AutoConfig.from_pretrained(folder)
        assert (
            type(loaded).__name__
            == {
                "llama": "LlamaConfig",
                "qwen2": "Qwen2Config",
                "mistral": "MistralConfig",
            }[c.model_type]
        )
        assert loaded.num_key_value_heads == c.num_key_value_heads
        assert getattr(loaded, "head_dim", None) in (None, c.head_dim)
        assert loaded.rope_parameters["rope_theta"] == c.rope_theta
        assert loaded.tie_word_embeddings == c.tie_word_embeddings
        assert str(loaded.dtype).removeprefix("torch.") == c.param_dtype.name
        # and transformers' own save of it reads back to the same config
        assert LlamaConfig.from_hf(_saved(folder / "again", loaded)) == c


def test_smollm2_as_transformers_5_writes_it():
    c = LlamaConfig.from_hf(SMOL_V5)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.tie_word_embeddings and c.param_dtype == jnp.bfloat16 and c.rope_theta == 1e5
    assert (c.bos_token_id, c.eos_token_id) == (0, 0)
    # nanotron's rope_interleaved=true would rotate other pairs than transformers does
    with pytest.raises(ValueError, match="rope_interleaved=True is not supported"):
        LlamaConfig.from_hf({**SMOL_V5, "rope_interleaved": True})


def test_llama_31_8b_as_transformers_4_wrote_it():
    hf = json.loads((ROOT / "examples/lm/hf_configs/llama-3.1-8b.json").read_text())
    c = LlamaConfig.from_hf(hf)
    assert c.rope_scaling == rl.Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    assert (c.rope_theta, c.num_key_value_heads, c.param_dtype) == (500000.0, 8, jnp.bfloat16)
    # v4's generic and generation fields, as older files carry them, change nothing
    v4 = dict(
        torchscript=False,
        use_bfloat16=False,
        tf_legacy_loss=False,
        pruned_heads={},
        num_beams=1,
        temperature=1.0,
        top_p=1.0,
        output_scores=False,
        _attn_implementation_internal=None,
        sep_token_id=None,
        unk_token_id=0,
    )
    assert LlamaConfig.from_hf({**hf, **v4}) == c


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(quantization_config={"bits": 4}), "quantization_config=.* read as plain floats"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported; the MLP is SwiGLU"),
        (dict(num_attention_heads=0), "num_attention_heads must be > 0, got .*=0"),
        (dict(num_attention_heads=4, num_key_value_heads=0), "num_key_value_heads must be > 0"),
        (dict(hidden_size=30), "hidden_size=30 is not a multiple of num_attention_heads=4"),
        (dict(head_dim=7), "head_dim=7 must be even"),
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be finite and > 0, got .*nan"),
        (
            dict(
                rope_parameters={
                    "rope_type": "llama3",
                    "factor": math.nan,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                },
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": math.nan,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                },
            ),
            r"rope_type='llama3': factor must be .*nan",
        ),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
        (dict(model_type="gemma"), "model_type='gemma' is not supported"),
        (dict(model_type="qwen2"), r"architectures=\['LlamaForCausalLM'\] is not"),
        (dict(eos_token_id=-1), r"eos_token_id must be a token id >= 0"),
        (dict(dtype="float64"), "dtype='float64' is not supported"),
    ],
)
def test_refusals_name_the_field_and_value(overrides, match):
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32"}
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf({**hf, **_tiny(), **overrides})


def test_windows_and_layer_types():
    mistral = {"model_type": "mistral", "dtype": "float32", **_tiny(sliding_window=8)}
    assert LlamaConfig.from_hf(mistral).window == (7, 0)
    assert LlamaConfig.from_hf({**mistral, "layer_types": ["sliding_attention"] * 2}).window
    with pytest.raises(ValueError, match=r"layer_types=.* every layer must be sliding_attention"):
        LlamaConfig.from_hf({**mistral, "layer_types": ["full_attention", "sliding_attention"]})
    qwen = {"model_type": "qwen2", "dtype": "float32", **_tiny()}
    off = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28)
    assert LlamaConfig.from_hf({**qwen, **off}).sliding_window is None
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):
        LlamaConfig.from_hf({**qwen, **off, "use_sliding_window": True})
    with pytest.raises(ValueError, match="mistral"):
        LlamaConfig(**_tiny(sliding_window=8)).to_hf()  # a llama has no window


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(qkv_bias=True), ValueError, "attention_bias puts biases on q, k, v and o"),
        (dict(model_type="qwen2"), ValueError, "qwen2' has qkv_bias=True"),
        (dict(model_type="qwen2", qkv_bias=True, head_dim=16), ValueError, "head_dim=16"),
        (dict(model_type="bert"), ValueError, "model_type='bert' is not one of"),
        (dict(param_dtype="int8"), ValueError, "param_dtype=int8 is not one of"),
        (dict(tie_word_embeddings=1), TypeError, "tie_word_embeddings must be a bool"),
        (dict(rope_scaling={"factor": 8}), TypeError, "rope_scaling must be a Llama3RopeScaling"),
        (dict(vocab_size=64.0), TypeError, "vocab_size must be an int, got vocab_size=64.0"),
    ],
)
def test_bad_configs(kwargs, error, match):
    with pytest.raises(error, match=match):
        LlamaConfig(**_tiny(**kwargs)).to_hf()
