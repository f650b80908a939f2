"""The layers of a Llama decoder block, with Hugging Face's attribute names: ``LlamaAttention``
(grouped-query attention with RoPE, prefill and decode through a ``KVCache`` whose prompt
block is shared by the prompt's samples), ``LlamaMLP`` (SwiGLU) and ``LlamaDecoderLayer``
(pre-norm residual block, with Mixtral's ``block_sparse_moe`` from ``_mixtral.py`` in place of
``mlp`` when the config has experts).
``LlamaForCausalLM`` in ``_llama.py`` stacks them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import rudax.kernels as rk
import rudax.layers as rl
from rudax.models._kv_cache import KVCache
from rudax.models._llama_config import LlamaConfig
from rudax.models._mixtral import MixtralSparseMoeBlock

__all__ = ["INIT", "LlamaAttention", "LlamaDecoderLayer", "LlamaMLP"]

# transformers' initializer: N(0, initializer_range = 0.02) for every projection and table.
INIT = nnx.initializers.normal(0.02)


class LlamaAttention(rl.Attention):
    """Grouped-query self-attention with RoPE, ``o_proj(attention(rope(q), rope(k), v))``:
    ``rudax.layers.Attention`` of a ``LlamaConfig``, plus the KV cache's prefill and decode.

    A call returns ``(out, cache)``: without a cache the layer's own attention and None;
    with one, prefill (the prompt block empty: the prompt's causal attention, its keys and
    values becoming the block) or one decode step (``_decode``).
    """

    def __init__(self, config: LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        self.config = c
        assert c.head_dim is not None and c.num_key_value_heads is not None  # filled by config
        super().__init__(
            c.hidden_size,
            c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            fused_qkv=False,  # transformers' q_proj, k_proj, v_proj
            qkv_bias=c.qkv_bias,
            out_bias=c.o_bias,
            window=c.window,
            rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling,
            dtype=dtype,
            param_dtype=c.param_dtype,
            kernel_init=INIT,
            out_init=INIT,
            rngs=rngs,
        )

    def __call__(
        self,
        x_BxTxD: jax.Array,
        *,
        positions: jax.Array,
        segment_ids: jax.Array | None,
        branch_ids: jax.Array | None = None,
        cache: tuple[jax.Array, ...] | None = None,
        cache_state: KVCache | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, ...] | None]:
        if cache is None or cache_state is None:
            out = super().__call__(
                x_BxTxD, segment_ids=segment_ids, branch_ids=branch_ids, positions=positions
            )
            return out, None
        b, t, _ = x_BxTxD.shape
        q, k, v = self.project(x_BxTxD)
        q = self.rope(q, positions, table_size=cache_state.size)
        k = self.rope(k, positions, table_size=cache_state.size)
        if cache[0].shape[2] == 0:
            # Prefill (the prompt block is empty): the prompt's own causal attention; its keys
            # and values become the prompt block, kv-head-major (the cache's one transpose).
            out = self.attend(q, k, v, segment_ids=segment_ids)
            _, _, own_k, own_v = cache
            to_block = lambda x: x.transpose(0, 2, 1, 3).astype(own_k.dtype)
            new_cache = (to_block(k), to_block(v), own_k, own_v)
        else:
            out, new_cache = self._decode(q, k, v, positions, cache, cache_state)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim)), new_cache

    def _decode(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        cache: tuple[jax.Array, ...],
        state: KVCache,
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """One token per sample row: its key and value written to the row's own block, its
        query attending to its prompt's block (shared by the prompt's samples) and its own."""
        prompt_k, prompt_v, own_k, own_v = cache
        slot = state.length - state.prompt_size
        write = lambda block, x: jax.lax.dynamic_update_slice(
            block, x.transpose(0, 2, 1, 3).astype(block.dtype), (0, 0, slot, 0)
        )
        own_k, own_v = write(own_k, k), write(own_v, v)
        # The slots a query sees: real tokens up to its own, and within Mistral's window.
        n = state.num_samples
        prompt_seen = jnp.repeat(state.prompt_valid, n, axis=0)
        own_seen = state.sample_valid
        window = self.config.sliding_window
        if window is not None:
            q_pos = positions[:, :1]
            prompt_seen &= q_pos - jnp.repeat(state.prompt_positions, n, axis=0) < window
            own_seen &= q_pos - state.sample_positions < window
        out = rk.decode_attention(
            q[:, 0],
            own_k.astype(q.dtype),
            own_v.astype(q.dtype),
            own_seen,
            shared_k=prompt_k.astype(q.dtype),
            shared_v=prompt_v.astype(q.dtype),
            shared_visible=prompt_seen,
        )
        return out[:, None], (prompt_k, prompt_v, own_k, own_v)


class LlamaMLP(rl.GatedMLP):
    """SwiGLU, ``down_proj(silu(gate_proj(x)) * up_proj(x))``: ``rudax.layers.GatedMLP`` of a
    ``LlamaConfig`` (its widths, biases, storage dtype and transformers' initializer)."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        super().__init__(
            c.hidden_size,
            c.intermediate_size,
            use_bias=c.mlp_bias,
            dtype=dtype,
            param_dtype=c.param_dtype,
            kernel_init=INIT,
            rngs=rngs,
        )


class LlamaDecoderLayer(nnx.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (or Mixtral's ``block_sparse_moe``).

    A call returns ``(x, (cache, balance))``: the attention's updated cache (None without
    one) and, for a Mixtral layer, its load-balancing statistics (None for a dense one).
    """

    def __init__(self, config: LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        norm = lambda: rl.RMSNorm(
            c.hidden_size, epsilon=c.rms_norm_eps, dtype=dtype, param_dtype=c.param_dtype
        )
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(c, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        if c.num_local_experts is None:
            self.mlp = LlamaMLP(c, dtype=dtype, rngs=rngs)
        else:
            self.block_sparse_moe = MixtralSparseMoeBlock(c, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, **attention: Any) -> tuple[jax.Array, tuple[Any, Any]]:
        a, cache = self.self_attn(self.input_layernorm(x), **attention)
        x = x + a
        h = self.post_attention_layernorm(x)
        if hasattr(self, "block_sparse_moe"):
            m, balance = self.block_sparse_moe(h, segment_ids=attention.get("segment_ids"))
        else:
            m, balance = self.mlp(h), None
        return x + m, (cache, balance)
