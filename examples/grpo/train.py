"""GRPO of a LoRA / QLoRA policy: prompts and reward functions in, a PEFT adapter out.

    python -m examples.grpo --base <HF dir> --data prompts.jsonl --val-data held_out.jsonl
    python -m examples.grpo ... --reward exact_match --reward 'format:\\d+' --num-samples 8
    python -m examples.grpo ... --reward my_rewards:correct   # yours, TRL's signature
    python -m examples.grpo --name g --resume                  # continues bit for bit

The run, top to bottom:

- session: ``examples.policy.Session.open``: processes, the run directory (``--resume``
  takes the run's flags), the mesh, the base's tokenizer.
- data: ``examples/grpo/data.py``: each JSONL line a prompt and the fields its rewards read.
- policy: ``Session.load``: the base (NF4 with ``--quantize nf4``) with LoRA adapters, AdamW,
  checkpoints; the step is ``rudax.sharding.make_train_steps`` of
  ``rudax.post_train.grpo_loss_sum`` (TRL's ``loss_type``, ``--epsilon``, the k3 KL to the
  base with its adapters off when ``--beta`` > 0).
- generation: every ``--num-iterations`` updates, ``rudax.post_train.rollout`` samples
  ``--num-samples`` completions of ``--batch-size`` x ``--grad-accum`` prompts (each
  prompt's keys and values cached once; the key ``--seed`` folded with the generation's
  number), rewards them, computes the group advantages and checks the sampler's log-probs
  against the trainer's forward (the run stops on a mismatch, naming the token). A prompt's
  completions are one row, the prompt once.
- loop: each update trains on the whole generation batch, ``--grad-accum`` microbatches of
  ``--batch-size`` rows, the sampler's log-probs as the old policy's; logs the loss, the
  rewards (mean, std, each function's), completion length, KL and clip ratio. Every
  ``--eval-every`` updates (and before the first) the held-out prompts are answered greedily
  and rewarded. A run stops and checkpoints only after a generation's last update.
- output: ``RUN/metrics.jsonl``, ``RUN/reward.png``, ``RUN/loss.png`` and the adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import rudax.models as rm
import rudax.post_train as rp
import rudax.run as rr
from examples.grpo.config import GRPOConfig
from examples.grpo.data import PromptData
from examples.grpo.mesh import mesh_score
from examples.policy.rows import pad_rows
from examples.policy.session import Session
from rudax.run import UsageError


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the program; returns what it reports (for tests). Exit statuses as
    ``rudax.run.run_program``'s: 2 a bad command line or data, 1 a reward function that
    fails or a sampler that disagrees with the trainer, 128 + a signal's number."""
    return GRPOConfig.main(grpo, argv)


