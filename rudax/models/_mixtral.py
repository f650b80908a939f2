"""Mixtral's sparse MLP: a router over SwiGLU experts, in place of a Llama layer's ``mlp``.

transformers' ``MixtralSparseMoeBlock``, with its checkpoint names: the router is ``gate``
(``[E, d]`` in the file) and expert ``e``'s projections are ``experts.{e}.w1`` (gate),
``w3`` (up) and ``w2`` (down). Here the experts are stored stacked, ``experts.w1`` ``[E, d,
h]``, so the grouped matmul (``jax.lax.ragged_dot``) reads them without copying; the
name table (``rudax.models._hf_names``) splits and joins them along that leading axis.

Per token ``x``: ``p = softmax(gate(x))`` in fp32 (the logits in the compute dtype, as
transformers computes them), the ``num_experts_per_tok`` most probable experts with their
probabilities renormalized to sum to 1, and the weighted sum of those experts' SwiGLU outputs
(``rudax.layers._moe.routed_experts``, shared with ``rudax.layers.MoE``).

Each call also returns the layer's load-balancing statistics over its real tokens (padding,
segment id 0, excluded, as transformers excludes masked tokens): the fraction of tokens
routed to each expert, summed over the k choices (so it sums to k), and the mean router
probability of each expert. ``LlamaForCausalLM`` pools them over layers into transformers'
``aux_loss``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import rudax.layers as rl
from rudax.models._llama_config import LlamaConfig

__all__ = ["MixtralExperts", "MixtralSparseMoeBlock", "load_balancing_loss"]

INIT = nnx.initializers.normal(0.02)


class MixtralExperts(nnx.Module):
    """The experts' weights, stacked on a leading expert axis, ``[in, out]`` per expert."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        assert c.num_local_experts is not None  # a Mixtral config (checked when built)
        e, d, h = c.num_local_experts, c.hidden_size, c.intermediate_size
        self.w1 = nnx.Param(INIT(rngs.params(), (e, d, h), c.param_dtype))
        self.w2 = nnx.Param(INIT(rngs.params(), (e, h, d), c.param_dtype))
        self.w3 = nnx.Param(INIT(rngs.params(), (e, d, h), c.param_dtype))


class MixtralSparseMoeBlock(nnx.Module):
    """``gate`` then the routed ``experts``; returns ``(y, (fraction_E, probability_E))``."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.dtype = dtype
        self.impl = "auto"
        assert c.num_local_experts is not None
        self.gate = rl.Linear(
            c.hidden_size,
            c.num_local_experts,
            use_bias=False,
            dtype=dtype,
            param_dtype=c.param_dtype,
            kernel_init=INIT,
            rngs=rngs,
        )
        self.experts = MixtralExperts(c, rngs=rngs)

    def __call__(
        self, x_BxTxD: jax.Array, *, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        c = self.config
        b, t, d = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(b * t, d).astype(self.dtype)
        probs_NxE = jax.nn.softmax(self.gate(x_NxD).astype(jnp.float32), axis=-1)
        w = self.experts
        weights = [v[...].astype(self.dtype) for v in (w.w1, w.w3, w.w2)]
        y_NxD, experts_NxK = rl.routed_experts(
            x_NxD, probs_NxE, *weights, top_k=c.num_experts_per_tok, impl=self.impl
        )
        real_N = (
            jnp.ones((b * t,), jnp.float32)
            if segment_ids is None
            else (segment_ids.reshape(b * t) != 0).astype(jnp.float32)
        )
        n = jnp.maximum(jnp.sum(real_N), 1.0)
        chosen_NxE = jnp.sum(jax.nn.one_hot(experts_NxK, probs_NxE.shape[-1]), axis=1)
        fraction_E = jnp.einsum("ne,n->e", chosen_NxE, real_N) / n
        probability_E = jnp.einsum("ne,n->e", probs_NxE, real_N) / n
        y = y_NxD.astype(self.dtype).reshape(b, t, d)
        return y, (fraction_E, probability_E)


def load_balancing_loss(fraction_LxE: jax.Array, probability_LxE: jax.Array) -> jax.Array:
    """transformers' Mixtral ``aux_loss`` from every layer's statistics: ``E * sum_e
    mean_l(fraction_le) * mean_l(probability_le)`` (its ``load_balancing_loss_func`` over the
    layers' router logits concatenated), fp32."""
    num_experts = fraction_LxE.shape[-1]
    f_E = jnp.mean(fraction_LxE, axis=0)
    p_E = jnp.mean(probability_LxE, axis=0)
    return float(num_experts) * jnp.sum(f_E * p_E)
