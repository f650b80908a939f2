"""rudax.models.load_tokenizer: a Hugging Face folder's tokenizer.json, its eos id taken from
generation_config.json, then config.json, then the tokenizer's one special token, checked to
be an id of the tokenizer; the ids its post-processor puts before a text (a Llama's bos); the
file's digest; a clear error for a missing file, bad JSON, an ambiguous eos and a missing
``tokenizers`` package."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from rudax.models import ModelTokenizer, load_tokenizer

WORDS = ["<|endoftext|>", "<s>", "a", "b", "c", "d", "e", "f", "g", "h"]


def _folder(tmp_path, *, specials=("<|endoftext|>",), bos=False):
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(specials))
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_eos_comes_from_generation_config_then_config_then_the_special_token(tmp_path):
    d = _folder(tmp_path)
    t = load_tokenizer(d)  # no config: the tokenizer's one special token, <|endoftext|>
    assert isinstance(t, ModelTokenizer)
    assert (t.eos_id, t.eos_source, t.prefix_ids, t.chat) == (0, "tokenizer.json", (), None)
    (d / "config.json").write_text(json.dumps({"eos_token_id": [5, 0]}))
    assert (load_tokenizer(d).eos_id, load_tokenizer(d).eos_source) == (5, "config.json")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    t = load_tokenizer(d)
    assert (t.eos_id, t.eos_source) == (7, "generation_config.json")
    assert t.sha256 == hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()
    assert t.path == d / "tokenizer.json"


def test_bad_folders_are_named(tmp_path):
    d = _folder(tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": len(WORDS)}))
    with pytest.raises(ValueError, match=rf"eos_token_id={len(WORDS)} is not an id of .*\(10 ids"):
        load_tokenizer(d)
    (d / "generation_config.json").write_text("{eos_token_id: 7}")
    with pytest.raises(ValueError, match=r"generation_config\.json: not valid JSON"):
        load_tokenizer(d)
    (d / "generation_config.json").unlink()
    d = _folder(tmp_path, specials=("<|endoftext|>", "<s>"))
    with pytest.raises(ValueError, match="the tokenizer has 2 special tokens, not one"):
        load_tokenizer(d)
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_a_post_processors_bos_is_the_prefix(tmp_path):
    d = _folder(tmp_path, bos=True)
    (d / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    t = load_tokenizer(d)
    assert t.prefix_ids == (1,)
    assert t.tokenizer.encode("a b", add_special_tokens=True).ids == [1, 2, 3]


def test_without_the_tokenizers_package_the_error_says_what_to_install(tmp_path, monkeypatch):
    d = _folder(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now fails
    with pytest.raises(ImportError, match="pip install tokenizers"):
        load_tokenizer(d)
