"""Mixtral's sparse MLP: a router over SwiGLU experts, in place of a Llama layer's ``mlp``.

transformers' ``MixtralSparseMoeBlock``, with its checkpoint names, is ``rudax.layers.MoE``
built from a config: the router is ``gate`` (``[E, d]`` in the file) and expert ``e``'s
projections are ``experts.{e}.w1`` (gate), ``w3`` (up) and ``w2`` (down). The layer stores
the experts stacked, ``experts.w1`` ``[E, d, h]``; the name table
(``rudax.models._hf_names``) splits and joins them along that leading axis.

As transformers computes it, the router's logits are in the compute dtype (``rudax.layers.MoE``
defaults to fp32 ones) and its softmax in fp32. Each call returns the layer's load-balancing
statistics over its real tokens (``MoE.route``: padding, segment id 0, excluded, as
transformers excludes masked tokens), which ``LlamaForCausalLM`` pools over layers into
transformers' ``aux_loss``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import rudax.layers as rl
from rudax.models._llama_config import LlamaConfig

__all__ = ["MixtralSparseMoeBlock", "load_balancing_loss"]

INIT = nnx.initializers.normal(0.02)


class MixtralSparseMoeBlock(rl.MoE):
    """``rl.MoE`` of a Mixtral config; a call returns ``(y, (fraction_E, probability_E))``."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        assert c.num_local_experts is not None and c.num_experts_per_tok is not None
        super().__init__(
            c.hidden_size,
            c.intermediate_size,
            c.num_local_experts,
            top_k=c.num_experts_per_tok,
            dtype=dtype,
            param_dtype=c.param_dtype,
            router_dtype=dtype,
            kernel_init=INIT,
            out_init=INIT,
            rngs=rngs,
        )

    def __call__(  # type: ignore[override]  # the statistics, not the loss: pooled by the model
        self, x_BxTxD: jax.Array, *, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        return self.route(x_BxTxD, segment_ids=segment_ids)


def load_balancing_loss(fraction_LxE: jax.Array, probability_LxE: jax.Array) -> jax.Array:
    """transformers' Mixtral ``aux_loss`` from every layer's statistics: ``E * sum_e
    mean_l(fraction_le) * mean_l(probability_le)`` (its ``load_balancing_loss_func`` over the
    layers' router logits concatenated), fp32."""
    num_experts = fraction_LxE.shape[-1]
    f_E = jnp.mean(fraction_LxE, axis=0)
    p_E = jnp.mean(probability_LxE, axis=0)
    return float(num_experts) * jnp.sum(f_E * p_E)
