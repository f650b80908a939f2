"""Fine-tuning records: a JSONL file read and checked, each example as the segments it is
tokenized from, and which of them the loss counts.

One JSON object per line, in one of three forms::

    {"prompt": "def add(a, b):", "completion": "Return the sum of a and b."}
    {"messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}
    {"text": "Any document: every token of it is learned."}

or a plain ``.txt`` file, which is one ``text`` document.

Lines holding only whitespace are skipped; every other line must be one of these objects,
with no other field. Anything else is a ``DataError`` naming the file, the line and the
field, so a bad record is found where it is, not as a strange loss later.

An example becomes a sequence of ``Segment``: a piece of text, or the end-of-sequence token
(``text=None``), and whether the loss counts it.

* prompt/completion: the prompt, not counted; the completion, counted; the eos, counted.
  This is the completion-only loss of TRL's ``SFTTrainer``: the model learns to answer
  and to stop, never to produce the prompt. The prompt may be empty; the completion may not.
* text: the text, counted, then the eos, counted: plain language modelling (continued
  pretraining on a corpus). A document longer than a row is cut into rows
  (``examples.finetune.data``), not refused.
* messages, a plain ChatML-like template. Each turn renders as ``"<|{role}|>\\n"`` (not
  counted) followed by ``content + "\\n"``, and an assistant turn adds the eos after it::

      <|system|>\\n{system}\\n<|user|>\\n{question}\\n<|assistant|>\\n{answer}\\n<eos>

  Only the assistant turns' ``content + "\\n"`` and their eos are counted; headers and the
  other turns are context. A chat needs at least one assistant turn with some content.
  The role tags are plain text for the tokenizer (no new tokens to learn embeddings for).

Segments are tokenized one by one and their ids concatenated (``examples.finetune.data``),
so the boundary between counted and uncounted tokens is a token boundary, and a prompt's ids
are those it gets when it is encoded on its own for generation.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

ROLES = ("system", "user", "assistant")
PROMPT_FIELDS = ("prompt", "completion")
CHAT_FIELDS = ("messages",)
TEXT_FIELDS = ("text",)
MESSAGE_FIELDS = ("role", "content")


class DataError(ValueError):
    """A fine-tuning file holds a record that is not valid; the message names the file, the
    line (1-based) and the field, and says what was expected."""


class Segment(NamedTuple):
    """A piece of an example: ``text`` (None for the end-of-sequence token), whether the loss
    counts its tokens, and the record's ``field`` it comes from ("" for the template's own
    text: chat headers and the eos)."""

    text: str | None
    counted: bool
    field: str = ""


@dataclass(frozen=True)
class Record:
    """One example of a JSONL file: its 1-based ``line`` and its ``segments`` in order."""

    line: int
    segments: tuple[Segment, ...]
    messages: tuple[dict[str, str], ...] | None = None  # a chat's turns, for its own template
    plain: bool = False  # a text document: every token counted, cut into rows if long


def chat_segments(messages: list[dict[str, str]]) -> tuple[Segment, ...]:
    """The segments of a checked chat (see the module docstring for the template).

    Args:
      messages: ``{"role": ..., "content": ...}`` turns, roles in ``ROLES``.

    Returns:
      Per turn the header ``"<|role|>\\n"`` (not counted) and ``content + "\\n"``; an
      assistant turn's content is counted and followed by the eos (``text=None``), counted.

    Example:
      >>> from examples.finetune.template import chat_segments, render
      >>> segments = chat_segments([{"role": "user", "content": "2+2?"},
      ...                           {"role": "assistant", "content": "4"}])
      >>> [s.counted for s in segments]
      [False, False, False, True, True]
      >>> render(segments, eos="<eos>")
      '<|user|>\\n2+2?\\n<|assistant|>\\n4\\n<eos>'
    """
    out: list[Segment] = []
    for k, message in enumerate(messages):
        answer = message["role"] == "assistant"
        content = Segment(message["content"] + "\n", answer, f"'messages'[{k}]['content']")
        out += [Segment(f"<|{message['role']}|>\n", False), content]
        if answer:
            out.append(Segment(None, True))
    return tuple(out)


def render(segments: tuple[Segment, ...], *, eos: str) -> str:
    """An example as text, the eos written as ``eos``: what the model reads, for display.

    Example:
      >>> from examples.finetune.template import Segment, render
      >>> render((Segment("Q: ", False), Segment("A", True), Segment(None, True)), eos="</s>")
      'Q: A</s>'
    """
    return "".join(eos if s.text is None else s.text for s in segments)


def read_records(path: str | os.PathLike) -> list[Record]:
    """Reads and checks a JSONL file of prompt/completion or chat examples.

    Args:
      path: a UTF-8 file, one JSON object per line (whitespace-only lines are skipped).

    Returns:
      One ``Record`` per example, in file order.

    Raises:
      DataError: the file is not UTF-8, a line is not JSON or not an object, a field is
        missing, unknown, of the wrong type or empty where it may not be, a role is not one
        of ``ROLES``, a chat has no assistant turn, or the file has no example at all. The
        message reads ``"{path}:{line}: {field}: {what is wrong}"``.

    Example:
      >>> import pathlib, tempfile
      >>> from examples.finetune.template import read_records
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "train.jsonl"
      >>> _ = path.write_text('{"prompt": "1+1=", "completion": "2"}\\n\\n{"prompt": "x"}\\n')
      >>> read_records(path)
      Traceback (most recent call last):
      ...
      examples.finetune.template.DataError: ...train.jsonl:3: 'completion': missing (...)
    """
    path = Path(path)
    if path.suffix == ".txt":
        return [_text_file(path)]
    records = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON: {e.msg} at column {e.colno}") from None
        segments = _segments(obj, where)
        messages = tuple(obj["messages"]) if "messages" in obj else None
        plain = isinstance(obj, dict) and "text" in obj
        records.append(Record(number, segments, messages, plain))
    if not records:
        raise DataError(f"{path}: holds no example (one JSON object per line is expected)")
    return records


def _text_file(path: Path) -> Record:
    """A ``.txt`` file: one text document (line 1 stands for the whole file)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise DataError(f"{path}: holds no text")
    return Record(1, _text_segments(text), None, True)


