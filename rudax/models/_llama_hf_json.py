"""``LlamaConfig``'s ``config.json`` form: what transformers writes, read and written.

``from_hf`` reads a ``config.json`` as transformers 4.4x writes it
(``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and as 5.x writes it
(``rope_parameters``, ``dtype``); ``to_hf`` writes both spellings, so either version loads
what rudax writes.

Which fields are read, refused or passed over is ``rudax.models._hf_config_fields``' policy:
a used field is checked (a bool must be a JSON bool, a size a JSON integer) and a value
rudax cannot compute (``hidden_act="gelu"``, a nonzero ``attention_dropout``, another RoPE
type, a quantized checkpoint) is refused with the field, the value and the reason;
bookkeeping passes; an unknown field is loaded as if absent, with one warning naming it.
An absent field takes transformers' default for the ``model_type``.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np

from rudax.layers import Llama3RopeScaling
from rudax.models import _hf_config_fields as policy

# The config class, which calls in here: this module never imports it (it imports this one).
C = TypeVar("C")

__all__ = ["ARCHITECTURES", "DTYPES", "from_hf", "to_hf"]

CONFIG = "config.json"

# model_type -> the architecture transformers names its causal LM after.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ROPE_TYPES = ("default", "llama3")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")


def _same(a: Any, b: Any) -> bool:
    """Equality in which NaN equals NaN (a NaN field is reported as NaN, not as a conflict)."""
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return both_nan or a == b


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def from_hf(cls: Callable[..., C], hf: Any, param_dtype: Any) -> C:
    """``LlamaConfig.from_hf``: ``cls(**fields)`` of a parsed ``config.json`` (module
    docstring)."""
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
    unknown = policy.unknown_fields(family, hf)
    if unknown:
        named = ", ".join(f"{key}={_short(hf[key])}" for key in unknown)
        warnings.warn(
            f"{CONFIG}: {named}: not a field of transformers' {ARCHITECTURES[family]}, which "
            "ignores it; rudax.models loads the checkpoint without it",
            stacklevel=3,
        )
    defaults = policy.DEFAULTS[family]

    def get(key: str) -> Any:  # the file's value, else transformers' default
        return hf[key] if key in hf else defaults.get(key)

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"{CONFIG}: {key} is missing" + (" (null)" if key in hf else ""))
        return hf[key]

    def refuse(key: str, why: str) -> None:
        raise ValueError(f"{CONFIG}: {key}={get(key)!r} is not supported; {why}")

    def flag(key: str) -> bool:
        value = get(key)
        if not isinstance(value, bool):
            raise TypeError(f"{CONFIG}: {key}={value!r} must be true or false (a JSON bool)")
        return value

    def zero(key: str, why: str) -> None:
        value = get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{CONFIG}: {key}={value!r} must be a number")
        if value != 0:
            refuse(key, why)

    for key, (off, other) in policy.CROSS_FAMILY.items():
        if key in hf and policy.kind(family, key) == "other family" and hf[key] is not off:
            raise ValueError(
                f"{CONFIG}: {key}={hf[key]!r} is not an option of model_type={family!r} "
                f"(transformers' {ARCHITECTURES[family]} would ignore it, model_type={other!r} "
                f"reads it): use model_type={other!r}, or remove the field"
            )
    if hf.get("quantization_config") is not None:
        refuse("quantization_config", "the weights are read as plain floats (dequantize first)")
    if get("hidden_act") not in ("silu", "swish"):
        refuse("hidden_act", "the MLP is SwiGLU (silu)")
    zero("attention_dropout", "attention has no dropout here (0.0 only)")
    if "rope_interleaved" in hf and flag("rope_interleaved"):
        refuse("rope_interleaved", "RoPE rotates the two halves of each head, as transformers")
    qkv_bias = o_bias = mlp_bias = False
    window = None
    experts: dict[str, Any] = {}
    if family == "llama":
        qkv_bias = o_bias = flag("attention_bias")
        mlp_bias = flag("mlp_bias")
    elif family == "qwen2":
        qkv_bias = True
        if flag("use_sliding_window"):
            named = {k: get(k) for k in ("sliding_window", "max_window_layers")}
            refuse("use_sliding_window", f"Qwen2's per-layer windows ({named}) are not implemented")
        # sliding_window and max_window_layers act only with use_sliding_window; Qwen2
        # checkpoints carry them (4096, 28...) with it off.
    else:  # mistral and mixtral: one window in every layer, or none
        window = get("sliding_window")
    if family == "mixtral":
        zero("router_jitter_noise", "the router has no jitter here (0.0 only)")
        experts = {key: get(key) for key in ("num_experts_per_tok", "router_aux_loss_coef")}
        experts["output_router_logits"] = flag("output_router_logits")
        experts["num_local_experts"] = _experts(hf, need)
    param_dtype = _dtype(hf) if param_dtype is None else param_dtype
    seq_len = get("max_position_embeddings")
    theta, scaling = _rope(hf, seq_len, defaults["rope_theta"])
    try:
        config = cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim"),
            max_position_embeddings=seq_len,
            rms_norm_eps=get("rms_norm_eps"),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=flag("tie_word_embeddings"),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=window,
            model_type=family,
            param_dtype=param_dtype,
            bos_token_id=get("bos_token_id"),
            eos_token_id=get("eos_token_id"),
            pad_token_id=get("pad_token_id"),
            **experts,
        )
    except (TypeError, ValueError) as e:
        if str(e).startswith(f"{CONFIG}: "):  # named already
            raise
        # a default the file did not hold, named as such
        filled = [k for k in defaults if k not in hf and defaults[k] is not None and k in str(e)]
        why = "".join(
            f" ({k}={defaults[k]!r} is transformers' default for model_type={family!r}; the "
            "file has none)"
            for k in filled
        )
        raise type(e)(f"{CONFIG}: {e}{why}") from e
    _layer_types(hf, hf["num_hidden_layers"], window is not None)
    return config


def _experts(hf: dict[str, Any], need: Any) -> Any:
    """Mixtral's expert count: ``num_local_experts``, or its alias ``num_experts``, else 8."""
    values = [need(key) for key in ("num_local_experts", "num_experts") if key in hf]
    if len(values) == 2 and values[0] != values[1]:
        raise ValueError(f"{CONFIG}: num_local_experts and num_experts disagree: {values}")
    return values[0] if values else policy.DEFAULTS["mixtral"]["num_local_experts"]


