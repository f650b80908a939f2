"""``LlamaConfig``'s ``config.json`` form: what transformers writes, read and written.

``from_hf`` reads a ``config.json`` as transformers 4.4x writes it
(``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and as 5.x writes it
(``rope_parameters``, ``dtype``); ``to_hf`` writes both spellings, so either version loads
what rudax writes.

Which fields are refused. A field falls in one of three sets:

* read: the architecture (sizes, heads, RoPE, norms, biases, window, tying) and the storage
  dtype, each checked;
* inert: fields that do not change the function the weights compute (``_INERT``): the
  bookkeeping every ``PretrainedConfig`` carries, token ids (kept for generation), v4's
  generation defaults, the initializer's std, the KV-cache switch;
* anything else is refused, naming the field. A file that needs an option rudax lacks (a
  quantization config, another RoPE type, an activation other than SiLU) is refused instead
  of being loaded to compute something else.

A read field whose value rudax cannot compute (``hidden_act="gelu"``, a nonzero
``attention_dropout``, a per-layer window pattern) is refused with the value and the reason.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

from rudax.layers._rope import Llama3RopeScaling

if TYPE_CHECKING:  # the class calls in here; only its type is needed
    from rudax.models._llama_config import LlamaConfig

__all__ = ["ARCHITECTURES", "DTYPES", "from_hf", "to_hf"]

CONFIG = "config.json"

# model_type -> the architecture transformers names its causal LM after.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

# Fields that do not change what the weights compute. The PretrainedConfig attributes of
# transformers 4.4x (many were dropped in 5.x) and 5.x, then the models' own inert fields.
_INERT = frozenset(
    {
        # bookkeeping
        "architectures", "model_type", "transformers_version", "_name_or_path",
        "_commit_hash", "_attn_implementation", "_attn_implementation_internal",
        "attn_implementation", "finetuning_task", "id2label", "label2id", "problem_type",
        "tokenizer_class", "prefix", "task_specific_params", "torchscript", "return_dict",
        "output_attentions", "output_hidden_states", "use_return_dict", "use_bfloat16",
        "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder",
        "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
        "tie_encoder_decoder", "gradient_checkpointing",
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
        # the models' own: initializer std, KV cache switch, v4's tensor-parallel slicing of
        # the same products (pretraining_tp > 1 sums the same terms in pieces)
        "initializer_range", "use_cache", "pretraining_tp",
    }
)  # fmt: skip

# Fields read below, per model_type.
_READ = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
        "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
        "attention_dropout", "rope_theta", "rope_scaling", "rope_parameters", "dtype",
        "torch_dtype",
    }
)  # fmt: skip
_FAMILY_READ = {
    # is_llama_config and rope_interleaved: written by nanotron's Llama conversion (SmolLM's
    # files carry them); the first is a marker, the second must be false (transformers
    # rotates halves, never interleaved pairs).
    "llama": frozenset({"attention_bias", "mlp_bias", "is_llama_config", "rope_interleaved"}),
    "qwen2": frozenset(
        {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
    ),
    "mistral": frozenset({"sliding_window", "layer_types"}),
    "mixtral": frozenset(
        {
            "sliding_window",
            "num_local_experts",
            "num_experts_per_tok",
            "router_aux_loss_coef",
            "output_router_logits",
            "router_jitter_noise",
        }
    ),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ROPE_TYPES = ("default", "llama3")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")


def _same(a: Any, b: Any) -> bool:
    """Equality in which NaN equals NaN (a NaN field is reported as NaN, not as a conflict)."""
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return both_nan or a == b


def from_hf(cls: type[LlamaConfig], hf: Any, param_dtype: Any) -> LlamaConfig:
    """``cls.from_hf``: the config of a parsed ``config.json`` (module docstring)."""
    if not isinstance(hf, dict):
        raise TypeError(f"hf must be a config.json's dict, got {type(hf).__name__}")
    family = hf.get("model_type")
    if family not in ARCHITECTURES:
        raise ValueError(
            f"{CONFIG}: model_type={family!r} is not supported; rudax.models reads "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    arch = hf.get("architectures")
    if arch is not None and arch != [ARCHITECTURES[family]]:
        raise ValueError(
            f"{CONFIG}: architectures={arch!r} is not [{ARCHITECTURES[family]!r}], the causal "
            f"LM of model_type={family!r}"
        )
    unknown = sorted(set(hf) - _INERT - _READ - _FAMILY_READ[family])
    if unknown:
        key = unknown[0]
        raise ValueError(
            f"{CONFIG}: {key}={hf[key]!r} is a field rudax.models does not implement; a "
            f"model that needs it would compute something else, so the checkpoint is refused"
        )

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"{CONFIG}: {key} is missing")
        return hf[key]

    def refuse(key: str, why: str) -> None:
        raise ValueError(f"{CONFIG}: {key}={hf[key]!r} is not supported; {why}")

    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        refuse("hidden_act", "the MLP is SwiGLU (silu)")
    if hf.get("attention_dropout", 0.0) not in (0, 0.0):
        refuse("attention_dropout", "attention has no dropout here (0.0 only)")
    qkv_bias = o_bias = mlp_bias = False
    window = None
    experts: dict[str, Any] = {}
    if family == "llama":
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
        if hf.get("rope_interleaved", False):
            refuse("rope_interleaved", "RoPE rotates the two halves of each head, as transformers")
    elif family == "qwen2":
        qkv_bias = True
        layer_types = hf.get("layer_types")
        if layer_types is not None and set(layer_types) != {"full_attention"}:
            refuse("layer_types", "Qwen2's per-layer windows are not implemented")
        if hf.get("use_sliding_window", False):
            refuse("use_sliding_window", "Qwen2's per-layer windows are not implemented")
        # sliding_window and max_window_layers act only with use_sliding_window; Qwen2
        # checkpoints carry them (4096, 28...) with it off.
    elif family == "mixtral":
        window = hf.get("sliding_window")
        if hf.get("router_jitter_noise", 0.0) not in (0, 0.0):
            refuse("router_jitter_noise", "the router has no jitter here (0.0 only)")
        experts = {"num_local_experts": need("num_local_experts")}
        for key in ("num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"):
            if key in hf:
                experts[key] = hf[key]
    else:  # mistral: one window in every layer, or none
        window = hf.get("sliding_window")
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            kinds = set(layer_types)
            want = {"sliding_attention"} if window is not None else {"full_attention"}
            if kinds != want:
                refuse("layer_types", f"every layer must be {want.pop()} for this sliding_window")
    param_dtype = _dtype(hf) if param_dtype is None else param_dtype
    seq_len = hf.get("max_position_embeddings", 2048)
    theta, scaling = _rope(hf, seq_len)
    try:
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=hf.get("num_key_value_heads"),
            head_dim=hf.get("head_dim"),
            max_position_embeddings=seq_len,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=window,
            model_type=family,
            param_dtype=param_dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            **experts,
        )
    except (TypeError, ValueError) as e:
        if str(e).startswith(f"{CONFIG}: "):  # need()'s, named already
            raise
        raise type(e)(f"{CONFIG}: {e}") from e


def _dtype(hf: dict[str, Any]) -> Any:
    names = {key: hf[key] for key in ("dtype", "torch_dtype") if hf.get(key) is not None}
    if len(set(names.values())) > 1:
        raise ValueError(f"{CONFIG}: dtype and torch_dtype disagree: {names}")
    if not names:
        raise ValueError(f"{CONFIG}: no dtype or torch_dtype field: pass param_dtype")
    key, name = next(iter(names.items()))
    if name not in DTYPES:
        raise ValueError(f"{CONFIG}: {key}={name!r} is not supported; {sorted(DTYPES)}")
    return DTYPES[name]


def _rope(hf: dict[str, Any], seq_len: Any) -> tuple[Any, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from v4's rope_theta + rope_scaling and/or v5's rope_parameters."""
    rope: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        part = hf.get(key)
        if part is None:
            continue
        if not isinstance(part, dict):
            raise ValueError(f"{CONFIG}: {key}={part!r} must be a dict or null")
        for field, value in part.items():
            if field in rope and not _same(rope[field], value):
                raise ValueError(
                    f"{CONFIG}: rope_scaling and rope_parameters disagree on {field}: "
                    f"{rope[field]!r} and {value!r}"
                )
            rope[field] = value
    if "rope_theta" in hf:
        if not _same(rope.setdefault("rope_theta", hf["rope_theta"]), hf["rope_theta"]):
            raise ValueError(
                f"{CONFIG}: rope_theta={hf['rope_theta']!r} but rope_parameters has "
                f"rope_theta={rope['rope_theta']!r}"
            )
    kinds = {rope[key] for key in ("rope_type", "type") if key in rope}
    if len(kinds) > 1:
        raise ValueError(f"{CONFIG}: rope 'type' and 'rope_type' disagree: {sorted(kinds)}")
    kind = kinds.pop() if kinds else "default"
    if kind not in _ROPE_TYPES:
        raise ValueError(
            f"{CONFIG}: rope_type={kind!r} is not implemented; rudax.models implements "
            f"{list(_ROPE_TYPES)}"
        )
    fields = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if kind == "llama3":
        fields |= {*_LLAMA3_FIELDS, "original_max_position_embeddings"}
    if not _same(rope.get("partial_rotary_factor", 1.0), 1.0):
        raise ValueError(
            f"{CONFIG}: partial_rotary_factor={rope['partial_rotary_factor']!r} is not "
            "supported; RoPE rotates every channel here (1.0)"
        )
    extra = sorted(set(rope) - fields)
    if extra:
        raise ValueError(
            f"{CONFIG}: rope field {extra[0]}={rope[extra[0]]!r} is not implemented for "
            f"rope_type={kind!r}"
        )
    theta = rope.get("rope_theta", 10000.0)
    if kind == "default":
        return theta, None
    missing = [f for f in _LLAMA3_FIELDS if f not in rope]
    if missing:
        raise ValueError(f"{CONFIG}: rope_type='llama3' needs {missing[0]}")
    # transformers' default when absent: the model's own context length.
    old = rope.get("original_max_position_embeddings", seq_len)
    try:
        scaling = Llama3RopeScaling(
            rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], old
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{CONFIG}: rope_type='llama3': {e}") from e
    return theta, scaling


