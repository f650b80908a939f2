"""A Hugging Face Llama (or Qwen2) ``config.json`` to and from ``GPTConfig``.

``config_from_hf`` reads what transformers v4 and v5 write (v4: ``rope_theta`` + ``rope_scaling``
and ``torch_dtype``; v5: ``rope_parameters`` and ``dtype``) and refuses every field it does
not implement, naming it; ``config_to_hf`` writes both spellings. ``examples/lm/hf.py`` moves
the tensors.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

import rudax.layers as rl
from examples.lm.model import GPTConfig

CONFIG = "config.json"

# architecture -> model_type. Qwen2 is Llama with q/k/v biases (and an optional sliding
# window, refused below).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}

# Fields that do not change the function a checkpoint computes, accepted without a check:
# bookkeeping, token ids (generation's business), the initializer's std, the KV cache, and
# pretraining_tp (transformers v4 sliced the same products into pieces when it was > 1).
_BENIGN = {
    "architectures",
    "model_type",
    "transformers_version",
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "use_cache",
    "pretraining_tp",
}
# Fields read (and checked) below; anything else in a config.json is refused.
_READ = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_dropout",
    "rope_theta",  # transformers v4: rope_theta and rope_scaling
    "rope_scaling",
    "rope_parameters",  # v5: one dict of both
    "dtype",  # v5
    "torch_dtype",  # v4
}
_FAMILY_READ = {
    "llama": {"attention_bias", "mlp_bias"},
    "qwen2": {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ROPE_TYPES = ("default", "llama3")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")


def config_from_hf(hf: dict[str, Any], *, param_dtype: Any = None, dtype: Any = None) -> GPTConfig:
    """The ``GPTConfig`` (separate q/k/v projections) of a transformers ``config.json``.

    Reads the v4 (``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and v5
    (``rope_parameters``, ``dtype``) spellings and checks that both agree where a file has
    both. Every field is either read, or known not to change what the model computes
    (``bos_token_id``, ``use_cache``, ...); any other is an error, so a checkpoint that
    needs something this GPT lacks is refused instead of loaded wrong.

    Args:
      hf: the parsed ``config.json``.
      param_dtype: storage dtype of the parameters; None for the checkpoint's (``dtype`` or
        ``torch_dtype``).
      dtype: compute dtype; None for ``param_dtype``.

    Returns:
      A ``GPTConfig`` with ``fused_qkv=False`` and ``seq_len = max_position_embeddings``.

    Example:
      >>> from examples.lm.hf_config import config_from_hf
      >>> hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64,
      ...           hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      ...           num_attention_heads=4, num_key_value_heads=2, dtype="float32")
      >>> config = config_from_hf(hf)
      >>> config.n_kv_heads, config.tie_embeddings, config.fused_qkv, config.seq_len
      (2, False, False, 2048)
      >>> config_from_hf({**hf, "hidden_act": "gelu"})
      Traceback (most recent call last):
      ...
      ValueError: config.json: hidden_act='gelu' is not supported; the GPT's MLP is SwiGLU (silu)
    """
    if not isinstance(hf, dict):
        raise TypeError(f"hf must be a config.json's dict, got {type(hf).__name__}")
    arch = hf.get("architectures")
    if not (isinstance(arch, list) and len(arch) == 1 and arch[0] in ARCHITECTURES):
        raise ValueError(
            f"{CONFIG}: architectures={arch!r} is not supported; load_hf reads "
            f"{' and '.join(ARCHITECTURES)} checkpoints"
        )
    family = ARCHITECTURES[arch[0]]
    if hf.get("model_type") != family:
        raise ValueError(
            f"{CONFIG}: model_type={hf.get('model_type')!r} does not match "
            f"architectures={arch!r} (model_type {family!r})"
        )
    unknown = sorted(set(hf) - _BENIGN - _READ - _FAMILY_READ[family])
    if unknown:
        key = unknown[0]
        raise ValueError(
            f"{CONFIG}: {key}={hf[key]!r} is a field load_hf does not implement; a model that "
            f"needs it would compute something else, so the checkpoint is refused"
        )

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"{CONFIG}: {key} is missing")
        return hf[key]

    def refuse(key: str, value: Any, why: str) -> None:
        raise ValueError(f"{CONFIG}: {key}={value!r} is not supported; {why}")

    d, heads = need("hidden_size"), need("num_attention_heads")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        refuse("hidden_act", act, "the GPT's MLP is SwiGLU (silu)")
    if hf.get("attention_dropout", 0.0) not in (0, 0.0):
        refuse("attention_dropout", hf["attention_dropout"], "the GPT has no dropout (0.0 only)")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * heads != d:
        refuse(
            "head_dim",
            head_dim,
            f"the GPT's heads are hidden_size // num_attention_heads = {d // heads} wide",
        )
    if family == "llama":
        for key, what in (("attention_bias", "q/k/v/o_proj"), ("mlp_bias", "the MLP's")):
            if hf.get(key, False):
                refuse(key, hf[key], f"the GPT has no {what} biases")
    else:
        if hf.get("use_sliding_window", False):
            refuse("use_sliding_window", hf["use_sliding_window"], "the GPT has no sliding window")
        # sliding_window and max_window_layers only act with use_sliding_window; Qwen2
        # checkpoints carry them (4096, 28...) with it off.
        layer_types = hf.get("layer_types")
        if layer_types is not None and set(layer_types) != {"full_attention"}:
            refuse("layer_types", layer_types, "every layer is full causal attention here")
    seq_len = hf.get("max_position_embeddings", 2048)
    theta, scaling = _rope(hf, seq_len)
    param_dtype = _dtype(hf) if param_dtype is None else param_dtype
    try:
        return GPTConfig(
            vocab_size=need("vocab_size"),
            seq_len=seq_len,
            d_model=d,
            n_layers=need("num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads,
            mlp_hidden=need("intermediate_size"),
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            param_dtype=param_dtype,
            dtype=param_dtype if dtype is None else dtype,
            tie_embeddings=hf.get("tie_word_embeddings", False),
            fused_qkv=False,
            qkv_bias=family == "qwen2",
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{CONFIG}: {e}") from e


def _dtype(hf: dict[str, Any]) -> Any:
    names = {key: hf[key] for key in ("dtype", "torch_dtype") if hf.get(key) is not None}
    if len(set(names.values())) > 1:
        raise ValueError(f"{CONFIG}: dtype and torch_dtype disagree: {names}")
    if not names:
        raise ValueError(f"{CONFIG}: no dtype or torch_dtype field: pass param_dtype")
    key, name = next(iter(names.items()))
    if name not in _DTYPES:
        raise ValueError(f"{CONFIG}: {key}={name!r} is not supported; {sorted(_DTYPES)}")
    return _DTYPES[name]


def _rope(hf: dict[str, Any], seq_len: int) -> tuple[float, rl.Llama3RopeScaling | None]:
    """(rope_theta, scaling) from v4's rope_theta + rope_scaling and/or v5's rope_parameters."""
    rope: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        part = hf.get(key)
        if part is None:
            continue
        if not isinstance(part, dict):
            raise ValueError(f"{CONFIG}: {key}={part!r} must be a dict or null")
        for field, value in part.items():
            if field in rope and rope[field] != value:
                raise ValueError(
                    f"{CONFIG}: rope_scaling and rope_parameters disagree on {field}: "
                    f"{rope[field]!r} and {value!r}"
                )
            rope[field] = value
    if "rope_theta" in hf and rope.setdefault("rope_theta", hf["rope_theta"]) != hf["rope_theta"]:
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
            f"{CONFIG}: rope_type={kind!r} is not implemented; load_hf implements "
            f"{list(_ROPE_TYPES)}"
        )
    fields = {"rope_type", "type", "rope_theta"}
    if kind == "llama3":
        fields |= {*_LLAMA3_FIELDS, "original_max_position_embeddings"}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"{CONFIG}: partial_rotary_factor={rope['partial_rotary_factor']!r} is not "
            "supported; RoPE rotates every channel here (1.0)"
        )
    fields.add("partial_rotary_factor")
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
        scaling = rl.Llama3RopeScaling(
            rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], old
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{CONFIG}: rope_type='llama3': {e}") from e
    return theta, scaling


def config_to_hf(config: GPTConfig, *, eos_token_id: int | None = None) -> dict[str, Any]:
    """The transformers ``config.json`` of a ``GPTConfig``, readable by transformers v4 and v5.

    A GPT with ``qkv_bias`` is a ``Qwen2ForCausalLM``, any other a ``LlamaForCausalLM``.
    RoPE is written both ways (v4's ``rope_theta`` + ``rope_scaling``, v5's
    ``rope_parameters``), the dtype as ``dtype`` and ``torch_dtype``.

    Args:
      config: a dense ``GPTConfig`` (``num_experts == 0``: the format has no MoE layers).
      eos_token_id: the tokenizer's end-of-text id, or None.

    Returns:
      A JSON-able dict.

    Example:
      >>> from examples.lm.hf_config import config_to_hf
      >>> from examples.lm.model import GPTConfig
      >>> hf = config_to_hf(GPTConfig(n_kv_heads=2))
      >>> hf["architectures"], hf["num_key_value_heads"], hf["tie_word_embeddings"], hf["dtype"]
      (['LlamaForCausalLM'], 2, True, 'bfloat16')
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    c = config
    if c.num_experts:
        raise ValueError(
            f"num_experts={c.num_experts}: a Llama-format checkpoint has no mixture-of-experts "
            "layers; only a dense GPT converts"
        )
    family = "qwen2" if c.qkv_bias else "llama"
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
        "architectures": ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"],
        "model_type": family,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.mlp_hidden,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": c.seq_len,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": 0.0,
        "rope_theta": c.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "dtype": dtype,
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if family == "llama":
        hf.update(head_dim=c.head_dim, attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layers)
    return hf
