"""A policy run, in the order a program calls it (see the package docstring).

``Session.open`` does everything that can refuse the command line before the data is read:
no file is written until ``Session.load`` has loaded the base, checked a resumed run's base
and data, and restored its checkpoint. A refused start leaves the run directory as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

import rudax.checkpoint as rc
import rudax.layers as rl
import rudax.models as rm
import rudax.optim as ro
import rudax.run as rr
import rudax.sharding as rs
from examples.policy.config import PolicyConfig
from examples.policy.held import Held
from examples.policy.jsonl import DataError
from rudax.run import UsageError

Batch = dict[str, np.ndarray]


@dataclasses.dataclass
class Session:
    """One process's session of a policy run. Fields past ``hf_config`` are set by ``load``."""

    config: Any  # the program's PolicyConfig subclass
    run_dir: Path
    multi: bool
    mesh: Mesh | None
    primary: bool
    base_dir: Path
    tokenizer: rm.ModelTokenizer
    hf_config: dict[str, Any]
    step: int = 0
    resumed: bool = False
    trained: Any = None
    graphdef: Any = None
    adapters: Any = None
    rngs: Any = None
    base: Any = None
    opt_state: Any = None
    acc: Any = None
    schedule: Any = None
    steps: Any = None
    checkpointer: Any = None
    log: Any = None
    held: Any = None  # Held: how the base is held and its adapters
    record_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    # ----------------------------------------------------------------------------- open

    @classmethod
    def open(cls, config: PolicyConfig, given: set[str] | None) -> Session:
        """Joins the other processes, finds the run directory (on ``--resume``, the run's
        flags with this session's on top), checks the flags, builds the mesh and reads the
        base's tokenizer and config. Raises ``UsageError`` for anything the user must fix."""
        program = config.PROGRAM
        multi = join_processes(config)
        run_dir = (
            Path(config.run_dir)
            if config.run_dir
            else Path(config.runs_dir)
            / (config.name or time.strftime(f"{program.split('.')[-1]}-%Y%m%d-%H%M%S"))
        )
        if config.resume:
            config = _resumed(config, run_dir, given)
        elif (run_dir / "config.json").exists():
            _check_program(run_dir, program)
            raise UsageError(f"{run_dir} already holds a run: continue it with --resume")
        check_flags(config)
        if multi and not config.mesh:
            raise UsageError(
                "several processes train one policy over a mesh of all their devices: give "
                "--mesh (e.g. data=2,fsdp=4 for 2 processes of 4 devices)"
            )
        base_dir = Path(str(config.base))  # required: check_flags
        try:
            hf_config = json.loads((base_dir / "config.json").read_text())
        except (OSError, ValueError):
            hf_config = None
        if not (isinstance(hf_config, dict) and "model_type" in hf_config):
            raise UsageError(
                f"--base {base_dir}: no config.json with a model_type, so not a Hugging Face "
                "checkpoint"
            )
        rr.retain_freed_memory()  # before JAX starts its CPU client
        try:
            mesh = None if not config.mesh else rs.make_mesh(config.mesh)
        except ValueError as e:
            raise UsageError(f"--mesh {e}") from e
        if multi:  # every process has checked the run directory before any writes to it
            multihost_utils.sync_global_devices(f"{program}: checked")
        try:
            tokenizer = rm.load_tokenizer(base_dir)
        except ValueError as e:
            raise UsageError(f"--base {base_dir}: {e}") from e
        primary = jax.process_index() == 0
        return cls(config, run_dir, multi, mesh, primary, base_dir, tokenizer, hf_config)

    def say(self, *args: Any) -> None:
        """Prints on process 0 only: one run, one voice."""
        if self.primary:
            print(*args, flush=True)

    def read_data(self, read: Callable[[Path], Any]) -> tuple[Any, Any, dict[str, Any]]:
        """``(train, val, identity)``: ``read`` of ``--data`` and of ``--val-data`` (None if
        not given), a bad file a ``UsageError`` (its ``file:line``), and what fixes their
        batches (each one's ``identity()``), which a resumed run is checked against."""
        try:
            train = read(Path(self.config.data))
            val = None if self.config.val_data is None else read(Path(self.config.val_data))
        except (DataError, ValueError) as e:
            raise UsageError(str(e)) from e
        identity = {
            "data_identity": train.identity(),
            "val_data_identity": None if val is None else val.identity(),
        }
        return train, val, identity

    @property
    def positions(self) -> int | None:
        """The base's context length (max_position_embeddings), if its config says."""
        return self.hf_config.get("max_position_embeddings")

    # ----------------------------------------------------------------------------- load

    def load(self, loss: Callable[[Any, Any], Any], identity: dict[str, Any]) -> Session:
        """Loads the base with its adapters, builds the optimizer and the jitted steps of
        ``loss`` (``make_train_steps``'s), checks a resumed run's ``identity`` (the program's
        data digests), restores its latest checkpoint, and writes config.json: the first
        write of the session."""
        config = self.config
        held = self.held = Held(config)
        try:
            if self.mesh is not None and "fsdp" in self.mesh.axis_names:
                # read straight onto the mesh: no process holds the whole base
                trained = rm.from_pretrained(
                    self.base_dir, mesh=self.mesh, prepare=held.add_adapters, **held.load_kw
                )
            else:
                trained = rm.from_pretrained(self.base_dir, **held.load_kw)
                held.add_adapters(trained)
        except ValueError as e:
            raise UsageError(f"--base {self.base_dir}: {e}") from e
        trained.remat = config.remat
        trained.eval()
        eval_def = nnx.graphdef(trained)  # dropout off
        trained.train()
        self.trained = trained
        self.graphdef, self.adapters, self.rngs, self.base = nnx.split(
            trained, rl.LoRAParam, nnx.RngState, ...
        )
        self.schedule = ro.warmup_cosine_decay_schedule(
            0.0, config.lr, config.warmup, config.steps, end_value=config.lr * config.min_lr_ratio
        )
        tx = optax.chain(
            ro.clip_by_global_norm(config.clip), ro.adamw(self.schedule, weight_decay=0.0)
        )
        self.opt_state = tx.init(self.adapters)
        self.acc = ro.GradientAccumulator.init(self.adapters, jax.numpy.float32)
        if self.mesh is not None:
            self.adapters, self.rngs, self.base, self.opt_state, self.acc = rs.place(
                (self.adapters, self.rngs, self.base, self.opt_state, self.acc), self.mesh
            )
        self.steps = rs.make_train_steps(
            self.graphdef, tx, loss, mesh=self.mesh, eval_graphdef=eval_def
        )
        identity = {
            "program": config.PROGRAM,
            "base_sha256": rm.checkpoint_digest(self.base_dir),
            **identity,
        }
        if config.resume and (self.run_dir / "config.json").exists():
            _check_identity(self.run_dir, identity)
        self.record_config = config.run_flags() | identity
        if self.primary:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.multi:
            multihost_utils.sync_global_devices(f"{config.PROGRAM}: run directory")
        self.checkpointer = rr.open_checkpoints(self.run_dir, keep=config.keep)
        self.resumed = config.resume and self.checkpointer.latest_step() is not None
        if config.resume and not self.resumed:
            self.say(f"--resume: {self.run_dir} has no checkpoint yet: starting from update 0")
        if self.resumed:
            try:
                restored = rr.restore_latest(self.checkpointer, self._record(0))
            except UsageError:
                self.checkpointer.close()
                raise
            self.adapters = restored.model["adapters"]
            self.rngs = restored.model["rngs"]
            self.opt_state, self.acc = restored.optimizer, restored.accumulator
            self.step = restored.state["step"]
            if self.mesh is not None:  # restored unsharded: placed as the steps return them
                self.adapters, self.rngs, self.opt_state, self.acc = rs.place(
                    (self.adapters, self.rngs, self.opt_state, self.acc), self.mesh
                )
            self.say(f"resumed {self.run_dir} at update {self.step} of {config.steps}")
        # Written once every check has passed: a refused --resume leaves the run as it was.
        if self.primary:
            saved = {**config.as_dict(), **identity}
            (self.run_dir / "config.json").write_text(json.dumps(saved, indent=1) + "\n")
        # Resumed, the rows logged after the checkpoint go; restarted, every row (-1) does.
        self.log = rr.MetricsLog(
            self.run_dir / "metrics.jsonl",
            resume_step=self.step if self.resumed else -1 if config.resume else None,
            tensorboard=self.run_dir / "tensorboard" if config.tensorboard else None,
            writer=self.primary,
        )
        # the base's parameters from shapes alone (an NF4 weight counts its elements)
        shapes = nnx.eval_shape(lambda: rm.LlamaForCausalLM(trained.config, rngs=nnx.Rngs(0)))
        n_base = sum(x.size for x in jax.tree.leaves(nnx.state(shapes)))
        n_adapters = sum(x.size for x in jax.tree.leaves(self.adapters))
        where = "" if self.mesh is None else f" over mesh {rs.mesh_text(config.mesh)}"
        self.say(
            f"{self.base_dir}: {n_base:,} base parameters "
            f"({'NF4' if held.quantized else config.param_dtype}); LoRA r={config.rank} on "
            f"{len(held.adapted)} layers: {n_adapters:,} trained{where}"
        )
        return self

    def _record(self, step: int) -> rc.TrainingRecord:
        return adapter_record(self, step)

    # ----------------------------------------------------------------------------- steps

    def policy(self) -> rm.LlamaForCausalLM:
        """The policy as it is now (adapters on, dropout off), for sampling."""
        model = nnx.merge(self.graphdef, self.adapters, self.rngs, self.base)
        model.eval()
        return model

    def _put(self, batch: Batch) -> Any:
        """A whole batch (every process computes the same) as the steps take it: this
        process's rows, placed on the mesh."""
        if self.mesh is None:
            return batch
        rows = len(next(iter(batch.values())))
        return rs.put_batch(rs.local_rows(batch), self.mesh, rows)

    def update(self, microbatches: Sequence[Batch]) -> tuple[dict[str, float], float]:
        """One optimizer update over ``microbatches`` (whole batches); returns the window's
        metrics summed over it and the gradient's global norm before clipping."""
        window = []
        for batch in microbatches:
            self.acc, self.rngs, m = self.steps.micro(
                self.adapters, self.rngs, self.acc, self.base, self._put(batch)
            )
            window.append(m)
        self.adapters, self.opt_state, self.acc, norm = self.steps.apply(
            self.adapters, self.opt_state, self.acc
        )
        window, norm = jax.device_get((window, norm))  # waits for the update
        return _sum(window), float(norm)

    def evaluate(self, batches: Sequence[Batch]) -> dict[str, float]:
        """The loss's metrics summed over ``batches``, dropout off, nothing updated."""
        ms = [
            self.steps.evaluate(self.adapters, self.rngs, self.base, self._put(b)) for b in batches
        ]
        return _sum(jax.device_get(ms))

    def log_update(self, step: int, grad_norm: float, row: dict[str, float]) -> None:
        """Logs update ``step``'s ``row`` (its ``loss`` first checked finite: a run that
        diverged stops, naming the update) with the learning rate it used."""
        rr.check_loss(row["loss"], step=step, latest=self.checkpointer.latest_step)
        lr = float(self.schedule(step - 1))
        self.log.write(kind="train", step=step, lr=lr, grad_norm=grad_norm, **row)

    @contextlib.contextmanager
    def running(self) -> Iterator[rr.Interruptions]:
        """The loop's context: Ctrl-C and SIGTERM become a request ``end_update`` answers
        after the update in flight; a loop that raises closes the log and the checkpoints
        (the ones written stay)."""
        with rr.Interruptions() as interrupt:
            try:
                yield interrupt
            except BaseException:
                self.log.close()
                self.checkpointer.close()
                raise

    def end_update(self, step: int, interrupt: rr.Interruptions, *, boundary: bool = True) -> bool:
        """After update ``step``: checkpoints it if due (every ``--checkpoint-every``, the
        last, or an interruption's), and returns whether to stop here. ``boundary``: whether
        the run can stop and resume here (GRPO's updates within one generation cannot)."""
        config = self.config
        stop = config.steps if config.stop_at is None else min(config.stop_at, config.steps)
        halt = interrupt.stop_after(step) if boundary else False  # every process, each update
        if boundary and (step % config.checkpoint_every == 0 or step == stop or halt):
            rr.check_finite(self.adapters, step=step, latest=self.checkpointer.latest_step)
            self.checkpointer.save(step, self._record(step))  # raises if orbax does not save
        self.step = step
        return halt or step >= stop

    # ----------------------------------------------------------------------------- finish

    def finish(self, interrupt: rr.Interruptions, plots: dict[str, dict[str, str]]) -> dict:
        """Closes the log and the checkpoints, draws ``plots`` (file name -> plot_losses'
        keywords), and, if the run is complete, writes the peft adapter (process 0); else
        prints the resume line. Returns the summary's common part."""
        config = self.config
        self.log.close()
        self.checkpointer.close()
        if self.primary:
            rows = rr.read_metrics(self.log.path)
            for name, keys in plots.items():
                title = f"{self.run_dir.name}: LoRA r={config.rank} on {self.base_dir}"
                rr.plot_losses(rows, self.run_dir / name, title=title, **keys)
        result: dict[str, Any] = {
            "run_dir": str(self.run_dir),
            "step": self.step,
            "interrupted": interrupt.signal_name,
        }
        if self.step < config.steps:
            why = "--stop-at" if interrupt.signal_name is None else interrupt.signal_name
            self.say(
                f"stopped at update {self.step} of {config.steps} ({why}); continue with: "
                f"python -m {config.PROGRAM} --resume --run-dir {self.run_dir}"
            )
            return result
        nnx.update(self.trained, self.adapters, self.rngs)
        if self.mesh is not None and "fsdp" in self.mesh.axis_names:
            saver = rm.gather_adapters(self.trained, self.held.add_adapters)
        else:
            saver = self.trained
        out = Path(config.export) if config.export else self.run_dir / "adapter"
        if self.primary:
            rl.save_adapter(saver, out, base_model_name_or_path=str(self.base_dir))
            self.held.write_beside(out)
            self.say(f"metrics: {self.log.path}\nadapter: {out}")
        return result | {"adapter": str(out)}


