"""``dpo_loss_sum``: a LoRA policy's DPO loss on packed preference pairs, for a training step.

``dpo_loss`` takes four numbers per pair; this computes them from a model and a batch of
``rudax.models.pack_shared_prefix`` rows whose examples are ``(prompt, [chosen, rejected])``:
the prompt is computed once for both answers (the shared-prefix attention), the policy's
log-probs with the adapters on, the reference's with them off (``rudax.layers.
adapters_disabled``: the same weights, no second copy), and returns what
``rudax.sharding.make_train_steps`` differentiates: the loss SUMMED over the pairs and their
count as the accumulator's weight, so that a window's gradient is the mean over all its pairs
however they fall into microbatches, devices and processes (TRL's mean over the batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

import rudax.layers as rl
from rudax.models import LlamaForCausalLM, causal_lm_token_logprobs
from rudax.post_train._dpo import DPOLossType, dpo_loss
from rudax.post_train._logprobs import (
    completion_token_counts,
    per_completion_sum,
    row_completions,
)

__all__ = ["dpo_loss_sum"]


def dpo_loss_sum(
    model: LlamaForCausalLM,
    batch: Mapping[str, Any],
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: DPOLossType = "sigmoid",
    chunk: int = 1024,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss of a batch of preference pairs, summed over the pairs, and its metrics.

    ``batch`` is ``pack_shared_prefix([(prompt, [chosen, rejected]), ...]).batch()`` with its
    ``completion`` array added: each pair's chosen answer is an even completion, its
    rejected one the next. For each pair, with ``logp`` the summed log-probabilities of an
    answer's tokens (``causal_lm_token_logprobs`` at temperature 1)::

        policy    = logp(answer | prompt)                  the model as it is
        reference = stop_gradient(logp(answer | prompt))   inside adapters_disabled(model)
        loss      = dpo_loss(policy chosen, policy rejected, reference chosen,
                             reference rejected, beta=, label_smoothing=, loss_type=)

    and the result is ``(sum of the pairs' losses, metrics)``. The pairs are found in each
    row by themselves (the row's completion numbers, shifted to start at 0), so a batch may
    be split by rows over devices (``jax.shard_map``) or microbatches and each part gives its
    own pairs' sum: a whole pair is always in one row.

    Args:
      model: a ``LlamaForCausalLM`` with LoRA adapters (``rudax.layers.apply_lora``, plain or
        NF4 base, or its FSDP form inside ``jax.shard_map``): the adapters are the policy's
        change from the reference. A model without adapters is a ValueError (its reference
        would be itself).
      batch: integer ``[B, T]`` arrays ``tokens``, ``labels``, ``segment_ids``,
        ``branch_ids``, ``positions`` and ``completion``, as ``pack_shared_prefix`` makes
        them for two answers per prompt (T >= 4).
      beta, label_smoothing, loss_type: ``dpo_loss``'s.
      chunk: ``causal_lm_token_logprobs``'s tokens per chunk of the head.

    Returns:
      ``(loss_sum, metrics)``: float32 ``loss_sum``, and sums over the batch's pairs:
      ``tokens`` (the int32 number of pairs: the weight a ``GradientAccumulator`` and
      ``make_train_steps`` divide by, named as they read it), ``pairs`` (the same),
      ``chosen_rewards``, ``rejected_rewards``, ``margins`` (chosen minus rejected) and
      ``accuracies`` (pairs whose chosen reward is strictly greater). Divide each by
      ``pairs`` for TRL's ``rewards/*`` means.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> from rudax.models import LlamaConfig, LlamaForCausalLM, pack_shared_prefix
      >>> from rudax.post_train import dpo_loss_sum
      >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
      ...                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
      >>> model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
      >>> _ = rl.apply_lora(model, ["q_proj", "v_proj"], rank=2, alpha=4, rngs=nnx.Rngs(1))
      >>> rows = pack_shared_prefix([([1, 2, 3], [[4, 5], [6]]), ([7], [[8], [9, 10]])])
      >>> batch = {**rows.batch(), "completion": rows.completion}
      >>> loss_sum, metrics = dpo_loss_sum(model, batch, beta=0.1)
      >>> int(metrics["pairs"]), round(float(loss_sum), 4)  # LoRA's B is 0: log 2 per pair
      (2, 1.3863)
    """
    # chosen answers even, rejected odd (a row's first answer is even)
    index, per_row = row_completions(batch, group=2)
    num = per_row * len(index)
    slots = num // 2  # the pairs the batch can hold
    scored = {k: v for k, v in batch.items() if k != "completion"}

    def answer_logps() -> jax.Array:
        per_token = causal_lm_token_logprobs(model, scored, chunk=chunk)
        return per_completion_sum(per_token, index, num).reshape(slots, 2)

    policy = answer_logps()
    with rl.adapters_disabled(model):
        reference = jax.lax.stop_gradient(answer_logps())
    lengths = completion_token_counts(index, num).reshape(slots, 2)
    # ipo divides by the answers' lengths; an empty slot's 0 is made 1 to keep it finite
    lengths_kw = (
        {
            "chosen_lengths": jnp.maximum(lengths[:, 0], 1),
            "rejected_lengths": jnp.maximum(lengths[:, 1], 1),
        }
        if loss_type == "ipo"
        else {}
    )
    out = dpo_loss(
        policy[:, 0],
        policy[:, 1],
        reference[:, 0],
        reference[:, 1],
        beta=beta,
        label_smoothing=label_smoothing,
        loss_type=loss_type,
        **lengths_kw,
    )
    # A slot holds a pair where its chosen answer has tokens (a pair is never split).
    real = lengths[:, 0] > 0
    total = lambda x: jnp.sum(jnp.where(real, x, 0))
    chosen, rejected = out.chosen_rewards, out.rejected_rewards
    pairs = jnp.sum(real, dtype=jnp.int32)
    metrics = {
        "tokens": pairs,
        "pairs": pairs,
        "chosen_rewards": total(chosen),
        "rejected_rewards": total(rejected),
        "margins": total(chosen - rejected),
        "accuracies": total((chosen > rejected).astype(chosen.dtype)),
    }
    return total(out.losses), metrics
