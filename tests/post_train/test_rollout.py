"""rudax.post_train.rollout: G samples of each prompt (the sampler's tokens and log-probs
kept), rewards from TRL-style functions with the prompts' columns repeated per sample, group
advantages, and a batch that grpo_loss_sum trains on (ratio 1 at the sampling policy); the
sampler's log-probs agree with the trainer's forward, and a trainer that computes another
distribution (here another temperature) is stopped, the token named."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rudax.models import causal_lm_token_logprobs, generate
from rudax.post_train import (
    LogprobMismatchError,
    RewardError,
    group_advantages,
    grpo_loss_sum,
    rollout,
)
from tests.post_train._lora import base_and_policy

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


def small_tokens(completions, answer, **kwargs):
    """The fraction of a completion's tokens below the row's ``answer`` (an int)."""
    return [float(np.mean(np.array(c) < a)) for c, a in zip(completions, answer, strict=True)]


def test_samples_rewards_advantages_and_a_batch_grpo_trains_on():
    _, policy = base_and_policy()
    key = jax.random.key(3)
    out = rollout(
        policy, PROMPTS, num_samples=4, max_new_tokens=6, reward_funcs=[small_tokens], rng=key,
        temperature=0.9, stop_tokens=[], columns={"answer": [20, 32, 44]},
    )  # fmt: skip
    # the sampler's own tokens and log-probs, the same call as generate's
    want = generate(policy, PROMPTS, 6, temperature=0.9, stop_tokens=[], rng=key, num_samples=4,
                    return_logprobs=True)  # fmt: skip
    assert out.tokens == want.tokens
    scored = out.batch["completion"] >= 0
    np.testing.assert_array_equal(out.batch["old_logps"][scored], np.concatenate(want.logprobs))
    # rewards with each prompt's answer repeated for its 4 samples
    answers = np.repeat([20, 32, 44], 4)
    expected = [np.mean(np.array(t) < a) for t, a in zip(want.tokens, answers, strict=True)]
    np.testing.assert_allclose(out.rewards.total, expected, rtol=1e-6)
    np.testing.assert_array_equal(
        out.advantages, np.asarray(group_advantages(out.rewards.total, 4))
    )
    np.testing.assert_array_equal(
        out.batch["advantages"][scored], out.advantages[out.batch["completion"][scored]]
    )
    assert out.batch["tokens"].shape[0] == 3  # a prompt's group per row
    assert out.logprob_max_error < 1e-4
    # At the sampling policy every ratio is 1: nothing clipped, the loss the advantages' mean
    loss_sum, metrics = grpo_loss_sum(policy, out.batch, temperature=0.9)
    assert float(metrics["clipped"]) == 0.0
    counted = out.batch["advantages"][scored]
    np.testing.assert_allclose(float(loss_sum), -counted.sum(), rtol=1e-4, atol=1e-5)


def test_a_trainer_at_another_temperature_is_stopped_naming_the_token():
    _, policy = base_and_policy()
    other = lambda batch: causal_lm_token_logprobs(policy, batch, temperature=2.0)
    with pytest.raises(LogprobMismatchError, match=r"completion \d+ \(prompt \d\) token \d+ \(id"):
        rollout(
            policy, PROMPTS, num_samples=2, max_new_tokens=4, reward_funcs=[small_tokens],
            rng=jax.random.key(0), columns={"answer": [1, 2, 3]}, score=other,
        )  # fmt: skip


def test_bad_arguments_and_rewards():
    _, policy = base_and_policy()
    kw = {"max_new_tokens": 3, "rng": jax.random.key(0), "reward_funcs": [small_tokens]}
    with pytest.raises(ValueError, match="num_samples must be an int >= 2"):
        rollout(policy, PROMPTS, num_samples=1, columns={"answer": [1, 2, 3]}, **kw)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        rollout(policy, PROMPTS, num_samples=2, temperature=0.0, **kw)
    with pytest.raises(ValueError, match=r"columns\['answer'\] has 2 entries for 3 prompts"):
        rollout(policy, PROMPTS, num_samples=2, columns={"answer": [1, 2]}, **kw)
    with pytest.raises(RewardError, match="small_tokens"):  # no answer column: it raises
        rollout(policy, PROMPTS, num_samples=2, **kw)