# ------------------------------------------------------------------------------- helpers


def join_processes(config: PolicyConfig) -> bool:
    """Joins the other processes of a run launched on several (``--coordinator`` ...), first,
    before anything starts a JAX backend; whether there are several. Several processes write
    one run directory, which they must be told: the default name is the time, which each
    process reads for itself."""
    try:
        multi = rr.initialize_from_flags(config)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if multi and not (config.run_dir or config.name):
        raise UsageError("several processes write one run: give it a --name or --run-dir")
    return multi


def adapter_record(state: Any, step: int) -> rc.TrainingRecord:
    """What an adapter run's checkpoint of update ``step`` holds: ``state``'s adapters and
    dropout RNG, optimizer state and accumulator, and its ``record_config``."""
    return rc.TrainingRecord.capture(
        model={"adapters": state.adapters, "rngs": state.rngs},
        optimizer=state.opt_state,
        accumulator=state.acc,
        state={"step": step},
        config=state.record_config,
    )


def check_flags(config: PolicyConfig, required: Sequence[str] = ("base", "data")) -> None:
    """The flags every adapter program takes, checked before anything is read or written;
    ``required``: the places the program has no default for."""
    for flag in required:
        if getattr(config, flag) is None:
            raise UsageError(f"--{flag} is required")
    positive = ("steps", "batch_size", "grad_accum", "rank", "eval_every", "checkpoint_every")
    for name in (*positive, "keep", "alpha", "lr", "clip"):
        value = getattr(config, name)
        if not value > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not 0 <= config.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {config.dropout}")
    if not 0 <= config.min_lr_ratio <= 1:
        raise UsageError(f"--min-lr-ratio must be in [0, 1], got {config.min_lr_ratio}")
    if not 0 <= config.warmup < config.steps:
        raise UsageError(
            f"--warmup must be in [0, --steps), got --warmup {config.warmup}, "
            f"--steps {config.steps}"
        )
    if config.stop_at is not None and config.stop_at <= 0:
        raise UsageError(f"--stop-at must be positive, got {config.stop_at}")
    devices = math.prod(config.mesh.values()) if config.mesh else 1
    if config.batch_size % devices:  # each batch's rows are split over every axis of the mesh
        raise UsageError(
            f"--batch-size must be divisible by the mesh's {devices} devices (each holds an "
            f"equal slice), got --batch-size {config.batch_size}, "
            f"--mesh {rs.mesh_text(config.mesh or {})}"
        )
    for flag in ("data", "val_data"):
        path = getattr(config, flag)
        if path is not None and not Path(path).is_file():
            raise UsageError(f"--{flag.replace('_', '-')} {path}: no such file")


