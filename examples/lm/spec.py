"""The trainer's model: a ``rudax.models.LlamaForCausalLM`` and how a run builds and scores it.

A run's flags decide a ``LlamaConfig`` (``LlamaConfig.tiny``'s layout at the flags' sizes:
tied embeddings, SwiGLU, RoPE; a Mixtral with ``--moe``; an ``--init-from`` checkpoint's own
config) and what the config does not hold: the compute dtype, the sequence length, remat,
scanned layers, the fused loss's chunk and the embedding's backward. ``ModelSpec`` keeps
them together, hashable, so a jitted builder compiles once per model.

The trainer's batches are ``[B, T + 1]`` rows of a token stream; ``loss_sum`` scores the
next token of each of the first ``T`` with ``rudax.models.causal_lm_loss_sum``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rudax.models as rm
import rudax.sharding as rs

__all__ = ["ModelSpec", "loss_sum"]


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
      loss_chunk: tokens per chunk of the fused head and cross entropy.
      embedding_backward: ``"scatter"``, or ``"sorted"`` for a GPU run without scatter-add
        atomics (``--deterministic``).
    """

    config: rm.LlamaConfig
    seq_len: int
    dtype: Any = jnp.float32
    remat: str = "none"
    scan_layers: bool = False
    loss_chunk: int = 1024
    embedding_backward: str = "scatter"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))  # one spelling: equal hashes

    def create(self, seed: int) -> rm.LlamaForCausalLM:
        """The model initialized from ``seed`` (transformers' N(0, 0.02))."""
        model = _create(self, seed)
        # Stacked after the jitted build, on the host: the conversion releases each
        # per-layer array as its stacked copy is made.
        model.scan_layers = self.scan_layers
        return model

    def adopt(self, model: rm.LlamaForCausalLM) -> rm.LlamaForCausalLM:
        """A loaded model (``--init-from``) made this spec's: its remat, layout and backward."""
        model.remat = self.remat  # type: ignore[assignment]
        model.model.embed_tokens.backward = self.embedding_backward  # type: ignore[assignment]
        model.scan_layers = self.scan_layers
        return model

    def _build(self, seed: int) -> rm.LlamaForCausalLM:
        model = rm.LlamaForCausalLM(
            self.config,
            dtype=self.dtype,
            remat=self.remat,
            rngs=nnx.Rngs(seed),  # type: ignore[arg-type]
        )
        model.model.embed_tokens.backward = self.embedding_backward  # type: ignore[assignment]
        return model


@functools.partial(nnx.jit, static_argnums=(0, 1))
def _create(spec: ModelSpec, seed: int) -> rm.LlamaForCausalLM:
    # under jit: one compilation, not one per initializer shape, and (the cache is keyed by
    # the static spec) none for a second run alike
    return spec._build(seed)


def loss_sum(
    model: rm.LlamaForCausalLM, batch_BxT1: jax.Array, *, chunk: int = 1024
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy SUMMED over a ``[B, T + 1]`` batch's ``B * T`` targets.

    ``rudax.models.causal_lm_loss_sum`` of ``tokens = batch[:, :-1]``, ``labels =
    batch[:, 1:]``: every target counts. A Mixtral adds its load-balancing term as
    transformers does. The sum is the contract with token-weighted accumulation
    (``rudax.optim.GradientAccumulator``): the weight of a microbatch is its ``tokens``.

    Args:
      model: a ``LlamaForCausalLM``, or its ``rudax.models.shard``ed form inside
        ``jax.shard_map``.
      batch_BxT1: integer token ids ``[B, T + 1]``, ``T >= 1``.
      chunk: tokens per chunk of the fused head and loss.

    Returns:
      ``(loss_sum, {"tokens", "ce_sum", "aux_loss"})`` as ``causal_lm_loss_sum``'s.

    Example:
      >>> import jax.numpy as jnp
      >>> from examples.lm.spec import ModelSpec, loss_sum
      >>> from rudax.models import LlamaConfig
      >>> spec = ModelSpec(LlamaConfig.tiny(64, hidden_size=32, num_attention_heads=2), 8)
      >>> loss, metrics = loss_sum(spec.create(0), jnp.ones((2, 9), jnp.int32))
      >>> int(metrics["tokens"]), loss.dtype
      (16, dtype('float32'))
    """
    batch_BxT1 = jnp.asarray(batch_BxT1)
    if batch_BxT1.ndim != 2 or batch_BxT1.shape[1] < 2:
        raise ValueError(
            f"batch_BxT1 must be [batch, time + 1] with time >= 1, got "
            f"batch_BxT1.shape={batch_BxT1.shape}"
        )
    batch = {"tokens": batch_BxT1[:, :-1], "labels": batch_BxT1[:, 1:]}
    return rm.causal_lm_loss_sum(model, batch, chunk=chunk)


def shard(model: rm.LlamaForCausalLM, mesh: jax.sharding.Mesh) -> rm.LlamaForCausalLM:
    """The model's FSDP form over the mesh's ``fsdp`` axis, as the trainer runs it.

    Parameters are gathered, and their gradients reduce-scattered, in fp32: the bf16
    rounding of a gradient then happens once, as on one device, not once per device.
    """
    return rm.shard(model, rs.ShardingContext(mesh, "fsdp"), compute_dtype=jnp.float32)
