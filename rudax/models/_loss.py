"""``causal_lm_loss_sum``: a causal LM's cross entropy summed over labelled tokens.

The loss is a *sum* with its token count beside it, the contract of token-weighted gradient
accumulation (``rudax.optim.GradientAccumulator``): ``acc.add(grad, weight=count)`` over
microbatches, then ``acc.pop(normalize=True)``, is the gradient of the mean over every
counted token of the window, however the examples were split or packed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

import rudax.kernels as rk
import rudax.sharding as rs
from rudax.models._llama import LlamaForCausalLM

__all__ = ["IGNORE_INDEX", "causal_lm_loss_sum", "next_token_loss_sum"]

# transformers' and torch's label of a position that is not counted.
IGNORE_INDEX = -100
REQUIRED, OPTIONAL = ("tokens", "labels"), ("segment_ids", "branch_ids", "positions")


def causal_lm_loss_sum(
    model: LlamaForCausalLM, batch: Mapping[str, Any], *, chunk: int = 1024
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross entropy SUMMED over the labelled tokens of a (packed) batch, and their count.

    ``batch`` holds integer ``[B, T]`` arrays: ``tokens``; ``labels``, the id to predict at
    each position (already shifted: the next token of the same example) or ``-100``
    (``IGNORE_INDEX``) where nothing is counted (prompt tokens, padding, an example's last
    token); optionally ``segment_ids`` (1, 2, ... per example packed in a row, 0 for
    padding: tokens attend within their example only), ``branch_ids`` (a prompt shared by
    its completions: ``pack_shared_prefix``) and ``positions`` (each token's place in its
    own example). With ``counted = labels != -100``::

        h        = model.hidden_states(tokens, segment_ids=..., branch_ids=..., positions=...)
        ce_sum   = sum_{b,t} [counted] (logsumexp(logits[b, t]) - logits[b, t, labels[b, t]])

    with ``logits = h @ lm_head.T`` computed ``chunk`` tokens at a time by
    ``rudax.kernels.linear_cross_entropy`` (fp32), never all ``[B, T, V]`` at once. A batch
    with nothing counted gives 0 and zero gradients, no NaN.

    Args:
      model: a ``LlamaForCausalLM`` (plain, LoRA or NF4 + LoRA), or its ``shard``ed form
        inside ``jax.shard_map`` (then the sum is of this rank's rows).
      batch: the arrays above; anything else, a missing key, a non-integer array or two
        shapes is a TypeError or ValueError naming the key (checked at trace time). Labels
        must be in ``[0, vocab_size)`` or -100.
      chunk: tokens per chunk of the fused head and loss.

    A Mixtral whose config has ``output_router_logits`` adds its load-balancing loss as
    transformers does (``loss = ce_mean + router_aux_loss_coef * aux_loss``), as a sum:
    ``ce_sum + router_aux_loss_coef * aux_loss * count``.

    Returns:
      ``(loss, {"tokens": count (int32), "ce_sum": ce_sum, "aux_loss": aux_loss (fp32, 0
      for a dense model)})``; the loss is ``ce_sum`` but for the Mixtral term above, and the
      mean cross entropy is ``ce_sum / tokens``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from rudax.models import LlamaConfig, LlamaForCausalLM, causal_lm_loss_sum
      >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
      ...                      num_hidden_layers=1, num_attention_heads=4)
      >>> model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
      >>> batch = {  # a 3-token prompt and a 2-token completion, then padding
      ...     "tokens":      jnp.array([[5, 6, 7, 8, 9, 0, 0]]),
      ...     "labels":      jnp.array([[-100, -100, 8, 9, -100, -100, -100]]),
      ...     "segment_ids": jnp.array([[1, 1, 1, 1, 1, 0, 0]]),
      ...     "positions":   jnp.array([[0, 1, 2, 3, 4, 0, 0]]),
      ... }
      >>> loss, metrics = causal_lm_loss_sum(model, batch)
      >>> int(metrics["tokens"]), loss.dtype
      (2, dtype('float32'))
    """
    h, head, labels, aux = head_inputs(model, batch, chunk)
    n, d = labels.size, h.shape[-1]
    ce_sum, count = rk.linear_cross_entropy(
        h.reshape(n, d),
        head.embedding[...],
        labels.reshape(n),
        ignore_index=IGNORE_INDEX,
        dtype=head.dtype,
        chunk=chunk,
    )
    metrics = {"tokens": count, "ce_sum": ce_sum, "aux_loss": aux}
    config = model.config
    if config.num_local_experts is not None and config.output_router_logits:
        # transformers adds coef * aux_loss to the mean loss; as a sum over the counted
        # tokens that is coef * aux_loss * count (the token-weighted mean over microbatches).
        total = ce_sum + config.router_aux_loss_coef * aux * count.astype(jnp.float32)
        return total, metrics
    return ce_sum, metrics