def grpo(config: GRPOConfig, given: set[str] | None = None) -> dict[str, Any]:
    """The run itself, top to bottom; see the module docstring."""
    session = Session.open(config, given)
    config = session.config  # on --resume, the run's flags
    _check_flags(config)
    funcs = reward_functions(config.reward or ["exact_match"])
    if config.reward_weights is not None and len(config.reward_weights) != len(funcs):
        raise UsageError(
            f"--reward-weights has {len(config.reward_weights)} weights for {len(funcs)} "
            "--reward functions"
        )

    # ----------------------------------------------------------------------------- data
    train, val, identity = session.read_data(
        lambda path: PromptData(
            path,
            session.tokenizer,
            positions=session.positions,
            max_new_tokens=config.max_new_tokens,
        )
    )
    if "exact_match" in (config.reward or ["exact_match"]):
        for flag, data in (("--data", train), ("--val-data", val)):
            if data is not None and "answer" not in data.fields[0]:
                raise UsageError(
                    f"--reward exact_match reads each row's 'answer': {flag} {data.path} has none"
                )
    g = config.num_samples
    # every generation's rows as long: the longest prompt and G completions, each + 1
    longest = max(train.longest, 0 if val is None else val.longest)
    row_length = longest + g * (config.max_new_tokens + 1)
    prompts_per_generation = config.batch_size * config.grad_accum

    # ----------------------------------------------------------------------------- policy
    def loss(model: Any, batch: Any) -> Any:
        return rp.grpo_loss_sum(
            model,
            batch,
            temperature=config.temperature,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            beta=config.beta,
            loss_type=config.loss_type,
            # dr_grpo's normalizer (the others take none)
            max_completion_length=config.max_new_tokens if config.loss_type == "dr_grpo" else None,
        )

    session.load(loss, identity)
    session.say(
        f"{len(train.prompts)} prompts ({train.path}); each generation {prompts_per_generation} "
        f"prompts x {g} completions of <= {config.max_new_tokens} tokens, "
        f"{config.num_iterations} update(s) each; updates {session.step + 1} to "
        f"{config.stop_at or config.steps} of {config.steps}"
    )
    eos = session.hf_config.get("eos_token_id")
    listed = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    stop_tokens = sorted({session.tokenizer.eos_id, *listed})
    decode = lambda ids: session.tokenizer.tokenizer.decode(ids, skip_special_tokens=True)
    score = None if session.mesh is None else mesh_score(session, config.temperature)

    def generation(index: int) -> tuple[rp.Rollout, list[dict[str, np.ndarray]]]:
        prompts, columns = train.batch(index, prompts_per_generation, config.seed)
        try:
            out = rp.rollout(
                session.policy(),
                prompts,
                num_samples=g,
                max_new_tokens=config.max_new_tokens,
                reward_funcs=funcs,
                rng=jax.random.fold_in(jax.random.key(config.seed), index),
                temperature=config.temperature,
                stop_tokens=stop_tokens,
                decode=decode,
                columns=columns,
                reward_weights=config.reward_weights,
                scale_rewards=config.scale_rewards,
                row_length=row_length,
                logprob_tolerance=config.logprob_tolerance,
                score=score,
            )
        except (rp.RewardError, rp.LogprobMismatchError) as e:
            raise rr.TrainingHalted(f"generation {index}: {e}") from e
        batch = pad_rows(out.batch, prompts_per_generation)
        b = config.batch_size
        micro = [
            {k: v[a * b : (a + 1) * b] for k, v in batch.items()} for a in range(config.grad_accum)
        ]
        return out, micro

    def evaluate(step: int) -> dict[str, float] | None:
        if val is None:
            return None
        prompts, columns = val.take(list(range(len(val.prompts))))
        tokens = rm.generate(
            session.policy(), prompts, config.max_new_tokens, stop_tokens=stop_tokens
        )
        try:
            rewards = rp.compute_rewards(
                funcs,
                prompts=[decode(p) for p in prompts],
                completions=[decode(t) for t in tokens],
                completion_ids=tokens,
                columns=columns,
                weights=config.reward_weights,
            )
        except rp.RewardError as e:
            raise rr.TrainingHalted(f"held-out evaluation at update {step}: {e}") from e
        means = {"val_reward": float(np.mean(rewards.total))}
        for name, column in zip(rewards.names, rewards.per_function.T, strict=True):
            means[f"val_rewards/{name}"] = float(np.nanmean(column))
        session.log.write(kind="eval", step=step, **means)
        session.say(f"update {step}: held-out reward {means['val_reward']:.4f} (greedy)")
        return means

    # ----------------------------------------------------------------------------- loop
    last: dict[str, Any] = {"train": None, "eval": None}
    with session.running() as interrupt:
        if session.step == 0:
            last["eval"] = evaluate(0)
        stop = False
        while not stop and session.step < config.steps:
            out, micro = generation(session.step // config.num_iterations)
            for _ in range(config.num_iterations):
                step = session.step + 1
                metrics, norm = session.update(micro)
                last["train"] = row = _train_row(metrics, out)
                session.log_update(step, norm, row)
                if step % config.eval_every == 0 or step == config.steps:
                    last["eval"] = evaluate(step) or last["eval"]
                boundary = step % config.num_iterations == 0
                stop = session.end_update(step, interrupt, boundary=boundary)
                if stop:
                    break

    # ----------------------------------------------------------------------------- output
    plots = {
        "reward.png": {"train_key": "reward", "eval_key": "val_reward", "ylabel": "mean reward"},
        "loss.png": {"ylabel": f"GRPO loss ({config.loss_type})"},
    }
    result = session.finish(interrupt, plots)
    return result | {"train": last["train"], "eval": last["eval"]}


def reward_functions(specs: Sequence[str]) -> list[Any]:
    """``--reward``'s functions: ``exact_match``, ``format:REGEX`` or ``module:function``."""
    funcs = []
    for spec in specs:
        if spec == "exact_match":
            funcs.append(rp.exact_match_reward)
        elif spec.startswith("format:"):
            funcs.append(rp.format_reward(spec.removeprefix("format:")))
        else:
            try:
                funcs.append(rp.load_reward(spec))
            except ValueError as e:
                raise UsageError(f"--reward {spec}: {e}") from e
    return funcs


def _check_flags(config: GRPOConfig) -> None:
    if config.num_samples < 2:
        raise UsageError(
            f"--num-samples must be >= 2 (a group's advantages compare its completions), got "
            f"{config.num_samples}"
        )
    for flag in ("max_new_tokens", "temperature", "num_iterations", "epsilon"):
        if not getattr(config, flag) > 0:
            raise UsageError(
                f"--{flag.replace('_', '-')} must be positive, got {getattr(config, flag)}"
            )
    if not config.beta >= 0:
        raise UsageError(f"--beta must be >= 0, got {config.beta}")
    if not config.logprob_tolerance >= 0:
        raise UsageError(f"--logprob-tolerance must be >= 0, got {config.logprob_tolerance}")
    # A run stops, and resumes, only between generations: the next one is sampled afresh.
    n = config.num_iterations
    for flag in ("steps", "checkpoint_every", "stop_at"):
        value = getattr(config, flag)
        if value is not None and value % n:
            raise UsageError(
                f"--{flag.replace('_', '-')} {value} must be a multiple of --num-iterations "
                f"{n}: a run stops and checkpoints between generations"
            )


def _train_row(metrics: dict[str, float], out: rp.Rollout) -> dict[str, float]:
    """An update's logged row: the loss over its weight, the generation's rewards, TRL's
    means over the scored tokens (KL, clip ratio) and the log-prob check's largest error."""
    tokens = max(1.0, metrics["completion_tokens"])
    lengths = [len(t) for t in out.tokens]
    row = {
        "loss": metrics["loss_sum"] / max(1.0, metrics["tokens"]),
        "reward": float(np.mean(out.rewards.total)),
        "reward_std": float(np.std(out.rewards.total)),
        "completion_length": float(np.mean(lengths)),
        "clip_ratio": metrics["clipped"] / tokens,
        "logprob_error": out.logprob_max_error,
    }
    if "kl" in metrics:
        row["kl"] = metrics["kl"] / tokens
    for name, column in zip(out.rewards.names, out.rewards.per_function.T, strict=True):
        row[f"rewards/{name}"] = float(np.nanmean(column))
    return row
