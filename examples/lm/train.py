"""Train a small Llama from scratch with rudax, end to end: the README's main job.

    python -m examples.lm.train                          # a few minutes on a 2-core CPU
    python -m examples.lm.train --moe --steps 100        # a Mixtral: top-2 of 4 experts
    python -m examples.lm.train --mesh data=2,fsdp=4    # 8 devices, FSDP (Muon too)
    python -m examples.lm.train --name a --stop-at 100   # ... later:
    python -m examples.lm.train --name a --resume        # continues to --steps, bit for bit
    python -m examples.lm.train --name a --resume --resume-step 100  # from an earlier checkpoint
    python -m examples.lm.train --tensorboard            # then: tensorboard --logdir runs

With no flags it tokenizes the Python standard library's own sources into ``data/lm`` (once:
a BPE trained locally, nothing downloaded), trains a 4-layer ``rudax.models.LlamaForCausalLM``
(``LlamaConfig.tiny``) on them with bf16 weights, fp32 master weights, Muon on the layers'
matrices and AdamW on the rest, warmup + cosine and
global-norm clipping, evaluates the validation loss every ``--eval-every`` updates,
checkpoints every ``--checkpoint-every``, and leaves in ``runs/<timestamp>/``:
``config.json``, ``checkpoints/``, ``metrics.jsonl`` and ``loss.png``; with ``--tensorboard``
also ``tensorboard/``, metrics.jsonl's scalars as event files (``train/loss``, ``val/loss``,
``train/lr``, ...; written with tensorboardX, no TensorFlow). ``--help`` lists every flag.

A run never trains on, or saves, what is broken (``rudax.run``, ``examples/lm/guard.py``):
shards are checked against their recorded SHA-256 and the vocabulary when opened; the first
non-finite training loss stops the run, naming the update; a checkpoint of non-finite weights
is never written; and ``--max-skipped-updates`` updates in a row skipped by the optimizer stop
it too.

Everything rudax offers runs here: ``rudax.models`` (the model, ``ModelSpec``),
``rudax.optim`` (``fp32_master``, ``GradientAccumulator``, clipping, schedules, AdamW, Muon,
fused AdamW), ``rudax.sharding`` (FSDP over a mesh inside ``jax.shard_map``) and
``rudax.checkpoint`` (the whole state, restored exactly). The step itself is in
``examples/lm/step.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from tqdm.auto import tqdm

import rudax.checkpoint as rc
import rudax.models as rm
import rudax.optim as ro
import rudax.run as rr
import rudax.sharding as rs
from examples.lm import config as cfg
from examples.lm import guard, hf_init
from examples.lm.setup import Data, Run, configure, make_mesh, open_data
from examples.lm.step import make_optimizer, model_spec, optimizer_spec, shard
from examples.lm.timing import profile

UsageError = cfg.UsageError


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the trainer; bad flags end in argparse's ``error:`` line and exit code 2.

    A run that goes wrong (a non-finite loss or weights, too many skipped updates; see
    ``examples/lm/guard.py``) ends in an ``error:`` line naming the update and exit code 1,
    its checkpoints as they were before it. Ctrl-C or SIGTERM (a preemption) mid-run lets
    the update in flight finish and checkpoints it, prints the ``--resume`` line as
    ``--stop-at`` does, and exits with 128 + the signal's number (130, 143), as shells report
    a signal; a second Ctrl-C stops at once.

    Args:
      argv: the command line without the program name; None reads ``sys.argv``.

    Returns:
      A summary: ``run_dir``, ``metrics``, ``plot``, ``tensorboard`` (paths; the last None
      without ``--tensorboard``), ``step`` (the last update),
      ``loss``/``val_loss`` (the last train and validation losses), ``tokens_per_s``, and
      ``compilations`` (how often each jitted step compiled); with ``--profile``, only
      ``profile``, the table printed.
    """
    parser = cfg.build_parser()
    rr.add_distributed_flags(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    flags = cfg.TrainConfig.from_flags(parser.parse_args(argv))
    return rr.run_program(parser, lambda: train(flags, rr.given_flags(parser, argv)))


def train(flags: cfg.TrainConfig, given: set[str]) -> dict[str, Any]:
    """The run itself, top to bottom; see the module docstring."""
    run = configure(flags, given)  # every check that needs no data, before anything is written
    flags = run.flags
    # Before JAX starts its CPU client: each step's scratch is then reused, not faulted in.
    rr.retain_freed_memory()
    mesh = make_mesh(flags.mesh)
    # Process 0 writes the run's files, logs and prints; every process reads its own rows of
    # each batch (rows [p * b, (p + 1) * b) of the global batch, b = batch_size / processes).
    primary = jax.process_index() == 0
    say = print if primary else lambda *a, **k: None
    data = open_data(
        flags, run.hf_dir, multi=run.multi, process=jax.process_index(),
        processes=jax.process_count(),
    )  # fmt: skip
    spec = model_spec(flags, data.vocab_size)  # the tokenizer's vocabulary
    model, n_params = _model(spec, run.hf_dir, mesh, seed=flags.seed, say=say)
    trainer = _Trainer.build(run, spec, model, mesh, data)
    del model
    if flags.profile:
        return {"profile": _profile(trainer, spec, say)}

    if primary:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir / "config.json").write_text(json.dumps(flags.as_dict(), indent=1) + "\n")
    if flags.resume:
        trainer.restore(run.run_dir, say)
    checkpointer = rr.open_checkpoints(run.run_dir, keep=flags.keep)
    events = run.run_dir / "tensorboard" if flags.tensorboard and primary else None
    log = rr.MetricsLog(
        run.run_dir / "metrics.jsonl",
        resume_step=trainer.step if flags.resume else None,
        tensorboard=events,
        writer=primary,  # the run's one log, by process 0
    )
    where = f" over mesh {rs.mesh_text(flags.mesh)}" if mesh is not None else ""
    if jax.process_count() > 1:
        where += f" of {jax.process_count()} processes"
    say(
        f"training a {n_params:,}-parameter {spec.config.model_type} model{where} on "
        f"{data.directory}, updates {trainer.step + 1} to {run.stop} of {flags.steps}, "
        f"{trainer.tokens_per_update:,} tokens each"
    )
    last, interrupted = _loop(trainer, run, spec.config, checkpointer, log, say)
    return _report(trainer, run, spec, log, checkpointer, events, last, interrupted, say)


