"""rudax.models' config.json policy (``_hf_config_fields``) against transformers' own classes.

Every field transformers' LlamaConfig, Qwen2Config, MistralConfig and MixtralConfig declare
or write is used (changing it changes the config, or is refused naming it), or bookkeeping
(changing it changes nothing); none is unknown. An absent field takes the class's default.
A checkpoint folder whose config.json carries a field no one knows loads, with one warning.
"""

import dataclasses
import json
import re
import warnings
from typing import Any

import jax.numpy as jnp
import pytest
import transformers
from flax import nnx

from rudax.models import LlamaConfig, LlamaForCausalLM, from_pretrained, save_pretrained
from rudax.models import _hf_config_fields as policy

CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "mistral": transformers.MistralConfig,
    "mixtral": transformers.MixtralConfig,
}
SIZES: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

# A used field's change: (context given to both loads, the change). Loading the change
# either gives another config or is refused with the field's name.
CHANGES: dict[str, tuple[dict[str, Any], Any]] = {
    "vocab_size": ({}, 128),
    "hidden_size": ({}, 64),
    "intermediate_size": ({}, 96),
    "num_hidden_layers": ({}, 3),
    "num_attention_heads": ({}, 8),
    "num_key_value_heads": ({}, 4),
    "head_dim": ({}, 16),
    "hidden_act": ({}, "gelu"),
    "max_position_embeddings": ({}, 4096),
    "rms_norm_eps": ({}, 1e-3),
    "tie_word_embeddings": ({}, True),
    "attention_dropout": ({}, 0.1),
    "layer_types": ({}, ["full_attention", "sliding_attention"]),
    "dtype": ({}, "bfloat16"),
    "torch_dtype": ({}, "bfloat16"),
    "rope_theta": ({"rope_parameters": None}, 5.0),
    "rope_scaling": ({"rope_parameters": None}, {"rope_type": "default", "rope_theta": 5.0}),
    "rope_parameters": ({}, {"rope_type": "default", "rope_theta": 5.0}),
    "partial_rotary_factor": ({}, 0.5),
    "original_max_position_embeddings": ({"rope_parameters": LLAMA3}, 64),
    "quantization_config": ({}, {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    "rope_interleaved": ({}, True),
    "attention_bias": ({}, True),
    "mlp_bias": ({}, True),
    "use_sliding_window": ({}, True),
    "sliding_window": ({}, 8),
    "max_window_layers": ({"use_sliding_window": True}, 1),
    "num_local_experts": ({}, 4),
    "num_experts": ({}, 4),
    "num_experts_per_tok": ({}, 1),
    "router_aux_loss_coef": ({}, 0.5),
    "output_router_logits": ({}, True),
    "router_jitter_noise": ({}, 0.1),
}
# qwen2's window is read only with use_sliding_window on, which is refused, naming it.
FAMILY_CHANGES: dict[tuple[str, str], tuple[dict[str, Any], Any]] = {
    ("qwen2", "sliding_window"): ({"use_sliding_window": True}, 8)
}


def _written(family):
    """What transformers writes for a tiny config of ``family``: every field, JSON's types."""
    config = CLASSES[family](**SIZES)
    return {**json.loads(config.to_json_string(use_diff=False)), "dtype": "float32"}


def _fields(family):
    """Every field transformers' class declares or writes."""
    cls = CLASSES[family]
    return sorted(set(cls().to_dict()) | {f.name for f in dataclasses.fields(cls)})


def _load(hf):
    """``LlamaConfig.from_hf``, with any warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return LlamaConfig.from_hf(hf)


def _no_ids(config):
    return dataclasses.replace(config, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _other(value):
    """Another value of a bookkeeping field's JSON type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "-x"
    if isinstance(value, list | dict):
        return type(value)()
    return 7  # a null token id or label field


@pytest.mark.parametrize("family", CLASSES)
def test_every_field_transformers_writes_is_used_or_bookkeeping(family):
    kinds = {name: policy.kind(family, name) for name in _fields(family)}
    assert {k: v for k, v in kinds.items() if v not in ("used", "bookkeeping")} == {}
    _load(_written(family))  # nothing warned


USED = [
    (family, name)
    for family in CLASSES
    for name in sorted(set(_fields(family)) | policy.USED[family])
    if policy.kind(family, name) == "used" and name != "model_type"  # model_type: the family
]


@pytest.mark.parametrize(("family", "name"), USED)
def test_a_used_field_changes_the_config_or_is_refused_by_name(family, name):
    context, value = FAMILY_CHANGES.get((family, name), CHANGES[name])
    base = {**_written(family), **context}
    try:
        changed = _load({**base, name: value})
    except (TypeError, ValueError) as e:
        assert re.search(rf"\b{name}\b", str(e)), (name, str(e))
        if not isinstance(value, dict):
            assert repr(value) in str(e), (name, str(e))
        return
    assert changed != _load(base), name


BOOKKEEPING = [
    (family, name)
    for family in CLASSES
    for name in _fields(family)
    if policy.kind(family, name) == "bookkeeping"
]


@pytest.mark.parametrize(("family", "name"), BOOKKEEPING)
def test_a_bookkeeping_field_changes_nothing_computed(family, name):
    hf = _written(family)
    value = None if name == "architectures" else _other(hf[name])
    assert _no_ids(_load({**hf, name: value})) == _no_ids(_load(hf)), name


@pytest.mark.parametrize("family", CLASSES)
def test_the_defaults_are_transformers_class_defaults(family):
    cls = CLASSES[family]
    declared = {f.name: f.default for f in dataclasses.fields(cls)}
    for name, value in policy.DEFAULTS[family].items():
        want = cls.default_theta if name == "rope_theta" else declared[name]
        assert value == want and type(value) is type(want), (family, name, value, want)
    # End to end: a file with the sizes only, read by transformers and by rudax. 32 heads, so
    # that each family's default key/value heads (32 or 8) divide them.
    sizes = dict(vocab_size=64, hidden_size=512, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=32)  # fmt: skip
    assert set(sizes) == set(policy.REQUIRED)
    theirs = cls.from_dict({"model_type": family, **sizes})
    ours = _load({"model_type": family, "dtype": "float32", **sizes})
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 512 // 32)
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert theirs.rope_parameters == {"rope_type": "default", "rope_theta": ours.rope_theta}
    assert ours.rope_scaling is None
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert (theirs.hidden_act, theirs.attention_dropout) == ("silu", 0.0)
    # qwen2's window is None unless use_sliding_window; llama has none
    assert ours.sliding_window == getattr(theirs, "sliding_window", None)
    biases = (ours.qkv_bias, ours.o_bias, ours.mlp_bias)
    if family == "llama":
        assert biases == (theirs.attention_bias, theirs.attention_bias, theirs.mlp_bias)
    else:
        assert biases == (family == "qwen2", False, False)
    if family == "mixtral":
        assert ours.num_local_experts == theirs.num_local_experts
        assert ours.num_experts_per_tok == theirs.num_experts_per_tok
        assert ours.router_aux_loss_coef == theirs.router_aux_loss_coef
        assert ours.output_router_logits == theirs.output_router_logits
        assert theirs.router_jitter_noise == 0.0
    ids = (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == ids


def test_a_default_that_does_not_fit_is_named_as_transformers_default():
    qwen = {"model_type": "qwen2", "dtype": "float32", **SIZES}
    del qwen["num_key_value_heads"]
    with pytest.raises(ValueError, match="num_key_value_heads=32 is transformers' default"):
        LlamaConfig.from_hf(qwen)


def test_a_folder_with_unknown_and_private_fields_loads_with_one_warning(tmp_path):
    # a dequantized GGUF folder as transformers 5 saves it was refused over the first
    config = LlamaConfig(**SIZES)
    save_pretrained(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), tmp_path)
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    hf.update(_model_name_or_path="/models/smol.Q8_0.gguf", a_new_knob=[1, 2])
    path.write_text(json.dumps(hf))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = from_pretrained(tmp_path)
    assert [str(w.message) for w in caught] == [
        "config.json: a_new_knob=[1, 2]: not a field of transformers' LlamaForCausalLM, which "
        "ignores it; rudax.models loads the checkpoint without it"
    ]
    assert model.config == config and model.config.param_dtype == jnp.float32
