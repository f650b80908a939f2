"""``group_advantages`` and ``grpo_loss``: GRPO, Dr. GRPO and DAPO, as TRL 1.16 defines them.

GRPO scores G completions of each prompt, takes each completion's advantage relative to its
group (``group_advantages``), and maximizes a PPO-style clipped objective per token
(``grpo_loss``). The variants differ in how the rewards are scaled and how the token losses
are averaged. The definitions are TRL's ``GRPOTrainer`` (trl 1.16.0,
``trl/trainer/grpo_trainer.py``: the advantages in ``_generate_and_score_completions``, the
loss in ``_compute_loss``) with its defaults elsewhere (``importance_sampling_level="token"``,
no entropy bonus or masking, no vLLM importance correction, ``delta=None``);
tests/post_train/test_grpo.py runs TRL's own methods on the same numbers.

``grpo_loss`` takes its inputs per token in any layout: TRL's ``[N, L]`` (one completion per
row, padded) or packed rows of several completions (``rudax.models.pack_shared_prefix``),
described by ``completion``, the completion each position scores or -1.
"""

from __future__ import annotations

import numbers
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from rudax._validation import check_non_negative, check_positive, check_positive_int
from rudax.post_train._logprobs import (
    _completion_index,
    _compute_dtype,
    _floating,
    completion_token_counts,
    per_completion_sum,
)

__all__ = ["GRPO_LOSS_TYPES", "GRPOOutput", "group_advantages", "grpo_loss"]

GRPOLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
GRPO_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")
ScaleRewards = Literal["group", "batch", "none"] | bool
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")

# TRL adds it to the standard deviation before dividing (trl 1.16.0 grpo_trainer.py:2787): a
# group of equal rewards has std 0 and then advantage 0 / 1e-4 = 0, never NaN.
STD_EPSILON = 1e-4