# ------------------------------------------------------------------------------- steps


@dataclasses.dataclass
class _Trainer:
    """The train state where the steps keep it (on the mesh, if any) and the jitted steps:
    the parameters, the model's RNG state (empty: no dropout) and the rest (no buffers), the
    optimizer state and the accumulator, at update ``step`` after ``tokens`` tokens."""

    flags: cfg.TrainConfig
    mesh: Mesh | None
    data: Data
    params: Any
    rngs: Any
    rest: Any
    opt_state: Any
    acc: Any
    steps: rs.TrainSteps
    lr_at: Callable[[int], jax.Array]  # the lr of update s is lr_at(s - 1)
    run_config: dict[str, Any]  # what the checkpoints record
    step: int = 0
    tokens: int = 0

    @classmethod
    def build(
        cls, run: Run, spec: rm.ModelSpec, model: rm.LlamaForCausalLM, mesh: Mesh | None,
        data: Data,
    ) -> _Trainer:  # fmt: skip
        """The state placed, ``--init-from``'s weights in, the optimizer's state and the
        steps built (``examples/lm/step.py``)."""
        flags = run.flags
        # the train state where the steps keep it: fresh zeros and restored arrays alike
        place = lambda tree: tree if mesh is None else rs.place(tree, mesh)
        graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        params, rngs, rest = place((params, rngs, rest))
        if run.init_from is not None:
            # Before the optimizer state is built from them: its fp32 masters start as copies
            # of these weights, and the first update writes the masters into the parameters.
            params = _init_from(run.init_from, params)
        tx = make_optimizer(flags, mesh)
        lr_at = jax.jit(optimizer_spec(flags).schedule(flags.lr))
        opt_state = place(jax.jit(tx.init)(params))
        acc = place(jax.jit(ro.GradientAccumulator.init, static_argnums=1)(params, jnp.float32))
        # --profile times each step repeatedly on the same inputs, which donation would delete.
        loss = functools.partial(rm.next_token_loss_sum, chunk=spec.loss_chunk)
        steps = rs.make_train_steps(graphdef, tx, loss, mesh=mesh, donate=not flags.profile)
        return cls(
            flags, mesh, data, params, rngs, rest, opt_state, acc, steps, lr_at, run.run_config
        )

    @property
    def tokens_per_update(self) -> int:
        return self.flags.batch_size * self.flags.seq_len * self.flags.grad_accum

    def put(self, batch: np.ndarray) -> Any:
        """This process's rows of a batch, placed on the mesh (as they are on one device)."""
        return batch if self.mesh is None else rs.put_batch(batch, self.mesh, self.flags.batch_size)

    def microbatch(self, step: int, a: int) -> Any:
        """Microbatch ``a`` of update ``step``: this process's rows, placed."""
        i = (step - 1) * self.flags.grad_accum + a
        return self.put(
            self.data.train.batch(i, shard=jax.process_index(), num_shards=jax.process_count())
        )

    def evaluate(self) -> float:
        """The validation loss per token over the fixed validation batches."""
        ce, n = 0.0, 0
        for b in self.data.val_batches:
            m = self.steps.evaluate(self.params, self.rngs, self.rest, self.put(b))
            ce, n = ce + float(m["ce_sum"]), n + int(m["tokens"])
        return ce / n

    def record(self, step: int, tokens: int) -> rc.TrainingRecord:
        """What a checkpoint holds. No RNG key to keep: the model has no dropout and batch i
        is drawn from (seed, i), so the update count is the whole data position; the
        schedule's is in the optimizer state."""
        return rc.TrainingRecord.capture(
            model=self.params,
            optimizer=self.opt_state,
            accumulator=self.acc,
            state={"step": step, "tokens": tokens},
            config=self.run_config,
        )

    def restore(self, run_dir: Path, say: Callable[[str], None]) -> None:
        """--resume: the state of the run's checkpoint (``--resume-step``'s, or the latest)."""
        flags = self.flags
        restored = _resume(run_dir, self.record(0, 0), flags.resume_step, keep=flags.keep, say=say)
        self.params, self.opt_state = restored.model, restored.optimizer
        self.acc = restored.accumulator
        self.step, self.tokens = restored.state["step"], restored.state["tokens"]
        say(f"resumed {run_dir} at update {self.step} of {flags.steps}")

    def update(self) -> tuple[list[dict[str, Any]], float, Any]:
        """Update ``step + 1``: ``(its microbatches' metrics, the gradient norm, the
        optimizer's count of skipped updates)``, fetched in one transfer, which waits for the
        update (so the bar counts finished updates)."""
        self.step += 1
        window = []
        for a in range(self.flags.grad_accum):
            self.acc, self.rngs, m = self.steps.micro(
                self.params, self.rngs, self.acc, self.rest, self.microbatch(self.step, a)
            )
            window.append(m)
        self.params, self.opt_state, self.acc, norm = self.steps.apply(
            self.params, self.opt_state, self.acc
        )
        self.tokens += self.tokens_per_update
        return jax.device_get((window, norm, guard.num_skipped(self.opt_state)))


