"""``grpo_loss_sum``: a LoRA policy's GRPO loss on packed groups, for a training step.

``grpo_loss`` takes per-token log-probs; this computes them from a model and a batch of
``rudax.models.pack_shared_prefix`` rows whose examples are ``(prompt, [completion 1, ...,
completion G])``, each prompt computed once for its group, the reference (for the KL term)
the same model with its adapters off, and returns what ``rudax.sharding.make_train_steps``
differentiates: a SUM and the weight the window's gradient is divided by, chosen so that a
window split into microbatches, devices and processes gives TRL's update.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

import rudax.layers as rl
from rudax.models import LlamaForCausalLM, causal_lm_token_logprobs
from rudax.post_train._grpo import GRPOLossType, grpo_loss
from rudax.post_train._logprobs import completion_token_counts, row_completions

__all__ = ["grpo_loss_sum"]


def grpo_loss_sum(
    model: LlamaForCausalLM,
    batch: Mapping[str, Any],
    *,
    temperature: float = 1.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    loss_type: GRPOLossType = "dapo",
    max_completion_length: int | None = None,
    chunk: int = 1024,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss of a batch of sampled completions as a sum with its weight, and metrics.

    ``batch`` is ``pack_shared_prefix([(prompt, completions), ...]).batch()`` with these
    ``[B, T]`` arrays added:

    * ``completion``: ``pack_shared_prefix``'s (which completion each position scores, -1
      where none);
    * ``advantages``: float, at each scored position its completion's advantage
      (``group_advantages``, spread over the completion's tokens), anything elsewhere; a NaN
      or infinite one makes the loss NaN (never trained on as 0);
    * ``old_logps`` (optional): float, the sampling policy's log-probs of the tokens
      (``generate(..., return_logprobs=True)``'s, or the policy's before this generation
      batch's first update), anything where nothing is scored. Absent: the current policy's
      (TRL with ``num_iterations=1``), ratio 1.

    The per-token log-probs are ``causal_lm_token_logprobs(model, batch, temperature=)``,
    the reference's (when ``beta > 0``) the same inside ``adapters_disabled(model)``, without
    gradient; then ``grpo_loss`` with the completions numbered row by row. The weight,
    ``metrics["tokens"]``, makes the window's mean TRL's loss:

    ========= ================================================ =========================
    loss_type loss_sum                                          weight (``tokens``)
    ========= ================================================ =========================
    dapo      sum of the token losses                           the scored tokens
    grpo      sum over completions of their token-mean loss      the completions
    dr_grpo   sum of the token losses / max_completion_length    the completions
    bnpo      this part's token-mean loss                        1 (per device)
    ========= ================================================ =========================

    so over a window: ``dapo`` divides by all its tokens (TRL 1.16's ``num_items_in_batch``
    when the window is the generation batch), ``grpo`` and ``dr_grpo`` average over all its
    completions, and ``bnpo`` averages the token means of its parts, microbatches and
    devices, as TRL averages over accumulation steps and processes. ``grpo`` and
    ``dr_grpo`` equal TRL's when every part holds as many completions, as TRL's equal
    split of a generation batch does.

    Args:
      model: a ``LlamaForCausalLM`` with LoRA adapters (or its FSDP form inside
        ``jax.shard_map``); a model without adapters is a ValueError when ``beta > 0``
        (its reference would be itself).
      batch: the arrays above, ``[B, T]`` each.
      temperature: the sampling temperature (the policy's log-probs are the tempered
        distribution's, as the sampler's).
      epsilon, epsilon_high, beta, loss_type, max_completion_length: ``grpo_loss``'s.
      chunk: ``causal_lm_token_logprobs``'s tokens per chunk of the head.

    Returns:
      ``(loss_sum, metrics)``: ``tokens`` the weight above (int32), and sums over the
      batch: ``completions``, ``completion_tokens`` (scored tokens), ``kl`` (the k3
      estimate summed over tokens, when ``beta > 0``), ``clipped_low``, ``clipped_high``
      and ``clipped`` (token counts, TRL's clip ratios times the tokens). Divide by
      ``completion_tokens`` for TRL's means.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> from rudax.models import LlamaConfig, LlamaForCausalLM, pack_shared_prefix
      >>> from rudax.post_train import grpo_loss_sum
      >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
      ...                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
      >>> model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
      >>> _ = rl.apply_lora(model, ["q_proj", "v_proj"], rank=2, alpha=4, rngs=nnx.Rngs(1))
      >>> rows = pack_shared_prefix([([1, 2, 3], [[4, 5], [6], [7, 8, 9]])])
      >>> advantages = np.array([1.0, -0.5, -0.5])[rows.completion]  # per token
      >>> batch = {**rows.batch(), "completion": rows.completion, "advantages": advantages}
      >>> loss_sum, metrics = grpo_loss_sum(model, batch, loss_type="grpo")
      >>> float(loss_sum), int(metrics["tokens"]), int(metrics["completion_tokens"])
      (0.0, 3, 6)
    """
    if "advantages" not in batch:
        raise KeyError("batch has no 'advantages': see grpo_loss_sum's docstring for its arrays")
    index, per_row = row_completions(batch, group=1)
    completion_shape = index.shape
    per_token_inputs = {k: jnp.asarray(batch[k]) for k in ("advantages", "old_logps") if k in batch}
    for key, value in per_token_inputs.items():
        if value.shape != completion_shape:
            raise ValueError(
                f"batch[{key!r}] must be [B, T] like batch['completion'] {completion_shape} "
                f"(a value at each position), got shape {value.shape}"
            )
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise TypeError(f"batch[{key!r}] must be floating, got dtype {value.dtype}")
    num = per_row * len(index)
    counted = index >= 0
    # Each completion's advantage: every one of its positions holds it; max reads it exactly.
    given = per_token_inputs["advantages"]
    segments = jnp.where(counted, index, num).reshape(-1)
    advantages = jax.ops.segment_max(
        jnp.where(counted & jnp.isfinite(given), given, -jnp.inf).reshape(-1),
        segments,
        num_segments=num,
    )
    # A NaN or infinite advantage is not trained on as 0: it makes the loss NaN, which a
    # run's loss check stops at. Empty slots (no tokens) hold 0.
    finite = jax.ops.segment_min(
        jnp.where(counted, jnp.isfinite(given), True).astype(jnp.int32).reshape(-1),
        segments,
        num_segments=num,
    )
    empty = completion_token_counts(index, num) == 0
    advantages = jnp.where(empty, 0.0, jnp.where(finite > 0, advantages, jnp.nan))
    scored = {k: v for k, v in batch.items() if k not in ("completion", "advantages", "old_logps")}
    logps = lambda: causal_lm_token_logprobs(model, scored, temperature=temperature, chunk=chunk)
    policy = logps()
    ref = None
    if beta > 0:
        with rl.adapters_disabled(model):
            ref = jax.lax.stop_gradient(logps())
    out = grpo_loss(
        policy,
        per_token_inputs.get("old_logps"),
        ref,
        advantages,
        index,
        num_completions=num,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        beta=beta,
        loss_type=loss_type,
        max_completion_length=max_completion_length,
        num_items_in_batch=1 if loss_type == "dapo" else None,
    )
    tokens = jnp.sum(counted, dtype=jnp.int32)
    completions = jnp.sum(completion_token_counts(index, num) > 0, dtype=jnp.int32)
    if loss_type == "dapo":
        loss_sum, weight = out.loss, tokens
    elif loss_type in ("grpo", "dr_grpo"):
        # grpo_loss's mean over the num slots, empty ones included: times num, their sum
        loss_sum, weight = out.loss * num, completions
    else:
        loss_sum, weight = out.loss, jnp.int32(1)
    as_count = lambda mean: mean * tokens.astype(mean.dtype)
    metrics = {
        "tokens": weight,
        "completions": completions,
        "completion_tokens": tokens,
        "clipped_low": as_count(out.clip_ratio_low_mean),
        "clipped_high": as_count(out.clip_ratio_high_mean),
        "clipped": as_count(out.clip_ratio_region_mean),
    }
    if out.kl is not None:
        metrics["kl"] = as_count(out.kl)
    return loss_sum, metrics
