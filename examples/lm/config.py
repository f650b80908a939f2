"""The flags of ``python -m examples.lm.train``: each with its default and meaning, validated.

Flags fall in two groups. *Run* flags define what is trained (data, model, optimizer, batch,
schedule, mesh, seed): they are stored with the run, and ``--resume`` takes them from there
and refuses a command line that contradicts them. *Session* flags only control this process
(where to log, how often to evaluate or checkpoint, profiling) and may change between
sessions of one run.

Every bad value ends in argparse's one-line ``error:`` message and exit code 2: a flag's own
type checks here, cross-flag checks in ``check``, and checks that need the machine or the
disk (device count, checkpoints) raise ``UsageError``, which ``train.main`` turns into the
same message.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any

import rudax.layers as rl
import rudax.models as rm
import rudax.run as rr
import rudax.sharding as rs

OPTIMIZERS = rm.OPTIMIZERS
# The optimizer flags' defaults: the library's recipe (benchmarks build the same one).
_OPT = rm.OptimizerSpec()
DTYPES = ("bfloat16", "float32")
REMAT_POLICIES = rl.REMAT_POLICIES

# The flags that define a run: stored in its config and checked on --resume.
RUN_KEYS = (
    "data",
    "data_dir",
    "vocab_size",
    "seed",
    "seq_len",
    "d_model",
    "n_layers",
    "n_heads",
    "mlp_hidden",
    "moe",
    "num_experts",
    "top_k",
    "moe_aux_weight",
    "param_dtype",
    "compute_dtype",
    "optimizer",
    "lr",
    "muon_lr",
    "min_lr_ratio",
    "warmup",
    "weight_decay",
    "beta1",
    "beta2",
    "eps",
    "clip",
    "batch_size",
    "grad_accum",
    "steps",
    "mesh",
    "eval_batches",  # the validation loss's definition
    "deterministic",
    "scan_layers",  # the checkpoints hold the layers stacked
    "architecture",  # not a flag: the model fields an --init-from HF directory decided
    "model",  # not a flag: "llama", the rudax.models class the checkpoints hold
)


# The model class a run's checkpoints hold (rudax.models.LlamaForCausalLM).
MODEL = "llama"

_FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A run's configuration: every flag of ``build_parser``, typed (see ``--help``), built
    once from the parsed command line. A resumed run's (its run flags) and an ``--init-from``
    Hugging Face directory's (its shape) are new records (``dataclasses.replace``)."""

    # session
    runs_dir: str
    name: str | None
    run_dir: str | None
    resume: bool
    resume_step: int | None
    init_from: str | None
    stop_at: int | None
    log_every: int
    tensorboard: bool
    eval_every: int
    checkpoint_every: int
    keep: int
    max_skipped_updates: int
    profile: bool
    trace: str | None
    # data
    data: str | None
    data_dir: str | None
    vocab_size: int
    seed: int
    eval_batches: int
    # model
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    mlp_hidden: int | None
    moe: bool
    num_experts: int
    top_k: int
    moe_aux_weight: float
    param_dtype: str
    deterministic: bool
    remat: str
    scan_layers: bool
    compute_dtype: str
    # optimizer
    optimizer: str
    lr: float
    muon_lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    clip: float
    # batch, schedule and devices
    batch_size: int
    grad_accum: int
    steps: int
    mesh: dict[str, int] | None
    # not flags: the model fields an --init-from HF directory decided; the checkpoints' class
    architecture: dict[str, Any] | None = None
    model: str = MODEL
    # where this session's processes meet (rudax.run.add_distributed_flags; not the plan's)
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    distributed_timeout: int = 300
    heartbeat_timeout: int = 60

    @classmethod
    def from_flags(cls, flags: argparse.Namespace | dict[str, Any]) -> TrainConfig:
        """The configuration of parsed flags (a program's parser may add its own: left out)."""
        values = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags)
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})

    @classmethod
    def of_run(cls, saved: dict[str, Any]) -> TrainConfig:
        """A run's configuration from its config.json: a flag added since the run was started
        (absent there) takes its default."""
        return cls.from_flags({**vars(build_parser().parse_args([])), **saved})

    def as_dict(self) -> dict[str, Any]:
        """Every field, JSON-able: the run directory's config.json."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# A flag value that only the machine or the disk can refute; reported like a bad flag.
UsageError = rr.UsageError


def _number(kind: type, low: float, *, inclusive: bool = True, high: float | None = None):
    """An argparse ``type=`` that parses ``kind`` and checks ``low <= x`` (or ``<``) ``< high``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        ok = value >= low if inclusive else value > low
        if high is not None:
            ok = ok and value < high
        if not (ok and math.isfinite(value)):
            bound = (">= " if inclusive else "> ") + str(low)
            if high is not None:
                bound += f" and < {high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        if kind is float and abs(value) > _FLOAT32_MAX:
            # Every float flag becomes a float32 on the device: 1e39 would be inf there, and
            # the learning rate of the first update NaN.
            raise argparse.ArgumentTypeError(
                f"must be at most {_FLOAT32_MAX:.7g} (float32's largest), got {text}"
            )
        return value

    return parse


