"""``python -m examples.grpo``'s flags: ``examples.policy``'s, and GRPO's own."""

from __future__ import annotations

import argparse
import dataclasses

import rudax.post_train as rp
from examples.policy.config import Defaults, PolicyConfig
from examples.policy.config import build_parser as policy_parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; ``--help`` lists every flag with its default."""
    p = policy_parser(
        "examples.grpo",
        "GRPO of a LoRA / QLoRA policy (TRL's GRPOTrainer losses): G completions of each "
        "prompt sampled with the prompt's keys and values cached once, rewarded by Python "
        "functions, trained on for --num-iterations updates. --batch-size counts prompts "
        "(a prompt's G completions are one row).",
        Defaults(steps=40, lr=5e-4, batch_size=4, dropout=None),
    )
    g = p.add_argument_group("GRPO (run flags)")
    g.add_argument(
        "--reward",
        action="append",
        help="a reward, repeatable: exact_match (the row's 'answer'), format:REGEX (the whole "
        "completion matches), or module:function (TRL's signature: completions, prompts and "
        "the rows' fields as keywords; one float or None per completion). Default: exact_match",
    )
    g.add_argument(
        "--reward-weights",
        type=lambda s: [float(w) for w in s.split(",")],
        help="comma-separated weights of the rewards (default: 1 each)",
    )
    g.add_argument("--num-samples", type=int, default=4, help="G, completions per prompt")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens per completion at most")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument(
        "--num-iterations",
        type=int,
        default=1,
        help="updates per generation batch, the old log-probs kept (TRL's num_iterations)",
    )
    g.add_argument("--epsilon", type=float, default=0.2, help="the ratio's clip")
    g.add_argument("--epsilon-high", type=float, help="DAPO's upper clip (default: --epsilon)")
    g.add_argument("--beta", type=float, default=0.0, help="the k3 KL's weight (TRL's default 0)")
    g.add_argument(
        "--loss-type", choices=rp.GRPO_LOSS_TYPES, default="dapo", help="TRL's loss_type"
    )
    g.add_argument(
        "--scale-rewards",
        choices=("group", "batch", "none"),
        default="group",
        help="the advantages' std: the group's, the batch's, or none (Dr. GRPO)",
    )
    g.add_argument(
        "--logprob-tolerance",
        type=float,
        default=1e-2,
        help="the most a token's sampler and trainer log-probs may differ before the run stops",
    )
    return p


@dataclasses.dataclass(frozen=True)
class GRPOConfig(PolicyConfig):
    """The GRPO run's configuration: every flag of ``build_parser``, typed."""

    PARSER = build_parser
    PROGRAM = "examples.grpo"
    reward: list[str] | None
    reward_weights: list[float] | None
    num_samples: int
    max_new_tokens: int
    temperature: float
    num_iterations: int
    epsilon: float
    epsilon_high: float | None
    beta: float
    loss_type: str
    scale_rewards: str
    logprob_tolerance: float
