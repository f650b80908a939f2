"""examples/finetune's data: JSONL records -> tokens -> packed or padded, labelled batches.

The expectation is written here plainly, one example at a time: its ids are the tokenizer's
ids of each segment in the order of the template, and a position is labelled with the next
token exactly when that next token belongs to the completion (or an assistant turn, or is the
eos after one). Batches are then checked against it row by row.
"""

import doctest
import hashlib
import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, processors

from examples.finetune import data as fdata
from examples.finetune import template
from examples.finetune.data import FinetuneData, counted_tokens
from examples.finetune.template import DataError, render
from examples.lm.tokenizer import train_tokenizer
from rudax.models import load_tokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "return", "value", "sum", "of", "the", "list"]
EOS = 0  # <|endoftext|> in examples.lm's tokenizer, config.json's eos_token_id below


def _sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_records(n, seed=0):
    """``n`` distinct records, prompt/completion and chats mixed, of varied lengths."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        if k % 3 == 2:
            out.append(
                {
                    "messages": [
                        {"role": "system", "content": f"be brief {k}"},
                        {"role": "user", "content": _sentence(rng, rng.randint(1, 4))},
                        {"role": "assistant", "content": _sentence(rng, rng.randint(1, 3))},
                        {"role": "user", "content": f"and {k}?"},
                        {"role": "assistant", "content": _sentence(rng, 2)},
                    ]
                }
            )
        else:
            prompt = f"def f{k}(" + _sentence(rng, rng.randint(0, 5)) + "):"
            out.append({"prompt": prompt, "completion": " " + _sentence(rng, rng.randint(1, 6))})
    return out


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A Hugging Face-like directory: a tiny byte-level BPE and config.json's eos id."""
    root = tmp_path_factory.mktemp("base")
    rng = random.Random(1)
    sample = [_sentence(rng, 30) + " def f(a): <|user|> <|assistant|>" for _ in range(50)]
    train_tokenizer(sample, 320).save(str(root / "tokenizer.json"))
    (root / "config.json").write_text(json.dumps({"eos_token_id": EOS, "vocab_size": 320}))
    return root


@pytest.fixture(scope="module")
def tok(base):
    return load_tokenizer(base)


def expected(tokenizer, record, *, prefix=()):
    """(ids, labels) of one record, written out from the template's definition."""

    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False).ids

    ids, counted = list(prefix), [False] * len(prefix)
    if "messages" in record:
        for m in record["messages"]:
            header, content = enc(f"<|{m['role']}|>\n"), enc(m["content"] + "\n")
            ids += header + content
            counted += [False] * len(header) + [m["role"] == "assistant"] * len(content)
            if m["role"] == "assistant":
                ids.append(EOS)
                counted.append(True)
    else:
        p, c = enc(record["prompt"]), enc(record["completion"])
        ids += p + c + [EOS]
        counted += [False] * len(p) + [True] * (len(c) + 1)
    labels = []
    for t in range(len(ids)):
        if t + 1 < len(ids) and counted[t + 1]:
            labels.append(ids[t + 1])
        else:
            labels.append(-100)
    return ids, labels


def row_segments(batch, r):
    """The examples of row r as (tokens, labels, positions) lists, split by segment id."""
    seg = batch["segment_ids"][r].tolist()
    out = []
    for k in range(1, max(seg, default=0) + 1):
        where = [t for t, s in enumerate(seg) if s == k]
        assert where == list(range(where[0], where[-1] + 1)), f"segment {k} not contiguous"
        out.append(
            (
                [int(batch["tokens"][r, t]) for t in where],
                [int(batch["labels"][r, t]) for t in where],
                [int(batch["positions"][r, t]) for t in where],
            )
        )
    return out


def check_padding(batch, r, used, pad_id):
    assert batch["segment_ids"][r, :used].min(initial=1) >= 1
    assert (batch["segment_ids"][r, used:] == 0).all()
    assert (batch["labels"][r, used:] == -100).all()
    assert (batch["positions"][r, used:] == 0).all()
    assert (batch["tokens"][r, used:] == pad_id).all()