def _layer_types(hf: dict[str, Any], layers: int, windowed: bool) -> None:
    """A ``layer_types`` list must name the config's one attention for each of its layers."""
    kinds = hf.get("layer_types")
    want = "sliding_attention" if windowed else "full_attention"
    if kinds is not None and (not isinstance(kinds, list) or kinds != [want] * layers):
        raise ValueError(
            f"{CONFIG}: layer_types={_short(kinds)} is not supported; every layer must be "
            f"{want}, one entry for each of num_hidden_layers={layers} (per-layer windows are "
            "not implemented)"
        )


def _dtype(hf: dict[str, Any]) -> Any:
    names = {key: hf[key] for key in ("dtype", "torch_dtype") if hf.get(key) is not None}
    if len(set(map(repr, names.values()))) > 1:
        raise ValueError(f"{CONFIG}: dtype and torch_dtype disagree: {names}")
    if not names:
        raise ValueError(f"{CONFIG}: no dtype or torch_dtype field: pass param_dtype")
    key, name = next(iter(names.items()))
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"{CONFIG}: {key}={name!r} is not supported; {sorted(DTYPES)}")
    return DTYPES[name]


def _rope(
    hf: dict[str, Any], seq_len: Any, default_theta: float
) -> tuple[Any, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from v4's rope_theta + rope_scaling and/or v5's rope_parameters,
    and the top-level fields transformers folds into them."""
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
    for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
        if key in hf and not _same(rope.setdefault(key, hf[key]), hf[key]):
            raise ValueError(
                f"{CONFIG}: {key}={hf[key]!r} but rope_parameters has {key}={rope[key]!r}"
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
    # original_max_position_embeddings is llama3's L; transformers' default RoPE ignores it
    fields = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    fields.add("original_max_position_embeddings")
    if kind == "llama3":
        fields |= set(_LLAMA3_FIELDS)
    partial = rope.get("partial_rotary_factor", 1.0)
    if isinstance(partial, bool) or not _same(partial, 1.0):
        raise ValueError(
            f"{CONFIG}: partial_rotary_factor={partial!r} is not supported; RoPE rotates "
            "every channel here (1.0)"
        )
    extra = sorted(set(rope) - fields)
    if extra:
        raise ValueError(
            f"{CONFIG}: rope field {extra[0]}={rope[extra[0]]!r} is not implemented for "
            f"rope_type={kind!r}"
        )
    theta = rope.get("rope_theta", default_theta)
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


def to_hf(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``LlamaConfig.to_hf``: the ``config.json`` both transformers versions read, of the
    config's fields (name -> value)."""
    c = types.SimpleNamespace(**fields)
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
