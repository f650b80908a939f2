"""The README's post-training walk-through data: two-digit additions, written once.

    python -m examples.arithmetic data/arithmetic

Every problem ``a+b=`` with ``0 <= a, b <= 99`` is dealt once, in an order drawn from the
seed, to one of these files (so no held-out problem is ever trained on):

- ``grpo_val.jsonl``: 100 held-out prompts with their ``answer`` (the accuracy reported);
- ``dpo_val.jsonl``: 100 held-out pairs;
- ``grpo_train.jsonl``: 1,000 prompts for GRPO, ``{"prompt": "12+7=", "answer": "19"}``;
- ``dpo_train.jsonl``: 1,000 pairs, the right sum chosen, a near miss rejected (off by one
  or by ten: the mistakes a model that has not learned carrying makes),
  ``{"prompt": "12+7=", "chosen": "19", "rejected": "20"}``;
- ``corpus.jsonl``: the other 7,800 as documents ``{"text": "12+7=19"}`` for the main job's
  trainer (``python -m examples.lm.train --data``), which ends each with its
  ``<|endoftext|>``: the model learns to stop after the sum.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path

SIZES = {"grpo_val": 100, "dpo_val": 100, "grpo_train": 1000, "dpo_train": 1000}


def write(out: Path, seed: int = 0) -> dict[str, int]:
    """Writes the files into ``out``; returns each one's row count."""
    rng = random.Random(seed)
    problems = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(problems)
    out.mkdir(parents=True, exist_ok=True)
    counts, start = {}, 0
    for name, size in (*SIZES.items(), ("corpus", len(problems) - sum(SIZES.values()))):
        rows = [_row(name, a, b, rng) for a, b in problems[start : start + size]]
        start += size
        tmp = out / f"{name}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(out / f"{name}.jsonl")
        counts[name] = len(rows)
    return counts


def _row(name: str, a: int, b: int, rng: random.Random) -> dict[str, str]:
    prompt, answer = f"{a}+{b}=", a + b
    if name == "corpus":
        return {"text": f"{prompt}{answer}"}
    if name.startswith("grpo"):
        return {"prompt": prompt, "answer": str(answer)}
    wrong = answer + rng.choice([d for d in (-10, -1, 1, 10) if answer + d >= 0])
    return {"prompt": prompt, "chosen": str(answer), "rejected": str(wrong)}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m examples.arithmetic", description=__doc__)
    p.add_argument("out", type=Path, help="the folder to write")
    p.add_argument("--seed", type=int, default=0, help="the problems' order")
    args = p.parse_args(argv)
    counts = write(args.out, args.seed)
    print(", ".join(f"{args.out / name}.jsonl: {n}" for name, n in counts.items()))


if __name__ == "__main__":
    main()