def _sum(window: Sequence[dict[str, Any]]) -> dict[str, float]:
    return {k: float(sum(float(m[k]) for m in window)) for k in window[0]}


def _check_program(run_dir: Path, program: str) -> None:
    """A run directory of another program (they share ``runs/``) is named as such."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except ValueError:
        saved = None
    theirs = saved.get("program") if isinstance(saved, dict) else None
    if theirs != program:
        what = f"a {theirs} run" if theirs else "a run of another program"
        raise UsageError(
            f"{run_dir} holds {what}, not a {program} run: give this run another --name or "
            "--run-dir"
        )


def _resumed(config: PolicyConfig, run_dir: Path, given: set[str] | None) -> Any:
    """--resume: the run's flags from its config.json; this session's flags on top."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"--resume: {run_dir} holds no run (no config.json)") from None
    _check_program(run_dir, config.PROGRAM)
    if given is None:
        defaults = config.defaults().as_dict()
        given = {k for k, v in config.as_dict().items() if v != defaults[k]}
    try:
        return config.resumed(saved, given)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_identity(run_dir: Path, identity: dict[str, Any]) -> None:
    """--resume on another base or other data is refused, naming what differs."""
    saved = json.loads((run_dir / "config.json").read_text())
    for key, value in identity.items():
        if saved.get(key) != value:
            raise UsageError(
                f"--resume: the run's {key} is {saved.get(key)!r}, this session's {value!r}: "
                "a different base or different data would not continue the same run"
            )
