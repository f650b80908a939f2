"""Post-training steps, each prompt computed once per group or once per answer, in one run.

* ``dpo``: one DPO training step of a LoRA policy (``rudax.post_train.dpo_loss_sum``: the
  policy's forward and backward, the reference's forward with the adapters off, the
  gradient of the adapters) on ``--pairs`` preference pairs. Shared: each pair one row
  ``[prompt, chosen, rejected]`` (``pack_shared_prefix``, the prompt computed once for both
  answers); unshared: TRL's layout, ``prompt + chosen`` and ``prompt + rejected`` as two
  examples (the prompt computed twice), packed two to a row so that the pair stays in one
  row. Both arms go through the same function on the same pairs and must give the same
  loss (the relative difference is printed) before they are timed, alternating
  (``benchmarks/_timing.py``). Per arm: tokens, XLA's temp bytes of the compiled step,
  median seconds; speed: the unshared time / the shared one per round, median [min, max].

    python -m benchmarks.post_train dpo                        # 4 layers, 512 + 2 x 128
    python -m benchmarks.post_train --json out.json dpo --layers 30 --rounds 3

* ``grpo``: one GRPO iteration on one prompt's group of G: sampling (``rudax.models.
  generate``, temperature 1, with log-probs) and one training step
  (``rudax.post_train.grpo_loss_sum``, the old log-probs the sampler's, the KL to the
  reference with ``beta=0.04``). Shared: ``generate(num_samples=G)`` (the prompt prefilled
  once, its keys and values stored once) and one row ``[prompt, completion 1..G]``;
  unshared: the prompt repeated G times, and G rows ``prompt + completion``. The two
  training layouts' per-token log-probs are compared before timing (the loss, a sum of
  advantages that nearly cancel, would say little). The four calls alternate; per
  arm: sampling, training and iteration seconds (medians); speed: unshared / shared per
  round for each.

    python -m benchmarks.post_train grpo                       # 4 layers, G=8, 512 + 128

A random model of SmolLM-135M's shape (``benchmarks.shared_prefix``'s presets), fp32 on the
CPU, LoRA rank 16 on every projection.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rudax.layers as rl
from benchmarks._sections import run_sections
from benchmarks._timing import alternate, ratio_summary
from benchmarks.shared_prefix import PRESETS, build, step_table
from rudax.models import PROJECTIONS, causal_lm_token_logprobs, generate, pack_shared_prefix
from rudax.post_train import dpo_loss_sum, group_advantages, grpo_loss_sum


def _lora(preset: str, layers: int | None, rank: int) -> Any:
    model = build(preset, layers)
    rl.apply_lora(model, list(PROJECTIONS), rank=rank, alpha=2 * rank, rngs=nnx.Rngs(1))
    # B non-zero, as after some training: the policy differs from the reference
    for i, (_, node) in enumerate(nnx.iter_graph(model)):
        if isinstance(node, rl.LoRALinear):
            key = jax.random.fold_in(jax.random.key(2), i)
            node.lora_b.set_value(0.1 * jax.random.normal(key, node.lora_b.shape))
    return model


def _training_steps(
    model: Any, loss: Any, batches: dict[str, dict[str, jax.Array]]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, float]]:
    """Each batch's compiled training step, the adapters' ``value_and_grad`` of ``loss``'s
    sum over its weight: ``({arm: call}, {arm: tokens and XLA temp bytes}, {arm: loss})``."""
    graphdef, adapters, rest = nnx.split(model, rl.LoRAParam, ...)

    @jax.jit
    def step(adapters: Any, batch: dict[str, jax.Array]) -> Any:
        def mean_loss(a: Any) -> jax.Array:
            total, metrics = loss(nnx.merge(graphdef, a, rest), batch)
            return total / metrics["tokens"].astype(total.dtype)

        return jax.value_and_grad(mean_loss)(adapters)

    calls, stats, losses = {}, {}, {}
    for arm, batch in batches.items():
        compiled = step.lower(adapters, batch).compile()
        memory = compiled.memory_analysis()
        losses[arm] = float(compiled(adapters, batch)[0])
        stats[arm] = {
            "tokens": int(batch["tokens"].size),
            "temp_bytes": None if memory is None else int(memory.temp_size_in_bytes),
        }
        calls[arm] = lambda c=compiled, b=batch: c(adapters, b)
    return calls, stats, losses


def dpo(
    preset: str, layers: int | None, pairs: int, prompt_len: int, answer_len: int, rounds: int
) -> dict[str, Any]:
    model = _lora(preset, layers, rank=16)
    rng = np.random.default_rng(0)
    draw = lambda n: rng.integers(1, model.config.vocab_size, n).tolist()
    examples = [(draw(prompt_len), draw(answer_len), draw(answer_len)) for _ in range(pairs)]
    shared = pack_shared_prefix([(p, [c, r]) for p, c, r in examples])
    # Without sharing: each answer its own example after a copy of the prompt, a pair's two
    # in one row (a row as long as the pair's two examples).
    unshared = pack_shared_prefix(
        [e for p, c, r in examples for e in ((p, [c]), (p, [r]))],
        row_length=2 * (prompt_len + answer_len),
    )
    batches = {
        arm: {**{k: jnp.asarray(v) for k, v in rows.batch().items()},
              "completion": jnp.asarray(rows.completion)}
        for arm, rows in (("shared", shared), ("unshared", unshared))
    }  # fmt: skip
    loss = lambda m, b: dpo_loss_sum(m, b, beta=0.1)  # its weight: the pairs
    arms, stats, losses = _training_steps(model, loss, batches)
    diff = abs(losses["shared"] - losses["unshared"]) / abs(losses["unshared"])
    times = alternate(arms, rounds=rounds, iters=1)
    for arm in arms:
        stats[arm]["seconds"] = statistics.median(times[arm])
        stats[arm]["times_s"] = times[arm]
    return {
        "preset": preset,
        "layers": model.config.num_hidden_layers,
        "pairs": pairs,
        "prompt_len": prompt_len,
        "answer_len": answer_len,
        "rounds": rounds,
        "device": jax.devices()[0].device_kind,
        "loss": losses,
        "loss_relative_difference": diff,
        "arms": stats,
        "speed_shared_vs_unshared": ratio_summary(times["unshared"], times["shared"]),
    }


def dpo_report(r: dict[str, Any]) -> str:
    lines = [
        f"DPO step (policy forward + backward, reference forward, LoRA r=16 on every "
        f"projection), {r['preset']} shape, {r['layers']} layers, fp32, {r['device']}: "
        f"{r['pairs']} pairs of a {r['prompt_len']}-token prompt and two {r['answer_len']}-token "
        f"answers, {r['rounds']} rounds; losses agree within "
        f"{r['loss_relative_difference']:.1e} (relative)",
        "",
    ]
    names = {"shared": "shared prompt", "unshared": "prompt per answer (TRL's layout)"}
    return "\n".join(lines + step_table(r["arms"], names, r["speed_shared_vs_unshared"]))


def _dpo_section(sections: Any) -> None:
    s = sections.add_parser("dpo", help="a DPO step, the prompt shared against repeated")
    s.add_argument("--preset", choices=sorted(PRESETS), default="smollm-135m")
    s.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    s.add_argument("--pairs", type=int, default=2)
    s.add_argument("--prompt-len", type=int, default=512)
    s.add_argument("--answer-len", type=int, default=128)
    s.add_argument("--rounds", type=int, default=5)

    def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
        r = dpo(args.preset, args.layers, args.pairs, args.prompt_len, args.answer_len, args.rounds)
        return r, dpo_report(r)

    s.set_defaults(run=run)


def grpo(
    preset: str, layers: int | None, samples: int, prompt_len: int, new_tokens: int, rounds: int
) -> dict[str, Any]:
    model = _lora(preset, layers, rank=16)
    prompt = np.random.default_rng(0).integers(1, model.config.vocab_size, prompt_len).tolist()
    key = jax.random.key(0)
    sample = {
        "shared": lambda: generate(
            model, [prompt], new_tokens, num_samples=samples, temperature=1.0, rng=key,
            stop_tokens=[], return_logprobs=True,
        ),
        "unshared": lambda: generate(
            model, [prompt] * samples, new_tokens, temperature=1.0, rng=key, stop_tokens=[],
            return_logprobs=True,
        ),
    }  # fmt: skip
    drawn = sample["shared"]()
    rewards = np.random.default_rng(1).integers(0, 2, samples).astype(np.float32)
    advantages = np.asarray(group_advantages(jnp.asarray(rewards), samples))
    layouts = {
        "shared": pack_shared_prefix([(prompt, drawn.tokens)]),
        "unshared": pack_shared_prefix([(prompt, [c]) for c in drawn.tokens]),
    }
    old = np.concatenate([np.asarray(lp, np.float32) for lp in drawn.logprobs])
    batches = {}
    for arm, rows in layouts.items():
        scored = rows.completion >= 0
        old_logps = np.zeros(rows.tokens.shape, np.float32)
        old_logps[scored] = old  # the scored positions in order: the samples' tokens
        batches[arm] = {
            **{k: jnp.asarray(v) for k, v in rows.batch().items()},
            "completion": jnp.asarray(rows.completion),
            "advantages": jnp.asarray(np.where(scored, advantages[rows.completion], 0)),
            "old_logps": jnp.asarray(old_logps),
        }
    loss = lambda m, b: grpo_loss_sum(m, b, beta=0.04)
    training, stats, losses = _training_steps(model, loss, batches)
    arms = {}
    for arm in batches:
        arms[f"{arm} sampling"] = sample[arm]
        arms[f"{arm} training"] = training[arm]
    # The loss is a sum of +- advantages that nearly cancel: its relative difference says
    # little. What the layouts must agree on is each scored token's log-prob.
    scored = {
        arm: np.asarray(
            causal_lm_token_logprobs(model, {k: batch[k] for k in layouts[arm].batch()})
        )[np.asarray(batch["completion"]) >= 0]
        for arm, batch in batches.items()
    }
    diff = float(
        np.abs(scored["shared"] - scored["unshared"]).max() / np.abs(scored["unshared"]).max()
    )
    times = alternate(arms, rounds=rounds, iters=1)
    for arm in batches:
        s, t = times[f"{arm} sampling"], times[f"{arm} training"]
        stats[arm] |= {
            "sampling_s": statistics.median(s),
            "training_s": statistics.median(t),
            "iteration_s": statistics.median([a + b for a, b in zip(s, t, strict=True)]),
            "sampling_times_s": s,
            "training_times_s": t,
        }
    speed = {
        part: ratio_summary(
            stats["unshared"][f"{part}_times_s"], stats["shared"][f"{part}_times_s"]
        )
        for part in ("sampling", "training")
    }
    iteration = {
        arm: [
            a + b
            for a, b in zip(
                stats[arm]["sampling_times_s"], stats[arm]["training_times_s"], strict=True
            )
        ]
        for arm in batches
    }
    speed["iteration"] = ratio_summary(iteration["unshared"], iteration["shared"])
    return {
        "preset": preset,
        "layers": model.config.num_hidden_layers,
        "samples": samples,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "device": jax.devices()[0].device_kind,
        "loss": losses,
        "logprob_relative_difference": diff,
        "arms": stats,
        "speed_shared_vs_unshared": speed,
    }


def grpo_report(r: dict[str, Any]) -> str:
    lines = [
        f"GRPO iteration (sampling at temperature 1 with log-probs; a training step with the "
        f"KL's reference forward, LoRA r=16 on every projection), {r['preset']} shape, "
        f"{r['layers']} layers, fp32, {r['device']}: a {r['prompt_len']}-token prompt, "
        f"G={r['samples']} completions of {r['new_tokens']}, {r['rounds']} rounds; the layouts' "
        f"token log-probs agree within {r['logprob_relative_difference']:.1e} of the largest",
        "",
        "| arm | training tokens | XLA temp MiB (training) | sampling s | training s | "
        "iteration s |",
        "|---|---|---|---|---|---|",
    ]
    names = {"shared": "shared prompt", "unshared": f"prompt repeated {r['samples']}x"}
    for arm, row in r["arms"].items():
        temp = "n/a" if row["temp_bytes"] is None else f"{row['temp_bytes'] / 2**20:,.1f}"
        lines.append(
            f"| {names[arm]} | {row['tokens']:,} | {temp} | {row['sampling_s']:.3f} | "
            f"{row['training_s']:.3f} | {row['iteration_s']:.3f} |"
        )
    lines.append("")
    for part, (med, lo, hi) in r["speed_shared_vs_unshared"].items():
        lines.append(f"speed, {part}: shared {med:.2f}x the unshared's [{lo:.2f}, {hi:.2f}]")
    return "\n".join(lines)


def _grpo_section(sections: Any) -> None:
    s = sections.add_parser("grpo", help="a GRPO iteration, the prompt shared against repeated")
    s.add_argument("--preset", choices=sorted(PRESETS), default="smollm-135m")
    s.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    s.add_argument("--samples", type=int, default=8, help="G, completions per prompt")
    s.add_argument("--prompt-len", type=int, default=512)
    s.add_argument("--new-tokens", type=int, default=128)
    s.add_argument("--rounds", type=int, default=3)

    def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
        r = grpo(
            args.preset, args.layers, args.samples, args.prompt_len, args.new_tokens, args.rounds
        )
        return r, grpo_report(r)

    s.set_defaults(run=run)


# --- the command ---------------------------------------------------------------------------

SECTIONS = [_dpo_section, _grpo_section]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run_sections(__doc__.split("\n\n")[0], SECTIONS, argv)


if __name__ == "__main__":
    main()
