"""A Hugging Face Llama (or Qwen2, Mistral) ``config.json`` to and from ``GPTConfig``.

``rudax.models.LlamaConfig`` reads and writes the file (transformers 4.4x and 5.x); this
module maps it onto the GPT's ``GPTConfig`` and refuses what the GPT lacks (an o/MLP bias,
heads narrower than ``hidden_size // num_attention_heads``, a sliding window shorter than the
context). ``examples/lm/hf.py`` moves the tensors.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from examples.lm.model import GPTConfig
from rudax.models import LlamaConfig

CONFIG = "config.json"


def config_from_hf(hf: dict[str, Any], *, param_dtype: Any = None, dtype: Any = None) -> GPTConfig:
    """The ``GPTConfig`` (separate q/k/v projections) of a transformers ``config.json``.

    ``rudax.models.LlamaConfig.from_hf`` reads the file: every field is either read, or
    known not to change what the model computes (``bos_token_id``, ``unk_token_id``,
    ``use_cache``, ...); any other is an error. Then what this GPT cannot compute is refused.

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
      ValueError: config.json: hidden_act='gelu' is not supported; the MLP is SwiGLU (silu)
    """
    c = LlamaConfig.from_hf(hf, param_dtype=param_dtype)
    return gpt_config(c, dtype=dtype, hf=hf)


def gpt_config(c: LlamaConfig, *, dtype: Any = None, hf: dict[str, Any] | None = None) -> GPTConfig:
    """The ``GPTConfig`` of a ``LlamaConfig``; a ValueError for what the GPT cannot compute."""

    def refuse(key: str, value: Any, why: str) -> None:
        raise ValueError(f"{CONFIG}: {key}={value!r} is not supported; {why}")

    fields = hf or {}
    if c.o_bias:
        refuse("attention_bias", fields.get("attention_bias", True), "the GPT has no o_proj bias")
    if c.mlp_bias:
        refuse("mlp_bias", fields.get("mlp_bias", True), "the GPT has no MLP biases")
    if c.head_dim * c.num_attention_heads != c.hidden_size:
        refuse(
            "head_dim",
            c.head_dim,
            f"the GPT's heads are hidden_size // num_attention_heads = "
            f"{c.hidden_size // c.num_attention_heads} wide",
        )
    if c.sliding_window is not None and c.sliding_window < c.max_position_embeddings:
        refuse("sliding_window", c.sliding_window, "the GPT has no sliding window")
    # jnp's scalar types, as GPTConfig's own defaults are (a config built here then equals and
    # hashes like one built in code).
    param_dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[
        c.param_dtype.name
    ]
    try:
        return GPTConfig(
            vocab_size=c.vocab_size,
            seq_len=c.max_position_embeddings,
            d_model=c.hidden_size,
            n_layers=c.num_hidden_layers,
            n_heads=c.num_attention_heads,
            n_kv_heads=c.num_key_value_heads,
            mlp_hidden=c.intermediate_size,
            rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling,
            norm_eps=c.rms_norm_eps,
            param_dtype=param_dtype,
            dtype=param_dtype if dtype is None else dtype,
            tie_embeddings=c.tie_word_embeddings,
            fused_qkv=False,
            qkv_bias=c.qkv_bias,
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{CONFIG}: {e}") from e


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
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.mlp_hidden,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        max_position_embeddings=c.seq_len,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling,
        tie_word_embeddings=c.tie_embeddings,
        qkv_bias=c.qkv_bias,
        model_type="qwen2" if c.qkv_bias else "llama",
        param_dtype=c.param_dtype,
        eos_token_id=eos_token_id,
    ).to_hf()
