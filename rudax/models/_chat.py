"""A tokenizer's own chat template: rendered as transformers renders it, assistant turns found.

Checkpoints ship their conversation format as a Jinja template (``chat_template.jinja`` from
transformers 5, the ``chat_template`` field of ``tokenizer_config.json`` before). A model
fine-tuned on another format does not stop where its own template says a turn ends, so
training data must be rendered with the template the model will be prompted with.

``ChatTemplate.render`` is ``apply_chat_template(..., tokenize=False)``: the same sandboxed
Jinja environment settings (``trim_blocks``, ``lstrip_blocks``, loop controls), the same
helpers (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text), the
``{% generation %}`` tag, and the tokenizer's special tokens as variables (``bos_token``,
``eos_token``...).

``ChatTemplate.segments`` splits a conversation into the text the loss counts (each assistant
turn as the template writes it, its end-of-turn marker included, so the model learns to stop)
and the context around it. Each assistant turn is found as the difference between the
conversation rendered up to it with the generation prompt and rendered through it: a
template for which that is not a prefix (one that rewrites earlier turns later) is refused.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ChatTemplate", "load_chat_template"]

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _environment() -> Any:
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # an optional dependency: only chat templates need it
        raise ImportError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from e

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body (transformers uses
        it to mark assistant text; rudax finds the turns by rendering prefixes instead)."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
        sort_keys: bool = False,
    ) -> str:  # fmt: skip
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it may refer to.

    Attributes:
      template: the Jinja source.
      special_tokens: ``{"bos_token": "<s>", "eos_token": "</s>", ...}``: variables the
        template reads, as the tokenizer's config names them.

    Example:
      >>> from rudax.models import ChatTemplate
      >>> chat = ChatTemplate(
      ...     "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
      ...     "{% if add_generation_prompt %}<|assistant|>{% endif %}")
      >>> chat.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
      '<|user|>hi<|end|><|assistant|>'
      >>> chat.segments([{"role": "user", "content": "hi"},
      ...                {"role": "assistant", "content": "hello"}])
      [('<|user|>hi<|end|><|assistant|>', False), ('hello<|end|>', True)]
    """

    template: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.template, str) or not self.template:
            raise TypeError(f"template must be a non-empty string, got {self.template!r}")
        object.__setattr__(self, "special_tokens", dict(self.special_tokens))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        **variables: Any,
    ) -> str:
        """The conversation as text, as ``apply_chat_template(tokenize=False)`` gives it."""
        compiled = _compiled(self.template)
        context = {**self.special_tokens, **variables}
        return str(
            compiled.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **context
            )
        )

    def segments(self, messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, bool]]:
        """``(text, counted)`` pieces whose concatenation is ``render(messages)``: each
        assistant turn counted, everything else (headers, other turns) not.

        Raises:
          ValueError: the conversation has no assistant turn, or the template does not render
            it as a growing prefix (so its assistant turns cannot be located).
        """
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns:
            raise ValueError("messages hold no assistant turn: nothing to learn")
        pieces: list[tuple[str, bool]] = []
        done = ""
        for i in turns:
            prompt = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not prompt.startswith(done) or not through.startswith(prompt):
                raise ValueError(
                    f"the chat template does not render messages[:{i + 1}] as a continuation "
                    f"of messages[:{i}] with the generation prompt, so assistant turn {i} cannot "
                    "be told from its context"
                )
            pieces += [(prompt[len(done) :], False), (through[len(prompt) :], True)]
            done = through
        full = self.render(messages)
        if not full.startswith(done):
            raise ValueError("the chat template rewrites earlier turns once later ones follow")
        pieces.append((full[len(done) :], False))
        return [(text, counted) for text, counted in pieces if text]


_CACHE: dict[str, Any] = {}


def _compiled(template: str) -> Any:
    if template not in _CACHE:
        _CACHE[template] = _environment().from_string(template)
    return _CACHE[template]


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def load_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The chat template a tokenizer folder holds, or None when it has none.

    ``chat_template.jinja`` (transformers 5) first, else ``tokenizer_config.json``'s
    ``chat_template``: a string, or a list of named templates (the one named ``"default"``).
    The special tokens come from ``tokenizer_config.json``.

    Args:
      directory: a folder as ``AutoTokenizer.save_pretrained`` writes it.
    """
    folder = Path(directory)
    config: dict[str, Any] = {}
    if (folder / TOKENIZER_CONFIG).is_file():
        try:
            loaded = json.loads((folder / TOKENIZER_CONFIG).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{folder / TOKENIZER_CONFIG}: not JSON ({e})") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"{folder / TOKENIZER_CONFIG}: not a JSON object")
        config = loaded
    template: Any = None
    if (folder / TEMPLATE_FILE).is_file():
        template = (folder / TEMPLATE_FILE).read_text()
    else:
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str) or not template:
        raise ValueError(f"{folder}: chat_template={template!r} is not a template string")
    special = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
    return ChatTemplate(template, special)
