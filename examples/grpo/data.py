"""The GRPO program's data: prompts from JSONL, with the fields their rewards read.

Each line has a ``prompt`` (text, or chat messages the base's chat template renders with its
generation prompt) and any other fields, which the reward functions get as keywords (one
value per completion, TRL's convention)::

    {"prompt": "12+7=", "answer": "19"}

Batch ``i`` holds prompts ``i * B`` to ``(i + 1) * B - 1`` of an endless sequence of epochs
(``examples.policy.order``): a pure function of the file, the seed and ``i``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import rudax.models as rm
from examples.policy.jsonl import read_rows, sha256
from examples.policy.order import batch_indices


class PromptData:
    """A JSONL file's prompts, checked and tokenized once.

    Args:
      path: the file.
      tokenizer: the base's.
      positions: the base's context (``max_position_embeddings``; None: unknown).
      max_new_tokens: a completion's most tokens: a prompt leaves room for them.

    Raises:
      DataError: a line without a usable prompt, or one too long (``file:line: why``).
    """

    def __init__(
        self,
        path: Path,
        tokenizer: rm.ModelTokenizer,
        *,
        positions: int | None,
        max_new_tokens: int,
    ):
        self.path = path

        def parse(row: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
            if "prompt" not in row:
                raise ValueError(f"no 'prompt' (fields: {sorted(row)})")
            prompt = row["prompt"]
            if isinstance(prompt, str):
                ids = tokenizer.tokenizer.encode(prompt, add_special_tokens=True).ids
            elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
                if tokenizer.chat is None:
                    raise ValueError(
                        f"the prompt is chat messages, and {tokenizer.path.parent} has no chat "
                        "template to render them"
                    )
                text = tokenizer.chat.render(prompt, add_generation_prompt=True)
                ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
            else:
                raise ValueError(
                    f"'prompt' must be text or chat messages, got {type(prompt).__name__}"
                )
            if not ids:
                raise ValueError("the prompt has no tokens")
            if positions is not None and len(ids) + max_new_tokens > positions:
                raise ValueError(
                    f"the prompt's {len(ids)} tokens and --max-new-tokens {max_new_tokens} "
                    f"take more than the base's {positions} positions (max_position_embeddings)"
                )
            return ids, {k: v for k, v in row.items() if k != "prompt"}

        rows = read_rows(path, parse)
        self.prompts = [ids for ids, _ in rows]
        fields = sorted({k for _, f in rows for k in f})
        # a field a row lacks is None for it, as a datasets column would hold
        self.fields = [{k: f.get(k) for k in fields} for _, f in rows]

    @property
    def longest(self) -> int:
        """The longest prompt's tokens."""
        return max(map(len, self.prompts))

    def identity(self) -> dict[str, Any]:
        """What fixes the batches: the file's digest and its prompts' count."""
        return {"sha256": sha256(self.path), "prompts": len(self.prompts)}

    def batch(self, i: int, size: int, seed: int) -> tuple[list[list[int]], dict[str, list]]:
        """Training batch ``i``: ``size`` prompts' ids and their fields as columns."""
        return self.take(batch_indices(len(self.prompts), seed, i, size))

    def take(self, picked: list[int]) -> tuple[list[list[int]], dict[str, list]]:
        """Prompts ``picked``' ids and their fields as columns (``rollout``'s ``columns``)."""
        keys = self.fields[0].keys()
        return [self.prompts[k] for k in picked], {
            key: [self.fields[k][key] for k in picked] for key in keys
        }
