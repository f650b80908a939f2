"""``LlamaForCausalLM``: a Llama-family decoder whose module paths are Hugging Face's names.

``model.layers[3].self_attn.q_proj`` here is ``model.layers.3.self_attn.q_proj`` in a
transformers checkpoint and in a peft adapter, so LoRA targets, adapter keys and weight names
need no translation code: a leaf's Hugging Face name is its module path plus the leaf's
name in a small table (``rudax.models._hf_names``; Mixtral's stacked experts are split
along their leading axis there).

The arithmetic is transformers' Llama: pre-norm RMSNorm blocks, rotary positions (Llama 3's
scaling), grouped-query attention through ``rudax.kernels.flash_attention`` (O(T) memory,
packed rows, Mistral's window), a SwiGLU MLP (or Mixtral's routed experts), optional q/k/v
(Qwen2) and o/MLP biases, tied or separate output head.

A forward call takes token ids and returns logits. Generation passes a ``KVCache``
(``init_cache``): the prompt is run once (prefill, causal attention over it, keys and values
written to the cache's prompt block, shared by the prompt's samples), then one token per
sample per call (decode, attention over the prompt's slots and the sample's own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

import rudax.layers as rl
from rudax._validation import float_dtype
from rudax.layers._remat import Policy  # the names of rl.REMAT_POLICIES, as a type
from rudax.models._kv_cache import KVCache
from rudax.models._llama_config import LlamaConfig
from rudax.models._llama_layers import INIT, LlamaDecoderLayer
from rudax.models._mixtral import load_balancing_loss

__all__ = ["KVCache", "LlamaForCausalLM"]


def _check_remat(remat: Any) -> None:
    if remat not in rl.REMAT_POLICIES:
        raise ValueError(f"remat must be one of {rl.REMAT_POLICIES}, got {remat=}")


class LlamaModel(nnx.Module):
    """The embedding, the decoder layers and the final norm (transformers' ``model``)."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        self.embed_tokens = rl.Embedding(
            c.vocab_size,
            c.hidden_size,
            dtype=dtype,
            param_dtype=c.param_dtype,
            embedding_init=INIT,
            rngs=rngs,
        )
        # one module per layer, or one stacked module (LlamaForCausalLM.scan_layers)
        self.layers: Any = nnx.List(
            [LlamaDecoderLayer(c, dtype=dtype, rngs=rngs) for _ in range(c.num_hidden_layers)]
        )
        self.norm = rl.RMSNorm(
            c.hidden_size, epsilon=c.rms_norm_eps, dtype=dtype, param_dtype=c.param_dtype
        )


