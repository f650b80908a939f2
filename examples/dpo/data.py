"""The DPO program's data: preference pairs from JSONL, as shared-prefix rows.

Each line is TRL's explicit-prompt preference example, text or chat messages (the base's
chat template renders them), tokenized as TRL's ``DPOTrainer`` does
(``rudax.post_train.tokenize_preference``)::

    {"prompt": "2+2=", "chosen": "4", "rejected": "5"}

A pair is one row of ``--seq-len`` tokens, ``[prompt, chosen, rejected]`` with the prompt
once (``rudax.models.pack_shared_prefix``): it takes ``len(prompt) + len(chosen) + 1 +
len(rejected) + 1`` tokens. Batch ``i`` holds pairs ``i * B`` to ``(i + 1) * B - 1`` of an
endless sequence of epochs (``examples.policy.order``): a pure function of the file, the
seed and ``i``, so a resumed run reads the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import rudax.models as rm
import rudax.post_train as rp
from examples.policy.jsonl import read_rows, sha256
from examples.policy.order import batch_indices
from examples.policy.rows import pad_rows

Pair = tuple[list[int], list[int], list[int]]


class PreferenceData:
    """A JSONL file's preference pairs, checked and tokenized once.

    Args:
      path: the file.
      tokenizer: the base's.
      seq_len: tokens per row.
      positions: the base's context (``max_position_embeddings``; None: unknown).
      too_long: ``"error"`` or ``"drop"`` for a pair longer than ``seq_len``.

    Raises:
      DataError: a line that is not an example, or too long (``file:line: why``).
    """

    def __init__(
        self,
        path: Path,
        tokenizer: rm.ModelTokenizer,
        *,
        seq_len: int,
        positions: int | None,
        too_long: str,
    ):
        self.path, self.seq_len = path, seq_len
        self.dropped = 0

        def parse(row: dict[str, Any]) -> Pair | None:
            prompt, chosen, rejected = rp.tokenize_preference(row, tokenizer)
            longest = len(prompt) + max(len(chosen), len(rejected))
            if positions is not None and longest > positions:
                raise ValueError(
                    f"prompt and answer take {longest} positions; the base has {positions} "
                    "(max_position_embeddings)"
                )
            size = len(prompt) + len(chosen) + len(rejected) + 2
            if size > seq_len:
                if too_long == "drop":
                    self.dropped += 1
                    return None
                raise ValueError(
                    f"the pair takes {size} tokens in a row (prompt once, each answer + 1), "
                    f"more than --seq-len {seq_len} (raise it, or --too-long drop)"
                )
            return prompt, chosen, rejected

        self.pairs = [p for p in read_rows(path, parse) if p is not None]
        if not self.pairs:
            raise ValueError(f"{path}: every pair is longer than --seq-len {seq_len}")

    def identity(self) -> dict[str, Any]:
        """What fixes the batches: the file's digest and the pairs' count and row length."""
        return {"sha256": sha256(self.path), "pairs": len(self.pairs), "seq_len": self.seq_len}

    def batch(self, i: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
        """Training batch ``i``: ``batch_size`` pairs, a row each (see the module doc)."""
        picked = batch_indices(len(self.pairs), seed, i, batch_size)
        return self.rows([self.pairs[k] for k in picked], batch_size)

    def eval_batches(self, batch_size: int) -> list[dict[str, np.ndarray]]:
        """Every pair once, in the file's order; the last batch filled with empty rows."""
        return [
            self.rows(self.pairs[s : s + batch_size], batch_size)
            for s in range(0, len(self.pairs), batch_size)
        ]

    def rows(self, pairs: list[Pair], batch_size: int) -> dict[str, np.ndarray]:
        """``pairs`` a row each, ``batch_size`` rows (empty rows score nothing)."""
        parts = []
        for prompt, chosen, rejected in pairs:
            packed = rm.pack_shared_prefix([(prompt, [chosen, rejected])], row_length=self.seq_len)
            parts.append({**packed.batch(), "completion": packed.completion})
        return pad_rows({k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, batch_size)
