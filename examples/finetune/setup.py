"""Before anything is written: the processes joined, the run directory found (a resumed run's
flags read back), every flag checked, the base and the data found (``hf/base`` exported from
the main job's run, the standard library set written, if not given), and the mesh built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
from jax.experimental import multihost_utils

import rudax.models as rm
import rudax.run as rr
import rudax.sharding as rs
from examples.finetune import instructions
from examples.finetune.config import DEFAULT_BASE, DEFAULT_BASE_RUN, DEFAULT_DATA, FinetuneConfig
from examples.policy.session import check_flags as check_shared_flags
from examples.policy.session import join_processes
from rudax.run import UsageError


class Run(NamedTuple):
    """What the configuration step decided: the flags (a resumed run's with this session's on
    top), where the run, the base and the data are, and the mesh."""

    config: FinetuneConfig
    run_dir: Path
    stop: int  # the last update of this session
    base_dir: Path
    train_path: Path
    val_path: Path | None
    too_long: str  # what --too-long means for this data: "error" or "drop"
    mesh: jax.sharding.Mesh | None
    multi: bool  # several processes


def configure(config: FinetuneConfig, given: set[str] | None) -> Run:
    """The processes joined and every flag checked against the disk (the run directory, the
    base, the data's paths) and the devices: a refusal comes before anything is written."""
    multi = join_processes(config)  # first, before anything starts a JAX backend
    run_dir = _run_dir(config)
    if config.resume:
        config = _run_flags(config, run_dir, given)  # the run's flags, this session's on top
    elif (run_dir / "config.json").exists():
        _check_finetune_run(run_dir)
        raise UsageError(f"{run_dir} already holds a run: continue it with --resume")
    _check_flags(config, run_dir)
    stop = config.steps if config.stop_at is None else min(config.stop_at, config.steps)
    base_dir = find_base(config.base)
    train_path, val_path, generated = find_data(config)
    too_long = config.too_long or ("drop" if generated else "error")
    if multi and not config.mesh:
        raise UsageError(
            "several processes tune one model over a mesh of all their devices: give --mesh "
            "(e.g. data=2,fsdp=4 for 2 processes of 4 devices)"
        )
    rr.retain_freed_memory()  # before JAX starts its CPU client: each step's scratch is reused
    try:
        mesh = None if not config.mesh else rs.make_mesh(config.mesh)
    except ValueError as e:
        raise UsageError(f"--mesh {e}") from e
    if multi:  # every process has checked the run directory before any writes to it
        multihost_utils.sync_global_devices("examples.finetune: checked")
    return Run(config, run_dir, stop, base_dir, train_path, val_path, too_long, mesh, multi)


def _run_dir(config: FinetuneConfig) -> Path:
    if config.run_dir:
        return Path(config.run_dir)
    return Path(config.runs_dir) / (config.name or time.strftime("finetune-%Y%m%d-%H%M%S"))


def adapter_dir(config: FinetuneConfig, run_dir: Path) -> Path:
    return Path(config.export) if config.export else run_dir / "adapter"


def _run_flags(config: FinetuneConfig, run_dir: Path, given: set[str] | None) -> FinetuneConfig:
    """--resume: the run's flags from its config.json; this session's flags on top."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"--resume: {run_dir} holds no run (no config.json)") from None
    _check_finetune_run(run_dir)
    if given is None:
        defaults = FinetuneConfig.defaults().as_dict()
        given = {k for k, v in config.as_dict().items() if v != defaults[k]}
    try:
        return config.resumed(saved, given)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_finetune_run(run_dir: Path) -> None:
    """A run directory of another program (``examples.lm.train``'s, which shares ``runs/``)
    is named as such: neither continued nor overwritten."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except ValueError:
        saved = None
    if not (isinstance(saved, dict) and {"targets", "rank", "base_sha256"} <= saved.keys()):
        raise UsageError(
            f"{run_dir} holds a run that is not a fine-tuning run (its config.json has no "
            "targets, rank or base digest: examples.lm.train's, say, which also writes to "
            "runs/): give this run another --name or --run-dir"
        )


def _check_flags(config: FinetuneConfig, run_dir: Path) -> None:
    """The shared flags (``examples.policy``'s checks; --base and --data have defaults
    here), then the fine-tuner's own."""
    check_shared_flags(config, required=())
    for name in ("seq_len", "eval_batches"):
        value = getattr(config, name)
        if not value > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if config.scan_layers and config.dropout:
        raise UsageError(
            f"--scan-layers needs --dropout 0, got --dropout {config.dropout}: a scan would draw "
            "the same dropout masks in every block"
        )
    if config.merged:
        merged = Path(config.merged)
        if merged.exists() and not merged.is_dir():
            raise UsageError(f"--merged {merged}: a file, not a directory")
        base = Path(config.base) if config.base is not None else DEFAULT_BASE
        if merged.resolve() == base.resolve():
            raise UsageError(f"--merged {merged} is the base itself, which is only read")
        if merged.resolve() == adapter_dir(config, run_dir).resolve():
            raise UsageError(f"--merged {merged} is the adapter's directory: write elsewhere")
        if (merged / "model.safetensors.index.json").exists():
            raise UsageError(f"--merged {merged} holds a sharded checkpoint: write elsewhere")
        if config.quantize != "none" and set(config.targets) != set(rm.PROJECTIONS):
            raise UsageError(
                f"--merged with --quantize {config.quantize} needs every projection adapted "
                f"(--targets {','.join(rm.PROJECTIONS)}): the others would stay 4-bit, "
                "which a Hugging Face checkpoint cannot hold"
            )
    if config.sample_tokens < 0:
        raise UsageError(f"--sample-tokens must be >= 0, got {config.sample_tokens}")


def find_base(base: str | None) -> Path:
    """--base, or hf/base, exported from runs/base (the main job's run) if it is not there."""
    if base is not None:
        path = Path(base)
        if not _is_hf_dir(path):
            raise UsageError(
                f"--base {path}: no config.json with a model_type, so not an HF checkpoint"
            )
        return path
    if _is_hf_dir(DEFAULT_BASE):
        return DEFAULT_BASE
    if not (DEFAULT_BASE_RUN / "checkpoints").is_dir():
        raise UsageError(
            f"no --base, and neither {DEFAULT_BASE} nor the run {DEFAULT_BASE_RUN} exists: run "
            "python -m examples.lm.train --name base first, or pass --base <HF dir>"
        )
    # The trainer's own command, run as a user would: its checkpoint format is its business.
    command = [sys.executable, "-m", "examples.lm.export", str(DEFAULT_BASE_RUN)]
    command.append(str(DEFAULT_BASE))
    print(f"exporting {DEFAULT_BASE_RUN} to {DEFAULT_BASE}: {' '.join(command[1:])}")
    # The directory holding examples/, wherever this process was started from.
    root = str(Path(__file__).resolve().parents[2])
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    if subprocess.run(command, check=False, env=env).returncode != 0:
        raise UsageError(
            f"exporting {DEFAULT_BASE_RUN} to {DEFAULT_BASE} failed (see above): pass --base "
            "<HF dir>, or export the run yourself"
        )
    return DEFAULT_BASE


def _is_hf_dir(path: Path) -> bool:
    """Whether path holds a Hugging Face model: a config.json with a ``model_type``."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config


def find_data(config: FinetuneConfig) -> tuple[Path, Path | None, bool]:
    """(train, val, generated): --data/--val-data, or the standard-library set, made once."""
    if config.data is not None:
        return Path(config.data), None if config.val_data is None else Path(config.val_data), False
    if not (DEFAULT_DATA / instructions.TRAIN).exists():
        counts = instructions.write(DEFAULT_DATA)
        print(
            f"{DEFAULT_DATA}: {counts['train']} training and {counts['val']} validation "
            "examples from the standard library's docstrings"
        )
    val = Path(config.val_data) if config.val_data else DEFAULT_DATA / instructions.VAL
    return DEFAULT_DATA / instructions.TRAIN, val, True