def to_hf(c: LlamaConfig) -> dict[str, Any]:
    """``c.to_hf()``: the ``config.json`` both transformers versions read."""
    rope: dict[str, Any] = {"rope_theta": c.rope_theta, "rope_type": "default"}
    scaling = None
    if c.rope_scaling is not None:
        s = c.rope_scaling
        scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
        rope.update(scaling)
    dtype = np.dtype(c.param_dtype).name
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[c.model_type]],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_dropout": 0.0,
        "rope_theta": c.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "dtype": dtype,
        "torch_dtype": dtype,
        "bos_token_id": _json_ids(c.bos_token_id),
        "eos_token_id": _json_ids(c.eos_token_id),
        "pad_token_id": _json_ids(c.pad_token_id),
        "initializer_range": 0.02,
        "use_cache": True,
    }
    family = c.model_type
    where = f"model_type={family!r}"
    if family == "llama":
        if c.qkv_bias != c.o_bias:
            raise ValueError(
                f"{where}: Llama's attention_bias puts biases on q, k, v and o together; got "
                f"qkv_bias={c.qkv_bias}, o_bias={c.o_bias} (q/k/v only is model_type='qwen2')"
            )
        if c.sliding_window is not None:
            raise ValueError(f"{where} has no sliding window: use model_type='mistral'")
        hf.update(attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias, pretraining_tp=1)
    else:
        wanted = (True, False, False) if family == "qwen2" else (False, False, False)
        if (c.qkv_bias, c.o_bias, c.mlp_bias) != wanted:
            raise ValueError(
                f"{where} has qkv_bias={wanted[0]}, o_bias=False, mlp_bias=False; got "
                f"{c.qkv_bias}, {c.o_bias}, {c.mlp_bias}"
            )
        if family == "qwen2":
            if c.sliding_window is not None:
                raise ValueError(f"{where}: Qwen2's sliding window is not implemented")
            del hf["head_dim"]  # not a Qwen2 field: always hidden_size // heads there
            if c.head_dim != c.hidden_size // c.num_attention_heads:
                raise ValueError(
                    f"{where} has head_dim = hidden_size // num_attention_heads, got "
                    f"head_dim={c.head_dim}"
                )
            hf.update(
                use_sliding_window=False, sliding_window=None, max_window_layers=c.num_hidden_layers
            )
        else:
            hf.update(sliding_window=c.sliding_window)
    if family == "mixtral":
        assert c.num_local_experts is not None  # checked when the config was built
        hf.update(
            num_local_experts=c.num_local_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            router_aux_loss_coef=c.router_aux_loss_coef,
            output_router_logits=c.output_router_logits,
            router_jitter_noise=0.0,
        )
    return hf


def _json_ids(ids: Any) -> int | list[int] | None:
    return list(ids) if isinstance(ids, tuple) else ids
