"""Fixtures of the fine-tuning tests: a tiny HF Llama base with its own tokenizer, and data."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

from examples.lm.tokenizer import train_tokenizer
from rudax.models import LlamaConfig, LlamaForCausalLM, save_pretrained

NAMES = ["alpha", "beta", "gamma", "delta", "value", "total", "index", "item"]


def examples(n: int, seed: int) -> list[dict[str, str]]:
    """Prompt/completion pairs a tiny model learns in a few updates: a signature, its doc."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.choice(NAMES), rng.choice(NAMES)
        rows.append(
            {
                "prompt": f"def {a}_{i}({b}, n={i % 7}):\n",
                "completion": f"Return {b} times n plus {i % 5}.",
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_base(out: Path, *, seq_len: int = 64) -> Path:
    """A random 2-block Llama (widths multiples of 64, as NF4's blocks need) saved as an HF
    directory ``out`` with a BPE trained on the examples' text; ``seq_len`` positions."""
    out.parent.mkdir(parents=True, exist_ok=True)
    texts = [r["prompt"] + r["completion"] for r in examples(200, seed=0)]
    tokenizer = train_tokenizer(texts, 300)
    tokenizer_dir = out.parent / f"{out.name}.tokenizer"
    tokenizer_dir.mkdir()
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    config = LlamaConfig.tiny(
        320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        param_dtype=jnp.float32,
        eos_token_id=0,
    )
    save_pretrained(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), out, tokenizer=tokenizer_dir)
    return out


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory) -> Path:
    """``tiny_base`` with 64 positions; never modify it."""
    return tiny_base(tmp_path_factory.mktemp("base") / "hf")


@pytest.fixture(scope="session")
def data_files(tmp_path_factory) -> tuple[Path, Path]:
    """(train.jsonl, val.jsonl): 96 and 16 examples; never modify them."""
    root = tmp_path_factory.mktemp("data")
    rows = examples(112, seed=1)
    return write_jsonl(root / "train.jsonl", rows[:96]), write_jsonl(root / "val.jsonl", rows[96:])