class LlamaForCausalLM(nnx.Module):
    """A Llama-family causal LM (Llama 2/3/3.1, Qwen2, Mistral, Mixtral, SmolLM) with HF's names.

    Args:
      config: the architecture, a ``LlamaConfig``.
      dtype: the compute dtype; None for the storage dtype (``config.param_dtype``), as
        transformers computes. Norms, softmax and RoPE run in fp32 whatever it is.
      rngs: draws the initial weights (N(0, 0.02), transformers' ``initializer_range``).
      remat: each decoder layer's activation checkpointing in a training call, one of
        ``rudax.layers.REMAT_POLICIES``. It changes memory and time, not the gradients.
      scan_layers: store the decoder layers stacked (``rudax.layers.stack_layers``:
        ``model.layers`` is one ``LlamaDecoderLayer`` whose variables have a leading layer
        axis) and run them as one ``lax.scan``, which reads them as stored: one layer
        compiled instead of ``num_hidden_layers``, remat then saves memory on every backend,
        and no copy of the weights per step. The Hugging Face names and files are the same
        either way. Layers holding dropout (LoRA with dropout in training) are refused.

    ``remat`` is an attribute that may be set between calls. ``scan_layers`` may be set too:
    it converts the storage in place, on the host; apply LoRA to the layers one module each,
    then set it (``rudax.layers.apply_lora``, ``merge_lora`` and ``save_adapter`` refuse
    stacked layers, naming them). A call with a cache (generation) runs the layers in turn.

    Calling the model on token ids ``[B, T]`` returns logits ``[B, T, V]`` in the compute
    dtype. Keyword arguments: ``positions`` ``[B, T]`` (RoPE's positions; default 0 .. T-1),
    ``segment_ids`` ``[B, T]`` (packed rows: tokens attend within their segment only),
    ``branch_ids`` ``[B, T]`` (a shared prompt and its completions in one row, as
    ``pack_shared_prefix`` builds it: 0 the prompt, g completion g, which sees the prompt and
    itself only; give each completion positions restarting at the prompt's length), and
    ``cache``, a ``KVCache`` from ``init_cache``: then the call returns ``(logits, cache)``
    with the new tokens' keys and values written to it. The first call with a cache is the
    prefill: B prompt rows of T tokens, written once to the cache's prompt block (their
    attention sees only their own tokens). Each later call adds one token to each of the
    cache's ``B * num_samples`` sample rows (prompt-major), attending to its prompt's block
    and its own (``rudax.kernels.decode_attention``); ``generate`` does both.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from rudax.models import LlamaConfig, LlamaForCausalLM
      >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
      ...                      num_hidden_layers=2, num_attention_heads=4,
      ...                      num_key_value_heads=2, tie_word_embeddings=True)
      >>> model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
      >>> model(jnp.array([[1, 2, 3]])).shape
      (1, 3, 64)
      >>> model.model.layers[1].self_attn.k_proj.kernel.shape   # [in, out]: HF's k_proj.weight.T
      (32, 16)
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: DTypeLike | None = None,
        remat: Policy = "none",
        scan_layers: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a rudax.models.LlamaConfig, got {config!r}")
        _check_remat(remat)
        c = config
        self.config = c
        self.remat: Policy = remat
        compute = float_dtype("dtype", dtype)
        self.dtype = c.param_dtype if compute is None else compute
        self.model = LlamaModel(c, dtype=self.dtype, rngs=rngs)
        # lm_head keeps HF's [V, d] layout in an Embedding-shaped table, tied or not: the
        # tied head holds the embedding's own Param (one leaf, as transformers ties them).
        table = (
            self.model.embed_tokens
            if c.tie_word_embeddings
            else rl.Embedding(
                c.vocab_size,
                c.hidden_size,
                dtype=self.dtype,
                param_dtype=c.param_dtype,
                embedding_init=INIT,
                rngs=rngs,
            )
        )
        self.lm_head = rl.TiedProjection(table, dtype=self.dtype)
        self.scan_layers = scan_layers

    @property
    def scan_layers(self) -> bool:
        """Whether the decoder layers are stored stacked and run as one ``lax.scan``.

        Setting it converts the storage in place (``rudax.layers.stack_layers`` /
        ``unstack_layers``): on the host, outside any transform, after LoRA is applied.
        """
        return rl.is_stacked(self.model.layers)

    @scan_layers.setter
    def scan_layers(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"scan_layers must be a bool, got {value!r}")
        if value == self.scan_layers:
            return
        if value:
            self.model.layers = rl.stack_layers(list(self.model.layers))
        else:
            self.model.layers = nnx.List(rl.unstack_layers(self.model.layers))

    def _layer_modules(self) -> list[Any]:
        """The decoder layers' modules: one per layer, or the one stacked module."""
        layers = self.model.layers
        return [layers] if rl.is_stacked(layers) else list(layers)

    def set_attention_impl(self, impl: str, *, interpret: bool = False) -> None:
        """``flash_attention``'s ``impl`` (and ``interpret``) in every layer."""
        for layer in self._layer_modules():
            layer.self_attn.impl, layer.self_attn.interpret = impl, interpret

    def set_moe_impl(self, impl: str) -> None:
        """How a Mixtral's experts run in every layer: ``"auto"``, ``"ragged"`` (grouped
        matmuls) or ``"dense"`` (every expert on every token): ``rudax.layers.MoE``'s."""
        if impl not in rl.MoE.IMPLS:
            raise ValueError(f"impl must be one of {rl.MoE.IMPLS}, got {impl=}")
        for layer in self._layer_modules():
            if hasattr(layer, "block_sparse_moe"):
                layer.block_sparse_moe.impl = impl

    def init_cache(
        self,
        batch_size: int,
        size: int,
        *,
        num_samples: int = 1,
        dtype: DTypeLike | None = None,
    ) -> KVCache:
        """An empty ``KVCache``: ``size`` slots for each of ``num_samples`` samples of
        ``batch_size`` prompts.

        The prefill (the first call with the cache) fills the prompt block with its T tokens,
        once per prompt, and leaves each sample ``size - T`` slots of its own.

        Args:
          batch_size: B, the prompts.
          size: slots per sample: the prompt's padded length plus the tokens to generate
            (past ``max_position_embeddings`` RoPE was never trained, but nothing refuses it).
          num_samples: the continuations of each prompt, sharing its keys and values.
          dtype: the cache's dtype; None for the compute dtype.
        """
        c = self.config
        assert c.num_key_value_heads is not None and c.head_dim is not None
        for name, value in (("batch_size", batch_size), ("size", size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {name}={value!r}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples=!r}")
        g, k, rows = c.num_key_value_heads, c.head_dim, batch_size * num_samples
        dt = self.dtype if dtype is None else jnp.dtype(dtype)
        empty = lambda shape: tuple(jnp.zeros(shape, dt) for _ in range(c.num_hidden_layers))
        return KVCache(
            prompt_keys=empty((batch_size, g, 0, k)),
            prompt_values=empty((batch_size, g, 0, k)),
            prompt_valid=jnp.zeros((batch_size, 0), bool),
            prompt_positions=jnp.zeros((batch_size, 0), jnp.int32),
            sample_keys=empty((rows, g, size, k)),
            sample_values=empty((rows, g, size, k)),
            sample_valid=jnp.zeros((rows, size), bool),
            sample_positions=jnp.zeros((rows, size), jnp.int32),
            length=jnp.zeros((), jnp.int32),
        )

    def __call__(
        self,
        input_ids: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        branch_ids: jax.Array | None = None,
        cache: KVCache | None = None,
    ) -> Any:
        h, cache, _ = self.hidden_states(
            input_ids,
            positions=positions,
            segment_ids=segment_ids,
            branch_ids=branch_ids,
            cache=cache,
        )
        logits = self.lm_head(h)
        return logits if cache is None else (logits, cache)

    def hidden_states(
        self,
        input_ids: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        branch_ids: jax.Array | None = None,
        cache: KVCache | None = None,
    ) -> tuple[jax.Array, KVCache | None, jax.Array]:
        """``(h, cache, aux_loss)``: the final norm's output ``[B, T, d]`` (what ``lm_head``
        projects), the updated cache (None without one), and, for a Mixtral, transformers'
        load-balancing ``aux_loss`` over the real tokens (segment id != 0) of a call without
        a cache (fp32; 0 for a dense model or with a cache)."""
        ids = jnp.asarray(input_ids)
        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(
                f"input_ids must be integer token ids [batch, time], got "
                f"shape={ids.shape}, dtype={ids.dtype}"
            )
        b, t = ids.shape
        given = (("positions", positions), ("segment_ids", segment_ids), ("branch_ids", branch_ids))
        for name, value in given:
            if value is not None and jnp.shape(value) != (b, t):
                raise ValueError(
                    f"{name} must be [batch, time] = {(b, t)}, got {name}.shape={jnp.shape(value)}"
                )
        if positions is None:
            if cache is not None:
                raise ValueError("with a cache, pass positions (each row's token positions)")
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = jnp.asarray(positions, jnp.int32)
        if branch_ids is not None and cache is not None:
            raise ValueError(
                "branch_ids is for training rows without a cache; to sample several "
                "continuations of a prompt, use generate(..., num_samples=G)"
            )
        x = self.model.embed_tokens(ids)
        if cache is None:
            _check_remat(self.remat)  # the attribute may have been set since __init__
            context = {"positions": positions, "segment_ids": segment_ids}
            if branch_ids is not None:  # only when given: a stacked call's kwargs stay as they were
                context["branch_ids"] = branch_ids
            if self.scan_layers:
                x, (_, balance) = rl.scan_layers(
                    self.model.layers, x, remat_policy=self.remat, **context
                )
            else:
                balances = []
                for layer in self.model.layers:
                    x, (_, b) = rl.remat(layer, policy=self.remat)(x, **context)
                    balances.append(b)
                balance = (
                    None
                    if balances[0] is None
                    else jax.tree.map(lambda *a: jnp.stack(a), *balances)
                )
            aux = jnp.zeros((), jnp.float32) if balance is None else load_balancing_loss(*balance)
            return self.model.norm(x), None, aux
        return self._cached_hidden_states(x, positions, segment_ids, cache)

    def _cached_hidden_states(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, cache: KVCache
    ) -> tuple[jax.Array, KVCache, jax.Array]:
        """``hidden_states`` with a cache: the prefill (the first call: B prompt rows, written
        to the prompt block), or one decoding step (B * num_samples rows, each writing its own
        block)."""
        b, t, _ = x.shape
        # The slots these tokens fill hold real tokens where the segment id is not 0.
        new_valid = jnp.ones((b, t), bool) if segment_ids is None else segment_ids != 0
        sample_keys, sample_values = cache.sample_keys, cache.sample_values
        if cache.prompt_size == 0:  # the prefill
            if b != cache.batch_size:
                raise ValueError(f"cache holds {cache.batch_size} prompts, input_ids {b} rows")
            if t > cache.size:
                raise ValueError(f"cache of {cache.size} slots cannot hold a prefill of {t} tokens")
            # The prompt block is these tokens; each sample keeps the other size - t slots.
            own = cache.size - t
            state = dataclasses.replace(
                cache,
                prompt_valid=new_valid,
                prompt_positions=positions,
                sample_valid=cache.sample_valid[:, :own],
                sample_positions=cache.sample_positions[:, :own],
            )
            sample_keys = tuple(a[:, :, :own] for a in sample_keys)
            sample_values = tuple(a[:, :, :own] for a in sample_values)
        else:
            rows = cache.sample_valid.shape[0]
            if b != rows or t != 1:
                raise ValueError(
                    f"after the prefill a call adds one token to each of the cache's {rows} "
                    f"sample rows (prompt-major), got input_ids of shape {(b, t)}"
                )
            slot = cache.length - cache.prompt_size
            update = lambda a, new: jax.lax.dynamic_update_slice(a, new, (0, slot))
            state = dataclasses.replace(
                cache,
                sample_valid=update(cache.sample_valid, new_valid),
                sample_positions=update(cache.sample_positions, positions),
            )
        blocks = zip(
            cache.prompt_keys, cache.prompt_values, sample_keys, sample_values, strict=True
        )
        layers = self.model.layers
        if rl.is_stacked(layers):
            # Decoding a stacked model: each layer's slice, one at a time (a scan would need
            # the per-layer cache arrays stacked, a copy of the cache per token).
            graphdef, stacked = nnx.split(layers)
            layers = [
                nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))
                for i in range(self.config.num_hidden_layers)
            ]
        written = []
        for layer, block in zip(layers, blocks, strict=True):
            x, (block, _) = layer(
                x, positions=positions, segment_ids=segment_ids, cache=block, cache_state=state
            )
            assert block is not None  # a layer given a cache returns it
            written.append(block)
        pk, pv, sk, sv = (tuple(arrays) for arrays in zip(*written, strict=True))
        new = dataclasses.replace(
            state,
            prompt_keys=pk,
            prompt_values=pv,
            sample_keys=sk,
            sample_values=sv,
            length=cache.length + t,
        )
        return self.model.norm(x), new, jnp.zeros((), jnp.float32)