# ---------------------------------------------------------------------------------------------
# labels, template, padding


def test_unpacked_rows_equal_the_reference(base, tok, tmp_path):
    records = make_records(12)
    path = write_jsonl(tmp_path / "d.jsonl", records)
    data = FinetuneData(path, tok, seq_len=64, batch_size=4, seed=0, pack=False, shuffle=False)
    refs = [expected(tok.tokenizer, r) for r in records]
    assert data.lines.tolist() == list(range(1, 13))
    for i in range(3):
        batch = data.batch(i)
        assert set(batch) == set(fdata.KEYS)
        for name, array in batch.items():
            assert array.dtype == np.int32 and array.shape == (4, 64), name
        for r in range(4):
            ids, labels = refs[4 * i + r]
            n = len(ids)
            assert batch["tokens"][r, :n].tolist() == ids
            assert batch["labels"][r, :n].tolist() == labels
            assert batch["positions"][r, :n].tolist() == list(range(n))
            assert batch["segment_ids"][r, :n].tolist() == [1] * n
            check_padding(batch, r, n, pad_id=EOS)
        assert counted_tokens(batch) == sum(
            sum(x != -100 for x in refs[4 * i + r][1]) for r in range(4)
        )
    assert data.counted.tolist() == [sum(x != -100 for x in lab) for _, lab in refs]


def test_prompt_completion_counts_the_completion_and_eos_only(base, tok, tmp_path):
    """By hand: the labelled ids decode to the completion, then the eos; the prompt and
    the last position are -100."""
    record = {"prompt": "def f(a):", "completion": " return the sum"}
    data = FinetuneData(
        write_jsonl(tmp_path / "d.jsonl", [record]), tok, seq_len=32, batch_size=1, seed=0
    )
    batch = data.batch(0)
    p = tok.tokenizer.encode("def f(a):", add_special_tokens=False).ids
    c = tok.tokenizer.encode(" return the sum", add_special_tokens=False).ids
    labels = batch["labels"][0].tolist()
    assert labels[: len(p) - 1] == [-100] * (len(p) - 1)  # predicting prompt tokens: not counted
    assert labels[len(p) - 1 : len(p) + len(c)] == [*c, EOS]  # the completion, then the eos
    assert labels[len(p) + len(c) :] == [-100] * (32 - len(p) - len(c))
    assert tok.tokenizer.decode(c) == " return the sum"


def test_prompt_is_each_examples_context_in_file_order(base, tok, tmp_path):
    rows = [
        {"prompt": "def f(a):", "completion": " return the sum"},
        {"prompt": "class A:", "completion": " a thing"},
    ]
    data = FinetuneData(
        write_jsonl(tmp_path / "d.jsonl", rows), tok, seq_len=32, batch_size=1, seed=0
    )
    for k, row in enumerate(rows):
        want = tok.tokenizer.encode(row["prompt"], add_special_tokens=False).ids
        assert data.prompt(k).tolist() == want
    with pytest.raises(ValueError, match=r"k must be in \[0, 2\), got k=2"):
        data.prompt(2)


