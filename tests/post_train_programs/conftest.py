"""Fixtures of the DPO and GRPO programs' tests: a tiny HF Llama base (the fine-tuner's tests'),
preference pairs and prompts made from its examples."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.finetune.conftest import examples, tiny_base, write_jsonl


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory) -> Path:
    """A random 2-block Llama with 64 positions and its own tokenizer; never modify it."""
    return tiny_base(tmp_path_factory.mktemp("base") / "hf")


@pytest.fixture(scope="session")
def pair_files(tmp_path_factory) -> tuple[Path, Path]:
    """(train.jsonl, val.jsonl): 32 and 8 DPO pairs, each chosen answer its own prompt's
    docstring and the rejected one the next prompt's; never modify them."""
    rows = examples(40, seed=1)
    pairs = [
        {"prompt": r["prompt"], "chosen": r["completion"], "rejected": rows[i - 1]["completion"]}
        for i, r in enumerate(rows)
    ]
    root = tmp_path_factory.mktemp("pairs")
    return write_jsonl(root / "train.jsonl", pairs[:32]), write_jsonl(
        root / "val.jsonl", pairs[32:]
    )


@pytest.fixture(scope="session")
def prompt_files(tmp_path_factory) -> tuple[Path, Path]:
    """(train.jsonl, val.jsonl): 32 and 8 GRPO prompts with their ``answer``; never modify."""
    rows = [{"prompt": r["prompt"], "answer": r["completion"]} for r in examples(40, seed=1)]
    root = tmp_path_factory.mktemp("prompts")
    return write_jsonl(root / "train.jsonl", rows[:32]), write_jsonl(root / "val.jsonl", rows[32:])


@pytest.fixture(scope="session")
def chat_base(base_dir, tmp_path_factory) -> Path:
    """``base_dir`` with a chat template of its own (``chat_template.jinja``); never modify."""
    import json
    import shutil

    from examples.lm.tokenizer import EOT

    base = tmp_path_factory.mktemp("chat") / "hf"
    shutil.copytree(base_dir, base)
    (base / "chat_template.jinja").write_text(
        "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n"
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}### assistant:\n{% endif %}"
    )
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT}))
    return base
