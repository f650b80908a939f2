"""QLoRA (or LoRA) fine-tuning of a Hugging Face Llama directory on JSONL or plain text; a PEFT
adapter out (and, with ``--merged``, the tuned model).

    python -m examples.lm.train --name base              # the README's main job, then:
    python -m examples.finetune                          # QLoRA on it: a PEFT adapter out
    python -m examples.finetune --base <HF dir> --data train.jsonl --val-data val.jsonl
    python -m examples.finetune --base <HF dir> --data notes.txt --quantize none --merged out
    python -m examples.finetune --name qa --stop-at 20   # ... later, in a fresh process:
    python -m examples.finetune --name qa --resume       # continues bit for bit

With no ``--base`` it tunes ``hf/base``, exporting ``runs/base`` (the main job's run) there
first if need be; with no ``--data``, a prompt/completion set made from the standard
library's docstrings (``examples/finetune/instructions.py``, written once into
``data/instructions``). Nothing is downloaded.

The run, top to bottom:

- data: ``examples/finetune/data.py`` tokenizes the JSONL (or .txt) with the base's
  ``tokenizer.json``; only completion (assistant) tokens are labelled (every token of a
  text), the rest -100; rows packed (or padded)
  with segment ids, so examples in one row do not see each other. Batch ``i`` depends on the
  file, the seed and ``i`` only: the data position is the update count.
- model: ``rudax.models.from_pretrained`` reads the base tensor by tensor into a
  ``LlamaForCausalLM`` (module paths are Hugging Face's names), with ``--quantize nf4``
  quantizing each attention and MLP projection as it is read (``rudax.layers.NF4Linear``,
  its 8-bit absmax codes rounded as ``--absmax-rounding`` says);
  ``rudax.layers.apply_lora`` puts rank ``--rank`` adapters on ``--targets`` (fp32). Over a
  mesh with ``fsdp`` the base is read straight onto it, adapters included
  (``examples/finetune/base.py``). The base's identity is the SHA-256 of its config.json
  and of its safetensors files.
- samples: a greedy completion of the first validation prompt (``rudax.models.generate``)
  before the first update and after the last, ``--sample-tokens`` tokens at most.
- step: ``rudax.models.causal_lm_loss_sum`` (``rudax.kernels.linear_cross_entropy`` over the
  full vocabulary, a chunk of tokens at a time), gradients for the adapters only
  (``rudax.layers.LoRAParam``), accumulated over ``--grad-accum`` microbatches weighted by
  their counted tokens (``rudax.optim.GradientAccumulator``), then global-norm clipping and
  AdamW (weight decay 0) with warmup + cosine decay.
- checkpoint: every ``--checkpoint-every`` updates, the adapters, the dropout RNG, the
  optimizer (with the schedule's count) and the accumulator, with the run's configuration,
  the base's digest and the data's identity (``rudax.checkpoint``). ``--resume`` refuses
  another base or other data, and continues exactly.
- mesh: with ``--mesh data=D,fsdp=F`` the step runs over that many devices, of this process
  or of several (``rudax.run.initialize_distributed``'s flags, or ``python -m
  rudax.run.launch``): ``examples/finetune/mesh.py``. Process 0 writes the run's files.
- output: ``RUN/metrics.jsonl``, ``RUN/loss.png``, and ``--export`` (default ``RUN/adapter``):
  ``adapter_config.json`` + ``adapter_model.safetensors``, which
  ``peft.PeftModel.from_pretrained`` loads on transformers' model of the base, and
  ``rudax_base.json``, how the base was held (``--quantize``, ``--param-dtype``, ``--dtype``,
  ``--absmax-rounding``: ``examples.generate --adapter`` loads it so); with
  ``--merged DIR`` the model with its adapters folded in (``rudax.layers.merge_lora``) as a
  checkpoint folder (``rudax.models.save_pretrained``, the base's tokenizer copied).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

import rudax.checkpoint as rc
import rudax.layers as rl
import rudax.models as rm
import rudax.optim as ro
import rudax.run as rr
import rudax.sharding as rs
from examples.finetune import base as base_
from examples.finetune import instructions
from examples.finetune import mesh as mesh_
from examples.finetune.config import (
    DEFAULT_BASE,
    DEFAULT_BASE_RUN,
    DEFAULT_DATA,
    FinetuneConfig,
    build_parser,
)
from examples.finetune.data import FinetuneData
from examples.finetune.template import DataError
from examples.policy.held import Held
from examples.policy.session import check_flags
from rudax.run import UsageError


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the program; returns what it reports (for tests).

    Ctrl-C or SIGTERM (a preemption) mid-run lets the update in flight finish and
    checkpoints it, prints the ``--resume`` line as ``--stop-at`` does, and exits with 128 +
    the signal's number (130, 143); a second Ctrl-C stops at once.
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    config = FinetuneConfig.from_flags(parser.parse_args(argv))
    return rr.run_program(parser, lambda: finetune(config, rr.given_flags(parser, argv)))


def finetune(config: FinetuneConfig, given: set[str] | None = None) -> dict[str, Any]:
    """The run itself, top to bottom; see the module docstring. ``given``: the flags on the
    command line (None: those that differ from their defaults)."""
    # --------------------------------------------------------------------------- config
    run = _configure(config, given)  # every check that needs no data, before anything is written
    config, run_dir, base_dir, mesh, multi = (
        run.config,
        run.run_dir,
        run.base_dir,
        run.mesh,
        run.multi,
    )
    stop = run.stop
    # Process 0 writes the run's files, logs and prints.
    primary = jax.process_index() == 0
    say = print if primary else lambda *a, **k: None

    # --------------------------------------------------------------------------- data
    tokenizer, hf_config, train_data, val_data = _read_data(config, run)
    val_batches = [] if val_data is None else val_data.eval_batches()[: config.eval_batches]
    for name, data in (("--data", train_data), ("--val-data", val_data)):
        if data is not None and data.dropped:
            say(
                f"{name} {data.path}: {len(data.dropped)} examples longer than --seq-len "
                f"{config.seq_len} left out (--too-long drop)"
            )

    # --------------------------------------------------------------------------- model
    held = Held(config)  # how the base is held, and the adapters added to it
    model, trained, base_digest, legacy = _load_base(config, run, hf_config, held)
    n_base = base_.parameter_count(trained.config)
    # Over a mesh with fsdp, the model the step holds is sharded; `model`, if the base was
    # loaded whole (a legacy run), keeps the whole one for sampling and the adapter file.
    if mesh is not None and model is not None and "fsdp" in mesh.axis_names:
        trained = mesh_.shard(model, mesh)
    trained.remat = config.remat  # read when the model is called: how it runs, not what it stores
    trained.eval()
    eval_def = nnx.graphdef(trained)  # dropout off
    trained.train()
    graphdef, adapters, rngs, base = nnx.split(trained, rl.LoRAParam, nnx.RngState, ...)
    if mesh is not None:
        adapters, rngs, base = rs.place((adapters, rngs, base), mesh)
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(base))
    # what one device holds of it (the whole, or 1/fsdp of each weight plus padding)
    base_device_bytes = sum(
        x.addressable_shards[0].data.nbytes if isinstance(x, jax.Array) else x.nbytes
        for x in jax.tree.leaves(base)
    )
    n_adapters = sum(x.size for x in jax.tree.leaves(adapters))

    # --------------------------------------------------------------------------- optimizer
    schedule = ro.warmup_cosine_decay_schedule(
        0.0, config.lr, config.warmup, config.steps, end_value=config.lr * config.min_lr_ratio
    )
    tx = optax.chain(ro.clip_by_global_norm(config.clip), ro.adamw(schedule, weight_decay=0.0))
    opt_state = tx.init(adapters)
    acc = ro.GradientAccumulator.init(adapters, jnp.float32)
    if mesh is not None:
        opt_state, acc = rs.place((opt_state, acc), mesh)

    # --------------------------------------------------------------------------- step
    steps = rs.make_train_steps(
        graphdef, tx, rm.causal_lm_loss_sum, mesh=mesh, eval_graphdef=eval_def
    )
    if mesh is None:
        put: Any = lambda batch: batch
        real_tokens: Any = lambda batch: int(np.count_nonzero(batch["segment_ids"]))
    else:
        # this process's rows, placed; the count of real tokens over every process's rows
        put = lambda batch: rs.put_batch(batch, mesh, config.batch_size)
        real_tokens = lambda placed: int(_count_tokens(placed["segment_ids"]))

    def val_loss() -> float | None:
        if not val_batches:
            return None
        ms = jax.device_get(
            [steps.evaluate(adapters, rngs, base, put(rs.local_rows(b))) for b in val_batches]
        )
        return sum(float(m["ce_sum"]) for m in ms) / max(1, sum(int(m["tokens"]) for m in ms))

    # --------------------------------------------------------------------------- checkpoint
    identity = {
        **base_.identity(base_digest, legacy),
        "data_identity": _identity(train_data),
        "val_data_identity": None if val_data is None else _identity(val_data),
    }
    # Where the base and the data are is not the run's (a resumed run may find them elsewhere,
    # or take the default base): their identities stand for them in the checkpoint.
    run_config = config.run_flags() | identity
    if config.resume:
        _check_identity(run_dir, identity)
    if primary:
        run_dir.mkdir(parents=True, exist_ok=True)
    if multi:
        multihost_utils.sync_global_devices("examples.finetune: run directory")
    record = lambda step: rc.TrainingRecord.capture(
        model={"adapters": adapters, "rngs": rngs},
        optimizer=opt_state,
        accumulator=acc,
        state={"step": step},
        config=run_config,
    )
    step = 0
    checkpointer = rr.open_checkpoints(run_dir, keep=config.keep)
    resumed = config.resume and checkpointer.latest_step() is not None
    if config.resume and not resumed:
        say(f"--resume: {run_dir} has no checkpoint yet: starting from update 0")
    if resumed:
        try:
            restored = rr.restore_latest(checkpointer, record(0))
        except UsageError:
            checkpointer.close()
            raise
        adapters, rngs = restored.model["adapters"], restored.model["rngs"]
        opt_state, acc, step = restored.optimizer, restored.accumulator, restored.state["step"]
        say(f"resumed {run_dir} at update {step} of {config.steps}")
    # Written once every check has passed: a refused --resume leaves the run as it was.
    saved = {**config.as_dict(), **identity, "base": str(base_dir)}
    if primary:
        (run_dir / "config.json").write_text(json.dumps(saved, indent=1) + "\n")

    samples: dict[int, str] = {}
    sample_data = train_data if val_data is None else val_data
    # The model held whole samples on process 0 alone; one read onto the mesh samples over
    # it, every process taking part.
    sampler = trained if model is None else model
    sampling = config.sample_tokens and (primary or model is None)
    if step == 0 and sampling:
        samples[0] = _sample(
            sampler, tokenizer, sample_data, config.sample_tokens, "before training"
        )

    # --------------------------------------------------------------------------- loop
    # Resumed, the rows logged after the checkpoint go; restarted, every row (-1) does.
    log = rr.MetricsLog(
        run_dir / "metrics.jsonl",
        resume_step=step if resumed else -1 if config.resume else None,
        tensorboard=run_dir / "tensorboard" if config.tensorboard else None,
        writer=primary,  # the run's one log, by process 0
    )
    where = ""
    if mesh is not None:
        where = (
            f" over mesh {rs.mesh_text(config.mesh or {})} ({jax.process_count()} process(es); "
            f"{base_device_bytes:,} base bytes per device)"
        )
    say(
        f"{base_dir}: {n_base:,} base parameters in {base_bytes:,} bytes "
        f"({'NF4' if held.quantized else config.param_dtype}); LoRA r={config.rank} on "
        f"{len(held.adapted)} layers: {n_adapters:,} trained. {train_data.num_examples} examples "
        f"({train_data.path}), updates {step + 1} to {stop} of {config.steps}{where}"
    )
    if step == 0:
        log.write(kind="eval", step=0, val_loss=val_loss())
    bar = tqdm(total=stop, initial=step, unit="update", dynamic_ncols=True, disable=not primary)
    last: dict[str, float | None] = {"loss": None, "val_loss": None, "tokens_per_s": None}
    clock, timed = None, 0
    # Ctrl-C or a preemption's SIGTERM: the update in flight finishes, is saved, and the
    # run ends as --stop-at ends it (every process after the same update).
    with rr.Interruptions() as interrupt:
        try:
            while step < stop:
                step += 1
                window, real = [], 0
                for a in range(config.grad_accum):
                    # this process's rows of the batch (all of them on one process)
                    batch = put(
                        train_data.batch(
                            (step - 1) * config.grad_accum + a,
                            shard=jax.process_index(),
                            num_shards=jax.process_count(),
                        )
                    )
                    real += real_tokens(batch)  # tokens, not padding
                    acc, rngs, m = steps.micro(adapters, rngs, acc, base, batch)
                    window.append(m)
                adapters, opt_state, acc, norm = steps.apply(adapters, opt_state, acc)
                window, norm = jax.device_get((window, norm))  # waits for the update
                counted = sum(int(m["tokens"]) for m in window)
                loss = sum(float(m["ce_sum"]) for m in window) / max(1, counted)
                rr.check_loss(loss, step=step, latest=checkpointer.latest_step)
                if clock is None:  # the first update compiled the steps: time from its end
                    clock = time.perf_counter()
                else:
                    timed += real
                rate = timed / (time.perf_counter() - clock) if timed else None
                last.update(loss=loss, tokens_per_s=rate or last["tokens_per_s"])
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
                bar.update(1)
                log.write(
                    kind="train",
                    step=step,
                    loss=loss,
                    lr=float(schedule(step - 1)),
                    grad_norm=float(norm),
                    counted_tokens=counted,
                    tokens_per_s=rate,
                )
                paused = False
                if step % config.eval_every == 0 or step == config.steps:
                    last["val_loss"] = val_loss()
                    log.write(kind="eval", step=step, val_loss=last["val_loss"])
                    (bar.write if primary else say)(
                        f"update {step}: train loss {loss:.4f}, val loss {_show(last['val_loss'])}"
                    )
                    paused = True
                halt = interrupt.stop_after(step)  # every update, on every process
                if step % config.checkpoint_every == 0 or step == stop or halt:
                    rr.check_finite(adapters, step=step, latest=checkpointer.latest_step)
                    checkpointer.save(step, record(step))
                    paused = True
                if paused:  # evaluation and checkpoints are not training throughput
                    clock, timed = time.perf_counter(), 0
                if halt:
                    break
        except BaseException:
            log.close()
            raise
        finally:
            bar.close()
            checkpointer.close()

    # --------------------------------------------------------------------------- output
    log.close()
    plot = run_dir / "loss.png"
    if primary:
        title = f"{run_dir.name}: LoRA r={config.rank} on {base_dir}"
        rr.plot_losses(rr.read_metrics(log.path), plot, title=title)
    result: dict[str, Any] = {
        "run_dir": str(run_dir),
        "step": step,
        "base_sha256": base_digest,
        "base_bytes": base_bytes,
        "base_device_bytes": base_device_bytes,
        "adapted": held.adapted,
        "samples": samples,
        **last,
        "peak_rss_bytes": _peak_rss_bytes(),
        "interrupted": interrupt.signal_name,
    }
    if step < config.steps:
        why = "--stop-at" if interrupt.signal_name is None else interrupt.signal_name
        say(
            f"stopped at update {step} of {config.steps} ({why}); continue with: "
            f"python -m examples.finetune --resume --run-dir {run_dir}"
        )
        return result
    nnx.update(trained, adapters, rngs)
    if mesh is not None and model is not None:
        rm.gather_adapters_into(model, trained)  # the adapters whole, on every process
    if sampling:
        when = f"update {step}"
        samples[step] = _sample(sampler, tokenizer, sample_data, config.sample_tokens, when)
    if model is None:  # read onto the mesh: the adapters gathered into a model of no weights
        saver = rm.gather_adapters(trained, held.add_adapters)
    else:
        saver = model
        model.scan_layers = False  # peft's files name each layer's adapters (converted in place)
    sampler.eval()
    out = _adapter_dir(config, run_dir)
    if not primary:  # process 0 writes the adapter (and the merged model)
        return result | {"adapter": str(out), "model": sampler}
    rl.save_adapter(saver, out, base_model_name_or_path=str(base_dir))
    held.write_beside(out)
    if config.merged:
        if model is None:  # the base whole, only now, with the trained adapters on
            _, merged = base_.load(
                base_dir, None, held.add_adapters, scan_layers=False, **held.load_kw
            )
            nnx.update(merged, nnx.state(saver, rl.LoRAParam))
        else:
            merged = nnx.clone(model)  # the returned model keeps its adapters
        rl.merge_lora(merged)
        rm.save_pretrained(merged, config.merged, tokenizer=base_dir)
        print(f"merged model: {config.merged} (a Hugging Face checkpoint)")
    result["peak_rss_bytes"] = peak = _peak_rss_bytes()  # the merge's copy included
    print(
        f"final train loss {_show(last['loss'])}, val loss {_show(last['val_loss'])}, "
        f"{_show(last['tokens_per_s'], ',.0f')} tokens/s, host peak RSS {peak / 1e9:.2f} GB"
        f"\nmetrics: {log.path}\nloss curve: {plot}\nadapter: {out} "
        f"(peft.PeftModel.from_pretrained(<{base_dir}'s model>, it))"
    )
    return result | {"adapter": str(out), "model": sampler}


# ------------------------------------------------------------------------------- helpers


class _Run(NamedTuple):
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


def _configure(config: FinetuneConfig, given: set[str] | None) -> _Run:
    """The processes joined and every flag checked against the disk (the run directory, the
    base, the data's paths) and the devices: a refusal comes before anything is written."""
    # First, before anything starts a JAX backend.
    try:
        multi = rr.initialize_from_flags(config)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if multi and not (config.run_dir or config.name):
        # the default name is the time, which each process reads for itself
        raise UsageError("several processes write one run: give it a --name or --run-dir")

    run_dir = _run_dir(config)
    if config.resume:
        config = _run_flags(config, run_dir, given)  # the run's flags, this session's on top
    elif (run_dir / "config.json").exists():
        _check_finetune_run(run_dir)
        raise UsageError(f"{run_dir} already holds a run: continue it with --resume")
    _check_flags(config, run_dir)
    stop = config.steps if config.stop_at is None else min(config.stop_at, config.steps)
    base_dir = _base_dir(config.base)
    train_path, val_path, generated = _data_paths(config)
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
    return _Run(config, run_dir, stop, base_dir, train_path, val_path, too_long, mesh, multi)


def _load_base(
    config: FinetuneConfig, run: _Run, hf_config: dict[str, Any], held: Held
) -> tuple[rm.LlamaForCausalLM | None, rm.LlamaForCausalLM, str, bool]:
    """The base with its adapters: ``(model, trained, base_digest, legacy)``, ``trained``
    read onto the mesh (each process its shards) or whole; ``model`` the whole one when a
    run started before the files' digest needs the model's (``legacy``), else None."""
    # A run started before the files' digest checks the model's, which needs it whole.
    legacy = base_.legacy_run(run.run_dir, config.resume)
    digests: list[str] = []
    try:
        model, trained = base_.load(
            run.base_dir,
            None if legacy else run.mesh,
            held.add_adapters,
            loaded=(lambda m: digests.append(base_.model_digest(hf_config, m))) if legacy else None,
            scan_layers=config.scan_layers,
            **held.load_kw,
        )
    except ValueError as e:
        raise UsageError(f"--base {run.base_dir}: {e}") from e
    base_digest = digests[0] if legacy else rm.checkpoint_digest(run.base_dir)
    return model, trained, base_digest, legacy


def _read_data(
    config: FinetuneConfig, run: _Run
) -> tuple[rm.ModelTokenizer, dict[str, Any], FinetuneData, FinetuneData | None]:
    """The base's tokenizer and config.json, and the data read with it (``--data``, and
    ``--val-data`` if any); a bad file, line or length is a UsageError naming it."""
    try:
        tokenizer = rm.load_tokenizer(run.base_dir)
        hf_config = json.loads((run.base_dir / "config.json").read_text())
        limit = hf_config.get("max_position_embeddings")
        if limit is not None and config.seq_len > limit:
            raise UsageError(
                f"--seq-len {config.seq_len}: the base has {limit} positions "
                f"(max_position_embeddings in {run.base_dir / 'config.json'})"
            )
        read = lambda path, shuffle: FinetuneData(
            path,
            tokenizer,
            seq_len=config.seq_len,
            batch_size=config.batch_size,
            seed=config.seed,
            pack=config.pack,
            shuffle=shuffle,
            too_long=run.too_long,
            vocab_size=hf_config.get("vocab_size"),
        )
        train_data = read(run.train_path, True)
        val_data = None if run.val_path is None else read(run.val_path, False)
    except (DataError, ValueError) as e:
        raise UsageError(str(e)) from e
    return tokenizer, hf_config, train_data, val_data


@jax.jit
def _count_tokens(segment_ids: jax.Array) -> jax.Array:
    return jnp.count_nonzero(segment_ids)


def _sample(
    model: rm.LlamaForCausalLM, tokenizer: rm.ModelTokenizer, data: FinetuneData, n: int, when: str
) -> str:
    """Returns the model's greedy completion (dropout off) of data's first prompt; process 0
    prints it. A model held whole is called on process 0 alone; one sharded over the mesh by
    every process."""
    prompt = data.prompt(0).tolist()
    model.eval()
    # The data's eos and every eos id of the base's config.json (Llama 3 lists its turn's end).
    eos = model.config.eos_token_id
    listed = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    ids = rm.generate(model, [prompt], n, stop_tokens=sorted({tokenizer.eos_id, *listed}))[0]
    model.train()
    # Special tokens shown: a chat template's markers and the eos are what it learns to write.
    decode = lambda ids: tokenizer.tokenizer.decode(ids, skip_special_tokens=False)
    text = decode(ids)
    if jax.process_index() == 0:
        print(f"sample, {when}: {decode(prompt)!r} -> {text!r}")
    return text


def _peak_rss_bytes() -> int:
    """This process's peak resident memory on the host (not a device's): the most it has held
    in RAM since it started, the base's loading included. ``ru_maxrss`` is KiB on Linux and
    bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _show(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def _run_dir(config: FinetuneConfig) -> Path:
    if config.run_dir:
        return Path(config.run_dir)
    return Path(config.runs_dir) / (config.name or time.strftime("finetune-%Y%m%d-%H%M%S"))


def _adapter_dir(config: FinetuneConfig, run_dir: Path) -> Path:
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
    check_flags(config, required=())
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
        if merged.resolve() == _adapter_dir(config, run_dir).resolve():
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


def _base_dir(base: str | None) -> Path:
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


def _data_paths(config: FinetuneConfig) -> tuple[Path, Path | None, bool]:
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


def _identity(data: FinetuneData) -> dict[str, Any]:
    """What fixes the data's batches, the path left out (one file may be reached by two)."""
    return {k: v for k, v in data.identity().items() if k != "path"}


def _check_identity(run_dir: Path, identity: dict[str, Any]) -> None:
    """--resume on another base or other data is refused, naming what differs."""
    saved = json.loads((run_dir / "config.json").read_text())
    if saved.get("base_sha256") != identity["base_sha256"]:
        raise UsageError(
            f"--resume: the run was tuned on a base that hashes to "
            f"{saved.get('base_sha256')} ({saved.get('base')}); this base hashes to "
            f"{identity['base_sha256']}: a different model"
        )
    for key in ("data_identity", "val_data_identity"):
        if saved.get(key) != identity[key]:
            raise UsageError(
                f"--resume: the run's {key.removesuffix('_identity')} differs from this one's "
                f"({saved.get(key)} vs "
                f"{identity[key]}): the batches would not be the same"
            )
