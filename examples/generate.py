"""Print a completion from a Hugging Face checkpoint folder, with or without a LoRA adapter.

    python -m examples.generate --model path/to/base --prompt "def add(a, b):"
    python -m examples.generate --model path/to/base --adapter runs/a/adapter \\
        --chat --prompt "What is 2 + 2?" --max-new-tokens 32

``--chat`` renders the prompt as a user turn with the tokenizer's own chat template (and the
generation prompt), as ``apply_chat_template(..., add_generation_prompt=True)`` does; without
it the text is encoded as it is, with the tokenizer's special tokens around it (a bos).
Decoding is greedy unless ``--temperature`` is above 0; it stops at the checkpoint's eos ids
(``generation_config.json``, else ``config.json``) or after ``--max-new-tokens``.

An adapter is applied to the base as it was trained: an adapter that ``examples.finetune``
wrote records how that run held the base (``rudax_base.json`` beside its files: NF4 or not,
the storage and compute dtypes, the 8-bit absmax rounding), and so does its run's
``config.json`` for the run's own ``RUN/adapter``. A QLoRA adapter on the unquantized base
computes another function (logits 0.54 apart, relative, on a tuned SmolLM). ``--quantize``,
``--param-dtype``, ``--dtype`` and ``--absmax-rounding`` override the record; with no record
(a peft adapter, or none) the base is read as stored.

Everything here is the library: ``rudax.models.from_pretrained``, ``rudax.layers.load_adapter``,
``rudax.models.generate`` and ``rudax.models.load_chat_template``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from tokenizers import Tokenizer

import rudax.layers as rl
from rudax.models import LlamaForCausalLM, from_pretrained, generate, load_chat_template

# What examples.finetune writes beside an adapter: from_pretrained's keywords in its run.
BASE_RECORD = "rudax_base.json"
BASE_FLAGS = ("quantize", "param_dtype", "dtype", "absmax_rounding")
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
CHOICES = {
    "quantize": ("nf4", "none"),
    "param_dtype": tuple(sorted(DTYPES)),
    "dtype": tuple(sorted(DTYPES)),
    "absmax_rounding": ("cuda", "cpu"),
}


def _eos_ids(folder: Path, config_eos: int | tuple[int, ...] | None) -> list[int]:
    """generation_config.json's eos ids (what transformers' generate stops on), else
    config.json's."""
    path = folder / "generation_config.json"
    value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    if value is None:
        value = config_eos
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def base_record(adapter: Path) -> tuple[dict[str, str | None], Path | None]:
    """How the adapter's training run held the base, and the file that says so: the adapter's
    ``rudax_base.json``, else its run's ``config.json`` (``RUN/adapter``, an examples.finetune
    run's own); ``({}, None)`` for an adapter without either (a peft adapter)."""
    record, run_config = adapter / BASE_RECORD, adapter.parent / "config.json"
    for path in (record, run_config):
        if not path.is_file():
            continue
        saved = json.loads(path.read_text())
        # A run's config.json holds its flags; another config.json (a model's) is no record.
        if path == record or {"quantize", "param_dtype", "rank", "targets"} <= saved.keys():
            # Runs from before --absmax-rounding quantized as its default does.
            return {"absmax_rounding": "cuda"} | {k: saved.get(k) for k in BASE_FLAGS}, path
    return {}, None


def load(
    folder: Path, adapter: Path | None, flags: dict[str, str | None]
) -> tuple[LlamaForCausalLM, str]:
    """The model to generate with, and a line saying how its base was read: ``flags``
    (``--quantize`` .. ``--absmax-rounding``, None where not given) over the adapter's
    record."""
    record, source = base_record(adapter) if adapter is not None else ({}, None)
    how = record | {k: v for k, v in flags.items() if v is not None}
    for key, allowed in CHOICES.items():  # a flag given is one of them: argparse checked it
        if how.get(key) is not None and how[key] not in allowed:
            raise ValueError(f"{source}: {key} {how[key]!r} is not one of {allowed}")
    quantize = None if how.get("quantize") in (None, "none") else how["quantize"]
    param_dtype, dtype = (
        DTYPES[v] if v else None for v in (how.get("param_dtype"), how.get("dtype"))
    )
    model = from_pretrained(
        folder,
        param_dtype=param_dtype,
        dtype=dtype,
        quantize=quantize,
        absmax_rounding=how.get("absmax_rounding") or "cuda",
    )
    if adapter is not None:
        rl.load_adapter(model, adapter)
    described = ", ".join(f"{k} {how[k]}" for k in BASE_FLAGS if how.get(k) is not None)
    line = f"base {folder}: {described or 'as stored'}"
    if source is not None:
        line += f" (as the adapter was trained: {source})"
    return model, line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.generate", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    p.add_argument("--adapter", help="a peft LoRA adapter folder to apply")
    recorded = " (default: as the adapter's run held the base, else as stored)"
    p.add_argument("--quantize", choices=CHOICES["quantize"], help="the base" + recorded)
    p.add_argument("--param-dtype", choices=CHOICES["param_dtype"], help="storage" + recorded)
    p.add_argument("--dtype", choices=CHOICES["dtype"], help="compute dtype" + recorded)
    p.add_argument(
        "--absmax-rounding",
        choices=CHOICES["absmax_rounding"],
        help="with --quantize nf4, bitsandbytes' kernel whose 8-bit absmax codes to make"
        + recorded,
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="render the prompt as a user turn")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> str:
    """Runs the command; returns the completion it prints."""
    p = _parser()
    args = p.parse_args(argv)
    folder = Path(args.model)
    if not (folder / "tokenizer.json").is_file():
        p.error(f"--model {folder}: no tokenizer.json (a Hugging Face checkpoint folder?)")
    try:
        adapter = None if args.adapter is None else Path(args.adapter)
        model, how = load(folder, adapter, {k: getattr(args, k) for k in BASE_FLAGS})
        print(how, file=sys.stderr)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        if args.chat:
            chat = load_chat_template(folder)
            if chat is None:
                p.error(f"--chat: {folder} has no chat template (chat_template.jinja)")
            text = chat.render(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True
            )
            ids = tokenizer.encode(text, add_special_tokens=False).ids
        else:
            ids = tokenizer.encode(args.prompt).ids
        out = generate(
            model,
            [ids],
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_tokens=_eos_ids(folder, model.config.eos_token_id),
            rng=jax.random.key(args.seed),
        )[0]
    except (ValueError, TypeError, OSError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    completion = tokenizer.decode(out, skip_special_tokens=True)
    print(completion)
    return completion


if __name__ == "__main__":
    main()
