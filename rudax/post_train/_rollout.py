"""``rollout``: GRPO's generation step, from prompts to the batch ``grpo_loss_sum`` trains on.

For each prompt, G completions are sampled with the prompt's keys and values cached once
(``rudax.models.generate(num_samples=G, return_logprobs=True)``), scored by the reward
functions (``compute_rewards``), turned into group advantages (``group_advantages``) and
packed into shared-prefix rows (``pack_shared_prefix``: each prompt once, its completions as
branches), the sampler's log-probs stored as the old policy's. Then the trainer's own
forward scores the same tokens and must agree with the sampler within a tolerance: a
sampler and a trainer that compute different distributions (another temperature, filtered
log-probs, another precision or model) make every importance ratio wrong without any error,
as the marin/levanter log-prob mismatch showed; here that stops the run, naming the token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from rudax.models import LlamaForCausalLM, causal_lm_token_logprobs, generate, pack_shared_prefix
from rudax.post_train._grpo import ScaleRewards, group_advantages
from rudax.post_train._rewards import RewardFunction, Rewards, compute_rewards

__all__ = ["LogprobMismatchError", "Rollout", "rollout"]


class LogprobMismatchError(ValueError):
    """The sampler's log-probs and the trainer's forward disagree beyond the tolerance."""


class Rollout(NamedTuple):
    """What ``rollout`` returns.

    Attributes:
      batch: the ``[B, T]`` arrays ``grpo_loss_sum`` takes: ``pack_shared_prefix``'s rows,
        ``completion``, ``advantages`` (each scored position its completion's) and
        ``old_logps`` (the sampler's), NumPy.
      tokens: the N = prompts x G completions' token ids, prompt-major (prompt i's are
        ``tokens[i * G : (i + 1) * G]``), each ending at its stop token if it met one.
      rewards: ``compute_rewards``' result for them.
      advantages: ``[N]`` float32 group advantages.
      logprob_max_error: the largest ``|sampler - trainer|`` log-prob over the tokens.
    """

    batch: dict[str, np.ndarray]
    tokens: list[list[int]]
    rewards: Rewards
    advantages: np.ndarray
    logprob_max_error: float


def rollout(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    num_samples: int,
    max_new_tokens: int,
    reward_funcs: Sequence[RewardFunction],
    rng: jax.Array,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: int | Sequence[int] | None = None,
    decode: Callable[[list[int]], Any] | None = None,
    columns: Mapping[str, Sequence[Any]] | None = None,
    reward_weights: Sequence[float] | None = None,
    scale_rewards: ScaleRewards = "group",
    row_length: int | None = None,
    logprob_tolerance: float = 1e-2,
    score: Callable[[dict[str, np.ndarray]], ArrayLike] | None = None,
) -> Rollout:
    """Samples G completions of each prompt, rewards them, and packs them for training.

    Args:
      model: the policy (a ``LlamaForCausalLM``, LoRA or not); it is not modified.
      prompts: P prompts' token ids.
      num_samples: G >= 2, completions per prompt (TRL's ``num_generations``).
      max_new_tokens: the most tokens of a completion.
      reward_funcs: TRL-style reward functions (``compute_rewards``).
      rng: a ``jax.random.key`` for sampling.
      temperature, top_k, top_p, stop_tokens: ``generate``'s (temperature > 0: GRPO samples).
      decode: token ids to what the reward functions read (a tokenizer's decode); None passes
        the token lists themselves, prompts and completions alike.
      columns: the prompts' other fields, each a length-P sequence (``{"answer": [...]}``),
        given to the reward functions repeated for each of a prompt's G completions.
      reward_weights: ``compute_rewards``' weights.
      scale_rewards: ``group_advantages``' (``"group"``, ``"batch"`` or ``"none"``).
      row_length: ``pack_shared_prefix``'s tokens per row (None: a prompt's group per row).
      logprob_tolerance: the largest ``|sampler - trainer|`` log-prob allowed for any token.
        On the CPU in fp32 they agree within about 3e-6; bf16 compute differs more.
      score: the trainer's forward, ``score(batch) -> [B, T]`` per-token log-probs of the
        packed rows at ``temperature``; None for ``causal_lm_token_logprobs(model, batch,
        temperature=temperature)`` on one device (a model sharded over a mesh passes its
        own, run inside ``jax.shard_map``).

    Returns:
      A ``Rollout``: ``batch`` for ``grpo_loss_sum``, the tokens, rewards and advantages.

    Raises:
      LogprobMismatchError: a token's log-probs differ by more than ``logprob_tolerance``;
        the message names the completion, the token and both values.
      RewardError: a reward function failed (``compute_rewards``).

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> from rudax.models import LlamaConfig, LlamaForCausalLM
      >>> from rudax.post_train import rollout
      >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
      ...                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
      >>> model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
      >>> even = lambda completions, **kw: [float(c[0] % 2 == 0) for c in completions]
      >>> out = rollout(model, [[1, 2, 3], [4, 5]], num_samples=4, max_new_tokens=5,
      ...               reward_funcs=[even], rng=jax.random.key(0), stop_tokens=[])
      >>> len(out.tokens), out.batch["tokens"].shape[0], out.logprob_max_error < 1e-4
      (8, 2, True)
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 2:
        raise ValueError(
            f"num_samples must be an int >= 2 (a group's advantages compare its completions), "
            f"got {num_samples!r}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to sample a group, got {temperature!r}")
    if not logprob_tolerance >= 0:
        raise ValueError(f"logprob_tolerance must be >= 0, got {logprob_tolerance!r}")
    prompts = [list(map(int, p)) for p in prompts]
    g = num_samples
    cols = {k: list(v) for k, v in (columns or {}).items()}
    for name, values in cols.items():
        if len(values) != len(prompts):
            raise ValueError(
                f"columns[{name!r}] has {len(values)} entries for {len(prompts)} prompts: one "
                "per prompt"
            )
    samples = generate(
        model, prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        stop_tokens=stop_tokens, rng=rng, num_samples=g, return_logprobs=True,
    )  # fmt: skip
    tokens = samples.tokens
    show = decode or (lambda ids: ids)
    prompt_of = [i // g for i in range(len(tokens))]
    rewards = compute_rewards(
        reward_funcs,
        prompts=[show(prompts[i]) for i in prompt_of],
        completions=[show(t) for t in tokens],
        completion_ids=tokens,
        columns={k: [v[i] for i in prompt_of] for k, v in cols.items()},
        weights=reward_weights,
    )
    advantages = np.asarray(group_advantages(rewards.total, g, scale_rewards=scale_rewards))
    rows = pack_shared_prefix(
        [(p, tokens[i * g : (i + 1) * g]) for i, p in enumerate(prompts)], row_length=row_length
    )
    scored = rows.completion >= 0
    old = np.zeros(rows.tokens.shape, np.float32)
    old[scored] = np.concatenate([np.asarray(lp, np.float32) for lp in samples.logprobs])
    batch = {
        **rows.batch(),
        "completion": rows.completion,
        "advantages": np.where(scored, advantages[rows.completion], 0).astype(np.float32),
        "old_logps": old,
    }
    trainer = np.asarray(
        _logprobs(model, rows.batch(), temperature) if score is None else score(rows.batch())
    )
    error = np.where(scored, np.abs(trainer - old), 0)
    error = np.where(np.isnan(error), np.inf, error)  # a NaN is the worst disagreement
    worst = float(error.max())
    if worst > logprob_tolerance:
        r, t = np.unravel_index(int(np.argmax(error)), error.shape)
        i = int(rows.completion[r, t])
        k = int(np.count_nonzero(rows.completion[r, : t + 1] == i)) - 1
        raise LogprobMismatchError(
            f"the sampler gives completion {i} (prompt {prompt_of[i]}) token {k} (id "
            f"{tokens[i][k]}) the log-prob {old[r, t]:.6g}, the trainer's forward "
            f"{trainer[r, t]:.6g}: |difference| {error[r, t]:.3g} > logprob_tolerance="
            f"{logprob_tolerance}. The two compute different distributions (another "
            "temperature, filtered log-probs, another precision or model): every importance "
            "ratio would be wrong"
        )
    return Rollout(batch, tokens, rewards, advantages.astype(np.float32), worst)


@nnx.jit(static_argnames="temperature")
def _logprobs(model: LlamaForCausalLM, batch: dict[str, Any], temperature: float) -> jax.Array:
    return causal_lm_token_logprobs(model, batch, temperature=temperature)
