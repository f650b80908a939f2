"""``ModelSpec``: a Llama-family model and how it computes, hashable, built under ``jit``.

A ``LlamaConfig`` is the architecture; a training run also decides what the config does
not hold: the compute dtype, the sequence length, remat, scanned layers, the fused loss's
chunk and the embedding's backward. ``ModelSpec`` keeps them together and hashable, so a
jitted builder compiles once per model (``examples.lm.train`` builds its model from one,
and the benchmarks measure that model).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from rudax.layers._lookup import Backward  # the embedding backward's names, as a type
from rudax.layers._remat import Policy  # the names of rl.REMAT_POLICIES, as a type
from rudax.models._llama import LlamaForCausalLM
from rudax.models._llama_config import LlamaConfig

__all__ = ["ModelSpec"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A run's model: its architecture and how it computes.

    Attributes:
      config: the architecture (``rudax.models.LlamaConfig``).
      seq_len: T, the tokens per training row.
      dtype: the compute dtype of activations and logits (the loss is fp32 whatever it is).
      remat: each decoder layer's activation checkpointing, one of
        ``rudax.layers.REMAT_POLICIES``; it changes memory and time, not the gradients.
      scan_layers: the layers stored stacked and run as one ``lax.scan`` (one layer
        compiled; remat effective on every backend).
      loss_chunk: tokens per chunk of the fused head and cross entropy
        (``next_token_loss_sum``'s ``chunk``).
      embedding_backward: ``"scatter"``, or ``"sorted"`` for a GPU run without scatter-add
        atomics (deterministic gradients).

    Example:
      >>> from rudax.models import LlamaConfig, ModelSpec
      >>> spec = ModelSpec(LlamaConfig.tiny(64, hidden_size=32, num_attention_heads=2), 8)
      >>> model = spec.create(0)  # transformers' N(0, 0.02), built under jit
      >>> model.config.hidden_size, spec == ModelSpec(spec.config, 8, dtype="float32")
      (32, True)
    """

    config: LlamaConfig
    seq_len: int
    dtype: Any = jnp.float32
    remat: Policy = "none"
    scan_layers: bool = False
    loss_chunk: int = 1024
    embedding_backward: Backward = "scatter"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))  # one spelling: equal hashes

    def create(self, seed: int) -> LlamaForCausalLM:
        """The model initialized from ``seed`` (transformers' N(0, 0.02))."""
        model = _create(self, seed)
        # Stacked after the jitted build, on the host: the conversion releases each
        # per-layer array as its stacked copy is made.
        model.scan_layers = self.scan_layers
        return model

    def adopt(self, model: LlamaForCausalLM) -> LlamaForCausalLM:
        """A loaded model (``from_pretrained``) made this spec's: its remat, layout and
        embedding backward (the weights and config are the model's own)."""
        model.remat = self.remat
        model.model.embed_tokens.backward = self.embedding_backward
        model.scan_layers = self.scan_layers
        return model

    def _build(self, seed: int) -> LlamaForCausalLM:
        model = LlamaForCausalLM(
            self.config,
            dtype=self.dtype,
            remat=self.remat,
            rngs=nnx.Rngs(seed),
        )
        model.model.embed_tokens.backward = self.embedding_backward
        return model


@functools.partial(nnx.jit, static_argnums=(0, 1))
def _create(spec: ModelSpec, seed: int) -> LlamaForCausalLM:
    # under jit: one compilation, not one per initializer shape, and (the cache is keyed by
    # the static spec) none for a second run alike
    return spec._build(seed)
