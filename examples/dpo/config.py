"""``python -m examples.dpo``'s flags: ``examples.policy``'s, and DPO's own."""

from __future__ import annotations

import argparse
import dataclasses

import rudax.post_train as rp
from examples.policy.config import Defaults, PolicyConfig
from examples.policy.config import build_parser as policy_parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; ``--help`` lists every flag with its default."""
    p = policy_parser(
        "examples.dpo",
        "DPO of a LoRA / QLoRA policy on chosen/rejected pairs (TRL's DPOTrainer losses); the "
        "reference policy is the base, the adapters switched off; --dropout 0 by default, as "
        "TRL's.",
        Defaults(steps=40, lr=5e-4, batch_size=8, dropout=0.0),
    )
    dpo = p.add_argument_group("DPO (run flags)")
    dpo.add_argument("--seq-len", type=int, default=256, help="tokens per row (a pair a row)")
    dpo.add_argument(
        "--too-long", choices=("error", "drop"), default="error", help="a pair over --seq-len"
    )
    dpo.add_argument("--beta", type=float, default=0.1, help="DPO's beta (TRL's default)")
    dpo.add_argument(
        "--loss-type", choices=rp.DPO_LOSS_TYPES, default="sigmoid", help="TRL's loss_type"
    )
    dpo.add_argument(
        "--label-smoothing", type=float, default=0.0, help="robust / cDPO's label smoothing"
    )
    return p


@dataclasses.dataclass(frozen=True)
class DPOConfig(PolicyConfig):
    """The DPO run's configuration: every flag of ``build_parser``, typed."""

    PARSER = build_parser
    PROGRAM = "examples.dpo"
    seq_len: int
    too_long: str
    beta: float
    loss_type: str
    label_smoothing: float