def test_text_is_counted_whole_and_a_long_document_cut_into_rows(base, tok, tmp_path):
    rng = random.Random(3)
    text = " ".join(_sentence(rng, 12) for _ in range(6))
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    (tmp_path / "corpus.txt").write_text(text)
    write_jsonl(tmp_path / "short.jsonl", [{"text": "def f(a):"}])
    short = FinetuneData(tmp_path / "short.jsonl", tok, seq_len=32, batch_size=1, seed=0)
    s = tok.tokenizer.encode("def f(a):", add_special_tokens=False).ids
    assert [x for x in short.batch(0)["labels"][0].tolist() if x != -100] == [*s[1:], EOS]
    seq_len = 16
    data = FinetuneData(
        tmp_path / "corpus.txt", tok, seq_len=seq_len, batch_size=1, seed=0, shuffle=False,
        pack=False,
    )  # fmt: skip
    whole = [*ids, EOS]
    rows = [whole[lo : lo + seq_len] for lo in range(0, len(whole), seq_len)]
    rows = [r for r in rows if len(r) > 1]
    assert len(rows) > 2 and data.num_examples == len(rows)
    for r, want in enumerate(rows):
        batch = data.batch(r)
        assert batch["tokens"][0, : len(want)].tolist() == want
        # every token but the row's first is predicted from the row before it
        assert batch["labels"][0, : len(want) - 1].tolist() == want[1:]
    assert data.counted.tolist() == [len(r) - 1 for r in rows]
    assert data.prompt(0).tolist() == rows[0][:8]  # a text's prompt: its first half


def test_an_empty_prompt_leaves_the_first_token_unpredicted(tok, tmp_path):
    """Nothing comes before an example's first token, so it is never a target, even when it
    starts the completion: counted = the completion's other tokens + the eos."""
    record = {"prompt": "", "completion": "return the sum"}
    data = FinetuneData(
        write_jsonl(tmp_path / "d.jsonl", [record]), tok, seq_len=32, batch_size=1, seed=0
    )
    c = tok.tokenizer.encode("return the sum", add_special_tokens=False).ids
    batch = data.batch(0)
    assert batch["tokens"][0, : len(c) + 1].tolist() == [*c, EOS]
    assert [x for x in batch["labels"][0].tolist() if x != -100] == [*c[1:], EOS]
    assert data.counted.tolist() == [len(c)] == [counted_tokens(batch)]


def test_chat_template_renders_and_counts_assistant_turns(base, tok, tmp_path):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "sum of the list?"},
        {"role": "assistant", "content": "the sum"},
        {"role": "user", "content": "and alpha?"},
        {"role": "assistant", "content": "beta"},
    ]
    (record,) = template.read_records(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]))
    assert render(record.segments, eos="<E>") == (
        "<|system|>\nbe brief\n<|user|>\nsum of the list?\n"
        "<|assistant|>\nthe sum\n<E><|user|>\nand alpha?\n<|assistant|>\nbeta\n<E>"
    )
    data = FinetuneData(tmp_path / "c.jsonl", tok, seq_len=128, batch_size=1, seed=0)
    batch = data.batch(0)
    ids, labels = expected(tok.tokenizer, {"messages": messages})
    assert batch["tokens"][0, : len(ids)].tolist() == ids
    assert batch["labels"][0, : len(ids)].tolist() == labels
    # The counted targets are exactly each answer + "\n" followed by the eos.
    targets = [x for x in batch["labels"][0].tolist() if x != -100]
    answer_1 = tok.tokenizer.encode("the sum\n", add_special_tokens=False).ids
    answer_2 = tok.tokenizer.encode("beta\n", add_special_tokens=False).ids
    assert targets == [*answer_1, EOS, *answer_2, EOS]
    # Every token of the full rendering is in the row: the template hides nothing.
    assert tok.tokenizer.decode(ids, skip_special_tokens=False) == render(
        record.segments, eos="<|endoftext|>"
    )


