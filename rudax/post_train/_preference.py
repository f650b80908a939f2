"""``tokenize_preference``: a DPO example (prompt, chosen, rejected) to token ids, as TRL does.

TRL 1.16's ``DPOTrainer`` tokenizes ``prompt``, ``prompt + chosen`` and ``prompt + rejected``
each whole (plain text with the tokenizer's special tokens, its bos; chat messages through
the chat template, the prompt with the generation prompt) and lets each answer start where
the prompt's ids and the pair's diverge: a template may render a prompt alone differently
from the same prompt followed by an answer, and tokens may merge across the boundary.
Plain answers get the eos token's text appended first (unless they end with it). This is
that, on a ``rudax.models.ModelTokenizer``, checked against TRL's own code in the tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rudax.models import ModelTokenizer

__all__ = ["tokenize_preference"]

_FIELDS = ("prompt", "chosen", "rejected")


def tokenize_preference(
    example: Mapping[str, Any], tokenizer: ModelTokenizer
) -> tuple[list[int], list[int], list[int]]:
    """``(prompt ids, chosen ids, rejected ids)`` of one preference example.

    Args:
      example: TRL's explicit-prompt preference format, either all text::

            {"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}

        or all chat messages (the answers the assistant's turns that follow the prompt)::

            {"prompt": [{"role": "user", "content": "2+2?"}],
             "chosen": [{"role": "assistant", "content": "4"}],
             "rejected": [{"role": "assistant", "content": "5"}]}

        Other fields are ignored.
      tokenizer: the model's (``rudax.models.load_tokenizer``); chat messages need its chat
        template.

    Returns:
      Three lists of ids: ``pack_shared_prefix([(prompt, [chosen, rejected])])`` takes them.

    Raises:
      ValueError: a field is missing or of the wrong kind, text and messages are mixed,
        the chosen answer equals the rejected one, chat messages come without a chat
        template, or an answer (or the prompt) has no token of its own. The message names
        the field.

    Example:
      >>> import json, pathlib, tempfile
      >>> from tokenizers import Tokenizer, models, pre_tokenizers
      >>> from rudax.models import load_tokenizer
      >>> from rudax.post_train import tokenize_preference
      >>> folder = pathlib.Path(tempfile.mkdtemp())
      >>> words = ["<eos>", "2+2=", "4", "5"]
      >>> tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
      >>> tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
      >>> _ = tok.add_special_tokens(["<eos>"])  # the eos: one id, read as such in text
      >>> tok.save(str(folder / "tokenizer.json"))
      >>> tokenize_preference({"prompt": "2+2=", "chosen": " 4", "rejected": " 5"},
      ...                     load_tokenizer(folder))
      ([1], [2, 0], [3, 0])
    """
    missing = [f for f in _FIELDS if f not in example]
    if missing:
        raise ValueError(
            f"the example has no {' or '.join(map(repr, missing))}: a preference example is "
            '{"prompt": ..., "chosen": ..., "rejected": ...} (text, or chat messages)'
        )
    kinds = {f: _kind(f, example[f]) for f in _FIELDS}
    if len(set(kinds.values())) > 1:
        raise ValueError(
            "prompt, chosen and rejected must be all text or all chat messages, got "
            + ", ".join(f"{f}: {k}" for f, k in kinds.items())
        )
    prompt, chosen, rejected = (example[f] for f in _FIELDS)
    if chosen == rejected:
        raise ValueError(
            f"chosen and rejected are the same ({chosen!r:.80}): a pair teaches nothing"
        )
    if kinds["prompt"] == "text":
        eos = tokenizer.tokenizer.id_to_token(tokenizer.eos_id)
        encode = lambda text: tokenizer.tokenizer.encode(text, add_special_tokens=True).ids
        ended = lambda answer: answer if answer.endswith(eos) else answer + eos
        prompt_ids = encode(prompt)
        pairs = [encode(prompt + ended(answer)) for answer in (chosen, rejected)]
    else:
        if tokenizer.chat is None:
            raise ValueError(
                f"the example is chat messages, and {tokenizer.path.parent} has no chat template "
                "(chat_template.jinja, or tokenizer_config.json's chat_template) to render them"
            )
        for f in ("chosen", "rejected"):
            roles = [m.get("role") for m in example[f]]
            if not roles or roles[0] != "assistant":
                raise ValueError(f"{f} must start with the assistant's turn, got roles {roles}")
        chat = tokenizer.chat
        encode = lambda text: tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        prompt_ids = encode(chat.render(prompt, add_generation_prompt=True))
        pairs = [encode(chat.render([*prompt, *answer])) for answer in (chosen, rejected)]
    # Each answer starts where the prompt's ids and the pair's diverge (TRL's rule).
    start = min(_common_prefix(prompt_ids, ids) for ids in pairs)
    out = (prompt_ids[:start], pairs[0][start:], pairs[1][start:])
    for name, ids in zip(_FIELDS, out, strict=True):
        if not ids:
            raise ValueError(f"{name} has no token of its own after tokenization")
    return out


def _kind(field: str, value: Any) -> str:
    if isinstance(value, str):
        return "text"
    if (
        isinstance(value, Sequence)
        and value
        and all(isinstance(m, Mapping) and {"role", "content"} <= m.keys() for m in value)
    ):
        return "messages"
    raise ValueError(
        f"{field} must be text or a non-empty list of chat messages ({{'role': ..., 'content': "
        f"...}}), got {value!r:.80}"
    )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
