"""``pack_shared_prefix``: rows in which a prompt is computed once for all its completions.

Post-training scores many completions of one prompt (DPO's chosen and rejected answers,
GRPO's group of G samples). Laid out one completion per example, a P-token prompt with G
completions of R tokens costs G (P + R) tokens; shared, P + G R. A row holds, per example::

    tokens     prompt[:-1]      | prompt[-1] c1[0] .. c1[-1] | prompt[-1] c2[0] .. | ...
    branch_ids 0 ... 0          | 1 ...................... 1 | 2 ............... 2 |
    positions  0 ... P-2        | P-1 ........... P-1+R1     | P-1 ............... |
    labels     -100 ...         | c1[0] c1[1] .. c1[-1] -100 | c2[0] ...           |

The prompt's last token opens each branch: its logits predict that completion's first token,
and a position can hold only one label, so each branch carries its own copy of it (one token
per completion). ``rudax.kernels.flash_attention``'s ``branch_ids`` makes each branch see the
prompt and itself only, and the positions restart at the prompt's end, so every completion
token's logits are those of ``prompt + completion`` computed alone, and the prompt's
gradient is the sum of its completions' (tests/models/test_shared_prefix.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rudax.models._loss import IGNORE_INDEX

__all__ = ["SharedPrefixBatch", "pack_shared_prefix"]


@dataclasses.dataclass(frozen=True)
class SharedPrefixBatch:
    """Packed shared-prefix rows, every array ``[B, T]`` int32 (NumPy).

    Attributes:
      tokens: the token ids; ``pad_id`` in padding.
      labels: the next token of the same completion at each position (already shifted, as
        ``causal_lm_loss_sum`` takes them), ``-100`` on prompts, completions' last tokens and
        padding.
      segment_ids: 1, 2, ... for the examples packed in a row, 0 for padding.
      branch_ids: 0 for an example's prompt, g for its completion g (1-based).
      positions: RoPE positions: the prompt's from 0, each completion's from the prompt's last.
      completion: which completion (0, 1, ... over all examples, in input order) a labelled
        position scores, -1 where nothing is counted: per-completion sums of a per-token loss
        are ``segment_sum`` over it.
    """

    tokens: np.ndarray
    labels: np.ndarray
    segment_ids: np.ndarray
    branch_ids: np.ndarray
    positions: np.ndarray
    completion: np.ndarray

    @property
    def num_tokens(self) -> int:
        """The labelled (counted) tokens: the completions' lengths summed."""
        return int((self.labels != IGNORE_INDEX).sum())

    def batch(self) -> dict[str, np.ndarray]:
        """The dict ``causal_lm_loss_sum`` takes."""
        return {
            "tokens": self.tokens,
            "labels": self.labels,
            "segment_ids": self.segment_ids,
            "branch_ids": self.branch_ids,
            "positions": self.positions,
        }


