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

import dataclasses
import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
from examples.finetune import mesh as mesh_
from examples.finetune.config import (
    FinetuneConfig,
)
from examples.finetune.data import FinetuneData
from examples.finetune.setup import Run, adapter_dir, configure
from examples.finetune.template import DataError
from examples.policy.held import Held
from examples.policy.session import adapter_record
from rudax.run import UsageError


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the program; returns what it reports (for tests).

    Ctrl-C or SIGTERM (a preemption) mid-run lets the update in flight finish and
    checkpoints it, prints the ``--resume`` line as ``--stop-at`` does, and exits with 128 +
    the signal's number (130, 143); a second Ctrl-C stops at once.
    """
    return FinetuneConfig.main(finetune, argv)


def finetune(config: FinetuneConfig, given: set[str] | None = None) -> dict[str, Any]:
    """The run itself, top to bottom; see the module docstring. ``given``: the flags on the
    command line (None: those that differ from their defaults)."""
    run = configure(config, given)  # every check that needs no data, before anything is written
    config = run.config
    tokenizer, hf_config, train_data, val_data = _read_data(config, run)
    held = Held(config)  # how the base is held, and the adapters added to it
    model, trained, base_digest, legacy = _load_base(config, run, hf_config, held)
    # Over a mesh with fsdp, the model the step holds is sharded; `model`, if the base was
    # loaded whole (a legacy run), keeps the whole one for sampling and the adapter file.
    if run.mesh is not None and model is not None and "fsdp" in run.mesh.axis_names:
        trained = mesh_.shard(model, run.mesh)
    tuner = _Tuner.build(config, run.mesh, trained, val_data)
    identity = {
        **base_.identity(base_digest, legacy),
        "data_identity": _identity(train_data),
        "val_data_identity": None if val_data is None else _identity(val_data),
    }
    checkpointer, resumed = tuner.open_run(run, identity)

    # The model held whole samples on process 0 alone; one read onto the mesh samples over
    # it, every process taking part.
    sampler = trained if model is None else model
    sampling = bool(config.sample_tokens) and (tuner.primary or model is None)
    sample_data = train_data if val_data is None else val_data
    samples: dict[int, str] = {}
    if tuner.step == 0 and sampling:
        samples[0] = _sample(
            sampler, tokenizer, sample_data, config.sample_tokens, "before training"
        )
    # Resumed, the rows logged after the checkpoint go; restarted, every row (-1) does.
    log = rr.MetricsLog(
        run.run_dir / "metrics.jsonl",
        resume_step=tuner.step if resumed else -1 if config.resume else None,
        tensorboard=run.run_dir / "tensorboard" if config.tensorboard else None,
        writer=tuner.primary,  # the run's one log, by process 0
    )
    tuner.say(_start_line(run, tuner, held, trained, train_data))
    last, interrupted = _loop(tuner, run, train_data, checkpointer, log)
    if tuner.primary:  # the loss curve of every session, stopped or complete
        title = f"{run.run_dir.name}: LoRA r={config.rank} on {run.base_dir}"
        rr.plot_losses(rr.read_metrics(log.path), run.run_dir / "loss.png", title=title)

    result: dict[str, Any] = {
        "run_dir": str(run.run_dir),
        "step": tuner.step,
        "base_sha256": base_digest,
        "base_bytes": tuner.base_bytes,
        "base_device_bytes": tuner.base_device_bytes,
        "adapted": held.adapted,
        "samples": samples,
        **last,
        "peak_rss_bytes": _peak_rss_bytes(),
        "interrupted": interrupted,
    }
    if tuner.step < config.steps:
        why = "--stop-at" if interrupted is None else interrupted
        tuner.say(
            f"stopped at update {tuner.step} of {config.steps} ({why}); continue with: "
            f"python -m examples.finetune --resume --run-dir {run.run_dir}"
        )
        return result
    nnx.update(trained, tuner.adapters, tuner.rngs)
    if run.mesh is not None and model is not None:
        rm.gather_adapters_into(model, trained)  # the adapters whole, on every process
    if sampling:
        when = f"update {tuner.step}"
        samples[tuner.step] = _sample(sampler, tokenizer, sample_data, config.sample_tokens, when)
    sampler.eval()
    out = adapter_dir(config, run.run_dir)
    if tuner.primary:  # process 0 writes the adapter (and the merged model)
        _write_outputs(config, run, held, model, trained, out, log, last)
        result["peak_rss_bytes"] = _peak_rss_bytes()  # the merge's copy included
    return result | {"adapter": str(out), "model": sampler}


# ------------------------------------------------------------------------------- steps


@dataclasses.dataclass
class _Tuner:
    """The run's state and its jitted steps: the adapters, dropout RNG, optimizer state and
    accumulator (placed on the mesh, if any), the base they adapt, and update ``step``."""

    config: FinetuneConfig
    mesh: jax.sharding.Mesh | None
    graphdef: Any
    adapters: Any
    rngs: Any
    base: Any
    opt_state: Any
    acc: Any
    steps: rs.TrainSteps
    schedule: optax.Schedule
    val_batches: list[dict[str, np.ndarray]]
    base_bytes: int
    base_device_bytes: int  # what one device holds of the base: the whole, or 1/fsdp of it
    record_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    step: int = 0
    primary: bool = dataclasses.field(default_factory=lambda: jax.process_index() == 0)

    @classmethod
    def build(
        cls,
        config: FinetuneConfig,
        mesh: jax.sharding.Mesh | None,
        trained: rm.LlamaForCausalLM,
        val_data: FinetuneData | None,
    ) -> _Tuner:
        """Splits the model into adapters and the rest, and builds AdamW (weight decay 0,
        warmup + cosine, clipped) and the steps of ``causal_lm_loss_sum``."""
        trained.remat = config.remat  # read when the model is called: how it runs, not stores
        trained.eval()
        eval_def = nnx.graphdef(trained)  # dropout off
        trained.train()
        graphdef, adapters, rngs, base = nnx.split(trained, rl.LoRAParam, nnx.RngState, ...)
        schedule = ro.warmup_cosine_decay_schedule(
            0.0, config.lr, config.warmup, config.steps, end_value=config.lr * config.min_lr_ratio
        )
        tx = optax.chain(ro.clip_by_global_norm(config.clip), ro.adamw(schedule, weight_decay=0.0))
        if mesh is not None:
            adapters, rngs, base = rs.place((adapters, rngs, base), mesh)
        opt_state = tx.init(adapters)
        acc = ro.GradientAccumulator.init(adapters, jnp.float32)
        if mesh is not None:
            opt_state, acc = rs.place((opt_state, acc), mesh)
        steps = rs.make_train_steps(
            graphdef, tx, rm.causal_lm_loss_sum, mesh=mesh, eval_graphdef=eval_def
        )
        val_batches = [] if val_data is None else val_data.eval_batches()[: config.eval_batches]
        leaves = jax.tree.leaves(base)
        device_bytes = sum(
            x.addressable_shards[0].data.nbytes if isinstance(x, jax.Array) else x.nbytes
            for x in leaves
        )
        return cls(
            config, mesh, graphdef, adapters, rngs, base, opt_state, acc, steps, schedule,
            val_batches, sum(x.nbytes for x in leaves), device_bytes,
        )  # fmt: skip

    def say(self, *args: Any) -> None:
        """Prints on process 0 only: one run, one voice."""
        if self.primary:
            print(*args, flush=True)

    def _put(self, batch: dict[str, np.ndarray]) -> Any:
        """This process's rows of a batch, placed on the mesh (as they are on one device)."""
        if self.mesh is None:
            return batch
        return rs.put_batch(batch, self.mesh, self.config.batch_size)

    def open_run(self, run: Run, identity: dict[str, Any]) -> tuple[rc.Checkpointer, bool]:
        """Checks a resumed run's base and data, restores its latest checkpoint and writes
        config.json, the session's first write: ``(checkpointer, resumed)``."""
        config = self.config
        # Where the base and the data are is not the run's (a resumed run may find them
        # elsewhere, or take the default base): their identities stand for them.
        self.record_config = config.run_flags() | identity
        if config.resume:
            _check_identity(run.run_dir, identity)
        if self.primary:
            run.run_dir.mkdir(parents=True, exist_ok=True)
        if run.multi:
            multihost_utils.sync_global_devices("examples.finetune: run directory")
        checkpointer = rr.open_checkpoints(run.run_dir, keep=config.keep)
        resumed = config.resume and checkpointer.latest_step() is not None
        if config.resume and not resumed:
            self.say(f"--resume: {run.run_dir} has no checkpoint yet: starting from update 0")
        if resumed:
            try:
                restored = rr.restore_latest(checkpointer, self.record(0))
            except UsageError:
                checkpointer.close()
                raise
            self.adapters, self.rngs = restored.model["adapters"], restored.model["rngs"]
            self.opt_state, self.acc = restored.optimizer, restored.accumulator
            self.step = restored.state["step"]
            self.say(f"resumed {run.run_dir} at update {self.step} of {config.steps}")
        # Written once every check has passed: a refused --resume leaves the run as it was.
        saved = {**config.as_dict(), **identity, "base": str(run.base_dir)}
        if self.primary:
            (run.run_dir / "config.json").write_text(json.dumps(saved, indent=1) + "\n")
        return checkpointer, resumed

    def record(self, step: int) -> rc.TrainingRecord:
        """What a checkpoint of update ``step`` holds."""
        return adapter_record(self, step)

    def update(self, data: FinetuneData) -> tuple[float, int, int, float]:
        """Update ``step + 1`` over ``--grad-accum`` microbatches of ``data``: ``(loss,
        counted tokens, real tokens, gradient norm)``; real tokens are the batch's, padding
        left out, every process's rows counted."""
        config = self.config
        self.step += 1
        window, real = [], 0
        for a in range(config.grad_accum):
            # this process's rows of the batch (all of them on one process)
            i = (self.step - 1) * config.grad_accum + a
            rows = data.batch(i, shard=jax.process_index(), num_shards=jax.process_count())
            batch = self._put(rows)
            if self.mesh is None:
                real += int(np.count_nonzero(batch["segment_ids"]))
            else:
                real += int(_count_tokens(batch["segment_ids"]))
            self.acc, self.rngs, m = self.steps.micro(
                self.adapters, self.rngs, self.acc, self.base, batch
            )
            window.append(m)
        self.adapters, self.opt_state, self.acc, norm = self.steps.apply(
            self.adapters, self.opt_state, self.acc
        )
        window, norm = jax.device_get((window, norm))  # waits for the update
        counted = sum(int(m["tokens"]) for m in window)
        loss = sum(float(m["ce_sum"]) for m in window) / max(1, counted)
        return loss, counted, real, float(norm)

    def val_loss(self) -> float | None:
        """The validation loss per counted token, dropout off (None: no validation data)."""
        if not self.val_batches:
            return None
        ms = jax.device_get(
            [
                self.steps.evaluate(
                    self.adapters, self.rngs, self.base, self._put(rs.local_rows(b))
                )
                for b in self.val_batches
            ]
        )
        return sum(float(m["ce_sum"]) for m in ms) / max(1, sum(int(m["tokens"]) for m in ms))


