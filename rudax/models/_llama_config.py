"""``LlamaConfig``: a Llama-family decoder's architecture in Hugging Face's field names.

One class covers the checkpoints that differ from Llama only in options: Llama 2, 3 and 3.1
(Llama 3's RoPE scaling), Qwen2 (q/k/v biases), Mistral (a sliding window), Mixtral (a
mixture of experts in place of each MLP), and SmolLM-style tied embeddings. Every field is
checked when a config is built. Its ``config.json`` form (``from_hf`` / ``to_hf``) is
``rudax.models._llama_hf_json``'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from rudax.layers import Llama3RopeScaling
from rudax.models import _llama_hf_json
from rudax.models._llama_hf_json import ARCHITECTURES as _ARCHITECTURES
from rudax.models._llama_hf_json import DTYPES as _DTYPES

__all__ = ["LlamaConfig"]

TokenIds = int | tuple[int, ...] | None


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The architecture of a Llama-family decoder; checked when built, hashable (a static jit
    argument).

    The names are Hugging Face's, so a field here is the ``config.json`` field of the same name.

    Attributes:
      vocab_size: tokens in the vocabulary.
      hidden_size: width of the residual stream.
      intermediate_size: hidden width of the gated (SwiGLU) MLP.
      num_hidden_layers: decoder blocks.
      num_attention_heads: query heads.
      num_key_value_heads: key/value heads, dividing ``num_attention_heads``; None for as many
        (multi-head attention). Filled in when built.
      head_dim: channels per head, even (RoPE rotates pairs); None for ``hidden_size //
        num_attention_heads``. Filled in when built.
      max_position_embeddings: the longest context the model was trained for.
      rms_norm_eps: RMSNorm's epsilon.
      rope_theta: RoPE's base wavelength.
      rope_scaling: None, or Llama 3.1's ``Llama3RopeScaling``.
      tie_word_embeddings: the output head is the token embedding's table.
      qkv_bias: q, k and v projections have biases (Qwen2; Llama's ``attention_bias``).
      o_bias: the output projection has a bias (Llama's ``attention_bias``).
      mlp_bias: the MLP's projections have biases (Llama's ``mlp_bias``).
      sliding_window: None, or each query sees itself and the ``sliding_window - 1`` keys
        before it (Mistral's, in every layer).
      num_local_experts: None for a dense SwiGLU MLP in every layer; E >= 1 for Mixtral's
        sparse block: a router over E SwiGLU experts of ``intermediate_size`` each.
      num_experts_per_tok: experts each token is routed to, in ``[1, num_local_experts]``.
      router_aux_loss_coef: the weight of the load-balancing loss in the training loss.
      output_router_logits: whether the training loss (``causal_lm_loss_sum``) adds the
        load-balancing loss, as transformers' Mixtral adds it only then.
      model_type: ``"llama"``, ``"qwen2"``, ``"mistral"`` or ``"mixtral"``: which
        transformers class ``to_hf`` names.
      param_dtype: the checkpoint's storage dtype (``dtype`` / ``torch_dtype``).
      bos_token_id, eos_token_id, pad_token_id: the token ids the checkpoint names (an int,
        a tuple of ints or None), kept for generation.

    Example:
      >>> from rudax.models import LlamaConfig
      >>> c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
      ...                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
      >>> c.head_dim, c.to_hf()["architectures"]
      (8, ['LlamaForCausalLM'])
      >>> LlamaConfig.from_hf(c.to_hf()) == c
      True
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    num_local_experts: int | None = None
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    model_type: str = "llama"
    param_dtype: Any = jnp.float32
    bos_token_id: TokenIds = None
    eos_token_id: TokenIds = None
    pad_token_id: TokenIds = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            _check_positive_int(name, getattr(self, name))
        heads = self.num_attention_heads
        kv = heads if self.num_key_value_heads is None else self.num_key_value_heads
        _check_positive_int("num_key_value_heads", kv)
        if heads % kv:
            raise ValueError(f"num_key_value_heads={kv} must divide num_attention_heads={heads}")
        object.__setattr__(self, "num_key_value_heads", kv)
        head_dim = self.head_dim
        if head_dim is None:
            if self.hidden_size % heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not a multiple of "
                    f"num_attention_heads={heads}: give head_dim"
                )
            head_dim = self.hidden_size // heads
        _check_positive_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even: RoPE rotates pairs")
        object.__setattr__(self, "head_dim", head_dim)
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {name}={value!r}")
            object.__setattr__(self, name, float(value))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise TypeError(
                f"rope_scaling must be a Llama3RopeScaling or None, got {self.rope_scaling!r}"
            )
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)
        self._check_experts()
        if self.model_type not in _ARCHITECTURES:
            raise ValueError(
                f"model_type={self.model_type!r} is not one of {sorted(_ARCHITECTURES)}"
            )
        try:
            dtype = jnp.dtype(self.param_dtype)
        except TypeError as e:
            raise TypeError(f"param_dtype={self.param_dtype!r} is not a dtype") from e
        if dtype.name not in _DTYPES:
            raise ValueError(f"param_dtype={dtype.name} is not one of {sorted(_DTYPES)}")
        object.__setattr__(self, "param_dtype", dtype)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            object.__setattr__(self, name, _token_ids(name, getattr(self, name)))

    def _check_experts(self) -> None:
        experts = self.num_local_experts
        if experts is not None:
            _check_positive_int("num_local_experts", experts)
            _check_positive_int("num_experts_per_tok", self.num_experts_per_tok)
            if self.num_experts_per_tok > experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be <= "
                    f"num_local_experts={experts}"
                )
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, int | float):
            raise TypeError(f"router_aux_loss_coef must be a number, got {coef!r}")
        if not (math.isfinite(coef) and coef >= 0):
            raise ValueError(f"router_aux_loss_coef must be finite and >= 0, got {coef!r}")
        object.__setattr__(self, "router_aux_loss_coef", float(coef))
        if not isinstance(self.output_router_logits, bool):
            raise TypeError(
                f"output_router_logits must be a bool, got {self.output_router_logits!r}"
            )
        if (self.model_type == "mixtral") != (experts is not None):
            raise ValueError(
                f"model_type={self.model_type!r} with num_local_experts={experts}: experts are "
                "Mixtral's (model_type='mixtral'), and a Mixtral has experts"
            )

    @property
    def window(self) -> tuple[int, int] | None:
        """The sliding window as ``flash_attention``'s ``(left, right)``, or None."""
        return None if self.sliding_window is None else (self.sliding_window - 1, 0)

    @classmethod
    def tiny(
        cls,
        vocab_size: int = 8192,
        *,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        intermediate_size: int | None = None,
        max_position_embeddings: int = 256,
        param_dtype: Any = jnp.bfloat16,
        **fields: Any,
    ) -> LlamaConfig:
        """The small model ``examples.lm.train`` trains from scratch (the README's main job).

        A Llama with tied embeddings (SmolLM's layout) and bf16 storage: 3.2M parameters in
        its blocks and 2.1M in the shared table at the defaults, a few minutes of training on
        a 2-core CPU. Any field may be changed by name.

        Args:
          vocab_size: the tokenizer's vocabulary.
          hidden_size, num_hidden_layers, num_attention_heads, max_position_embeddings: as
            the class's fields.
          intermediate_size: None for SwiGLU's ``8/3 * hidden_size`` rounded up to a multiple
            of 64, which keeps the MLP's parameter count that of a 4x GELU MLP.
          param_dtype: the storage dtype.
          **fields: any other field of the class (``num_key_value_heads=2``, say).

        Returns:
          The config.

        Example:
          >>> from rudax.models import LlamaConfig
          >>> c = LlamaConfig.tiny()
          >>> c.intermediate_size, c.tie_word_embeddings, c.param_dtype
          (704, True, dtype(bfloat16))
          >>> LlamaConfig.tiny(hidden_size=512).intermediate_size
          1408
        """
        if intermediate_size is None:
            _check_positive_int("hidden_size", hidden_size)
            intermediate_size = -(-8 * hidden_size // (3 * 64)) * 64  # ceil, in integers
        fields.setdefault("tie_word_embeddings", True)
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            max_position_embeddings=max_position_embeddings,
            param_dtype=param_dtype,
            **fields,
        )

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, param_dtype: Any = None) -> LlamaConfig:
        """The ``LlamaConfig`` of a transformers ``config.json`` (4.4x or 5.x).

        Args:
          hf: the parsed ``config.json``.
          param_dtype: the storage dtype; None for the file's ``dtype`` / ``torch_dtype``.

        Returns:
          The config. A ValueError names the first field that is missing, or whose value
          rudax cannot compute (``rudax.models._hf_config_fields`` lists them), a TypeError
          one of the wrong JSON type (``"false"`` for a bool); v4 and v5 spellings present
          together must agree. An absent field takes the default of transformers' config
          class for the ``model_type``; a field neither used nor bookkeeping is loaded as if
          absent, with one warning naming it.

        Example:
          >>> from rudax.models import LlamaConfig
          >>> hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64,
          ...           hidden_size=32, intermediate_size=48, num_hidden_layers=2,
          ...           num_attention_heads=4, num_key_value_heads=2, dtype="bfloat16",
          ...           unk_token_id=0, rope_parameters={"rope_type": "default",
          ...                                            "rope_theta": 1e5})
          >>> c = LlamaConfig.from_hf(hf)
          >>> c.num_key_value_heads, c.rope_theta, c.param_dtype
          (2, 100000.0, dtype(bfloat16))
          >>> LlamaConfig.from_hf({**hf, "hidden_act": "gelu"})
          Traceback (most recent call last):
          ...
          ValueError: config.json: hidden_act='gelu' is not supported; the MLP is SwiGLU (silu)
        """
        return _llama_hf_json.from_hf(cls, hf, param_dtype)

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` transformers 4.4x and 5.x both read: RoPE written both ways
        (``rope_theta`` + ``rope_scaling`` and ``rope_parameters``), the dtype as ``dtype`` and
        ``torch_dtype``.

        Returns:
          A JSON-able dict; ``LlamaConfig.from_hf`` of it equals this config.
        """
        return _llama_hf_json.to_hf(
            {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        )


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {name}={value!r}")


def _token_ids(name: str, value: Any) -> TokenIds:
    if value is None:
        return None
    values = list(value) if isinstance(value, list | tuple) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
            raise ValueError(f"{name} must be a token id >= 0 or a list of them, got {value!r}")
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in values)
    return int(value)
