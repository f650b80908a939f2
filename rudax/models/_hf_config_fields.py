"""Which ``config.json`` fields rudax.models uses, refuses or passes over, and an absent
field's default, per ``model_type``.

The lists are read off transformers' own code (5.x, and the 4.4x spellings): the fields each
family's ``configuration_*.py`` declares and its ``modeling_*.py`` reads, and the ones
``PreTrainedModel`` reads for every model. A field falls in one of three sets:

* used (``USED``): read into ``LlamaConfig``, or checked to hold the one value rudax
  computes. ``REFUSED`` lists the values refused, by the field's name, because they change
  what the model computes and rudax does not implement them;
* bookkeeping (``BOOKKEEPING`` and every ``_``-prefixed name): names, paths, versions, token
  ids, labels, v4's generation defaults, switches of transformers' runtime (the attention
  implementation, the KV cache). They leave the function the weights compute unchanged;
* unknown: anything else. transformers' model for that ``model_type`` ignores it too (its
  modeling code reads the used fields only), so it is loaded as if absent, with one warning
  naming it: a list of harmless names would keep missing the next one a tool writes.

``CROSS_FAMILY``: an option of another of the four families (Mistral's window in a Llama
file) is refused unless it holds its "off" value: the file meant something rudax would not
compute under this ``model_type``.

An absent field takes the default of transformers' config class for the ``model_type``
(``DEFAULTS``), except the sizes (``REQUIRED``): a file without them is damaged, and
transformers' 7B defaults would only fail later, against the weights' shapes.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BOOKKEEPING",
    "CROSS_FAMILY",
    "DEFAULTS",
    "REFUSED",
    "REQUIRED",
    "USED",
    "kind",
    "unknown_fields",
]

# The sizes the weights are shaped by; no default is taken for them.
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)

_COMMON = frozenset(
    {
        *REQUIRED, "model_type", "num_key_value_heads", "head_dim", "hidden_act",
        "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
        "attention_dropout", "layer_types", "dtype", "torch_dtype",
        # RoPE: v4's rope_theta + rope_scaling, v5's rope_parameters, and the two fields
        # transformers folds into them from the top level
        "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
        "original_max_position_embeddings",
        # PreTrainedModel's: weights stored quantized; nanotron's Llama conversion's pairing
        "quantization_config", "rope_interleaved",
    }
)  # fmt: skip
USED = {
    "llama": _COMMON | {"attention_bias", "mlp_bias"},
    "qwen2": _COMMON | {"use_sliding_window", "sliding_window", "max_window_layers"},
    "mistral": _COMMON | {"sliding_window"},
    "mixtral": _COMMON
    | {
        "sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok",
        "router_aux_loss_coef", "output_router_logits", "router_jitter_noise",
    },
}  # fmt: skip

# The values of used fields that are refused, each naming the field, its value and why.
REFUSED = {
    "hidden_act": "anything but 'silu' (or 'swish'): the MLP is SwiGLU",
    "attention_dropout": "anything but 0: attention has no dropout here",
    "rope_scaling": "a rope_type other than 'default' and 'llama3', or a field that type lacks",
    "rope_parameters": "as rope_scaling; per-layer RoPE parameters",
    "partial_rotary_factor": "anything but 1.0: RoPE rotates every channel here",
    "quantization_config": "any: the weights are read as plain floats",
    "rope_interleaved": "true: RoPE rotates the two halves of each head, as transformers",
    "layer_types": "a layer whose attention differs from the config's (window or none)",
    "use_sliding_window": "true (Qwen2): its per-layer windows are not implemented",
    "router_jitter_noise": "anything but 0 (Mixtral): the router has no jitter here",
}

# Options of one family in another family's file: accepted only at the value that means off.
# name -> (that value, the model_type whose option it is)
CROSS_FAMILY = {
    "attention_bias": (False, "llama"),
    "mlp_bias": (False, "llama"),
    "sliding_window": (None, "mistral"),
    "use_sliding_window": (False, "qwen2"),
    "num_local_experts": (None, "mixtral"),
}

BOOKKEEPING = frozenset(
    {
        # the family's own name, checked against model_type
        "architectures", "transformers_version", "_name_or_path",
        # PretrainedConfig's attributes, 4.4x (many dropped in 5.x) and 5.x
        "finetuning_task", "id2label", "label2id", "problem_type", "tokenizer_class",
        "prefix", "task_specific_params", "torchscript", "return_dict", "output_attentions",
        "output_hidden_states", "use_return_dict", "use_bfloat16", "tf_legacy_loss",
        "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
        "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
        "gradient_checkpointing", "attn_implementation",
        # token ids: what generation and tokenizers use, not the forward pass
        "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id",
        "cls_token_id", "mask_token_id", "decoder_start_token_id", "forced_bos_token_id",
        "forced_eos_token_id",
        # transformers 4.x's generation defaults, stored in config.json before
        # generation_config.json existed
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
        "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
        "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "output_scores", "return_dict_in_generate", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
        # the models' own: the initializer's std, the KV cache switch, v4's tensor-parallel
        # slicing of the same products (pretraining_tp > 1 sums the same terms in pieces),
        # nanotron's marker of a Llama config
        "initializer_range", "use_cache", "pretraining_tp", "is_llama_config",
    }
)  # fmt: skip

# transformers' config classes' defaults for an absent field (5.x; 4.4x has the same). None
# for num_key_value_heads: as many as the query heads. head_dim has no default but
# hidden_size // num_attention_heads (Qwen2Config does not declare it; its model reads it).
_LLAMA_LIKE = dict(
    num_key_value_heads=None,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_LIKE, "attention_bias": False, "mlp_bias": False},
    "qwen2": {
        **_LLAMA_LIKE,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_sliding_window": False,
        "sliding_window": 4096,  # acts only with use_sliding_window
        "max_window_layers": 28,
    },
    "mistral": {
        **_LLAMA_LIKE,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
    },
    "mixtral": {
        **_LLAMA_LIKE,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
    },
}


def kind(family: str, name: str) -> str:
    """What field ``name`` is to ``model_type=family``: ``"used"``, ``"other family"``
    (``CROSS_FAMILY``), ``"bookkeeping"`` or ``"unknown"``."""
    if name in USED[family]:
        return "used"
    if name in CROSS_FAMILY:
        return "other family"
    if name in BOOKKEEPING or name.startswith("_"):
        return "bookkeeping"
    return "unknown"


def unknown_fields(family: str, hf: dict[str, Any]) -> list[str]:
    """The fields of ``hf`` that ``model_type=family`` neither uses nor keeps as bookkeeping."""
    return sorted(k for k in hf if kind(family, k) == "unknown")