def _start_line(
    run: Run,
    tuner: _Tuner,
    held: Held,
    trained: rm.LlamaForCausalLM,
    data: FinetuneData,
) -> str:
    """What the run holds and what this session does, in one line."""
    config = run.config
    n_adapters = sum(x.size for x in jax.tree.leaves(tuner.adapters))
    where = ""
    if run.mesh is not None:
        where = (
            f" over mesh {rs.mesh_text(config.mesh or {})} ({jax.process_count()} process(es); "
            f"{tuner.base_device_bytes:,} base bytes per device)"
        )
    return (
        f"{run.base_dir}: {base_.parameter_count(trained.config):,} base parameters in "
        f"{tuner.base_bytes:,} bytes ({'NF4' if held.quantized else config.param_dtype}); "
        f"LoRA r={config.rank} on {len(held.adapted)} layers: {n_adapters:,} trained. "
        f"{data.num_examples} examples ({data.path}), updates {tuner.step + 1} to {run.stop} "
        f"of {config.steps}{where}"
    )


def _loop(
    tuner: _Tuner,
    run: Run,
    data: FinetuneData,
    checkpointer: rc.Checkpointer,
    log: rr.MetricsLog,
) -> tuple[dict[str, float | None], str | None]:
    """The updates up to ``run.stop``, evaluated and checkpointed as the flags say:
    ``(the last loss, validation loss and tokens/s, the interrupting signal's name)``.

    Ctrl-C or a preemption's SIGTERM: the update in flight finishes, is saved, and the run
    ends as --stop-at ends it (every process after the same update)."""
    config = run.config
    if tuner.step == 0:
        log.write(kind="eval", step=0, val_loss=tuner.val_loss())
    bar = tqdm(
        total=run.stop, initial=tuner.step, unit="update", dynamic_ncols=True,
        disable=not tuner.primary,
    )  # fmt: skip
    last: dict[str, float | None] = {"loss": None, "val_loss": None, "tokens_per_s": None}
    clock, timed = None, 0
    with rr.Interruptions() as interrupt:
        try:
            while tuner.step < run.stop:
                loss, counted, real, norm = tuner.update(data)
                step = tuner.step
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
                    lr=float(tuner.schedule(step - 1)),
                    grad_norm=norm,
                    counted_tokens=counted,
                    tokens_per_s=rate,
                )
                paused = False
                if step % config.eval_every == 0 or step == config.steps:
                    last["val_loss"] = tuner.val_loss()
                    log.write(kind="eval", step=step, val_loss=last["val_loss"])
                    (bar.write if tuner.primary else tuner.say)(
                        f"update {step}: train loss {loss:.4f}, val loss {_show(last['val_loss'])}"
                    )
                    paused = True
                halt = interrupt.stop_after(step)  # every update, on every process
                if step % config.checkpoint_every == 0 or step == run.stop or halt:
                    rr.check_finite(tuner.adapters, step=step, latest=checkpointer.latest_step)
                    checkpointer.save(step, tuner.record(step))
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
    log.close()
    return last, interrupt.signal_name


