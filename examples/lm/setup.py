"""Before the model is built: the processes joined, the flags checked (a resumed run's with
this session's on top, an HF directory's shape taken), the run directory found, and the
corpus prepared and opened; a bad flag or corpus is refused before anything is written."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

import rudax.checkpoint as rc
import rudax.kernels as rk
import rudax.run as rr
import rudax.sharding as rs
from examples.lm import config as cfg
from examples.lm import hf_init
from examples.lm.corpus import CorpusError
from examples.lm.data import ShardError, TokenLoader
from examples.lm.prepare import PreparationConflict, open_split, prepare, read_prepared
from examples.lm.step import model_spec

UsageError = cfg.UsageError


class Run(NamedTuple):
    """What the configuration step decided: the flags (a resumed run's, or an HF
    directory's shape), where the run lives and what it starts from."""

    flags: cfg.TrainConfig
    run_dir: Path
    hf_dir: Path | None  # --init-from a Hugging Face directory
    init_from: Path | None  # --init-from a run's checkpoints
    run_config: dict[str, Any]  # what the checkpoints record
    stop: int  # the last update of this session
    multi: bool  # several processes


def configure(flags: cfg.TrainConfig, given: set[str]) -> Run:
    """The processes joined, the flags checked (a resumed run's with this session's on top),
    and every check that needs no data done: a bad flag is refused before anything is
    written or the corpus prepared."""
    # First, before anything starts a JAX backend (reading checkpoints does).
    try:
        multi = rr.initialize_from_flags(flags)
    except ValueError as e:
        raise UsageError(str(e)) from e

    cfg.check_session(flags)
    if multi and not (flags.run_dir or flags.name):
        # the default name is the time, which each process reads for itself
        raise UsageError("several processes write one run: give it a --name or --run-dir")
    run_dir = _run_dir(flags)
    _check_run_dir(flags, run_dir)  # now, not after the data is prepared
    if flags.resume:
        flags = _run_flags(flags, given, run_dir)  # the run's flags, this session's on top
    elif (run_dir / "checkpoints").exists():
        raise UsageError(
            f"{run_dir} already holds a run: continue it with --resume, or pick "
            "another --name/--run-dir"
        )
    # An HF directory decides the model's shape: before the flags are checked and recorded.
    hf_dir = Path(flags.init_from) if flags.init_from else None
    if hf_dir is not None and hf_init.is_hf_dir(hf_dir):
        flags = hf_init.take_architecture(flags, given, hf_dir)
    else:
        hf_dir = None
    cfg.check(flags)
    if flags.deterministic:
        _deterministic_xla()
    if flags.tensorboard:
        _check_tensorboard()  # now, not when the first metrics row is written
    run_config = cfg.run_config(flags)
    stop = flags.stop_at or flags.steps
    if flags.resume:
        saved = _committed_steps(run_dir / "checkpoints", "--resume")
        if flags.resume_step is not None and flags.resume_step not in saved:
            raise UsageError(
                f"--resume-step {flags.resume_step}: no checkpoint {flags.resume_step} in "
                f"{run_dir / 'checkpoints'}; saved: {saved}"
            )
        start = saved[-1] if flags.resume_step is None else flags.resume_step
        if start >= stop:
            raise UsageError(
                f"--resume: the run is at update {start} already; nothing to do up to update {stop}"
            )
    init_from = _checkpoint_root(flags.init_from) if flags.init_from and not hf_dir else None
    try:
        model_spec(flags)  # a shape error now, not after the corpus is prepared
    except (TypeError, ValueError) as e:
        raise UsageError(f"model: {e}") from e

    if multi and not flags.mesh:
        raise UsageError(
            "several processes train one model over a mesh of all their devices: give --mesh "
            "(e.g. data=2,fsdp=4 for 2 processes of 4 devices)"
        )
    if multi:  # every process has checked the run directory before any writes to it
        multihost_utils.sync_global_devices("examples.lm.train: checked")
    return Run(flags, run_dir, hf_dir, init_from, run_config, stop, multi)


class Data(NamedTuple):
    directory: Path
    vocab_size: int  # the tokenizer's
    train: TokenLoader  # batch i is a pure function of (seed, i)
    val_batches: list[np.ndarray]  # this process's rows of the fixed validation batches


def open_data(
    flags: cfg.TrainConfig, hf_dir: Path | None, *, multi: bool, process: int, processes: int
) -> Data:
    """The corpus prepared (once: tokenized into checked shards), its training split opened
    and this process's rows of the validation batches read; a preparation with other
    settings, a damaged shard or a bad corpus is a UsageError saying how to rebuild it."""
    primary = process == 0
    data_dir = Path(flags.data_dir or default_data_dir(flags.data))
    # The trainer has no --force: rebuilding a data folder that other runs read is
    # examples.lm.prepare's job, named here with the flags that do it.
    rebuild = shlex.join(
        ["python", "-m", "examples.lm.prepare"]
        + (["--data", flags.data] if flags.data else [])
        + ["--out", str(data_dir), "--vocab-size", str(flags.vocab_size), "--force"]
    )
    try:
        if multi:  # one process prepares, the others then find the preparation complete
            if primary:
                prepare(flags.data, data_dir, vocab_size=flags.vocab_size)
            multihost_utils.sync_global_devices("examples.lm.train: data prepared")
        prepare(flags.data, data_dir, vocab_size=flags.vocab_size, verbose=primary)
        vocab_size = read_prepared(data_dir)["vocab_size"]
        # Batch i is a pure function of (seed, i): resuming at update s needs nothing but s.
        # Each shard's checksum and largest id are checked here, once, not per batch.
        loader = lambda split: open_split(
            data_dir, split, seq_len=flags.seq_len, batch_size=flags.batch_size, seed=flags.seed
        )
        train_data = loader("train")
        val_batches = loader("val").eval_batches(
            flags.eval_batches, shard=process, num_shards=processes
        )
        if hf_dir is not None:
            hf_init.check_tokenizer(hf_dir, data_dir)
    except PreparationConflict as e:
        raise UsageError(
            f"data: --data-dir {data_dir} holds a preparation with other settings "
            f"({e.detail}): choose another --data-dir, or rebuild it with: {rebuild} "
            "(a run trained on the old preparation would then resume on other tokens)"
        ) from e
    except ShardError as e:
        raise UsageError(f"data: {e}; prepare it again with: {rebuild}") from e
    except (CorpusError, ValueError) as e:
        raise UsageError(f"data: {e}") from e
    return Data(data_dir, vocab_size, train_data, val_batches)


def _check_tensorboard() -> None:
    """--tensorboard: UsageError if tensorboardX does not import, before any work is done."""
    try:
        import tensorboardX  # noqa: F401  (only with the flag: it imports torch, if installed)
    except ImportError as e:
        raise UsageError(
            f"--tensorboard writes its event files with tensorboardX, which does not import "
            f"here ({e}): pip install tensorboardX (it is in rudax's examples extra), or "
            "drop --tensorboard"
        ) from e


def _run_dir(flags: cfg.TrainConfig) -> Path:
    if flags.run_dir:
        return Path(flags.run_dir)
    return Path(flags.runs_dir) / (flags.name or time.strftime("%Y%m%d-%H%M%S"))


def _check_run_dir(flags: cfg.TrainConfig, run_dir: Path) -> None:
    """UsageError if the run directory, or a folder it would be made in, is a file."""
    for path in (run_dir, *run_dir.parents):
        if path.is_dir():
            return
        if path.exists():
            flag = "--run-dir" if flags.run_dir else ("--name" if path == run_dir else "--runs-dir")
            given = {"--run-dir": flags.run_dir, "--name": flags.name, "--runs-dir": flags.runs_dir}
            raise UsageError(
                f"{flag} {given[flag]}: {path} is a file, not a directory; give another "
                f"{flag} or move the file"
            )


def _run_flags(flags: cfg.TrainConfig, given: set[str], run_dir: Path) -> cfg.TrainConfig:
    """--resume: the run flags come from the run; any given again must agree."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"--resume: {run_dir} holds no run (no config.json)") from None
    if saved.get("model") != cfg.MODEL:
        raise UsageError(
            f"--resume: {run_dir} was trained by an earlier examples.lm.train, whose GPT "
            "checkpoints this one (a rudax.models.LlamaForCausalLM) does not read: start a "
            "new run, or resume it with the rudax version that wrote it"
        )
    conflicts = [
        f"--{key.replace('_', '-')} {getattr(flags, key)!r} (the run has {saved[key]!r})"
        for key in cfg.RUN_KEYS
        if key in given and getattr(flags, key) != saved[key]
    ]
    if conflicts:
        raise UsageError("--resume: flags differ from the run's: " + "; ".join(conflicts))
    return dataclasses.replace(flags, **{key: saved[key] for key in cfg.RUN_KEYS})


def _deterministic_xla() -> None:
    """--deterministic: XLA's deterministic GPU ops, set before JAX starts a backend.

    In a process that started JAX already (a test calling ``main``) that is too late; there
    it is an error on a GPU, where the flags matter, and nothing on the CPU, whose XLA
    sums scatters in order anyway.
    """
    try:
        rk.enable_deterministic_gpu()
    except RuntimeError as e:
        flags = os.environ.get("XLA_FLAGS", "").split()
        if jax.default_backend() == "gpu" and not set(rk.DETERMINISTIC_XLA_FLAGS) <= set(flags):
            raise UsageError(f"--deterministic: {e}") from None


def default_data_dir(data: str | None) -> str:
    # One folder per source, so a run on another corpus never meets the stdlib's tokens.
    return "data/lm" if data is None else f"data/lm-{Path(data).stem}"


def make_mesh(spec: dict[str, int] | None) -> Mesh | None:
    """The mesh of ``--mesh`` (``rudax.sharding.make_mesh``: every process's devices, in
    process order, so process ``p``'s devices take rows ``[p * b, (p + 1) * b)`` of each
    batch, the rows it reads); None without one."""
    if not spec:
        return None
    try:
        return rs.make_mesh(spec)
    except ValueError as e:
        raise UsageError(f"--mesh {e}") from None


def _committed_steps(directory: Path, flag: str) -> list[int]:
    """The committed checkpoint steps in directory, oldest first; UsageError if none."""
    if not directory.is_dir():
        raise UsageError(f"{flag}: no checkpoint directory {directory}")
    checkpointer = rc.Checkpointer(directory, read_only=True)  # beside a writer if need be
    try:
        steps = checkpointer.all_steps()
    finally:
        checkpointer.close()
    if not steps:
        raise UsageError(f"{flag}: no checkpoint in {directory}")
    return steps


def _checkpoint_root(source: str) -> Path:
    """--init-from DIR: DIR's checkpoints/ if DIR is a run directory, else DIR itself."""
    root = Path(source)
    root = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    _committed_steps(root, "--init-from")
    return root