def _profile(trainer: _Trainer, spec: rm.ModelSpec, say: Callable[[str], None]) -> str:
    """--profile: each step timed on update 1's microbatches; the table printed."""
    flags = trainer.flags
    table = profile(
        trainer.steps,
        (trainer.params, trainer.rngs, trainer.rest),
        trainer.opt_state,
        trainer.acc,
        [trainer.microbatch(1, a) for a in range(flags.grad_accum)],
        flops_per_token=rm.flops_per_token(spec.config, spec.seq_len),
        trace_dir=flags.trace,
    )
    say(table + (f"\ntrace written to {flags.trace}" if flags.trace else ""))
    return table


def _loop(
    trainer: _Trainer,
    run: Run,
    config: rm.LlamaConfig,
    checkpointer: rc.Checkpointer,
    log: rr.MetricsLog,
    say: Callable[..., None],
) -> tuple[dict[str, float | None], str | None]:
    """The updates up to ``run.stop``, logged, evaluated and checkpointed as the flags say:
    ``(the last loss, validation loss and tokens/s, the interrupting signal's name)``.

    Ctrl-C or a preemption's SIGTERM: the update in flight finishes, is saved, and the run
    ends as --stop-at ends it (every process after the same update)."""
    flags, stop, primary = trainer.flags, run.stop, jax.process_index() == 0
    skips = guard.SkipWatch(
        flags.max_skipped_updates, jax.device_get(guard.num_skipped(trainer.opt_state))
    )
    if trainer.step == 0:
        log.write(kind="eval", step=0, val_loss=trainer.evaluate())
    bar = tqdm(
        total=stop, initial=trainer.step, unit="update", dynamic_ncols=True, disable=not primary
    )
    note = bar.write if primary else say  # a line above the bar
    last: dict[str, float | None] = {"loss": None, "val_loss": None, "tokens_per_s": None}
    clock, clock_tokens = None, trainer.tokens
    with rr.Interruptions() as interrupt:
        try:
            while trainer.step < stop:
                window, norm, skipped_so_far = trainer.update()
                step, tokens = trainer.step, trainer.tokens
                loss = sum(float(m["ce_sum"]) for m in window) / sum(
                    int(m["tokens"]) for m in window
                )
                rr.check_loss(loss, step=step, latest=checkpointer.latest_step)
                if skips.update(step, skipped_so_far):
                    note(
                        f"update {step}: skipped by the optimizer (its gradients were not finite); "
                        f"{skipped_so_far} skipped so far"
                    )
                if clock is None:  # the first update compiled the steps: time from its end
                    clock, clock_tokens = time.perf_counter(), tokens
                elapsed = time.perf_counter() - clock
                rate = (tokens - clock_tokens) / elapsed if tokens > clock_tokens else None
                lr = float(trainer.lr_at(step - 1))
                last.update(loss=loss, tokens_per_s=rate or last["tokens_per_s"])
                bar.set_postfix(
                    loss=f"{loss:.3f}", lr=f"{lr:.1e}", tok_s=_show(rate, ",.0f"), refresh=False
                )
                bar.update(1)
                if step % flags.log_every == 0 or step == stop:
                    aux = [float(m["aux_loss"]) for m in window] if config.num_local_experts else []
                    log.write(
                        kind="train",
                        step=step,
                        loss=loss,
                        lr=lr,
                        grad_norm=float(norm),
                        tokens=tokens,
                        tokens_per_s=rate,
                        # fp32_master's count of skipped updates; a Mixtral's balancing loss
                        **({} if skipped_so_far is None else {"skipped": int(skipped_so_far)}),
                        **({"aux_loss": float(np.mean(aux))} if aux else {}),
                    )
                paused = False
                if step % flags.eval_every == 0 or step == flags.steps:
                    last["val_loss"] = trainer.evaluate()
                    log.write(kind="eval", step=step, val_loss=last["val_loss"])
                    note(
                        f"update {step}: train loss {loss:.4f}, val loss {last['val_loss']:.4f}, "
                        f"{_show(last['tokens_per_s'], ',.0f')} tokens/s"
                    )
                    paused = True
                halt = interrupt.stop_after(step)  # every update, on every process
                if step % flags.checkpoint_every == 0 or step == stop or halt:
                    # Never a checkpoint of NaN weights: it would push an intact one out of --keep.
                    rr.check_finite(trainer.params, step=step, latest=checkpointer.latest_step)
                    checkpointer.save(step, trainer.record(step, tokens))
                    paused = True
                if paused:  # evaluation and checkpoint time are not training throughput
                    clock, clock_tokens = time.perf_counter(), tokens
                if halt:
                    break
        except BaseException:  # a halt, an interrupt: what was logged reaches the disk
            log.close()
            raise
        finally:
            bar.close()
            checkpointer.close()
    return last, interrupt.signal_name