def test_same_ids_as_transformers(base, tok, tmp_path):
    """PreTrainedTokenizerFast on the same tokenizer.json: the same ids per segment."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(base / "tokenizer.json"))
    records = make_records(9, seed=3)
    data = FinetuneData(
        write_jsonl(tmp_path / "d.jsonl", records),
        tok,
        seq_len=96,
        batch_size=9,
        seed=0,
        pack=False,
        shuffle=False,
    )
    batch = data.batch(0)
    for r, record in enumerate(records):
        if "messages" in record:
            ids = []
            for m in record["messages"]:
                ids += hf(f"<|{m['role']}|>\n", add_special_tokens=False)["input_ids"]
                ids += hf(m["content"] + "\n", add_special_tokens=False)["input_ids"]
                ids += [EOS] if m["role"] == "assistant" else []
        else:
            ids = hf(record["prompt"], add_special_tokens=False)["input_ids"]
            ids += hf(record["completion"], add_special_tokens=False)["input_ids"] + [EOS]
        assert batch["tokens"][r, : len(ids)].tolist() == ids
        assert batch["segment_ids"][r, len(ids) :].sum() == 0


def test_a_post_processor_bos_prefixes_every_example(base, tmp_path):
    """A Llama-like tokenizer.json that puts a bos before a sequence: each example starts
    with it, uncounted, as transformers' tokenizer(prompt) starts with it."""
    transformers = pytest.importorskip("transformers")
    llama = tmp_path / "llama"
    llama.mkdir()
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.add_special_tokens(["<s>"])
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tokenizer.save(str(llama / "tokenizer.json"))
    (llama / "config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": bos}))
    tok = load_tokenizer(llama)
    assert tok.prefix_ids == (bos,)
    record = {"prompt": "def f(a):", "completion": " return a"}
    data = FinetuneData(
        write_jsonl(tmp_path / "d.jsonl", [record, record]), tok, seq_len=32, batch_size=1, seed=0
    )
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(llama / "tokenizer.json"))
    prompt = hf("def f(a):")["input_ids"]
    assert prompt[0] == bos
    batch = data.batch(0)
    ids, labels = expected(tok.tokenizer, record, prefix=(bos,))
    assert batch["tokens"][0, : len(prompt)].tolist() == prompt
    assert batch["tokens"][0, : len(ids)].tolist() == ids
    assert batch["labels"][0, : len(ids)].tolist() == labels
    assert batch["segment_ids"][0].tolist().count(2) == len(ids)  # both fit, each with its bos


# ---------------------------------------------------------------------------------------------
# packing, order, determinism