def pack_shared_prefix(
    examples: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
    *,
    row_length: int | None = None,
    pad_id: int = 0,
) -> SharedPrefixBatch:
    """Rows of ``[prompt, completion 1, ..., completion G]`` examples, the prompt shared.

    Each example takes ``len(prompt) + sum(len(c) + 1 for c in completions)`` tokens (see
    the module docstring). Examples are packed whole into rows in their order, a new row
    started when the next does not fit.

    Args:
      examples: ``(prompt ids, [completion ids, ...])`` pairs: a prompt of at least one token,
        at least one completion, each of at least one token. Token ids are ints >= 0.
      row_length: T, the tokens per row; None for the longest example's length (then each
        row holds one example).
      pad_id: the token id of padding.

    Returns:
      A ``SharedPrefixBatch``.

    Example:
      >>> from rudax.models import pack_shared_prefix
      >>> rows = pack_shared_prefix([([5, 6, 7], [[8, 9], [10]])])
      >>> rows.tokens.tolist(), rows.branch_ids.tolist()
      ([[5, 6, 7, 8, 9, 7, 10]], [[0, 0, 1, 1, 1, 2, 2]])
      >>> rows.positions.tolist(), rows.labels.tolist()
      ([[0, 1, 2, 3, 4, 2, 3]], [[-100, -100, 8, 9, -100, 10, -100]])
    """
    checked = _check_examples(examples)
    laid_out = [_lay_out(example) for example in checked]
    longest = max(len(tokens) for tokens, *_ in laid_out)
    if row_length is None:
        row_length = longest
    if isinstance(row_length, bool) or not isinstance(row_length, int) or row_length < 1:
        raise ValueError(f"row_length must be None or an int >= 1, got {row_length=!r}")
    if longest > row_length:
        i = next(i for i, (tokens, *_) in enumerate(laid_out) if len(tokens) == longest)
        raise ValueError(
            f"examples[{i}] takes {longest} tokens shared (its prompt once, each completion "
            f"with a copy of the prompt's last token), more than {row_length=}"
        )
    _check_token("pad_id", pad_id)
    rows: list[list[int]] = [[]]  # example indices per row
    used = 0
    for i, (tokens, *_) in enumerate(laid_out):
        if used + len(tokens) > row_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += len(tokens)
    shape = (len(rows), row_length)
    out = {name: np.zeros(shape, np.int32) for name in ("segment_ids", "branch_ids", "positions")}
    tokens_BxT = np.full(shape, pad_id, np.int32)
    labels = np.full(shape, IGNORE_INDEX, np.int32)
    completion = np.full(shape, -1, np.int32)
    first_completion = np.cumsum([0] + [len(completions) for _, completions in checked])
    for r, members in enumerate(rows):
        start = 0
        for segment, i in enumerate(members, start=1):
            tok, lab, br, pos = laid_out[i]
            span = slice(start, start + len(tok))
            tokens_BxT[r, span], labels[r, span] = tok, lab
            out["branch_ids"][r, span], out["positions"][r, span] = br, pos
            out["segment_ids"][r, span] = segment
            completion[r, span] = np.where(lab != IGNORE_INDEX, first_completion[i] + br - 1, -1)
            start += len(tok)
    return SharedPrefixBatch(tokens=tokens_BxT, labels=labels, completion=completion, **out)


def _lay_out(example: tuple[list[int], list[list[int]]]) -> tuple[np.ndarray, ...]:
    """One example's ``(tokens, labels, branch_ids, positions)``."""
    prompt, completions = example
    p = len(prompt)
    tokens, labels = list(prompt[:-1]), [IGNORE_INDEX] * (p - 1)
    branch, positions = [0] * (p - 1), list(range(p - 1))
    for g, c in enumerate(completions, start=1):
        tokens += [prompt[-1], *c]
        labels += [*c, IGNORE_INDEX]
        branch += [g] * (len(c) + 1)
        positions += range(p - 1, p + len(c))
    return tuple(np.asarray(x, np.int32) for x in (tokens, labels, branch, positions))


def _check_examples(examples: Any) -> list[tuple[list[int], list[list[int]]]]:
    if isinstance(examples, str | bytes) or not isinstance(examples, Sequence) or not examples:
        raise TypeError(
            "examples must be a non-empty sequence of (prompt ids, [completion ids, ...]) "
            f"pairs, got {examples!r:.200}"
        )
    checked = []
    for i, example in enumerate(examples):
        if not (isinstance(example, tuple | list) and len(example) == 2):
            raise TypeError(
                f"examples[{i}] must be a (prompt ids, [completion ids, ...]) pair, got "
                f"{example!r:.200}"
            )
        prompt = _check_ids(f"examples[{i}][0] (the prompt)", example[0])
        completions = example[1]
        if isinstance(completions, str | bytes) or not isinstance(completions, Sequence):
            raise TypeError(f"examples[{i}][1] must be a list of completions, got {completions!r}")
        if not completions:
            raise ValueError(f"examples[{i}] has no completion")
        checked.append(
            (prompt, [_check_ids(f"examples[{i}][1][{g}]", c) for g, c in enumerate(completions)])
        )
    return checked


def _check_ids(name: str, ids: Any) -> list[int]:
    if isinstance(ids, np.ndarray):
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
        ids = ids.tolist()
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a sequence of token ids, got {ids!r:.200}")
    if not ids:
        raise ValueError(f"{name} must hold at least one token, got an empty sequence")
    for j, token in enumerate(ids):
        _check_token(f"{name}[{j}]", token)
    return [int(t) for t in ids]


def _check_token(name: str, token: Any) -> None:
    if isinstance(token, bool) or not isinstance(token, int | np.integer):
        raise TypeError(f"{name} must be an int token id, got {token!r} ({type(token).__name__})")
    if token < 0:
        raise ValueError(f"{name} must be a token id >= 0, got {token}")