def next_token_loss_sum(
    model: LlamaForCausalLM, batch_BxT1: Any, *, chunk: int = 1024
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy SUMMED over a ``[B, T + 1]`` batch of a token stream's rows.

    :func:`causal_lm_loss_sum` of ``tokens = batch[:, :-1]``, ``labels = batch[:, 1:]``:
    every one of the ``B * T`` targets counts (pretraining on a stream, as nanoGPT's
    ``x, y`` pairs). A Mixtral adds its load-balancing term as transformers does.

    Args:
      model: a ``LlamaForCausalLM``, or its ``shard``ed form inside ``jax.shard_map``.
      batch_BxT1: integer token ids ``[B, T + 1]``, ``T >= 1``.
      chunk: tokens per chunk of the fused head and loss.

    Returns:
      ``(loss_sum, {"tokens", "ce_sum", "aux_loss"})`` as :func:`causal_lm_loss_sum`'s.

    Example:
      >>> import jax.numpy as jnp
      >>> from rudax.models import LlamaConfig, ModelSpec, next_token_loss_sum
      >>> spec = ModelSpec(LlamaConfig.tiny(64, hidden_size=32, num_attention_heads=2), 8)
      >>> loss, metrics = next_token_loss_sum(spec.create(0), jnp.ones((2, 9), jnp.int32))
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
    return causal_lm_loss_sum(model, batch, chunk=chunk)


def head_inputs(model: Any, batch: Any, chunk: Any) -> tuple[jax.Array, Any, jax.Array, jax.Array]:
    """What a chunked op over the head needs: ``(h, head, labels, aux)`` of a checked call.

    ``model``, ``batch`` and ``chunk`` are checked first (a TypeError or ValueError naming
    them), then the model runs up to its final norm: ``h`` ``[B, T, d]``, the head (a
    ``TiedProjection``; a sharded head gathered, as its own call would gather it), the
    labels ``[B, T]`` and a Mixtral's load-balancing loss (0 for a dense model). Shared by
    ``causal_lm_loss_sum`` and ``causal_lm_token_logprobs``.
    """
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"model must be a rudax.models.LlamaForCausalLM, got {type(model)}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    arrays = _check_batch(batch)
    h, _, aux = model.hidden_states(
        arrays["tokens"],
        segment_ids=arrays.get("segment_ids"),
        branch_ids=arrays.get("branch_ids"),
        positions=arrays.get("positions"),
    )
    head: Any = model.lm_head
    if isinstance(head, rs.ShardedModule):
        # the fused ops need the head's table itself: a sharded head gathers it, as its
        # call would
        head = head.gathered()
    return h, head, arrays["labels"], aux


def _check_batch(batch: Any) -> dict[str, jax.Array]:
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"batch must be a dict with the keys {REQUIRED} (and optionally {OPTIONAL}), got "
            f"{type(batch).__name__}"
        )
    missing = [k for k in REQUIRED if k not in batch]
    unknown = sorted(str(k) for k in batch if k not in REQUIRED + OPTIONAL)
    if missing or unknown:
        raise ValueError(
            f"batch must have the keys {REQUIRED} and may have {OPTIONAL}: missing {missing}, "
            f"unknown {unknown}"
        )
    arrays: dict[str, jax.Array] = {}
    for key in REQUIRED + OPTIONAL:
        if batch.get(key) is None:
            continue
        try:
            value = jnp.asarray(batch[key])
        except (TypeError, ValueError) as e:
            raise TypeError(f"batch[{key!r}] must be an integer array, got {batch[key]!r}") from e
        if not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(
                f"batch[{key!r}] must hold integers, got batch[{key!r}].dtype={value.dtype}"
            )
        if value.ndim != 2:
            raise ValueError(
                f"batch[{key!r}] must be [batch, time], got batch[{key!r}].shape={value.shape}"
            )
        arrays[key] = value
    shapes = {key: a.shape for key, a in arrays.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"batch's arrays must have one shape [batch, time], got {shapes}")
    return arrays