def test_packing_keeps_examples_whole_and_fills_rows_next_fit(tok, tmp_path):
    records = make_records(40, seed=5)
    refs = {tuple(ids): labels for ids, labels in (expected(tok.tokenizer, r) for r in records)}
    assert len(refs) == 40  # distinct examples: a row's segment names one
    seq_len, batch_size = 80, 3
    data = FinetuneData(
        write_jsonl(tmp_path / "d.jsonl", records),
        tok,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=7,
    )
    rows_0, rows_1 = data.rows_in_epoch(0), data.rows_in_epoch(1)
    assert rows_0 < 40  # packing put several examples in some rows
    n_batches = -(-(rows_0 + rows_1) // batch_size)  # both epochs, whole
    stream = []  # the stream's rows, each a list of examples (tuples of ids)
    for i in range(n_batches):
        batch = data.batch(i)
        for r in range(batch_size):
            used = 0
            row = []
            for ids, labels, positions in row_segments(batch, r):
                assert labels == refs[tuple(ids)]  # labels shifted within the example only
                assert labels[-1] == -100
                assert positions == list(range(len(ids)))
                used += len(ids)
                row.append(tuple(ids))
            assert row, "a training row is never empty"
            check_padding(batch, r, used, pad_id=EOS)
            stream.append(row)
    epoch_0 = [ex for row in stream[:rows_0] for ex in row]
    assert sorted(epoch_0) == sorted(refs)  # every example once per epoch
    epoch_1 = [ex for row in stream[rows_0 : rows_0 + rows_1] for ex in row]
    assert sorted(epoch_1) == sorted(refs)
    assert epoch_0 != epoch_1[: len(epoch_0)]  # a new order
    # next fit: a row ends only when the next example of the epoch would not fit in it.
    for k in range(rows_0 - 1):
        row_len = sum(map(len, stream[k]))
        assert row_len <= seq_len
        assert row_len + len(stream[k + 1][0]) > seq_len


def test_batches_follow_the_documented_order(tok, tmp_path):
    """Unpacked rows: the stream is epoch 0's Philox(seed, 0) permutation, then epoch 1's,
    ...; batch i is its rows [iB, (i + 1)B), across an epoch's end."""
    records = make_records(7, seed=2)
    refs = [expected(tok.tokenizer, r)[0] for r in records]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    seed, batch_size = 11, 3
    data = FinetuneData(path, tok, seq_len=96, batch_size=batch_size, seed=seed, pack=False)
    orders = [
        np.random.Generator(np.random.Philox(key=np.array([seed, e], np.uint64))).permutation(7)
        for e in range(4)
    ]
    stream = np.concatenate(orders).tolist()
    for i in range(9):
        batch = data.batch(i)
        for r in range(batch_size):
            ids = refs[stream[i * batch_size + r]]
            assert batch["tokens"][r, : len(ids)].tolist() == ids
        assert data.epoch_of(i) == (i * batch_size) // 7
    assert not np.array_equal(orders[0], orders[1])
    plain = FinetuneData(path, tok, seq_len=96, batch_size=7, seed=seed, pack=False, shuffle=False)
    for i in range(2):  # file order every epoch
        for r in range(7):
            assert plain.batch(i)["tokens"][r, : len(refs[r])].tolist() == refs[r]


def test_batch_is_a_pure_function_of_file_seed_and_index(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", make_records(20, seed=4))
    kw = dict(seq_len=80, batch_size=2, seed=3)
    first = FinetuneData(path, tok, **kw)
    forward = [first.batch(i) for i in range(25)]  # several epochs
    fresh = FinetuneData(path, tok, **kw)
    for i in reversed(range(25)):  # another object, another access order: a resumed run
        again = fresh.batch(i)
        for key in fdata.KEYS:
            np.testing.assert_array_equal(again[key], forward[i][key])
    assert fresh.identity() == first.identity()
    assert first.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert first.tokenizer_sha256 == hashlib.sha256((tok.path).read_bytes()).hexdigest()
    other = FinetuneData(path, tok, **{**kw, "seed": 4})
    assert other.identity() != first.identity()
    assert any(not np.array_equal(other.batch(i)["tokens"], forward[i]["tokens"]) for i in range(5))


def test_host_shards_concatenate_to_the_batch(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", make_records(10))
    data = FinetuneData(path, tok, seq_len=80, batch_size=4, seed=0)
    for i in (0, 3):
        whole = data.batch(i)
        parts = [data.batch(i, shard=s, num_shards=2) for s in range(2)]
        for key in fdata.KEYS:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
    with pytest.raises(ValueError, match="num_shards must divide batch_size=4"):
        data.batch(0, num_shards=3)
    with pytest.raises(ValueError, match="shard must be in"):
        data.batch(0, shard=2, num_shards=2)


def test_eval_batches_hold_every_example_once_in_file_order(tok, tmp_path):
    records = make_records(11, seed=6)
    refs = [tuple(expected(tok.tokenizer, r)[0]) for r in records]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    for pack in (True, False):
        data = FinetuneData(path, tok, seq_len=96, batch_size=4, seed=0, pack=pack)
        batches = data.eval_batches()
        seen = [tuple(ids) for b in batches for r in range(4) for ids, _, _ in row_segments(b, r)]
        assert seen == refs
        assert all(b["tokens"].shape == (4, 96) for b in batches)
        assert sum(counted_tokens(b) for b in batches) == int(data.counted.sum())
        if not pack:  # 11 rows in batches of 4: the last holds one empty row
            assert len(batches) == 3
            check_padding(batches[-1], 3, 0, pad_id=EOS)


# ---------------------------------------------------------------------------------------------
# long examples, errors


def test_too_long_is_an_error_naming_the_line_or_dropped_and_listed(tok, tmp_path):
    long = {"prompt": "def f():", "completion": " " + " ".join(["alpha beta"] * 40)}
    short = [{"prompt": f"def f{k}():", "completion": " return"} for k in range(5)]
    records = [*short[:3], long, *short[3:], long]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    n = len(expected(tok.tokenizer, long)[0])
    assert n > 40
    with pytest.raises(DataError, match=rf"d\.jsonl:4: {n} tokens, longer than seq_len=40"):
        FinetuneData(path, tok, seq_len=40, batch_size=2, seed=0)
    data = FinetuneData(path, tok, seq_len=40, batch_size=2, seed=0, too_long="drop")
    assert data.dropped == (4, 7)
    assert data.lines.tolist() == [1, 2, 3, 5, 6]
    assert data.identity()["dropped"] == [4, 7]
    fits = FinetuneData(path, tok, seq_len=n, batch_size=2, seed=0)  # exactly seq_len fits
    assert fits.dropped == () and fits.num_examples == 7
    only_long = write_jsonl(tmp_path / "long.jsonl", [long])
    with pytest.raises(DataError, match="all 1 examples are longer than seq_len=40"):
        FinetuneData(only_long, tok, seq_len=40, batch_size=2, seed=0, too_long="drop")


GOOD = json.dumps({"prompt": "a", "completion": "b"})


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a", "completion": "b"', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt": "a"}', "'completion': missing"),
        ('{"completion": "b"}', "'prompt': missing"),
        ('{"prompt": "a", "completion": "b", "id": 3}', "'id': unknown field"),
        ('{"prompt": "a", "completion": ""}', "'completion': empty"),
        ('{"prompt": "a", "completion": "  \\n"}', "'completion': empty"),
        ('{"prompt": "a", "completion": 3}', "'completion': must be a string, got int 3"),
        ('{"prompt": null, "completion": "b"}', "'prompt': must be a string, got NoneType"),
        ('{"body": "a"}', "no 'prompt'/'completion', 'messages' or 'text' field"),
        ('{"messages": [], "prompt": "a"}', "'prompt': unknown field"),
        ('{"messages": []}', "'messages': expected a non-empty list"),
        ('{"messages": "hi"}', "'messages': expected a non-empty list"),
        ('{"messages": ["hi"]}', "'messages'[0]: expected an object"),
        ('{"messages": [{"role": "user"}]}', "'messages'[0]['content']: missing"),
        (
            '{"messages": [{"role": "user", "content": "a", "name": "x"}]}',
            "'messages'[0]['name']: unknown field",
        ),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}',
            "'messages'[1]['role']: must be one of ('system', 'user', 'assistant'), got \"bot\"",
        ),
        (
            '{"messages": [{"role": "assistant", "content": ["b"]}]}',
            "'messages'[0]['content']: must be a string, got list",
        ),
        (
            '{"messages": [{"role": "user", "content": "a"}, '
            '{"role": "assistant", "content": ""}]}',
            "'messages'[1]['content']: an assistant turn is empty",
        ),
        (
            '{"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]}',
            "'messages': no assistant turn",
        ),
    ],
)
def test_bad_records_name_file_line_and_field(tok, tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")  # the bad record is on line 3
    with pytest.raises(DataError) as info:
        FinetuneData(path, tok, seq_len=32, batch_size=1, seed=0)
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value)