positive_int = _number(int, 1)
non_negative_int = _number(int, 0)
positive_float = _number(float, 0, inclusive=False)
non_negative_float = _number(float, 0)
unit_interval = _number(float, 0, high=1)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; ``--help`` lists every flag with its default."""
    p = argparse.ArgumentParser(
        prog="python -m examples.lm.train",
        # one line above an error, not every flag: --help lists them
        usage="%(prog)s [flags]  (--help lists them)",
        description=(
            "Train a small Llama (dense, or a Mixtral of experts with --moe) with rudax on a "
            "local text corpus (default: the "
            "Python standard library's sources). Writes checkpoints, metrics.jsonl and loss.png "
            "into the run directory."
        ),
        formatter_class=rr.HelpFormatter,
        allow_abbrev=False,  # --resume checks which flags were given: no prefixes
    )
    run = p.add_argument_group("run (session flags: may change between sessions of one run)")
    run.add_argument("--runs-dir", default="runs", help="parent directory of new run directories")
    run.add_argument("--name", help="run directory name under --runs-dir (default: a timestamp)")
    run.add_argument("--run-dir", help="the run directory itself (overrides --runs-dir/--name)")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir (or --name) from its latest checkpoint to --steps; "
        "its run flags come from the run, and flags given again must agree with them",
    )
    run.add_argument(
        "--resume-step",
        type=non_negative_int,
        metavar="N",
        help="with --resume: continue from checkpoint N instead of the latest (say, when the "
        "latest is damaged); the later checkpoints are moved into the run's superseded/ folder",
    )
    run.add_argument(
        "--init-from",
        metavar="DIR",
        help="start a new run with the model weights of the latest checkpoint of the run "
        "directory (or checkpoint directory) DIR, or of the Hugging Face Llama directory DIR "
        "(config.json, *.safetensors and the data's tokenizer.json; its config.json sets the "
        "model's shape); the optimizer starts fresh and DIR is only read",
    )
    run.add_argument(
        "--stop-at",
        type=positive_int,
        metavar="STEP",
        help="end this process after update STEP (checkpointed), as an interruption would; "
        "continue with --resume",
    )
    run.add_argument("--log-every", type=positive_int, default=1, help="updates per metrics row")
    run.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write metrics.jsonl's scalars as TensorBoard event files into the run's "
        "tensorboard/ folder (needs tensorboardX; a resumed session writes them if given again)",
    )
    run.add_argument(
        "--eval-every", type=positive_int, default=50, help="updates between validation losses"
    )
    run.add_argument(
        "--checkpoint-every", type=positive_int, default=50, help="updates between checkpoints"
    )
    run.add_argument("--keep", type=positive_int, default=2, help="checkpoints kept on disk")
    run.add_argument(
        "--max-skipped-updates",
        type=positive_int,
        default=10,
        metavar="N",
        help="stop when the optimizer has skipped N updates in a row because their gradients "
        "were not finite (fused_adamw skips such updates; under muon and adamw they make the "
        "weights non-finite, and every optimizer stops at the first non-finite loss)",
    )
    run.add_argument(
        "--profile",
        action="store_true",
        help="time the forward, backward and optimizer phases of one update after warm-up, "
        "print a table and exit (no training)",
    )
    run.add_argument("--trace", metavar="DIR", help="with --profile: write a jax.profiler trace")

    data = p.add_argument_group("data (run flags)")
    data.add_argument(
        "--data",
        help="a text file, a folder of text files, or .jsonl/.parquet with a 'text' column "
        "(default: the Python standard library's .py files)",
    )
    data.add_argument(
        "--data-dir",
        help="where the tokenized corpus is prepared and read (default: data/lm for the "
        "standard library, data/lm-<name> for --data <name>.<ext>)",
    )
    data.add_argument("--vocab-size", type=positive_int, default=8192, help="BPE vocabulary")
    data.add_argument("--seed", type=non_negative_int, default=0, help="init and data order")
    data.add_argument(
        "--eval-batches",
        type=positive_int,
        default=8,
        help="fixed validation batches of --batch-size rows, the validation loss's data",
    )

    model = p.add_argument_group("model (run flags)")
    model.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence")
    model.add_argument("--d-model", type=positive_int, default=256, help="residual width")
    model.add_argument("--n-layers", type=positive_int, default=4, help="transformer blocks")
    model.add_argument("--n-heads", type=positive_int, default=4, help="attention heads")
    model.add_argument(
        "--mlp-hidden", type=positive_int, help="MLP hidden width (default: ~8/3 d_model)"
    )
    model.add_argument("--moe", action="store_true", help="mixture-of-experts MLPs")
    model.add_argument("--num-experts", type=positive_int, default=4, help="experts with --moe")
    model.add_argument("--top-k", type=positive_int, default=2, help="experts per token (--moe)")
    model.add_argument(
        "--moe-aux-weight",
        type=non_negative_float,
        default=0.01,
        help="load-balancing loss coefficient (--moe)",
    )
    model.add_argument(
        "--param-dtype",
        choices=DTYPES,
        default="bfloat16",
        help="parameter storage dtype (the optimizer keeps fp32 master weights)",
    )
    model.add_argument(
        "--deterministic",
        action="store_true",
        help="bit-identical runs on a GPU: XLA's deterministic GPU ops, and the embedding's "
        "gradient summed by a sorted segment sum instead of scatter-add atomics",
    )
    model.add_argument(
        "--remat",
        choices=REMAT_POLICIES,
        default="none",
        help="activation checkpointing of each block (not a run flag: a resumed run may "
        "change it): none keeps every activation; full recomputes the block in the backward; "
        "dots_saveable / dots_with_no_batch_dims keep matmul outputs; offload keeps them in "
        "pinned host memory",
    )
    model.add_argument(
        "--scan-layers",
        action="store_true",
        help="store the layers stacked and run them as one lax.scan (one layer compiled, and "
        "remat effective on every backend); a run flag: its checkpoints hold them stacked",
    )
    model.add_argument(
        "--compute-dtype",
        choices=DTYPES,
        default="float32",
        help="activation and matmul dtype (float32 runs faster than bfloat16 on most CPUs)",
    )

    opt = p.add_argument_group("optimizer (run flags)")
    opt.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=_OPT.name,
        help="muon: Muon on the blocks' matrices, AdamW on the rest; adamw; fused_adamw",
    )
    opt.add_argument(
        "--lr",
        type=non_negative_float,
        default=_OPT.learning_rate,
        help="AdamW's peak learning rate (with muon: of the embedding, norms and experts; "
        "for adamw alone 1.5e-3 trains this model more smoothly)",
    )
    opt.add_argument(
        "--muon-lr",
        type=non_negative_float,
        default=_OPT.muon_learning_rate,
        help="Muon's peak lr (matrices)",
    )
    opt.add_argument(
        "--min-lr-ratio",
        type=_number(float, 0, high=1.0000001),
        default=_OPT.min_lr_ratio,
        help="final lr as a fraction of the peak (cosine decay)",
    )
    opt.add_argument(
        "--warmup", type=non_negative_int, default=_OPT.warmup_steps, help="linear warmup updates"
    )
    opt.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=_OPT.weight_decay,
        help="decoupled weight decay of the weight matrices (attention, MLP, MoE router and "
        "experts), with every optimizer; norm scales and the embedding (the tied head) are "
        "not decayed",
    )
    opt.add_argument("--beta1", type=unit_interval, default=_OPT.b1, help="Adam's b1")
    opt.add_argument("--beta2", type=unit_interval, default=_OPT.b2, help="Adam's b2")
    opt.add_argument("--eps", type=non_negative_float, default=_OPT.eps, help="Adam's eps")
    opt.add_argument(
        "--clip", type=positive_float, default=_OPT.max_grad_norm, help="global gradient norm"
    )

    batch = p.add_argument_group("batch, schedule and devices (run flags)")
    batch.add_argument(
        "--batch-size", type=positive_int, default=16, help="sequences per microbatch (global)"
    )
    batch.add_argument("--grad-accum", type=positive_int, default=1, help="microbatches per update")
    batch.add_argument("--steps", type=positive_int, default=_OPT.steps, help="optimizer updates")
    batch.add_argument(
        "--mesh",
        type=rr.mesh_flag,
        help="spread each step over devices, e.g. data=2,fsdp=4 (its size must be the device "
        "count; on CPU that many devices are simulated); default: one device",
    )
    # Set from an --init-from Hugging Face directory's config.json (examples/lm/hf_init.py).
    # What the checkpoints hold: runs of the trainer's earlier GPT (no such key) are refused.
    p.set_defaults(architecture=None, model=MODEL)
    return p


def run_config(args: TrainConfig) -> dict[str, Any]:
    """The run flags as a JSON-able dict, the config a run is stored and checked with."""
    return {key: getattr(args, key) for key in RUN_KEYS}


def check_session(args: TrainConfig) -> None:
    """The session flags' own cross-checks, before --resume reads the run's flags."""
    if args.resume and args.init_from:
        raise UsageError("--resume continues a run; --init-from starts a new one: pick one")
    if args.resume_step is not None and not args.resume:
        raise UsageError("--resume-step N picks the checkpoint of --resume: add --resume")
    if args.resume and not (args.run_dir or args.name):
        raise UsageError("--resume needs the run to continue: give --run-dir or --name")


def check(args: TrainConfig) -> None:
    """Cross-flag checks; UsageError names the flags and their values."""
    if args.warmup >= args.steps:
        raise UsageError(
            f"--warmup must be < --steps, got --warmup {args.warmup}, --steps {args.steps}"
        )
    if args.stop_at is not None and args.stop_at > args.steps:
        raise UsageError(
            f"--stop-at must be <= --steps, got --stop-at {args.stop_at}, --steps {args.steps}"
        )
    if args.trace and not args.profile:
        raise UsageError("--trace DIR writes the trace of --profile: add --profile")
    if args.moe and args.top_k > args.num_experts:
        raise UsageError(
            f"--top-k must be <= --num-experts, got --top-k {args.top_k}, "
            f"--num-experts {args.num_experts}"
        )
    mesh = args.mesh or {}
    devices = math.prod(mesh.values()) if mesh else 1
    if args.batch_size % devices:
        raise UsageError(
            f"--batch-size must be divisible by the mesh's {devices} devices (each holds an "
            f"equal slice), got --batch-size {args.batch_size}, --mesh {rs.mesh_text(mesh)}"
        )
    check_seq_len(args)


# Positions are int32 (a row's seq_len + 1 tokens index them).
MAX_SEQ_LEN = 2**31 - 2


def host_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_seq_len(args: TrainConfig) -> None:
    """--seq-len that no machine of this kind can run, refused before anything is built.

    Issue 39: --seq-len 1000000000 allocated 238 GiB before failing. Whatever the model, a
    step builds its RoPE table for the row's T positions on the host as it is traced
    (``rudax.layers.apply_rope``: float64 angles, their cosines and sines, then float32
    copies): at least the angles and their cosines at once, ``8 * head_dim`` bytes a
    position. A length whose table alone exceeds this machine's memory is refused.
    """
    if args.seq_len > MAX_SEQ_LEN:
        raise UsageError(
            f"--seq-len {args.seq_len}: positions are int32, so at most {MAX_SEQ_LEN:,}"
        )
    memory = host_memory_bytes()
    architecture = args.architecture or {}
    head_dim = architecture.get("head_dim") or args.d_model // args.n_heads
    if memory is None or not head_dim:
        return
    per_position = 8 * head_dim
    if args.seq_len * per_position > memory:
        gib = 2**30
        raise UsageError(
            f"--seq-len {args.seq_len}: the RoPE table of a row is built on the host, at least "
            f"8 x head_dim = {per_position} bytes a position (float64 angles and their "
            f"cosines, head_dim {head_dim}): {args.seq_len * per_position / gib:.1f} GiB, more "
            f"than this machine's {memory / gib:.1f} GiB; the table alone caps --seq-len at "
            f"{memory // per_position:,} here, and the activations far below that"
        )
