"""The flags of ``python -m examples.finetune``, and the run's configuration built from them once.

``build_parser`` is the command line (each flag with its default and meaning).
``FinetuneConfig`` is what the program runs on: one frozen, typed record of every flag,
built once from the parsed command line (``FinetuneConfig.from_flags``); a resumed run's
configuration is the run's own with this session's flags on top (``resumed``), a new
record, never the command line's rewritten.

Flags fall in two groups. *Session* flags (``SESSION_FLAGS``) only control this process
(where the run is, when to stop, what to write at the end, how to meet the other
processes) and may change between sessions of one run. Every other flag is the *run's*:
stored in its config.json, and a resumed run refuses a command line that contradicts them.
The base's and the data's places (``PLACES``) are the run's by content (their digests),
not by path: a resumed run may find them elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from examples.policy import config as shared

DEFAULT_BASE, DEFAULT_BASE_RUN = Path("hf/base"), Path("runs/base")
DEFAULT_DATA = Path("data/instructions")
# Flags of one session, not of the run: a resumed run may change them (the shared ones, and
# what this session writes at its end). --remat changes memory and time only (the gradients
# are the same: tests/lm/test_remat.py). --scan-layers is the run's: its checkpoints hold the
# layers' adapters stacked.
SESSION_FLAGS = (*shared.SESSION_FLAGS, "merged", "sample_tokens")
# Where the base and the data are: a resumed run may find them elsewhere (their contents are
# what is checked: the base's digest and the data's identity), and takes the run's if not given.
PLACES = shared.PLACES
DTYPES = shared.DTYPES


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; ``--help`` lists every flag with its default."""
    p = shared.build_parser(
        "examples.finetune",
        "QLoRA / LoRA fine-tuning of a Hugging Face Llama directory on JSONL.",
        shared.Defaults(
            steps=40,
            lr=1e-3,
            batch_size=8,
            dropout=0.05,
            warmup=4,
            min_lr_ratio=0.1,
            usage="[flags]",
            base=f"the HF directory (default: {DEFAULT_BASE})",
            data="training JSONL (prompt/completion, messages or text records) or a .txt file "
            "(default: the standard library set)",
            val_data="validation JSONL or .txt (default: the set's val.jsonl)",
        ),
    )
    out = p.add_argument_group("output (session flags)")
    out.add_argument(
        "--merged",
        metavar="DIR",
        help="also write the tuned model, adapters folded in (merge_lora), as a Hugging Face "
        "checkpoint with the base's tokenizer, stored in --param-dtype as the base was",
    )
    out.add_argument(
        "--sample-tokens",
        type=int,
        default=32,
        help="greedy tokens of the first validation prompt printed before and after "
        "training (0: none)",
    )
    tune = p.add_argument_group("fine-tuning (run flags)")
    tune.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    tune.add_argument("--no-pack", dest="pack", action="store_false", help="one example per row")
    tune.add_argument(
        "--too-long",
        choices=("error", "drop"),
        help="an example longer than --seq-len (default: error; drop for the generated set)",
    )
    tune.add_argument(
        "--scan-layers",
        action="store_true",
        help="the blocks stored stacked and run as one lax.scan; needs --dropout 0 (a flag of "
        "the run: its checkpoints hold the adapters stacked)",
    )
    tune.add_argument("--eval-batches", type=int, default=8, help="validation batches (at most)")
    return p


@dataclasses.dataclass(frozen=True)
class FinetuneConfig(shared.PolicyConfig):
    """A run's configuration: every flag of ``build_parser``, typed (see ``--help``)."""

    PARSER = build_parser
    PROGRAM = "examples.finetune"
    SESSION_FLAGS = SESSION_FLAGS
    # output (session)
    merged: str | None
    sample_tokens: int
    # fine-tuning
    seq_len: int
    pack: bool
    too_long: str | None
    scan_layers: bool
    eval_batches: int