def group_advantages(
    rewards_N: ArrayLike, group_size: int, *, scale_rewards: ScaleRewards = "group"
) -> jax.Array:
    """Each completion's reward relative to the others of its prompt (TRL's advantages).

    The N rewards are N / G consecutive groups of G = ``group_size`` (the completions of one
    prompt, in order). With ``mean_g`` the mean of a reward's group and ``std`` the
    unbiased (Bessel-corrected, ``n - 1``) standard deviation::

        group: A = (r - mean_g) / (std of the group + 1e-4)
        batch: A = (r - mean_g) / (std of all N rewards + 1e-4)
        none:  A =  r - mean_g                                    (Dr. GRPO)

    A NaN reward is an unscorable completion (TRL: every reward function returned None): it
    is left out of its group's mean and std and its advantage is 0, and so is every
    advantage whose std is undefined (a single scorable reward). A group of equal rewards
    has advantage exactly 0 (its mean is taken around its largest reward, so the
    differences are exact zeros), with zero std and no NaN.

    Args:
      rewards_N: ``[N]`` floating rewards, one per completion, each group's G together. Pass
        the whole generation batch (all devices'): ``batch`` scaling and the groups span it.
      group_size: G, completions per prompt: an int >= 2 dividing N. TRL refuses
        ``num_generations < 2`` in training (``GRPOConfig``); with G = 1 each reward is its
        own group's mean and every advantage would be 0, so it is a ValueError here.
      scale_rewards: ``"group"`` (TRL's default), ``"batch"`` or ``"none"``; ``True`` and
        ``False`` are ``"group"`` and ``"none"``, as ``GRPOConfig`` maps them.

    Returns:
      ``[N]`` advantages, float32 (float64 for float64 rewards).

    Example:
      >>> import jax.numpy as jnp
      >>> from rudax.post_train import group_advantages
      >>> rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
      >>> [round(a, 4) for a in group_advantages(rewards, 3).tolist()]
      [1.1545, -0.5773, -0.5773, 0.0, 0.0, 0.0]
      >>> [round(a, 4) for a in group_advantages(rewards, 3, scale_rewards="none").tolist()]
      [0.6667, -0.3333, -0.3333, 0.0, 0.0, 0.0]

    References:
      Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
      Language Models" (GRPO, https://arxiv.org/abs/2402.03300). Liu et al. 2025,
      "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO: no std
      scaling, https://arxiv.org/abs/2503.20783).
    """
    if isinstance(scale_rewards, bool):
        scale_rewards = "group" if scale_rewards else "none"
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(
            f"scale_rewards must be one of {SCALE_REWARDS} (or True/False), got {scale_rewards=!r}"
        )
    check_positive_int("group_size", group_size)
    # TRL: GRPOConfig refuses num_generations < 2 (grpo_config.py:1137); only its evaluation
    # can meet G = 1, where it sets the std to 0 (grpo_trainer.py:2773) and every advantage
    # is r - r = 0. A training step with nothing to learn is a mistake: refuse it.
    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2: a completion alone in its group is its group's mean, "
            f"so its advantage is 0 (TRL's GRPOConfig requires num_generations >= 2), got "
            f"{group_size=}"
        )
    rewards = _floating("rewards_N", rewards_N)
    if rewards.ndim != 1:
        raise ValueError(f"rewards_N must be [N], one reward per completion, got {rewards.shape=}")
    n = rewards.shape[0]
    if n % group_size:
        raise ValueError(
            f"rewards_N's length must be a multiple of group_size (whole groups of each "
            f"prompt's completions), got {n} rewards and {group_size=}"
        )
    rewards = rewards.astype(_compute_dtype(rewards))
    grouped = rewards.reshape(n // group_size, group_size)
    centered = (grouped - _nanmean(grouped)).reshape(n)
    if scale_rewards == "group":
        std = jnp.repeat(_nanstd(grouped)[:, 0], group_size)
        advantages = centered / (std + STD_EPSILON)
    elif scale_rewards == "batch":
        advantages = centered / (_nanstd(rewards[None])[0, 0] + STD_EPSILON)
    else:
        advantages = centered
    # TRL's nan_to_num(nan=0): an unscorable completion, or an undefined std, moves nothing.
    return jnp.nan_to_num(advantages, nan=0.0)


def _nanmean(x: jax.Array) -> jax.Array:
    """The mean of each row's non-NaN values, ``[rows, 1]``, taken around the row's max.

    Shifting by the largest value first makes a row of equal values have differences of
    exactly 0 (a plain mean of 0.1, 0.1, 0.1 is not exactly 0.1), hence advantage exactly 0.
    """
    shift = jax.lax.stop_gradient(jnp.nanmax(x, axis=1, keepdims=True))
    return shift + jnp.nanmean(x - shift, axis=1, keepdims=True)


def _nanstd(x: jax.Array) -> jax.Array:
    """TRL's ``nanstd`` per row: unbiased over the non-NaN values, NaN below 2 of them."""
    count = jnp.sum(~jnp.isnan(x), axis=1, keepdims=True)
    variance = jnp.nanmean((x - _nanmean(x)) ** 2, axis=1, keepdims=True)
    bessel = jnp.where(count > 1, count / jnp.maximum(count - 1, 1), jnp.nan)
    return jnp.sqrt(variance * bessel.astype(x.dtype))


class GRPOOutput(NamedTuple):
    """What ``grpo_loss`` returns: the loss and the statistics TRL logs beside it.

    Attributes:
      loss: shape=(): the loss to minimize (see ``grpo_loss``).
      kl: shape=(): the mean over counted tokens of the k3 estimate of KL(policy || ref);
        None when ``ref_logps`` is None.
      clip_ratio_low_mean: shape=(): the fraction of counted tokens clipped below (ratio
        < 1 - epsilon with a negative advantage).
      clip_ratio_high_mean: shape=(): the fraction clipped above (ratio > 1 + epsilon_high
        with a positive advantage).
      clip_ratio_region_mean: shape=(): the fraction clipped either way.
      clip_ratio_low_min: shape=(): the smallest per-completion fraction clipped below
        (completions without tokens left out; NaN if none has tokens).
      clip_ratio_high_max: shape=(): the largest per-completion fraction clipped above.
    """

    loss: jax.Array
    kl: jax.Array | None
    clip_ratio_low_mean: jax.Array
    clip_ratio_high_mean: jax.Array
    clip_ratio_region_mean: jax.Array
    clip_ratio_low_min: jax.Array
    clip_ratio_high_max: jax.Array

    def metrics(self) -> dict[str, jax.Array]:
        """The statistics under the names TRL logs them (``kl`` only when it was computed).

        These are means over this batch's tokens: over microbatches or devices, weight each
        by its token count (TRL sums over all processes before dividing).
        """
        out = {} if self.kl is None else {"kl": self.kl}
        return out | {
            "clip_ratio/low_mean": self.clip_ratio_low_mean,
            "clip_ratio/high_mean": self.clip_ratio_high_mean,
            "clip_ratio/region_mean": self.clip_ratio_region_mean,
            "clip_ratio/low_min": self.clip_ratio_low_min,
            "clip_ratio/high_max": self.clip_ratio_high_max,
        }


def grpo_loss(
    logps: ArrayLike,
    old_logps: ArrayLike | None,
    ref_logps: ArrayLike | None,
    advantages: ArrayLike,
    completion: ArrayLike,
    *,
    num_completions: int,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    loss_type: GRPOLossType = "dapo",
    max_completion_length: int | None = None,
    num_items_in_batch: ArrayLike | None = None,
) -> GRPOOutput:
    """The clipped policy-gradient loss of GRPO and its variants, over per-token log-probs.

    For each counted position t (``completion[t] = i >= 0``), with ``A_t = advantages[i]``::

        ratio_t = exp(logps_t - old_logps_t)
        l_t     = -min(ratio_t A_t, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) A_t)
                  + beta (exp(ref_t - logps_t) - (ref_t - logps_t) - 1)

    the last term the k3 estimator of KL(policy || reference). ``loss_type`` says how the
    token losses are averaged (|i| is completion i's token count, T the counted tokens)::

        grpo:    mean over i of  sum_{t in i} l_t / max(|i|, 1)      (per sequence, then all)
        bnpo:    sum_t l_t / max(T, 1)                                (over this batch's tokens)
        dr_grpo: sum_t l_t / (num_completions * max_completion_length)
        dapo:    sum_t l_t / max(num_items_in_batch, 1)               (TRL 1.16's default)

    ``dapo`` divides by the token count of the whole generation batch: pass it as
    ``num_items_in_batch`` (all microbatches and devices) and *sum* the gradients over them
    to get TRL's update (TRL divides by ``num_processes`` and rescales by accumulation steps
    because DDP and its accumulation average). Left None, it is this batch's T: then
    ``dapo`` equals ``bnpo``. For ``grpo``, ``bnpo`` and ``dr_grpo`` TRL further divides by
    the gradient accumulation steps in training: *average* the gradients over microbatches.

    The layout is free: ``logps``, ``old_logps``, ``ref_logps`` and ``completion`` are
    per-token arrays of one shape, TRL's ``[N, L]`` (``completion[n, l] = n`` where the
    completion mask is 1, -1 elsewhere) or packed ``[B, T]`` rows, and give the same loss and
    per-token gradients for the same completions. Values at positions with ``completion ==
    -1`` are never read (padding may hold anything, NaN included) and get zero gradient.

    Args:
      logps: per-token log-probabilities of the completions under the policy being trained.
      old_logps: the same under the policy that sampled them, or None when that is the
        current one (TRL with ``num_iterations=1``): then ``stop_gradient(logps)``, ratio 1
        with the policy gradient's derivative.
      ref_logps: the same under the reference policy; needed when ``beta > 0``, else only
        for the ``kl`` statistic (None: no statistic).
      advantages: ``[num_completions]`` advantages, one per completion
        (``group_advantages``); no gradient flows into them.
      completion: integers shaped like ``logps``: the completion each position scores, or -1.
        Indices must be in ``[-1, num_completions)``, which cannot be checked at trace time:
        a larger one reads a clamped advantage and is left out of the per-completion sums.
      num_completions: N, the number of completions.
      epsilon: the clip range below 1 (TRL's ``epsilon`` / ``epsilon_low``), > 0; 0.2.
      epsilon_high: the clip range above 1 (DAPO's clip-higher; it recommends 0.28), > 0;
        None for ``epsilon``.
      beta: the KL coefficient, >= 0 (TRL's default 0.0: no reference model needed).
      loss_type: ``"dapo"`` (TRL 1.16's default), ``"grpo"``, ``"bnpo"`` or ``"dr_grpo"``.
      max_completion_length: the generation length limit, ``dr_grpo``'s constant (required
        there; TRL's ``GRPOConfig.max_completion_length``); for another loss type a
        ValueError, as it would be ignored.
      num_items_in_batch: ``dapo``'s denominator: the counted tokens of the whole generation
        batch (an int or an integer scalar array, possibly traced); None for this batch's.
        For another loss type a ValueError, as it would be ignored.

    The log-probs are computed in float32 (float64 if any input is float64). Shapes and
    arguments are checked at trace time.

    Returns:
      A ``GRPOOutput``: ``loss`` and the statistics TRL logs (``metrics()`` by TRL's names).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from rudax.post_train import grpo_loss
      >>> mask = jnp.array([[1, 1, 1], [1, 1, 0]])        # TRL's layout: 2 completions
      >>> completion = jnp.where(mask == 1, jnp.arange(2)[:, None], -1)
      >>> logps = jnp.array([[-1.0, -0.5, -2.0], [-0.3, -0.1, 0.0]])
      >>> out = grpo_loss(logps, None, None, jnp.array([1.0, -1.0]), completion,
      ...                 num_completions=2, loss_type="grpo")
      >>> float(out.loss)
      0.0
      >>> g = jax.grad(lambda lp: grpo_loss(lp, None, None, jnp.array([1.0, -1.0]), completion,
      ...                                   num_completions=2, loss_type="grpo").loss)(logps)
      >>> [[round(x, 4) for x in row] for row in g.tolist()]
      [[-0.1667, -0.1667, -0.1667], [0.25, 0.25, 0.0]]

    References:
      Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
      Language Models" (GRPO, https://arxiv.org/abs/2402.03300). Liu et al. 2025,
      "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO,
      https://arxiv.org/abs/2503.20783). Yu et al. 2025, "DAPO: An Open-Source LLM
      Reinforcement Learning System at Scale" (clip-higher and the token-level loss,
      https://arxiv.org/abs/2503.14476).
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type=!r}")
    check_positive_int("num_completions", num_completions)
    eps_low = check_positive("epsilon", epsilon, accept="concrete")
    eps_high = (
        eps_low
        if epsilon_high is None
        else check_positive("epsilon_high", epsilon_high, accept="concrete")
    )
    beta = check_non_negative("beta", beta, accept="concrete")
    if beta > 0 and ref_logps is None:
        raise ValueError(
            f"ref_logps is None, but beta={beta} > 0 weighs a KL term to the reference policy: "
            "give the reference's per-token log-probs, or beta=0"
        )
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError(
                "loss_type='dr_grpo' divides by num_completions * max_completion_length: give "
                "max_completion_length, the generation length limit (TRL's GRPOConfig default "
                "is 512), got max_completion_length=None"
            )
        check_positive_int("max_completion_length", max_completion_length)
    elif max_completion_length is not None:
        raise ValueError(
            f"max_completion_length is dr_grpo's normalizer, unused by {loss_type=!r}; got "
            f"{max_completion_length=}"
        )
    if loss_type != "dapo" and num_items_in_batch is not None:
        raise ValueError(
            f"num_items_in_batch is dapo's normalizer, unused by {loss_type=!r}; got "
            f"{num_items_in_batch=}"
        )

    policy = _floating("logps", logps)
    named = {"old_logps": old_logps, "ref_logps": ref_logps}
    others = {name: _floating(name, v) for name, v in named.items() if v is not None}
    for name, array in others.items():
        if array.shape != policy.shape:
            raise ValueError(
                f"{name} must have logps's shape, got {name}.shape={array.shape} and "
                f"logps.shape={policy.shape}"
            )
    index = _completion_index(completion, policy.shape, "logps")
    adv = _floating("advantages", advantages)
    if adv.shape != (num_completions,):
        raise ValueError(
            f"advantages must be [num_completions], one per completion, got "
            f"advantages.shape={adv.shape} and {num_completions=}"
        )
    dtype = _compute_dtype(policy, adv, *others.values())
    counted = index >= 0
    # Padding is zeroed before any arithmetic: exp() of garbage there could be inf, and
    # 0 * inf in a masked sum, or in its gradient, is NaN.
    zeroed = lambda x: jnp.where(counted, x.astype(dtype), 0)
    logp = zeroed(policy)
    old = jax.lax.stop_gradient(logp) if "old_logps" not in others else zeroed(others["old_logps"])
    adv_t = jax.lax.stop_gradient(jnp.where(counted, adv.astype(dtype)[index], 0))

    ratio = jnp.exp(logp - old)
    lo, hi = 1 - eps_low, 1 + eps_high
    # torch.clamp passes the gradient on at the bounds themselves; jnp.clip (min of max)
    # would halve it there.
    clipped = jnp.where(ratio < lo, lo, jnp.where(ratio > hi, hi, ratio))
    per_token = -jnp.minimum(ratio * adv_t, clipped * adv_t)
    kl = None
    if "ref_logps" in others:
        diff = zeroed(others["ref_logps"]) - logp
        kl_t = jnp.exp(diff) - diff - 1  # k3: unbiased, >= 0 (Schulman 2020)
        if beta > 0:
            per_token = per_token + beta * kl_t
        kl = _masked_mean(kl_t, counted)
    per_token = jnp.where(counted, per_token, 0)

    total = jnp.sum(per_token)
    counts = completion_token_counts(index, num_completions)
    if loss_type == "grpo":
        sums = per_completion_sum(per_token, index, num_completions)
        loss = jnp.mean(sums / jnp.maximum(counts, 1).astype(dtype))
    elif loss_type == "bnpo":
        loss = total / jnp.maximum(jnp.sum(counted), 1).astype(dtype)
    elif loss_type == "dr_grpo":
        assert max_completion_length is not None  # checked above
        loss = total / (num_completions * max_completion_length)
    else:
        loss = total / _num_items(num_items_in_batch, counted).astype(dtype)

    low = (ratio < lo) & (adv_t < 0) & counted
    high = (ratio > hi) & (adv_t > 0) & counted

    def per_completion_mean(flags: jax.Array) -> jax.Array:
        # TRL's masked_seq_mean divides by the count unclamped: NaN for an empty completion,
        # which its nanmin / nanmax then skip.
        sums = per_completion_sum(flags.astype(dtype), index, num_completions)
        return jnp.where(counts > 0, sums / jnp.maximum(counts, 1).astype(dtype), jnp.nan)

    return GRPOOutput(
        loss=loss,
        kl=kl,
        clip_ratio_low_mean=_masked_mean(low.astype(dtype), counted),
        clip_ratio_high_mean=_masked_mean(high.astype(dtype), counted),
        clip_ratio_region_mean=_masked_mean((low | high).astype(dtype), counted),
        clip_ratio_low_min=jnp.nanmin(per_completion_mean(low)),
        clip_ratio_high_max=jnp.nanmax(per_completion_mean(high)),
    )


def _masked_mean(x: jax.Array, counted: jax.Array) -> jax.Array:
    """TRL's global_masked_mean: the mean over counted positions, 0 if there are none."""
    total = jnp.sum(jnp.where(counted, jax.lax.stop_gradient(x), 0))
    return total / jnp.maximum(jnp.sum(counted), 1).astype(x.dtype)


def _num_items(num_items_in_batch: ArrayLike | None, counted: jax.Array) -> jax.Array:
    """dapo's denominator, at least 1 (TRL's ``clamp(min=1.0)``)."""
    if num_items_in_batch is None:
        return jnp.maximum(jnp.sum(counted), 1)
    if isinstance(num_items_in_batch, bool):
        raise TypeError(f"num_items_in_batch must be a token count, got {num_items_in_batch=}")
    if isinstance(num_items_in_batch, numbers.Number):
        if not isinstance(num_items_in_batch, numbers.Real) or num_items_in_batch < 0:
            raise ValueError(
                f"num_items_in_batch must be a token count >= 0, got {num_items_in_batch=}"
            )
    value = jnp.asarray(num_items_in_batch)
    if value.ndim != 0:
        raise ValueError(
            f"num_items_in_batch must be a scalar token count, got shape {value.shape}"
        )
    return jnp.maximum(value, 1)
