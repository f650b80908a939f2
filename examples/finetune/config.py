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

import jax.numpy as jnp

import rudax.layers as rl
import rudax.models as rm
import rudax.run as rr

DEFAULT_BASE, DEFAULT_BASE_RUN = Path("hf/base"), Path("runs/base")
DEFAULT_DATA = Path("data/instructions")
# Flags that may change between the sessions of one run; every other one is the run's.
# Flags of one session, not of the run: a resumed run may change them. --remat changes
# memory and time only (the gradients are the same: tests/lm/test_remat.py). --scan-layers is
# the run's: its checkpoints hold the layers' adapters stacked.
SESSION_FLAGS = (
    "resume",
    "stop_at",
    "export",
    "merged",
    "name",
    "runs_dir",
    "run_dir",
    "remat",
    "sample_tokens",
    # rudax.run.add_distributed_flags': where this session's processes meet
    "coordinator",
    "num_processes",
    "process_id",
    "distributed_timeout",
    "heartbeat_timeout",
)
# Where the base and the data are: a resumed run may find them elsewhere (their contents are
# what is checked: the base's digest and the data's identity), and takes the run's if not given.
PLACES = ("base", "data", "val_data")
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; ``--help`` lists every flag with its default."""
    p = argparse.ArgumentParser(
        prog="python -m examples.finetune",
        # one line above an error, not every flag: --help lists them
        usage="%(prog)s [flags]  (--help lists them)",
        description="QLoRA / LoRA fine-tuning of a Hugging Face Llama directory on JSONL.",
        formatter_class=rr.HelpFormatter,
        allow_abbrev=False,
    )
    run = p.add_argument_group("run (session flags)")
    run.add_argument("--runs-dir", default="runs", help="parent directory of run directories")
    run.add_argument("--name", help="run directory name (default: finetune-<timestamp>)")
    run.add_argument("--run-dir", help="the run directory itself (overrides --runs-dir/--name)")
    run.add_argument("--resume", action="store_true", help="continue the run from its checkpoint")
    run.add_argument("--stop-at", type=int, help="stop after this update, as an interruption would")
    run.add_argument("--export", help="the PEFT adapter's directory (default: RUN/adapter)")
    run.add_argument(
        "--merged",
        metavar="DIR",
        help="also write the tuned model, adapters folded in (merge_lora), as a Hugging Face "
        "checkpoint with the base's tokenizer, stored in --param-dtype as the base was",
    )
    run.add_argument(
        "--sample-tokens",
        type=int,
        default=32,
        help="greedy tokens of the first validation prompt printed before and after "
        "training (0: none)",
    )
    base = p.add_argument_group("base and data (run flags)")
    base.add_argument("--base", help=f"the HF directory (default: {DEFAULT_BASE})")
    base.add_argument(
        "--data",
        help="training JSONL (prompt/completion, messages or text records) or a .txt file "
        "(default: the standard library set)",
    )
    base.add_argument("--val-data", help="validation JSONL or .txt (default: the set's val.jsonl)")
    base.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    base.add_argument("--no-pack", dest="pack", action="store_false", help="one example per row")
    base.add_argument(
        "--too-long",
        choices=("error", "drop"),
        help="an example longer than --seq-len (default: error; drop for the generated set)",
    )
    base.add_argument("--seed", type=int, default=0, help="adapter init, dropout, data order")
    model = p.add_argument_group("model (run flags)")
    model.add_argument("--quantize", choices=("nf4", "none"), default="nf4", help="the base")
    model.add_argument(
        "--absmax-rounding",
        choices=("cuda", "cpu"),
        default="cuda",
        help="with --quantize nf4, whose 8-bit absmax codes (QLoRA's double quantization) "
        "to reproduce bit for bit: bitsandbytes' CUDA kernel, which quantized the checkpoints "
        "people share, or its CPU kernel, which rounds about 1 in 400 of them the other way "
        "(rudax.kernels.nf4_quantize)",
    )
    model.add_argument(
        "--param-dtype", choices=sorted(DTYPES), default="bfloat16", help="unquantized storage"
    )
    model.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype")
    model.add_argument(
        "--remat",
        choices=rl.REMAT_POLICIES,
        default="none",
        help="activation checkpointing of each block, as examples.lm.train's (may change on "
        "--resume)",
    )
    model.add_argument(
        "--scan-layers",
        action="store_true",
        help="the blocks stored stacked and run as one lax.scan; needs --dropout 0 (a flag of "
        "the run: its checkpoints hold the adapters stacked)",
    )
    model.add_argument(
        "--targets",
        type=lambda s: [t.strip() for t in s.split(",")],
        default=list(rm.PROJECTIONS),
        help="comma-separated module names to adapt (peft's target_modules)",
    )
    model.add_argument("--rank", type=int, default=8, help="LoRA rank")
    model.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha/rank)")
    model.add_argument("--dropout", type=float, default=0.05, help="dropout on adapter inputs")
    model.add_argument(
        "--mesh",
        type=rr.mesh_flag,
        help="spread each step over devices, e.g. data=2,fsdp=4: rows split over both, the "
        "base, adapters and moments stored 1/fsdp per device (examples/finetune/mesh.py); "
        "the product is the device count of the run (all its processes)",
    )
    opt = p.add_argument_group("optimizer and loop (run flags)")
    opt.add_argument("--steps", type=int, default=40, help="optimizer updates")
    opt.add_argument("--batch-size", type=int, default=8, help="rows per microbatch")
    opt.add_argument("--grad-accum", type=int, default=1, help="microbatches per update")
    opt.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    opt.add_argument("--warmup", type=int, default=4, help="linear warmup updates")
    opt.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine's end / peak")
    opt.add_argument("--clip", type=float, default=1.0, help="global gradient norm")
    opt.add_argument("--eval-every", type=int, default=10, help="updates per validation")
    opt.add_argument("--eval-batches", type=int, default=8, help="validation batches (at most)")
    opt.add_argument("--checkpoint-every", type=int, default=10, help="updates per checkpoint")
    opt.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    rr.add_distributed_flags(p)
    return p


@dataclasses.dataclass(frozen=True)
class FinetuneConfig(rr.RunConfig):
    """A run's configuration: every flag of ``build_parser``, typed (see ``--help``)."""

    PARSER = build_parser
    SESSION_FLAGS = SESSION_FLAGS
    PLACES = PLACES

    # session
    runs_dir: str
    name: str | None
    run_dir: str | None
    resume: bool
    stop_at: int | None
    export: str | None
    merged: str | None
    sample_tokens: int
    # base and data
    base: str | None
    data: str | None
    val_data: str | None
    seq_len: int
    pack: bool
    too_long: str | None
    seed: int
    # model
    quantize: str
    absmax_rounding: str
    param_dtype: str
    dtype: str
    remat: str
    scan_layers: bool
    targets: list[str]
    rank: int
    alpha: float
    dropout: float
    mesh: dict[str, int] | None
    # optimizer and loop
    steps: int
    batch_size: int
    grad_accum: int
    lr: float
    warmup: int
    min_lr_ratio: float
    clip: float
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    keep: int
    # where this session's processes meet (rudax.run.add_distributed_flags)
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    distributed_timeout: int
    heartbeat_timeout: int