def _text_segments(text: str) -> tuple[Segment, ...]:
    return (Segment(text, True, "'text'"), Segment(None, True))


def _segments(obj: Any, where: str) -> tuple[Segment, ...]:
    if not isinstance(obj, dict):
        raise DataError(
            f"{where}: expected a JSON object with fields {PROMPT_FIELDS}, {CHAT_FIELDS} or "
            f"{TEXT_FIELDS}, got {type(obj).__name__} {_short(obj)}"
        )
    if "messages" in obj:
        _check_fields(obj, CHAT_FIELDS, where, "a chat record")
        return chat_segments(_messages(obj["messages"], where))
    if "text" in obj:
        _check_fields(obj, TEXT_FIELDS, where, "a text record")
        _check_str(obj["text"], f"{where}: 'text'")
        if not obj["text"].strip():
            raise DataError(f"{where}: 'text': empty ({obj['text']!r}): nothing to learn")
        return _text_segments(obj["text"])
    if "prompt" not in obj and "completion" not in obj:
        raise DataError(
            f"{where}: no 'prompt'/'completion', 'messages' or 'text' field (found "
            f'{sorted(obj)}): each line is {{"prompt": ..., "completion": ...}}, '
            '{"messages": [...]} or {"text": ...}'
        )
    _check_fields(obj, PROMPT_FIELDS, where, "a prompt/completion record")
    prompt, completion = obj["prompt"], obj["completion"]
    _check_str(prompt, f"{where}: 'prompt'")
    _check_str(completion, f"{where}: 'completion'")
    if not completion.strip():
        raise DataError(f"{where}: 'completion': empty ({completion!r}): nothing to learn")
    return (
        Segment(prompt, False, "'prompt'"),
        Segment(completion, True, "'completion'"),
        Segment(None, True),
    )


def _messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: 'messages': expected a non-empty list of {{'role', 'content'}} objects, "
            f"got {_short(messages)}"
        )
    for k, message in enumerate(messages):
        field = f"'messages'[{k}]"
        if not isinstance(message, dict):
            raise DataError(
                f"{where}: {field}: expected an object with fields {MESSAGE_FIELDS}, "
                f"got {_short(message)}"
            )
        _check_fields(message, MESSAGE_FIELDS, where, "a message", prefix=field)
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise DataError(f"{where}: {field}['role']: must be one of {ROLES}, got {_short(role)}")
        _check_str(content, f"{where}: {field}['content']")
        if role == "assistant" and not content.strip():
            raise DataError(
                f"{where}: {field}['content']: an assistant turn is empty ({content!r}): "
                "nothing to learn"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f"{where}: 'messages': no assistant turn (roles {[m['role'] for m in messages]}): "
            "the loss counts assistant turns only, so this chat teaches nothing"
        )
    return messages


def _check_fields(
    obj: dict, fields: tuple[str, ...], where: str, kind: str, *, prefix: str = ""
) -> None:
    label = (lambda name: f"{prefix}[{name!r}]") if prefix else repr
    for name in fields:
        if name not in obj:
            raise DataError(f"{where}: {label(name)}: missing ({kind} has the fields {fields})")
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise DataError(
            f"{where}: {label(unknown[0])}: unknown field ({kind} has exactly the fields "
            f"{fields}; found {sorted(obj)})"
        )


def _check_str(value: Any, what: str) -> None:
    if not isinstance(value, str):
        raise DataError(f"{what}: must be a string, got {type(value).__name__} {_short(value)}")


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."