def _report(
    trainer: _Trainer,
    run: Run,
    spec: rm.ModelSpec,
    log: rr.MetricsLog,
    checkpointer: rc.Checkpointer,
    events: Path | None,
    last: dict[str, float | None],
    interrupted: str | None,
    say: Callable[..., None],
) -> dict[str, Any]:
    """The end of a session: the end row and the loss plot of a complete run, the resume
    line of a stopped one, and the summary ``main`` returns."""
    flags, step, tokens, run_dir = trainer.flags, trainer.step, trainer.tokens, run.run_dir
    config, steps, primary = spec.config, trainer.steps, jax.process_index() == 0
    if step == flags.steps:
        log.write(
            kind="end",
            step=step,
            loss=last["loss"],
            val_loss=last["val_loss"],
            tokens=tokens,
            tokens_per_s=last["tokens_per_s"],
        )
    log.close()
    plot = run_dir / "loss.png"
    if primary:
        title = f"{run_dir.name}: {config.num_hidden_layers}x{config.hidden_size} "
        title += f"{config.model_type}, {flags.optimizer}"
        rr.plot_losses(rr.read_metrics(log.path), plot, title=title)
    if step < flags.steps:
        why = "--stop-at" if interrupted is None else interrupted
        say(
            f"stopped at update {step} of {flags.steps} ({why}); continue with: "
            f"python -m examples.lm.train --resume --run-dir {run_dir}"
        )
    say(
        f"final train loss {_show(last['loss'])}, val loss {_show(last['val_loss'])}, "
        f"{_show(last['tokens_per_s'], ',.0f')} tokens/s"
    )
    say(f"metrics: {log.path}\nloss curve: {plot}\ncheckpoints: {checkpointer.directory}")
    if events is not None:
        say(f"tensorboard: {events} (view with: tensorboard --logdir {events})")
    compilations = {
        name: getattr(steps, name)._cache_size() for name in ("micro", "apply", "evaluate")
    }
    return {
        "run_dir": str(run_dir),
        "metrics": str(log.path),
        "plot": str(plot),
        "tensorboard": None if events is None else str(events),
        "step": step,
        "interrupted": interrupted,
        **last,
        "compilations": compilations,
    }


