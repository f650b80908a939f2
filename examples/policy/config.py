"""The flags the adapter programs share (``examples.finetune``, ``examples.dpo``,
``examples.grpo``), and ``PolicyConfig``, the frozen run configuration each program's own
configuration extends.

Flags fall in two groups. *Session* flags (``SESSION_FLAGS``)
only control this process (where the run is, when to stop, where the adapter goes, how to
meet the other processes) and may change between sessions of one run. Every other flag is
the *run's*: stored in its config.json, and a resumed run refuses a command line that
contradicts them. The base's and the data's places (``PLACES``) are the run's by content
(their digests), not by path: a resumed run may find them elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import ClassVar

import jax.numpy as jnp

import rudax.layers as rl
import rudax.models as rm
import rudax.run as rr

SESSION_FLAGS = (
    "resume",
    "stop_at",
    "export",
    "name",
    "runs_dir",
    "run_dir",
    "remat",
    "tensorboard",
    # rudax.run.add_distributed_flags': where this session's processes meet
    "coordinator",
    "num_processes",
    "process_id",
    "distributed_timeout",
    "heartbeat_timeout",
)
PLACES = ("base", "data", "val_data")
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class Defaults:
    """A program's own defaults of the shared flags, and its help for the places.

    ``dropout``: ``--dropout``'s default, or None where the program does not offer it (GRPO:
    its sampler and its trainer must compute one function, TRL's ``disable_dropout``)."""

    steps: int
    lr: float
    batch_size: int
    dropout: float | None
    warmup: int = 0
    min_lr_ratio: float = 1.0
    usage: str = "--base DIR --data FILE [flags]"
    base: str = "the Hugging Face directory of the policy's base (required)"
    data: str = "training JSONL (required)"
    val_data: str = "held-out JSONL, evaluated every --eval-every updates"


def build_parser(program: str, description: str, defaults: Defaults) -> argparse.ArgumentParser:
    """The flags every adapter program takes, grouped as ``--help`` shows them; a program
    adds its own groups."""
    p = argparse.ArgumentParser(
        prog=f"python -m {program}",
        usage=f"%(prog)s {defaults.usage}  (--help lists them)",
        description=description,
        formatter_class=rr.HelpFormatter,
        allow_abbrev=False,
    )
    name = program.split(".")[-1]
    run = p.add_argument_group("run (session flags)")
    run.add_argument("--runs-dir", default="runs", help="parent directory of run directories")
    run.add_argument("--name", help=f"run directory name (default: {name}-<timestamp>)")
    run.add_argument("--run-dir", help="the run directory itself (overrides --runs-dir/--name)")
    run.add_argument("--resume", action="store_true", help="continue the run from its checkpoint")
    run.add_argument("--stop-at", type=int, help="stop after this update, as an interruption would")
    run.add_argument("--export", help="the PEFT adapter's directory (default: RUN/adapter)")
    run.add_argument(
        "--tensorboard", action="store_true", help="also TensorBoard events in RUN/tensorboard"
    )
    base = p.add_argument_group("base and data (run flags)")
    base.add_argument("--base", help=defaults.base)
    base.add_argument("--data", help=defaults.data)
    base.add_argument("--val-data", help=defaults.val_data)
    base.add_argument(
        "--seed", type=int, default=0, help="adapter init, dropout, data order, sampling"
    )
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
        "--targets",
        type=lambda s: [t.strip() for t in s.split(",")],
        default=list(rm.PROJECTIONS),
        help="comma-separated module names to adapt (peft's target_modules)",
    )
    model.add_argument("--rank", type=int, default=8, help="LoRA rank")
    model.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha/rank)")
    if defaults.dropout is None:
        p.set_defaults(dropout=0.0)
    else:
        model.add_argument(
            "--dropout",
            type=float,
            default=defaults.dropout,
            help="dropout on adapter inputs (peft's lora_dropout)",
        )
    model.add_argument(
        "--mesh",
        type=rr.mesh_flag,
        help="spread each step over devices, e.g. data=2,fsdp=4: rows split over both, the "
        "base, adapters and moments stored 1/fsdp per device; the product is the device "
        "count of the run (all its processes)",
    )
    opt = p.add_argument_group("optimizer and loop (run flags)")
    opt.add_argument("--steps", type=int, default=defaults.steps, help="optimizer updates")
    opt.add_argument(
        "--batch-size", type=int, default=defaults.batch_size, help="rows per microbatch"
    )
    opt.add_argument("--grad-accum", type=int, default=1, help="microbatches per update")
    opt.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (AdamW)")
    opt.add_argument("--warmup", type=int, default=defaults.warmup, help="linear warmup updates")
    opt.add_argument(
        "--min-lr-ratio", type=float, default=defaults.min_lr_ratio, help="cosine's end / peak"
    )
    opt.add_argument("--clip", type=float, default=1.0, help="global gradient norm")
    opt.add_argument("--eval-every", type=int, default=10, help="updates per evaluation")
    opt.add_argument("--checkpoint-every", type=int, default=10, help="updates per checkpoint")
    opt.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    rr.add_distributed_flags(p)
    return p


@dataclasses.dataclass(frozen=True)
class PolicyConfig(rr.RunConfig):
    """The flags every adapter program takes, typed (see ``--help``); a program's
    configuration subclasses it with its own fields, ``PARSER`` and ``PROGRAM``."""

    PROGRAM: ClassVar[str] = ""  # "examples.dpo"
    SESSION_FLAGS = SESSION_FLAGS
    PLACES = PLACES
    # session
    runs_dir: str
    name: str | None
    run_dir: str | None
    resume: bool
    stop_at: int | None
    export: str | None
    tensorboard: bool
    # base and data
    base: str | None
    data: str | None
    val_data: str | None
    seed: int
    # policy
    quantize: str
    absmax_rounding: str
    param_dtype: str
    dtype: str
    remat: str
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
    checkpoint_every: int
    keep: int
    # where this session's processes meet (rudax.run.add_distributed_flags)
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    distributed_timeout: int
    heartbeat_timeout: int
