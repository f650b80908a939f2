"""Print a completion from a Hugging Face checkpoint folder, with or without a LoRA adapter.

    python -m examples.generate --model path/to/base --prompt "def add(a, b):"
    python -m examples.generate --model path/to/base --adapter runs/a/adapter \\
        --chat --prompt "What is 2 + 2?" --max-new-tokens 32

``--chat`` renders the prompt as a user turn with the tokenizer's own chat template (and the
generation prompt), as ``apply_chat_template(..., add_generation_prompt=True)`` does; without
it the text is encoded as it is, with the tokenizer's special tokens around it (a bos).
Decoding is greedy unless ``--temperature`` is above 0; it stops at the checkpoint's eos ids
(``generation_config.json``, else ``config.json``) or after ``--max-new-tokens``.

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
from tokenizers import Tokenizer

import rudax.layers as rl
from rudax.models import from_pretrained, generate, load_chat_template


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.generate", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    p.add_argument("--adapter", help="a peft LoRA adapter folder to apply")
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
        model = from_pretrained(folder)
        if args.adapter is not None:
            rl.load_adapter(model, args.adapter)
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