def test_bad_files(tok, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(DataError, match=r"empty\.jsonl: holds no example"):
        FinetuneData(empty, tok, seq_len=32, batch_size=1, seed=0)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(GOOD.encode() + b'\n{"prompt": "caf\xe9", "completion": "b"}\n')
    with pytest.raises(DataError, match=r"latin\.jsonl:2: not UTF-8 text"):
        FinetuneData(latin, tok, seq_len=32, batch_size=1, seed=0)
    special = write_jsonl(
        tmp_path / "s.jsonl",
        [
            GOOD,
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b <|endoftext|>"},
                ]
            },
        ],
    )
    with pytest.raises(
        DataError, match=r"s\.jsonl:2: 'messages'\[1\]\['content'\]: holds '<\|endoftext\|>'"
    ):
        FinetuneData(special, tok, seq_len=32, batch_size=1, seed=0)
    big = write_jsonl(tmp_path / "b.jsonl", [GOOD])
    with pytest.raises(DataError, match=r"b\.jsonl:1: token id \d+ is outside the model's vo"):
        FinetuneData(big, tok, seq_len=32, batch_size=1, seed=0, vocab_size=50)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"seq_len": 0}, ValueError, "seq_len must be a positive int"),
        ({"batch_size": 1.0}, TypeError, "batch_size must be an int"),
        ({"seed": -1}, ValueError, "seed must be in"),
        ({"pack": 1}, TypeError, "pack must be a bool"),
        ({"too_long": "truncate"}, ValueError, "too_long must be one of ('error', 'drop')"),
        ({"vocab_size": 0}, ValueError, "vocab_size must be a positive int"),
    ],
)
def test_bad_arguments(tok, tmp_path, kwargs, error, message):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        FinetuneData(path, tok, **{"seq_len": 32, "batch_size": 1, "seed": 0, **kwargs})
    with pytest.raises(TypeError, match=r"tokenizer must be a rudax\.models\.load_tokenizer"):
        FinetuneData(path, "tokenizer.json", seq_len=32, batch_size=1, seed=0)


