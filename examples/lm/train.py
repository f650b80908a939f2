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
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from tqdm.auto import tqdm

import rudax.checkpoint as rc
import rudax.kernels as rk
import rudax.models as rm
import rudax.optim as ro
import rudax.run as rr
import rudax.sharding as rs
from examples.lm import config as cfg
from examples.lm import guard, hf_init
from examples.lm.corpus import CorpusError
from examples.lm.data import ShardError, TokenLoader
from examples.lm.prepare import PreparationConflict, open_split, prepare, read_prepared
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
    # --------------------------------------------------------------------------- config
    run = _configure(flags, given)  # every check that needs no data, before anything is written
    flags, run_dir, hf_dir, multi, stop = run.flags, run.run_dir, run.hf_dir, run.multi, run.stop

    # --------------------------------------------------------------------------- mesh
    # Before JAX starts its CPU client: each step's scratch is then reused, not faulted in.
    rr.retain_freed_memory()
    mesh = _mesh(flags.mesh)
    # Process 0 writes the run's files, logs and prints; every process reads its own rows of
    # each batch (rows [p * b, (p + 1) * b) of the global batch, b = batch_size / processes).
    primary, process, processes = jax.process_index() == 0, jax.process_index(), jax.process_count()
    say = print if primary else lambda *a, **k: None

    # --------------------------------------------------------------------------- data
    data = _open_data(flags, hf_dir, multi=multi, process=process, processes=processes)
    train_data, vocab_size, val_batches = data.train, data.vocab_size, data.val_batches
    put = lambda b: b if mesh is None else rs.put_batch(b, mesh, flags.batch_size)
    # the train state where the steps keep it: fresh zeros and restored arrays alike
    place = lambda tree: tree if mesh is None else rs.place(tree, mesh)

    # --------------------------------------------------------------------------- model
    spec = model_spec(flags, vocab_size)  # the tokenizer's vocabulary
    config = spec.config
    model, n_params = _model(spec, hf_dir, mesh, seed=flags.seed, say=say)
    # rngs: the model's RNG state (empty: no dropout); rest: what is neither (no buffers)
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    params, rngs, rest = place((params, rngs, rest))
    del model
    if run.init_from is not None:
        # Before the optimizer state is built from them: its fp32 masters start as copies of
        # these weights, and the first update writes the masters into the parameters.
        params = _init_from(run.init_from, params)

    # --------------------------------------------------------------------------- optimizer
    tx = make_optimizer(flags, mesh)
    lr_at = jax.jit(optimizer_spec(flags).schedule(flags.lr))  # the lr of update s is lr_at(s - 1)
    opt_state = place(jax.jit(tx.init)(params))
    acc = place(jax.jit(ro.GradientAccumulator.init, static_argnums=1)(params, jnp.float32))

    # --------------------------------------------------------------------------- step
    # --profile times each step repeatedly on the same inputs, which donation would delete.
    loss = functools.partial(rm.next_token_loss_sum, chunk=spec.loss_chunk)
    steps = rs.make_train_steps(graphdef, tx, loss, mesh=mesh, donate=not flags.profile)
    microbatch = lambda s, a: put(
        train_data.batch((s - 1) * flags.grad_accum + a, shard=process, num_shards=processes)
    )
    if flags.profile:
        table = profile(
            steps,
            (params, rngs, rest),
            opt_state,
            acc,
            [microbatch(1, a) for a in range(flags.grad_accum)],
            flops_per_token=rm.flops_per_token(config, spec.seq_len),
            trace_dir=flags.trace,
        )
        say(table + (f"\ntrace written to {flags.trace}" if flags.trace else ""))
        return {"profile": table}

    def evaluate() -> float:
        ce, n = 0.0, 0
        for b in val_batches:
            m = steps.evaluate(params, rngs, rest, put(b))
            ce, n = ce + float(m["ce_sum"]), n + int(m["tokens"])
        return ce / n

    # --------------------------------------------------------------------------- checkpoint
    if primary:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(flags.as_dict(), indent=1) + "\n")
    # No RNG key to keep: the model has no dropout and batch i is drawn from (seed, i), so
    # the update count is the whole data position; the schedule's is in the optimizer state.
    record = lambda step, tokens: rc.TrainingRecord.capture(
        model=params,
        optimizer=opt_state,
        accumulator=acc,
        state={"step": step, "tokens": tokens},
        config=run.run_config,
    )
    step, tokens = 0, 0
    if flags.resume:
        restored = _resume(run_dir, record(0, 0), flags.resume_step, keep=flags.keep, say=say)
        params, opt_state, acc = restored.model, restored.optimizer, restored.accumulator
        step, tokens = restored.state["step"], restored.state["tokens"]
        say(f"resumed {run_dir} at update {step} of {flags.steps}")
    checkpointer = rr.open_checkpoints(run_dir, keep=flags.keep)
    skips = guard.SkipWatch(flags.max_skipped_updates, jax.device_get(guard.num_skipped(opt_state)))

    # --------------------------------------------------------------------------- loop
    events = run_dir / "tensorboard" if flags.tensorboard and primary else None
    log = rr.MetricsLog(
        run_dir / "metrics.jsonl",
        resume_step=step if flags.resume else None,
        tensorboard=events,
        writer=primary,  # the run's one log, by process 0
    )
    tokens_per_update = flags.batch_size * flags.seq_len * flags.grad_accum
    where = f" over mesh {rs.mesh_text(flags.mesh)}" if mesh is not None else ""
    if processes > 1:
        where += f" of {processes} processes"
    say(
        f"training a {n_params:,}-parameter {config.model_type} model{where} on {data.directory}, "
        f"updates {step + 1} to {stop} of {flags.steps}, {tokens_per_update:,} tokens each"
    )
    if step == 0:
        log.write(kind="eval", step=0, val_loss=evaluate())
    bar = tqdm(total=stop, initial=step, unit="update", dynamic_ncols=True, disable=not primary)
    note = bar.write if primary else say  # a line above the bar
    last: dict[str, float | None] = {"loss": None, "val_loss": None, "tokens_per_s": None}
    clock, clock_tokens = None, tokens
    # Ctrl-C or a preemption's SIGTERM: the update in flight finishes, is saved, and the run
    # ends as --stop-at ends it (every process after the same update).
    with rr.Interruptions() as interrupt:
        try:
            while step < stop:
                step += 1
                window = []
                for a in range(flags.grad_accum):
                    acc, rngs, m = steps.micro(params, rngs, acc, rest, microbatch(step, a))
                    window.append(m)
                params, opt_state, acc, norm = steps.apply(params, opt_state, acc)
                tokens += tokens_per_update
                # One transfer per update, which waits for it (so the bar counts finished
                # updates): the loss, the gradient norm and the optimizer's skip count together.
                window, norm, skipped_so_far = jax.device_get(
                    (window, norm, guard.num_skipped(opt_state))
                )
                loss = sum(float(m["ce_sum"]) for m in window) / sum(
                    int(m["tokens"]) for m in window
                )
                rr.check_loss(loss, step=step, latest=checkpointer.latest_step)
                if skips.update(step, skipped_so_far):
                    note(
                        f"update {step}: skipped by the optimizer (its gradients were not finite); "
                        f"{skipped_so_far} skipped so far"
                    )
                if (
                    clock is None
                ):  # the session's first update compiled the steps: time from its end
                    clock, clock_tokens = time.perf_counter(), tokens
                elapsed = time.perf_counter() - clock
                rate = (tokens - clock_tokens) / elapsed if tokens > clock_tokens else None
                lr = float(lr_at(step - 1))
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
                    last["val_loss"] = evaluate()
                    log.write(kind="eval", step=step, val_loss=last["val_loss"])
                    note(
                        f"update {step}: train loss {loss:.4f}, val loss {last['val_loss']:.4f}, "
                        f"{_show(last['tokens_per_s'], ',.0f')} tokens/s"
                    )
                    paused = True
                halt = interrupt.stop_after(step)  # every update, on every process
                if step % flags.checkpoint_every == 0 or step == stop or halt:
                    # Never a checkpoint of NaN weights: it would push an intact one out of --keep.
                    rr.check_finite(params, step=step, latest=checkpointer.latest_step)
                    checkpointer.save(step, record(step, tokens))
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

    # --------------------------------------------------------------------------- report
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
        why = "--stop-at" if interrupt.signal_name is None else interrupt.signal_name
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
        "interrupted": interrupt.signal_name,
        **last,
        "compilations": compilations,
    }