# ------------------------------------------------------------------------------- helpers


def _show(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def _resume(
    run_dir: Path,
    like: rc.TrainingRecord,
    step: int | None,
    *,
    keep: int,
    say: Callable[[str], None] = print,
) -> rc.TrainingRecord:
    """--resume: checkpoint ``step`` (None: the latest) of run_dir, restored into ``like``.

    A damaged checkpoint is a UsageError naming the intact ones, each tried by restoring it,
    and the --resume-step that picks one (``rudax.run.restore_latest``). Resuming from an
    earlier step moves the later ones into ``run_dir/superseded/``: this session saves those
    step numbers again, and nothing committed is deleted.
    """
    checkpointer = rr.open_checkpoints(run_dir, keep=keep)  # the lock: no other writer
    try:
        saved = checkpointer.all_steps()
        chosen = saved[-1] if step is None else step
        restored = rr.restore_latest(checkpointer, like, step=chosen, step_flag="--resume-step")
    finally:
        checkpointer.close()
    directory = run_dir / "checkpoints"
    later = [s for s in saved if s > chosen]
    if later and jax.process_count() > 1:
        # every process has restored `chosen` before process 0 moves the others away
        multihost_utils.sync_global_devices("examples.lm.train: restored")
    if later and jax.process_index() == 0:
        aside = run_dir / "superseded"
        aside.mkdir(exist_ok=True)
        for s in later:
            target = aside / str(s)
            if target.exists():  # superseded before, by an earlier --resume-step
                target = aside / f"{s}-{time.strftime('%Y%m%d-%H%M%S')}"
            (directory / str(s)).rename(target)
        say(f"--resume-step {chosen}: moved the later checkpoints {later} into {aside}")
    return restored


def _model(
    spec: rm.ModelSpec,
    hf_dir: Path | None,
    mesh: Mesh | None,
    *,
    seed: int,
    say: Callable[[str], None],
) -> tuple[rm.LlamaForCausalLM, int]:
    """The model, new from ``seed`` or read from a Hugging Face directory, in its FSDP form
    over a mesh with an ``fsdp`` axis; and its parameter count (a tied table once)."""
    fsdp = mesh is not None and "fsdp" in mesh.axis_names
    if hf_dir is None:
        model = spec.create(seed)
        n_params = _parameter_count(model)
        return (shard(model, mesh) if fsdp else model), n_params
    # Over an fsdp mesh each process reads only its devices' shards of the checkpoint.
    model = hf_init.load_model(hf_dir, spec, mesh=mesh if fsdp else None)
    say(f"initialized from the Hugging Face checkpoint {hf_dir}")
    return model, _parameter_count(model)


def _parameter_count(model: rm.LlamaForCausalLM) -> int:
    """The model's trainable parameters, a tied table once (sharded: their logical sizes)."""
    leaves = jax.tree.leaves(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, rs.ShardedParameter)
    )
    return sum(
        x.size * (x.local.shape[0] if x.stacked else 1)
        if isinstance(x, rs.ShardedParameter)
        else x.size
        for x in leaves
    )


def _init_from(root: Path, params: Any) -> Any:
    """The model weights of root's latest checkpoint, nothing else; root is only read."""
    checkpointer = rc.Checkpointer(root, read_only=True)  # the source is never written
    like = rc.TrainingRecord(model=params, optimizer=None, accumulator=None, state=None)
    try:
        # strict=False: read the model part only, whatever optimizer and config it ran with.
        restored = checkpointer.restore(like, strict=False)
        latest = checkpointer.latest_step()
    except ValueError as e:
        raise UsageError(f"--init-from: {e}") from e
    finally:
        checkpointer.close()
    print(f"initialized from the weights of {root} (update {latest})")
    return restored.model


if __name__ == "__main__":
    main()
