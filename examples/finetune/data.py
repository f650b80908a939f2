"""Fine-tuning batches: a JSONL (or .txt) file tokenized with the base's tokenizer, packed or padded
into labelled rows, batch ``i`` a pure function of (the file, the seed, ``i``).

Tokens. ``rudax.models.load_tokenizer`` reads the base directory's ``tokenizer.json``. Its
eos id is the ``eos_token_id`` of ``generation_config.json`` (what ``generate`` stops on),
else of ``config.json``, else the tokenizer's one special token; a list of ids (Llama 3)
gives its first. Each example's ids are the ids the tokenizer's post-processor puts before a
single sequence (Llama's ``<s>``; none for GPT-2-style and Qwen2 tokenizers), then each
segment of ``examples.finetune.template`` encoded on its own without special tokens, the eos
as its id. A special token's text inside a record (``"<|endoftext|>"`` in a completion) is
an error: the tokenizer would read it as that token, not as text.

Chats. When the base folder holds a chat template (``chat_template.jinja``, or
``tokenizer_config.json``'s ``chat_template``), a ``messages`` record is rendered with it, as
``apply_chat_template`` renders it (``rudax.models.ChatTemplate``): the model is trained in
the format it will be prompted with. Each assistant turn, its end-of-turn marker included,
is counted; the rest is context; no bos is added beyond the template's own. Without a
template, ``examples.finetune.template``'s plain one is used.

Labels are causal and already shifted, TRL's completion-only loss: ``labels[t]`` is the
token after ``tokens[t]`` where the template counts that token, -100 elsewhere (prompt and
chat context, padding, an example's last token). An example longer than ``seq_len`` is an
error naming its line by default (``too_long="error"``), except a ``text`` document, which is
cut into rows of ``seq_len`` tokens (each row's first token has no context, so it is not a
target); ``too_long="drop"`` leaves such
examples out and lists their lines in ``dropped``. Nothing is truncated: a cut completion
loses its eos and would teach the model not to stop.

Rows. With ``pack=True`` the examples of an epoch, in its order, are packed greedily (next
fit) into rows of ``seq_len`` tokens: an example goes into the current row if it fits, else
it starts the next one, so no example crosses a row. ``segment_ids`` number the examples of
a row 1, 2, ... (0 is padding) and ``positions`` restart at 0 for each, so attention masked
by segment and positions by example make a packed row compute what separate rows would. With
``pack=False`` each row holds one example. Padding is ``pad_id`` (the eos), labelled -100.

Order. Epoch ``e`` visits the examples in a permutation drawn by a Philox generator keyed by
``(seed, e)`` (file order with ``shuffle=False``); the epochs' rows follow each other in one
stream and batch ``i`` is its rows ``[i * batch_size, (i + 1) * batch_size)``, so a batch can
hold the end of one epoch and the start of the next. Nothing but ``i`` is state: a resumed
run reads the same batches from its step on, from a fresh object.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import numbers
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from examples.finetune.template import DataError, Record, Segment, read_records
from rudax.models import ChatTemplate, ModelTokenizer

IGNORE = -100  # the label of a position the loss does not count (torch's ignore_index)
TOO_LONG = ("error", "drop")
KEYS = ("tokens", "labels", "segment_ids", "positions")


def counted_tokens(batch: dict[str, np.ndarray]) -> int:
    """The positions a batch's loss counts, ``(labels != -100).sum()``: the weight of its
    gradient in a token-weighted accumulation."""
    return int((batch["labels"] != IGNORE).sum())


class FinetuneData:
    """A JSONL file's examples as packed or padded labelled batches (see the module docstring).

    Args:
      path: the JSONL file (``examples.finetune.template.read_records``).
      tokenizer: the base's ``rudax.models.load_tokenizer``.
      seq_len: tokens per row, ``T``; no example may be longer (see ``too_long``).
      batch_size: rows per batch, ``B``.
      seed: a non-negative int fixing every epoch's order.
      pack: several examples per row (True) or one, padded (False).
      shuffle: a new order each epoch (True) or file order.
      too_long: ``"error"`` (a ``DataError`` naming the first line longer than ``seq_len``)
        or ``"drop"`` (left out, their lines in ``dropped``).
      vocab_size: if given, the model's vocabulary: an id at or above it is an error.

    Attributes:
      sha256: the SHA-256 of the file's bytes; ``tokenizer_sha256``: of ``tokenizer.json``.
      lines: each kept example's line in the file; ``lengths``: its tokens; ``counted``:
        its counted positions. ``dropped``: the lines left out by ``too_long="drop"``.

    Raises:
      DataError: a record is invalid (``read_records``), holds a special token's text, is
        longer than ``seq_len`` under ``too_long="error"``, or no example is left.

    Example:
      >>> import json, pathlib, tempfile
      >>> from tokenizers import Tokenizer, models, pre_tokenizers
      >>> from examples.finetune.data import FinetuneData, counted_tokens
      >>> from rudax.models import load_tokenizer
      >>> root = pathlib.Path(tempfile.mkdtemp())
      >>> words = ["<eos>", "Q", ":", "add", "and", ".", "A", *map(str, range(10))]
      >>> tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
      >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()  # 11 tokens an example, with the eos
      >>> tok.save(str(root / "tokenizer.json"))
      >>> _ = (root / "config.json").write_text(json.dumps({"eos_token_id": 0}))
      >>> rows = [{"prompt": f"Q: add {a} and 2. A:", "completion": f" {a + 2}"} for a in range(6)]
      >>> _ = (root / "train.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
      >>> data = FinetuneData(root / "train.jsonl", load_tokenizer(root), seq_len=40,
      ...                     batch_size=2, seed=0)
      >>> batch = data.batch(0)
      >>> sorted(batch), batch["tokens"].shape, batch["tokens"].dtype
      (['labels', 'positions', 'segment_ids', 'tokens'], (2, 40), dtype('int32'))
      >>> data.rows_in_epoch(0), counted_tokens(batch) == int(data.counted.sum())  # all 6
      (2, True)
      >>> all(np.array_equal(batch[k], data.batch(0)[k]) for k in batch)
      True
    """

    def __init__(
        self,
        path: str | os.PathLike,
        tokenizer: ModelTokenizer,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        pack: bool = True,
        shuffle: bool = True,
        too_long: str = "error",
        vocab_size: int | None = None,
    ) -> None:
        if not isinstance(tokenizer, ModelTokenizer):
            raise TypeError(
                f"tokenizer must be a rudax.models.load_tokenizer(...), got {tokenizer=}"
            )
        _check("seq_len", seq_len, "positive int")
        _check("batch_size", batch_size, "positive int")
        _check("seed", seed, "int")
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed=}")
        _check("pack", pack, "bool")
        _check("shuffle", shuffle, "bool")
        if too_long not in TOO_LONG:
            raise ValueError(f"too_long must be one of {TOO_LONG}, got {too_long=}")
        if vocab_size is not None:
            _check("vocab_size", vocab_size, "positive int")
        self.path = Path(path)
        self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()
        self.tokenizer_sha256 = tokenizer.sha256
        self.chat_template = None if tokenizer.chat is None else tokenizer.chat.template
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.pack, self.shuffle, self.too_long = bool(pack), bool(shuffle), too_long
        self.pad_id = tokenizer.eos_id
        self._tokenize(tokenizer, vocab_size)
        self._rows_before = [0]  # rows of the stream before epoch e, for the epochs seen
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _tokenize(self, tok: ModelTokenizer, vocab_size: int | None) -> None:
        records = read_records(self.path)
        added = tok.tokenizer.get_added_tokens_decoder().values()
        specials = [t.content for t in added if t.special]
        special = re.compile("|".join(map(re.escape, specials))) if specials else None
        if tok.chat is not None:
            records = [self._chat_record(record, tok.chat, special) for record in records]
        texts = []
        for record in records:
            for segment in record.segments:
                if segment.text is None:
                    continue
                if segment.field and special and (m := special.search(segment.text)):
                    raise DataError(
                        f"{self.path}:{record.line}: {segment.field}: holds {m.group()!r}, a "
                        "special token of the tokenizer, which would read it as that token and "
                        "not as text: remove it"
                    )
                texts.append(segment.text)
        encode = getattr(tok.tokenizer, "encode_batch_fast", tok.tokenizer.encode_batch)
        encoded = iter(encode(texts, add_special_tokens=False))
        ids, targets, lines, dropped, plain = [], [], [], [], []
        for record in records:
            # A chat rendered by the tokenizer's template carries its own bos, as
            # apply_chat_template's text does: the post-processor's is not added again.
            prefix = [] if tok.chat is not None and record.messages is not None else tok.prefix_ids
            parts = [list(prefix)]
            flags = [[False] * len(prefix)]
            for segment in record.segments:
                piece = [tok.eos_id] if segment.text is None else next(encoded).ids
                parts.append(piece)
                flags.append([segment.counted] * len(piece))
            example = np.array([i for p in parts for i in p], np.int32)
            # A position is a target if the token there is counted; the first has no context.
            target = np.array([f for p in flags for f in p], bool)
            target[:1] = False
            if vocab_size is not None and int(example.max()) >= vocab_size:
                raise DataError(
                    f"{self.path}:{record.line}: token id {int(example.max())} is outside the "
                    f"model's vocabulary of {vocab_size}: the tokenizer and the model differ"
                )
            if record.plain and example.size > self.seq_len:
                # A text document is cut into rows, each row's first token without context.
                for lo in range(0, example.size, self.seq_len):
                    row = example[lo : lo + self.seq_len]
                    if row.size < 2:
                        continue  # a lone last token: nothing to predict it from
                    flag = target[lo : lo + self.seq_len].copy()
                    flag[0] = False
                    ids.append(row)
                    targets.append(flag)
                    lines.append(record.line)
                    plain.append(True)
                continue
            if example.size > self.seq_len:
                if self.too_long == "error":
                    raise DataError(
                        f"{self.path}:{record.line}: {example.size} tokens, longer than "
                        f"seq_len={self.seq_len}: shorten it, raise seq_len (up to the model's "
                        "context), or leave such examples out with too_long='drop'"
                    )
                dropped.append(record.line)
                continue
            ids.append(example)
            targets.append(target)
            lines.append(record.line)
            plain.append(record.plain)
        if not ids:
            raise DataError(
                f"{self.path}: all {len(records)} examples are longer than "
                f"seq_len={self.seq_len} (dropped by too_long='drop')"
            )
        self.lines = np.array(lines, np.int64)
        self._plain = np.array(plain, bool)
        self.dropped = tuple(dropped)
        self.lengths = np.array([x.size for x in ids], np.int64)
        self.counted = np.array([int(t.sum()) for t in targets], np.int64)
        self.num_examples = len(ids)
        self._starts = np.concatenate([[0], np.cumsum(self.lengths)])
        self._ids = np.concatenate(ids)
        self._targets = np.concatenate(targets)

    def _chat_record(
        self, record: Record, chat: ChatTemplate, special: re.Pattern[str] | None
    ) -> Record:
        """A chat record's segments rendered by the tokenizer's own template: the assistant
        turns counted (their end-of-turn marker included), the rest context."""
        if record.messages is None:
            return record
        where = f"{self.path}:{record.line}"
        for k, message in enumerate(record.messages):
            if special and (m := special.search(message["content"])):
                raise DataError(
                    f"{where}: 'messages'[{k}]['content']: holds {m.group()!r}, a special "
                    "token of the tokenizer, which would read it as that token and not as "
                    "text: remove it"
                )
        try:
            pieces = chat.segments(list(record.messages))
        except Exception as e:  # the template's own errors (raise_exception) included
            raise DataError(f"{where}: the tokenizer's chat template: {e}") from e
        # The template's text holds its special tokens, which it is meant to: no field.
        segments = tuple(Segment(text, counted) for text, counted in pieces)
        return Record(record.line, segments, record.messages)

    def prompt(self, k: int) -> np.ndarray:
        """Example ``k``'s context (in file order, dropped examples left out): its tokens
        before the first counted one, what the model is prompted with to answer it; for a
        text document (every token counted), its first half, at most 32 tokens."""
        if not 0 <= k < self.num_examples:
            raise ValueError(f"k must be in [0, {self.num_examples}), got {k=}")
        lo, hi = self._starts[k], self._starts[k + 1]
        if self._plain[k]:
            return self._ids[lo : lo + max(1, min(32, (hi - lo) // 2))]
        counted = np.flatnonzero(self._targets[lo:hi])
        return self._ids[lo : lo + (int(counted[0]) if counted.size else hi - lo)]

    def identity(self) -> dict[str, Any]:
        """What fixes the batches, for a checkpoint to record and a resumed run to compare:
        equal identities give equal ``batch(i)`` for every ``i`` (``path`` excepted: the
        same file may be reached by another path)."""
        return {
            "path": str(self.path),
            "sha256": self.sha256,
            "tokenizer_sha256": self.tokenizer_sha256,
            "pad_id": self.pad_id,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "pack": self.pack,
            "shuffle": self.shuffle,
            "too_long": self.too_long,
            "examples": self.num_examples,
            "dropped": list(self.dropped),
            # only when there is one: identities of runs without a template are unchanged
            **(
                {}
                if self.chat_template is None
                else {
                    "chat_template_sha256": hashlib.sha256(self.chat_template.encode()).hexdigest()
                }
            ),
        }

    def batch(self, i: int, *, shard: int = 0, num_shards: int = 1) -> dict[str, np.ndarray]:
        """Batch ``i``, or host ``shard``'s rows of it: the dict of ``KEYS``, int32 arrays
        of shape (batch_size // num_shards, seq_len). Hosts' shares concatenated in shard
        order are ``batch(i)``."""
        _check("i", i, "int")
        if not 0 <= i < 2**62:
            raise ValueError(f"i must be in [0, 2**62), got {i=}")
        _check("num_shards", num_shards, "positive int")
        _check("shard", shard, "int")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, {num_shards=}), got {shard=}")
        if self.batch_size % num_shards:
            raise ValueError(
                f"num_shards must divide batch_size={self.batch_size}, got {num_shards=}"
            )
        per_host = self.batch_size // num_shards
        first = i * self.batch_size + shard * per_host
        return self._fill([self._row(r) for r in range(first, first + per_host)])

    def epoch_of(self, i: int) -> int:
        """The epoch of batch ``i``'s first row."""
        _check("i", i, "int")
        return self._locate(i * self.batch_size)[0]

    def rows_in_epoch(self, epoch: int) -> int:
        """Rows the examples fill in ``epoch``'s order (the number of examples unpacked)."""
        return self._layout(epoch)[1].size - 1

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        """Every example once, in file order, packed like training; the last batch is filled
        up with rows of padding (no counted position), so every batch has the same shape."""
        order, bounds = self._pack(np.arange(self.num_examples))
        rows = [order[a:b] for a, b in itertools.pairwise(bounds)]
        rows += [order[:0]] * (-len(rows) % self.batch_size)
        return [
            self._fill(rows[k : k + self.batch_size]) for k in range(0, len(rows), self.batch_size)
        ]

    def _pack(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(order, bounds): row r holds the examples order[bounds[r]:bounds[r + 1]]."""
        if not self.pack:
            return order, np.arange(order.size + 1)
        bounds, used = [0], 0
        for j, n in enumerate(self.lengths[order].tolist()):
            if used + n > self.seq_len:  # next fit: this example starts a new row
                bounds.append(j)
                used = 0
            used += n
        bounds.append(order.size)
        return order, np.array(bounds, np.int64)

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        _check("epoch", epoch, "int")
        if not 0 <= epoch < 2**64:
            raise ValueError(f"epoch must be in [0, 2**64), got {epoch=}")
        if epoch not in self._layouts:
            if self.shuffle:
                key = np.array([self.seed, epoch], np.uint64)
                rng = np.random.Generator(np.random.Philox(key=key))
                order = rng.permutation(self.num_examples)
            else:
                order = np.arange(self.num_examples)
            if len(self._layouts) >= 4:  # the oldest: batches move forward through epochs
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[epoch] = self._pack(order)
        return self._layouts[epoch]

    def _locate(self, row: int) -> tuple[int, int]:
        """(epoch, row within it) of the stream's row ``row``."""
        while self._rows_before[-1] <= row:
            rows = self.rows_in_epoch(len(self._rows_before) - 1)
            self._rows_before.append(self._rows_before[-1] + rows)
        epoch = bisect.bisect_right(self._rows_before, row) - 1
        return epoch, row - self._rows_before[epoch]

    def _row(self, row: int) -> np.ndarray:
        epoch, local = self._locate(row)
        order, bounds = self._layout(epoch)
        return order[bounds[local] : bounds[local + 1]]

    def _fill(self, rows: list[np.ndarray]) -> dict[str, np.ndarray]:
        shape = (len(rows), self.seq_len)
        out = {
            "tokens": np.full(shape, self.pad_id, np.int32),
            "labels": np.full(shape, IGNORE, np.int32),
            "segment_ids": np.zeros(shape, np.int32),
            "positions": np.zeros(shape, np.int32),
        }
        for r, examples in enumerate(rows):
            at = 0
            for k, e in enumerate(examples.tolist(), start=1):
                lo, hi = int(self._starts[e]), int(self._starts[e + 1])
                n = hi - lo
                ids = self._ids[lo:hi]
                out["tokens"][r, at : at + n] = ids
                # labels[t] = the next token if it is counted; the example's last has none.
                next_counted = self._targets[lo + 1 : hi]
                out["labels"][r, at : at + n - 1] = np.where(next_counted, ids[1:], IGNORE)
                out["segment_ids"][r, at : at + n] = k
                out["positions"][r, at : at + n] = np.arange(n)
                at += n
        return out


def _check(name: str, value: Any, kind: str) -> None:
    """A TypeError or ValueError naming ``name`` unless ``value`` is a ``kind``: "bool" (a
    NumPy bool too), "int" (not a bool) or "positive int"."""
    if kind == "bool":
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"{name} must be a bool, got {name}={value!r}")
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    elif kind == "positive int" and value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