# ------------------------------------------------------------------------------- helpers


class _Run(NamedTuple):
    """What the configuration step decided: the flags (a resumed run's, or an HF
    directory's shape), where the run lives and what it starts from."""

    flags: cfg.TrainConfig
    run_dir: Path
    hf_dir: Path | None  # --init-from a Hugging Face directory
    init_from: Path | None  # --init-from a run's checkpoints
    run_config: dict[str, Any]  # what the checkpoints record
    stop: int  # the last update of this session
    multi: bool  # several processes


def _configure(flags: cfg.TrainConfig, given: set[str]) -> _Run:
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
    return _Run(flags, run_dir, hf_dir, init_from, run_config, stop, multi)


class _Data(NamedTuple):
    directory: Path
    vocab_size: int  # the tokenizer's
    train: TokenLoader  # batch i is a pure function of (seed, i)
    val_batches: list[np.ndarray]  # this process's rows of the fixed validation batches


def _open_data(
    flags: cfg.TrainConfig, hf_dir: Path | None, *, multi: bool, process: int, processes: int
) -> _Data:
    """The corpus prepared (once: tokenized into checked shards), its training split opened
    and this process's rows of the validation batches read; a preparation with other
    settings, a damaged shard or a bad corpus is a UsageError saying how to rebuild it."""
    primary = process == 0
    data_dir = Path(flags.data_dir or _default_data_dir(flags.data))
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
    return _Data(data_dir, vocab_size, train_data, val_batches)


def _show(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


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


def _default_data_dir(data: str | None) -> str:
    # One folder per source, so a run on another corpus never meets the stdlib's tokens.
    return "data/lm" if data is None else f"data/lm-{Path(data).stem}"


def _mesh(spec: dict[str, int] | None) -> Mesh | None:
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


def _checkpoint_root(source: str) -> Path:
    """--init-from DIR: DIR's checkpoints/ if DIR is a run directory, else DIR itself."""
    root = Path(source)
    root = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    _committed_steps(root, "--init-from")
    return root


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
