"""The layers of a Llama decoder block, with Hugging Face's attribute names: ``LlamaAttention``
(grouped-query attention with RoPE, prefill and decode through a ``KVCache``), ``LlamaMLP``
(SwiGLU) and ``LlamaDecoderLayer`` (pre-norm residual block, with Mixtral's
``block_sparse_moe`` from ``_mixtral.py`` in place of ``mlp`` when the config has experts).
``LlamaForCausalLM`` in ``_llama.py`` stacks them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import rudax.kernels as rk
import rudax.layers as rl
from rudax.layers._rope import apply_rope
from rudax.models._kv_cache import KVCache
from rudax.models._llama_config import LlamaConfig
from rudax.models._mixtral import MixtralSparseMoeBlock

__all__ = ["INIT", "LlamaAttention", "LlamaDecoderLayer", "LlamaMLP"]

# transformers' initializer: N(0, initializer_range = 0.02) for every projection and table.
INIT = nnx.initializers.normal(0.02)


class LlamaAttention(nnx.Module):
    """Grouped-query self-attention with RoPE: ``o_proj(attention(rope(q), rope(k), v))``."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.dtype = dtype
        self.impl, self.interpret = "auto", False
        assert c.head_dim is not None and c.num_key_value_heads is not None  # filled by config
        h, g, k = c.num_attention_heads, c.num_key_value_heads, c.head_dim

        def linear(n_in: int, n_out: int, bias: bool) -> rl.Linear:
            return rl.Linear(
                n_in,
                n_out,
                use_bias=bias,
                dtype=dtype,
                param_dtype=c.param_dtype,
                kernel_init=INIT,
                rngs=rngs,
            )

        self.q_proj = linear(c.hidden_size, h * k, c.qkv_bias)
        self.k_proj = linear(c.hidden_size, g * k, c.qkv_bias)
        self.v_proj = linear(c.hidden_size, g * k, c.qkv_bias)
        self.o_proj = linear(h * k, c.hidden_size, c.o_bias)

    def __call__(
        self,
        x_BxTxD: jax.Array,
        *,
        positions: jax.Array,
        segment_ids: jax.Array | None,
        branch_ids: jax.Array | None = None,
        cache: tuple[jax.Array, jax.Array] | None = None,
        cache_state: KVCache | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        c = self.config
        b, t, _ = x_BxTxD.shape
        h, g, kd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        assert g is not None and kd is not None
        q = self.q_proj(x_BxTxD).reshape(b, t, h, kd)
        k = self.k_proj(x_BxTxD).reshape(b, t, g, kd)
        v = self.v_proj(x_BxTxD).reshape(b, t, g, kd)
        table = None if cache_state is None else cache_state.size
        rope = lambda y: apply_rope(
            y,
            positions=positions,
            theta=c.rope_theta,
            scaling=c.rope_scaling,
            table_size=table,
        )
        q, k = rope(q), rope(k)
        attend = lambda q, k, v, **kw: rk.flash_attention(
            q, k, v, impl=self.impl, interpret=self.interpret, **kw
        )
        new_cache = None
        if cache is None or cache_state is None:
            out = attend(
                q, k, v, causal=True, segment_ids=segment_ids, branch_ids=branch_ids,
                window=c.window,
            )  # fmt: skip
        else:
            keys, values = cache
            start = cache_state.length
            keys = jax.lax.dynamic_update_slice(keys, k.astype(keys.dtype), (0, start, 0, 0))
            values = jax.lax.dynamic_update_slice(values, v.astype(values.dtype), (0, start, 0, 0))
            new_cache = (keys, values)
            if t > 1:
                # Prefill: the cache is empty before these tokens (checked by the caller), so
                # attention is over the new tokens alone, causal.
                out = attend(q, k, v, causal=True, segment_ids=segment_ids, window=c.window)
            else:
                # Decode: one query over every slot; the slots it may see (real tokens up to
                # its own, and within the window) are the kv segment 1, the rest 0.
                seen = cache_state.valid
                if c.sliding_window is not None:
                    reach = positions[:, :1] - cache_state.positions < c.sliding_window
                    seen = seen & reach
                out = attend(
                    q,
                    keys.astype(q.dtype),
                    values.astype(q.dtype),
                    segment_ids=jnp.ones((b, 1), jnp.int32),
                    kv_segment_ids=seen.astype(jnp.int32),
                )
        return self.o_proj(out.reshape(b, t, h * kd)), new_cache


class LlamaMLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        c = config

        def linear(n_in: int, n_out: int) -> rl.Linear:
            return rl.Linear(
                n_in,
                n_out,
                use_bias=c.mlp_bias,
                dtype=dtype,
                param_dtype=c.param_dtype,
                kernel_init=INIT,
                rngs=rngs,
            )

        self.gate_proj = linear(c.hidden_size, c.intermediate_size)
        self.up_proj = linear(c.hidden_size, c.intermediate_size)
        self.down_proj = linear(c.intermediate_size, c.hidden_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(rk.silu_mul(self.gate_proj(x), self.up_proj(x)))


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
