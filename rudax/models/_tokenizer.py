"""A Hugging Face model folder's tokenizer: ``tokenizer.json``, the end-of-sequence id its
configs name, the ids it puts before a text, and its chat template, read once and checked.

``tokenizers`` (Hugging Face's, which reads ``tokenizer.json``) is not a dependency of rudax:
it is imported when a tokenizer is loaded, and the examples' extra installs it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rudax.models._chat import ChatTemplate, load_chat_template

__all__ = ["TOKENIZER", "ModelTokenizer", "load_tokenizer"]

TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class ModelTokenizer:
    """A Hugging Face model folder's tokenizer and the ids a data pipeline adds around text.

    Attributes:
      tokenizer: the ``tokenizers.Tokenizer`` of ``tokenizer.json``.
      eos_id: the end-of-sequence id (a training example's end, what sampling stops on).
      eos_source: the file the eos id was read from.
      prefix_ids: the ids the tokenizer's post-processor puts before a single text (Llama's
        ``<s>``; none for GPT-2-style and Qwen2 tokenizers).
      sha256: the SHA-256 of ``tokenizer.json``'s bytes, for a checkpoint to record.
      path: the ``tokenizer.json`` read.
      chat: the folder's own chat template (``load_chat_template``), or None.
    """

    tokenizer: Any  # a tokenizers.Tokenizer (tokenizers is imported only when loading)
    eos_id: int
    eos_source: str
    prefix_ids: tuple[int, ...]
    sha256: str
    path: Path
    chat: ChatTemplate | None = None


def load_tokenizer(base_dir: str | os.PathLike) -> ModelTokenizer:
    """Reads a Hugging Face directory's ``tokenizer.json`` and finds its eos id.

    The eos id is the first of: ``generation_config.json``'s ``eos_token_id``, then
    ``config.json``'s (a list of ids gives its first), then the tokenizer's only special
    token. It must be an id of the tokenizer.

    Args:
      base_dir: a directory holding ``tokenizer.json`` (and usually ``config.json``).

    Returns:
      A ``ModelTokenizer``.

    Raises:
      ValueError: ``tokenizer.json`` is missing, a config file is not a JSON object, no eos
        id can be found, or the one found is not an id of the tokenizer.

    Example:
      >>> import json, pathlib, tempfile
      >>> from tokenizers import Tokenizer, models
      >>> from rudax.models import load_tokenizer
      >>> base = pathlib.Path(tempfile.mkdtemp())
      >>> vocab = {"<eos>": 0, "some": 1, "text": 2}
      >>> Tokenizer(models.WordLevel(vocab, unk_token="<eos>")).save(str(base / "tokenizer.json"))
      >>> _ = (base / "config.json").write_text(json.dumps({"eos_token_id": 0}))
      >>> tok = load_tokenizer(base)
      >>> tok.eos_id, tok.eos_source, tok.prefix_ids
      (0, 'config.json', ())
    """
    base = Path(base_dir)
    path = base / TOKENIZER
    if not path.is_file():
        raise ValueError(f"base_dir={str(base)!r} has no {TOKENIZER}")
    blob = path.read_bytes()
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # not a dependency of the library: the examples' extra has it
        raise ImportError(
            "rudax.models.load_tokenizer reads tokenizer.json with Hugging Face's tokenizers: "
            "pip install tokenizers"
        ) from e
    tokenizer = Tokenizer.from_str(blob.decode("utf-8"))
    eos_id, source = None, ""
    for name in ("generation_config.json", "config.json"):
        if (base / name).is_file():
            try:
                value = json.loads((base / name).read_text()).get("eos_token_id")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                raise ValueError(f"{base / name}: not valid JSON of an object ({e})") from None
            if isinstance(value, list) and value:
                value = value[0]
            if value is not None:
                eos_id, source = value, name
                break
    if eos_id is None:
        specials = [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special]
        if len(specials) != 1:
            raise ValueError(
                f"{base}: no eos_token_id in generation_config.json or config.json, and the "
                f"tokenizer has {len(specials)} special tokens, not one to take for it: set "
                "eos_token_id in config.json"
            )
        eos_id, source = specials[0], TOKENIZER
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id < vocab:
        raise ValueError(
            f"{base / source}: eos_token_id={eos_id!r} is not an id of {path} ({vocab} ids)"
        )
    with_special = tokenizer.encode("a", add_special_tokens=True).ids
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    starts = [p for p in range(len(with_special)) if with_special[p : p + len(plain)] == plain]
    prefix = tuple(with_special[: starts[0]]) if starts else ()
    try:
        chat = load_chat_template(base)
    except ValueError as e:
        raise ValueError(f"base_dir={str(base)!r}: {e}") from e
    sha = hashlib.sha256(blob).hexdigest()
    return ModelTokenizer(tokenizer, eos_id, source, prefix, sha, path, chat)
