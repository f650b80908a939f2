"""DPO of a LoRA / QLoRA policy: chosen/rejected pairs in, a PEFT adapter out.

    python -m examples.dpo --base <HF dir> --data pairs.jsonl --val-data held_out.jsonl
    python -m examples.dpo ... --name d --stop-at 20    # ... later, in a fresh process:
    python -m examples.dpo --name d --resume             # continues bit for bit

The run, top to bottom:

- session: ``examples.policy.Session.open``: processes, the run directory (``--resume``
  takes the run's flags), the mesh, the base's tokenizer.
- data: ``examples/dpo/data.py``: each JSONL line a pair (TRL's format, text or chat), a
  pair a row with its prompt once.
- policy: ``Session.load``: the base (NF4 with ``--quantize nf4``) with LoRA adapters, AdamW
  with warmup and cosine decay, global-norm clipping, checkpoints; the step is
  ``rudax.sharding.make_train_steps`` of ``rudax.post_train.dpo_loss_sum``: the policy's
  answer log-probs with the adapters on, the reference's with them off (no second copy of
  the base), TRL's ``loss_type`` with ``--beta``; the window's gradient is the mean over its
  pairs, however they fall into microbatches, devices and processes.
- loop: every update logs the loss and TRL's ``rewards/*`` (chosen, rejected, margins,
  accuracies, means over the pairs); every ``--eval-every`` the held-out pairs' (before the
  first update too); checkpoints every ``--checkpoint-every``, on ``--stop-at``, Ctrl-C or
  SIGTERM.
- output: ``RUN/metrics.jsonl``, ``RUN/loss.png``, ``RUN/margin.png``, and the adapter
  (``--export``, default ``RUN/adapter``), which peft loads on transformers' base.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import rudax.post_train as rp
from examples.dpo.config import DPOConfig
from examples.dpo.data import PreferenceData
from examples.policy.session import Session
from rudax.run import UsageError


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the program; returns what it reports (for tests). Exit statuses as
    ``rudax.run.run_program``'s: 2 a bad command line or data, 128 + a signal's number."""
    return DPOConfig.main(dpo, argv)


def dpo(config: DPOConfig, given: set[str] | None = None) -> dict[str, Any]:
    """The run itself, top to bottom; see the module docstring."""
    session = Session.open(config, given)
    config = session.config  # on --resume, the run's flags
    for flag in ("seq_len", "beta"):
        if not getattr(config, flag) > 0:
            raise UsageError(
                f"--{flag.replace('_', '-')} must be positive, got {getattr(config, flag)}"
            )
    if not 0 <= config.label_smoothing < 0.5:
        raise UsageError(f"--label-smoothing must be in [0, 0.5), got {config.label_smoothing}")

    # ----------------------------------------------------------------------------- data
    train, val, identity = session.read_data(
        lambda path: PreferenceData(
            path,
            session.tokenizer,
            seq_len=config.seq_len,
            positions=session.positions,
            too_long=config.too_long,
        )
    )
    for flag, data in (("--data", train), ("--val-data", val)):
        if data is not None and data.dropped:
            session.say(f"{flag} {data.path}: {data.dropped} pairs over --seq-len left out")
    val_batches = [] if val is None else val.eval_batches(config.batch_size)

    # ----------------------------------------------------------------------------- policy
    def loss(model: Any, batch: Any) -> Any:
        total, metrics = rp.dpo_loss_sum(
            model,
            batch,
            beta=config.beta,
            label_smoothing=config.label_smoothing,
            loss_type=config.loss_type,
        )
        return total, {**metrics, "loss": total}  # evaluate reports metrics only

    session.load(loss, identity)
    session.say(
        f"{len(train.pairs)} pairs ({train.path}), {config.batch_size * config.grad_accum} "
        f"per update; updates {session.step + 1} to {config.stop_at or config.steps} of "
        f"{config.steps}"
    )

    def evaluate(step: int) -> dict[str, float] | None:
        if not val_batches:
            return None
        means = _means(session.evaluate(val_batches), "val_")
        session.log.write(kind="eval", step=step, **means)
        session.say(
            f"update {step}: held-out loss {means['val_loss']:.4f}, margin "
            f"{means['val_margins']:.4f}, accuracy {means['val_accuracies']:.3f}"
        )
        return means

    # ----------------------------------------------------------------------------- loop
    last: dict[str, Any] = {"train": None, "eval": None}
    with session.running() as interrupt:
        if session.step == 0:
            last["eval"] = evaluate(0)
        stop = False
        while not stop and session.step < config.steps:
            step = session.step + 1
            batches = [
                train.batch((step - 1) * config.grad_accum + a, config.batch_size, config.seed)
                for a in range(config.grad_accum)
            ]
            metrics, norm = session.update(batches)
            last["train"] = means = _means(metrics)
            session.log_update(step, norm, means)
            if step % config.eval_every == 0 or step == config.steps:
                last["eval"] = evaluate(step) or last["eval"]
            stop = session.end_update(step, interrupt)

    # ----------------------------------------------------------------------------- output
    plots = {
        "loss.png": {"ylabel": f"DPO loss ({config.loss_type})"},
        "margin.png": {
            "train_key": "margins",
            "eval_key": "val_margins",
            "ylabel": "reward margin (chosen - rejected)",
        },
    }
    result = session.finish(interrupt, plots)
    return result | {"train": last["train"], "eval": last["eval"]}


def _means(metrics: dict[str, float], prefix: str = "") -> dict[str, float]:
    """TRL's logged means: each metric over the pairs (``pairs`` itself kept as a count)."""
    pairs = max(1.0, metrics["pairs"])
    out = {f"{prefix}pairs": float(int(metrics["pairs"]))}
    for key in ("loss", "chosen_rewards", "rejected_rewards", "margins", "accuracies"):
        out[prefix + key] = metrics[key] / pairs
    return out
