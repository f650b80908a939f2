"""``shard``: a ``LlamaForCausalLM`` in its FSDP form over ``rudax.sharding``.

Each module at the model's places (the embedding, each layer's norms, its four attention
projections, its MLP or Mixtral block, the final norm, the head) becomes a
``rudax.sharding.ShardedModule``: its parameters are ``ShardedParameter``s, 1/N of each per
device, gathered when the module is called inside ``jax.shard_map``. Whatever sits at a place
is sharded as it is, a ``Linear`` or the ``LoRALinear`` / ``NF4Linear`` that
``rudax.layers.apply_lora`` put there (FSDP-QLoRA: the packed NF4 base split too), with its
variables' types kept, so ``nnx.split(model, rudax.layers.LoRAParam, ...)`` still separates
the adapters. A tied head keeps sharing the embedding's one sharded table.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from jax.typing import DTypeLike

import rudax.layers as rl
import rudax.sharding as rs
from rudax.models._llama import LlamaForCausalLM

__all__ = ["shard"]

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def shard(
    model: LlamaForCausalLM,
    ctx: rs.ShardingContext,
    *,
    compute_dtype: DTypeLike | None = None,
) -> LlamaForCausalLM:
    """The same model with every layer in its FSDP form (``rudax.sharding``), ties kept.

    ``model`` is not modified: the result is built on a structural copy that shares its
    arrays until they are sharded. Run the result inside ``jax.shard_map`` with the parameter
    state split as ``rudax.sharding.shard_specs`` says (``P(ctx.axis_name)``, or
    ``P(None, ctx.axis_name)`` for stacked layers) and each rank's own rows of the batch;
    ``jax.grad`` of
    the ranks' summed ``causal_lm_loss_sum`` returns gradients already reduce-scattered onto
    the shards.

    Args:
      model: a ``LlamaForCausalLM``; with ``scan_layers`` its stacked layers are sharded
        layer by layer (each variable ``(L, N*k)``, split over its last axis) and gathered
        one layer at a time by the scan.
      ctx: the ``rudax.sharding.ShardingContext`` of the mesh axis to shard over.
      compute_dtype: the dtype parameters are cast to before their all-gather (halving its
        bytes for bf16); None gathers them in their storage dtype.

    Returns:
      A new ``LlamaForCausalLM`` whose layers are ``ShardedModule``s.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> import rudax.sharding as rs
      >>> from rudax.models import LlamaConfig, LlamaForCausalLM, shard
      >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
      ...                      num_hidden_layers=1, num_attention_heads=4)
      >>> ctx = rs.ShardingContext(jax.sharding.Mesh(jax.devices(), ("fsdp",)))
      >>> sharded = shard(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), ctx)
      >>> type(sharded.model.layers[0].self_attn.q_proj).__name__
      'ShardedModule'
    """
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"model must be a rudax.models.LlamaForCausalLM, got {model!r}")
    if not isinstance(ctx, rs.ShardingContext):
        raise TypeError(f"ctx must be a rudax.sharding.ShardingContext, got {ctx!r}")
    sharded = nnx.merge(*nnx.split(model))
    kw: dict[str, Any] = dict(compute_dtype=compute_dtype)
    inner: Any = sharded.model  # its places now hold ShardedModules
    # ctx.module at every place: it shards whatever module sits there (a Linear, or the
    # LoRALinear apply_lora put in its place) exactly as the typed methods would.
    inner.embed_tokens = ctx.module(inner.embed_tokens, **kw)
    stacked = rl.is_stacked(inner.layers)
    # Layers stored stacked are one module: each of its sublayers sharded layer by layer,
    # and gathered one layer at a time by the scan that runs them.
    each: dict[str, Any] = dict(kw, stacked=stacked)
    for layer in [inner.layers] if stacked else inner.layers:
        layer.input_layernorm = ctx.module(layer.input_layernorm, **each)
        for name in ATTENTION:
            setattr(layer.self_attn, name, ctx.module(getattr(layer.self_attn, name), **each))
        layer.post_attention_layernorm = ctx.module(layer.post_attention_layernorm, **each)
        mlp = "block_sparse_moe" if hasattr(layer, "block_sparse_moe") else "mlp"
        setattr(layer, mlp, ctx.module(getattr(layer, mlp), **each))
    inner.norm = ctx.module(inner.norm, **kw)
    # A tied head's table is the embedding's variable, which the context has already
    # sharded once: the head shares that sharded variable.
    setattr(sharded, "lm_head", ctx.module(sharded.lm_head, **kw))  # noqa: B010
    return sharded