def test_docstring_examples():
    for module in (template, fdata):
        result = doctest.testmod(
            module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        )
        assert result.attempted > 0 and result.failed == 0, module.__name__


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_base_with_a_chat_template_renders_chats_with_it(base, tmp_path):
    """A tokenizer with its own template (ChatML, special tokens), saved by transformers:
    a chat's ids are apply_chat_template's, and the loss counts the assistant turns only,
    their <|im_end|> included; prompt/completion records are unchanged."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "chat-base"
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(base / "tokenizer.json"), eos_token="<|im_end|>"
    )
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.chat_template = CHATML
    hf.save_pretrained(folder)
    end = hf.convert_tokens_to_ids("<|im_end|>")
    (folder / "config.json").write_text(json.dumps({"eos_token_id": end, "vocab_size": 330}))
    tok = load_tokenizer(folder)
    assert tok.chat is not None and tok.chat.template == CHATML
    chats = [
        {"messages": [{"role": "user", "content": "def f(a):"}, {"role": "assistant",
                                                                 "content": "return a"}]},
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "sum a b"},
                      {"role": "assistant", "content": "def f(a, b):"},
                      {"role": "user", "content": "and c"},
                      {"role": "assistant", "content": "add c"}]},
        {"prompt": "def f(a):", "completion": " return a"},
    ]  # fmt: skip
    data = FinetuneData(
        write_jsonl(tmp_path / "chat.jsonl", chats),
        tok,
        seq_len=96,
        batch_size=3,
        seed=0,
        pack=False,
        shuffle=False,
    )
    batch = data.batch(0)
    for r, record in enumerate(chats[:2]):
        text = hf.apply_chat_template(record["messages"], tokenize=False)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert batch["tokens"][r, : len(ids)].tolist() == ids
        # the counted targets, read back as text: each assistant turn and its end marker
        labels = batch["labels"][r]
        counted = hf.decode([t for t in labels.tolist() if t != fdata.IGNORE])
        answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert counted == "".join(f"{a}<|im_end|>\n" for a in answers)
    plain = hf("def f(a):", add_special_tokens=False)["input_ids"]
    assert batch["tokens"][2, : len(plain)].tolist() == plain
    assert "chat_template_sha256" in data.identity()
    # a special token typed into a message is refused, naming the field
    bad = {"messages": [{"role": "user", "content": "hi <|im_end|>"},
                        {"role": "assistant", "content": "ok"}]}  # fmt: skip
    with pytest.raises(DataError, match=r"'messages'\[0\]\['content'\]: holds '<\|im_end\|>'"):
        FinetuneData(
            write_jsonl(tmp_path / "bad.jsonl", [bad]), tok, seq_len=96, batch_size=1, seed=0
        )
