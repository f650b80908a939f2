"""LoRA fine-tuning of a Hugging Face Llama directory on the prepared corpus; a PEFT adapter out.

    python -m examples.lm.train --name base                      # the README's main job
    python -m examples.lm.hf export runs/base hf/base            # its weights as a Llama
    python -m examples.lm.lora hf/base adapters/base-lora --steps 30
    python -m examples.lm.lora hf/base adapters/base-lora --steps 30 --merged hf/base-tuned

``examples.lm.hf.load_hf`` reads the directory (fp32 compute; the frozen base stored in
``--param-dtype``), ``rudax.layers.apply_lora`` puts rank ``--rank`` adapters on the layers
named by ``--targets`` (transformers' names, through ``hf_module_name``), and only those
adapters train (``nnx.split(model, rl.LoRAParam, ...)``): AdamW with linear warmup + cosine
decay and global-norm clipping, ``--grad-accum`` microbatches per update weighted by their
tokens (``rudax.optim.GradientAccumulator``). The data is the trainer's prepared corpus
(``--data``/``--data-dir`` as ``examples.lm.train`` takes them), whose ``tokenizer.json`` must
be the directory's. It prints the validation loss before and after and the tokens/s, and
writes ``OUT_DIR/adapter_config.json`` + ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained`` loads on transformers' model of ``HF_DIR``. ``--merged DIR``
also writes the model with the adapters folded in (``merge_lora``) as a plain HF checkpoint.
``HF_DIR`` is only read.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import rudax.layers as rl
import rudax.optim as ro
from examples.lm import config as cfg
from examples.lm import guard, hf_init, train
from examples.lm.corpus import CorpusError
from examples.lm.guard import TrainingHalted
from examples.lm.hf import INDEX, TOKENIZER, hf_module_name, load_hf, save_hf
from examples.lm.host_memory import retain_freed_memory
from examples.lm.model import loss_sum
from examples.lm.prepare import open_split, read_prepared
from examples.lm.step import make_schedule

UsageError = cfg.UsageError
TRAINER = cfg.build_parser()  # the trainer's flags: the same data, batches and seed


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; ``--help`` lists every flag with its default."""
    p = argparse.ArgumentParser(
        prog="python -m examples.lm.lora",
        description="LoRA fine-tuning of a Hugging Face Llama directory; a PEFT adapter out.",
        formatter_class=cfg._HelpFormatter,  # the trainer's: no "(default: None)"
        allow_abbrev=False,
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="the base: a Hugging Face Llama directory")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where the PEFT adapter is written")
    p.add_argument(
        "--merged", metavar="DIR", help="also write the merged model here, in --param-dtype"
    )
    _trainer_flag(p, "--data", "the trainer's --data: it picks the default --data-dir")
    _trainer_flag(p, "--data-dir", "the prepared corpus (default: the trainer's for --data)")
    for flag in ("--seed", "--eval-batches", "--batch-size", "--seq-len", "--grad-accum"):
        _trainer_flag(p, flag)
    p.add_argument("--param-dtype", choices=cfg.DTYPES, default="float32", help="frozen base")
    p.add_argument(
        "--targets",
        type=_names,
        default="q_proj,v_proj",
        help="comma-separated module names, as peft's target_modules (q_proj, k_proj, v_proj, "
        "o_proj, gate_proj, up_proj, down_proj)",
    )
    p.add_argument("--rank", type=cfg.positive_int, default=8, help="LoRA rank r")
    p.add_argument("--alpha", type=cfg.positive_float, default=16.0, help="scale = alpha / r")
    p.add_argument("--dropout", type=cfg.unit_interval, default=0.0, help="on the adapters' input")
    p.add_argument("--lr", type=cfg.positive_float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup", type=cfg.non_negative_int, default=5, help="linear warmup updates")
    p.add_argument("--min-lr-ratio", type=cfg.unit_interval, default=0.1, help="final lr / peak")
    _trainer_flag(p, "--clip")
    p.add_argument("--steps", type=cfg.positive_int, default=100, help="optimizer updates")
    return p


def _trainer_flag(p: argparse.ArgumentParser, flag: str, help: str | None = None) -> None:
    """Adds ``flag`` with examples.lm.train's type, default and (unless given) help."""
    (action,) = [a for a in TRAINER._actions if flag in a.option_strings]
    p.add_argument(flag, type=action.type or str, default=action.default, help=help or action.help)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the fine-tuning; bad flags or directories end in argparse's ``error:`` line (exit 2).

    Returns:
      ``val_loss_before``, ``val_loss_after``, ``tokens_per_s``, ``adapted`` (the adapted
      layers' names), ``out_dir``, ``merged`` (None without ``--merged``) and ``model``: the
      trained GPT with its LoRA layers, in eval mode.
    """
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        with jax.numpy_dtype_promotion("strict"):
            return finetune(args)
    except UsageError as e:
        parser.error(str(e))
    except TrainingHalted as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def finetune(args: argparse.Namespace) -> dict[str, Any]:
    """The run itself, top to bottom; see the module docstring."""
    # --------------------------------------------------------------------------- config
    hf_dir, out_dir = Path(args.hf_dir), Path(args.out_dir)
    merged_dir = Path(args.merged) if args.merged else None
    if args.warmup >= args.steps:
        raise UsageError(f"--warmup must be < --steps, got {args.warmup=}, {args.steps=}")
    if not hf_init.is_hf_dir(hf_dir):
        raise UsageError(
            f"HF_DIR {hf_dir}: no config.json with a model_type, so not a Hugging Face "
            "checkpoint (python -m examples.lm.hf export RUN OUT writes one)"
        )
    # Checked now, not after training: and an adapter (or a merged copy) written into the
    # base's directory would be loaded on top of it by transformers' from_pretrained.
    outputs = {"OUT_DIR": out_dir} | ({"--merged": merged_dir} if merged_dir else {})
    for flag, path in outputs.items():
        if path.exists() and not path.is_dir():
            raise UsageError(f"{flag} {path}: a file, not a directory")
        if path.resolve() == hf_dir.resolve():
            raise UsageError(f"{flag} {path} is HF_DIR itself, which is only read: write elsewhere")
    if merged_dir is not None and merged_dir.resolve() == out_dir.resolve():
        raise UsageError(f"--merged {merged_dir} is OUT_DIR: the adapter would apply twice")
    if merged_dir is not None and (merged_dir / INDEX).exists():
        raise UsageError(
            f"--merged {merged_dir} holds a sharded checkpoint ({INDEX}): write elsewhere"
        )

    # Before JAX starts its CPU client, as the trainer does: each step's scratch is reused.
    retain_freed_memory()

    # --------------------------------------------------------------------------- data
    data_dir = Path(args.data_dir or train._default_data_dir(args.data))
    try:  # no prepare(): a new BPE could never be the checkpoint's tokenizer
        meta = read_prepared(data_dir)
        load = lambda split: open_split(
            data_dir, split, seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed
        )
        train_data, val_batches = load("train"), load("val").eval_batches(args.eval_batches)
    except (CorpusError, ValueError) as e:
        raise UsageError(f"--data-dir {data_dir}: {e}") from e
    hf_init.check_tokenizer(hf_dir, data_dir, flag="HF_DIR")

    # --------------------------------------------------------------------------- model
    try:
        model = load_hf(hf_dir, param_dtype=jnp.dtype(args.param_dtype), dtype=jnp.float32)
    except ValueError as e:
        raise UsageError(f"HF_DIR {hf_dir}: {e}") from e
    c = model.config
    if meta["vocab_size"] > c.vocab_size:
        raise UsageError(
            f"HF_DIR {hf_dir}: vocab_size {c.vocab_size} in its config.json, but the data's "
            f"tokenizer has {meta['vocab_size']} ids"
        )
    if args.seq_len > c.seq_len:
        raise UsageError(
            f"--seq-len {args.seq_len}: the model has {c.seq_len} positions "
            "(max_position_embeddings in its config.json)"
        )
    try:
        adapted = rl.apply_lora(
            model,
            args.targets,
            rank=args.rank,
            alpha=args.alpha,
            dropout=args.dropout,
            names=hf_module_name,
            rngs=nnx.Rngs(args.seed),
        )
    except (TypeError, ValueError) as e:  # no match; a match that is not a Linear
        raise UsageError(f"--targets {','.join(args.targets)}: {e}") from e
    # Dropout draws its masks from RNG state that each step advances and returns.
    model.eval()
    eval_def = nnx.graphdef(model)
    model.train()
    graphdef, adapters, rngs, base = nnx.split(model, rl.LoRAParam, nnx.RngState, ...)
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
    print(
        f"{hf_dir}: a {c.n_layers}x{c.d_model} Llama, {count(base):,} frozen parameters "
        f"({args.param_dtype}); LoRA r={args.rank} alpha={args.alpha:g} on {len(adapted)} "
        f"layers ({','.join(args.targets)}): {count(adapters):,} trained"
    )

    # --------------------------------------------------------------------------- step
    # Weight decay 0: the adapters' origin is the base itself (HF Trainer's default too).
    tx = optax.chain(
        ro.clip_by_global_norm(args.clip), ro.adamw(make_schedule(args, args.lr), weight_decay=0.0)
    )
    opt_state = tx.init(adapters)
    acc = ro.GradientAccumulator.init(adapters, jnp.float32)

    # nnx's grad, not jax's: dropout advances its RNG counters inside the differentiated call.
    grad = nnx.value_and_grad(loss_sum, argnums=nnx.DiffState(0, rl.LoRAParam), has_aux=True)

    @jax.jit
    def micro(adapters, rngs, acc, base, batch):
        model = nnx.merge(graphdef, adapters, rngs, base)
        (_, metrics), grads = grad(model, batch)
        return acc.add(grads, weight=metrics["tokens"]), nnx.state(model, nnx.RngState), metrics

    @jax.jit
    def apply(adapters, opt_state, acc):
        grads, acc = acc.pop(normalize=True)  # the mean over the window's tokens
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, acc

    @jax.jit
    def evaluate(adapters, rngs, base, batch):  # dropout off
        return loss_sum(nnx.merge(eval_def, adapters, rngs, base), batch)[1]

    def val_loss() -> float:
        ms = [evaluate(adapters, rngs, base, b) for b in val_batches]
        return sum(float(m["ce_sum"]) for m in ms) / sum(int(m["tokens"]) for m in ms)

    # --------------------------------------------------------------------------- loop
    before = val_loss()
    print(f"validation loss before: {before:.4f} ({args.eval_batches} batches, {data_dir})")
    every = max(1, args.steps // 10)
    start, timed = None, 0
    for step in range(1, args.steps + 1):
        window = []
        for a in range(args.grad_accum):
            batch = train_data.batch((step - 1) * args.grad_accum + a)
            acc, rngs, m = micro(adapters, rngs, acc, base, batch)
            window.append(m)
        adapters, opt_state, acc = apply(adapters, opt_state, acc)
        window = jax.device_get(window)  # waits for the update
        tokens = sum(int(m["tokens"]) for m in window)
        loss = sum(float(m["ce_sum"]) for m in window) / tokens
        guard.check_loss(loss, step=step, latest=lambda: None)  # nothing is saved yet
        if start is None:  # the first update compiled the steps: time from its end
            start = time.perf_counter()
        else:
            timed += tokens
        if step % every == 0 or step == args.steps:
            print(f"update {step}/{args.steps}: train loss {loss:.4f}")
    rate = timed / (time.perf_counter() - start) if timed and start is not None else None
    after = val_loss()
    speed = f", {rate:,.0f} tokens/s (after the first update)" if rate else ""
    print(f"validation loss after: {after:.4f}{speed}")

    # --------------------------------------------------------------------------- save
    nnx.update(model, adapters, rngs)
    model.eval()
    rl.save_adapter(model, out_dir, base_model_name_or_path=str(hf_dir), names=hf_module_name)
    print(f"adapter: {out_dir} (peft.PeftModel.from_pretrained(<{hf_dir}'s model>, it))")
    if merged_dir is not None:
        merged = nnx.clone(model)  # the returned model keeps its adapters
        rl.merge_lora(merged)
        tokenizer = hf_dir / TOKENIZER
        save_hf(merged, merged_dir, tokenizer=tokenizer, eos_token_id=meta.get("eot_id"))
        print(f"merged model: {merged_dir} (a plain Hugging Face checkpoint)")
    return {
        "val_loss_before": before,
        "val_loss_after": after,
        "tokens_per_s": rate,
        "adapted": adapted,
        "out_dir": str(out_dir),
        "merged": None if merged_dir is None else str(merged_dir),
        "model": model,
    }


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected module names like q_proj,v_proj; got {text!r}")
    return names


if __name__ == "__main__":
    main()
