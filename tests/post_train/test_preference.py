"""rudax.post_train.tokenize_preference against TRL 1.16's own DPOTrainer._prepare_dataset run
on transformers' tokenizer of the same files: text examples (a bos post-processor, the eos
appended, a prompt whose last token merges with the answer's first) and chat examples through
the folder's chat template; bad examples named."""

from __future__ import annotations

import json
import types

import pytest

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
dpo_trainer = pytest.importorskip("trl.trainer.dpo_trainer")

from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: E402

from rudax.models import load_tokenizer  # noqa: E402
from rudax.post_train import tokenize_preference  # noqa: E402

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
WORDS += ["a", "b", "c", "d", "e", "ab", "\n"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tokenizer with a bos post-processor, merges ("a" "b" -> "ab") and a ChatML template,
    saved by transformers, with config.json naming </s> the eos."""
    tok = Tokenizer(
        models.BPE({w: i for i, w in enumerate(WORDS)}, [("a", "b")], unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.Split("\n", "isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.chat_template = CHATML
    root = tmp_path_factory.mktemp("tokenizer")
    hf.save_pretrained(root)
    (root / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return root


def _trl(folder, example):
    """TRL's own tokenization of one example (its method, run on a stand-in trainer)."""
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    trainer = types.SimpleNamespace(_tokenizer=hf)
    args = types.SimpleNamespace(
        dataset_num_proc=None, max_length=None, truncation_mode="keep_start"
    )
    dataset = datasets.Dataset.from_list([example])
    row = dpo_trainer.DPOTrainer._prepare_dataset(trainer, dataset, hf, args, "test")[0]
    return row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]


def _user(text):
    return [{"role": "user", "content": text}]


def _assistant(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "example",
    [
        {"prompt": "ab", "chosen": "cd", "rejected": "e"},
        {"prompt": "a", "chosen": "bcd", "rejected": "c"},  # "a" + "b..." merges into "ab"
        {"prompt": "a\nb", "chosen": "c</s>", "rejected": "d"},  # already ended
        {"prompt": _user("ab"), "chosen": _assistant("cd"), "rejected": _assistant("e")},
        {"prompt": [{"role": "system", "content": "a"}, *_user("b")],
         "chosen": _assistant("c"), "rejected": _assistant("dd")},
    ],
)  # fmt: skip
def test_the_ids_are_trls(folder, example):
    ours = tokenize_preference(example, load_tokenizer(folder))
    assert ours == tuple(list(x) for x in _trl(folder, example))
    assert all(ours)


def test_bad_examples_are_named(folder, tmp_path):
    tok = load_tokenizer(folder)
    for example, message in [
        ({"prompt": "a", "chosen": "b"}, "the example has no 'rejected'"),
        ({"prompt": "a", "chosen": "b", "rejected": "b"}, "chosen and rejected are the same"),
        ({"prompt": "a", "chosen": 3, "rejected": "b"}, "chosen must be text or a non-empty list"),
        ({"prompt": _user("a"), "chosen": "b", "rejected": "c"}, "all text or all chat messages"),
        ({"prompt": _user("a"), "chosen": _user("b"), "rejected": _assistant("c")},
         r"chosen must start with the assistant's turn, got roles \['user'\]"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            tokenize_preference(example, tok)
    (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    with pytest.raises(ValueError, match="has no chat template"):
        chat = {"prompt": _user("a"), "chosen": _assistant("b"), "rejected": _assistant("c")}
        tokenize_preference(chat, load_tokenizer(tmp_path))