def _write_outputs(
    config: FinetuneConfig,
    run: Run,
    held: Held,
    model: rm.LlamaForCausalLM | None,
    trained: rm.LlamaForCausalLM,
    out: Path,
    log: rr.MetricsLog,
    last: dict[str, float | None],
) -> None:
    """Process 0's end of a complete run: the PEFT adapter (with rudax_base.json), the
    merged model if ``--merged``, and the summary."""
    if model is None:  # read onto the mesh: the adapters gathered into a model of no weights
        saver = rm.gather_adapters(trained, held.add_adapters)
    else:
        saver = model
        model.scan_layers = False  # peft's files name each layer's adapters (converted in place)
    rl.save_adapter(saver, out, base_model_name_or_path=str(run.base_dir))
    held.write_beside(out)
    if config.merged:
        if model is None:  # the base whole, only now, with the trained adapters on
            _, merged = base_.load(
                run.base_dir, None, held.add_adapters, scan_layers=False, **held.load_kw
            )
            nnx.update(merged, nnx.state(saver, rl.LoRAParam))
        else:
            merged = nnx.clone(model)  # the returned model keeps its adapters
        rl.merge_lora(merged)
        rm.save_pretrained(merged, config.merged, tokenizer=run.base_dir)
        print(f"merged model: {config.merged} (a Hugging Face checkpoint)")
    print(
        f"final train loss {_show(last['loss'])}, val loss {_show(last['val_loss'])}, "
        f"{_show(last['tokens_per_s'], ',.0f')} tokens/s, host peak RSS "
        f"{_peak_rss_bytes() / 1e9:.2f} GB\nmetrics: {log.path}\nloss curve: "
        f"{run.run_dir / 'loss.png'}\nadapter: {out} "
        f"(peft.PeftModel.from_pretrained(<{run.base_dir}'s model>, it))"
    )


# ------------------------------------------------------------------------------- helpers


def _load_base(
    config: FinetuneConfig, run: Run, hf_config: dict[str, Any], held: Held
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
    config: FinetuneConfig, run: Run
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
    for name, data in (("--data", train_data), ("--val-data", val_data)):
        if data is not None and data.dropped and jax.process_index() == 0:
            print(
                f"{name} {data.path}: {len(data.dropped)} examples longer than --seq-len "
                f"{config.seq_len} left out (--too-long drop)"
            )
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
