"""examples/lm data: the token shard format, the loader, the corpus split and prepare.

Every corpus here is a few small files made in tmp_path; the references (the header layout,
the split rule, the windows) are written out plainly in the tests.
"""

import doctest
import hashlib
import importlib
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from examples.lm import prepare
from examples.lm.corpus import CorpusError, Document, open_corpus, stdlib_root
from examples.lm.data import (
    ShardError,
    TokenLoader,
    read_tokens,
    shard_sha256,
    token_dtype,
    write_tokens,
)
from examples.lm.tokenizer import bpe_sample

ROOT = Path(__file__).resolve().parents[2]
EOT = "<|endoftext|>"


def header(version, code, count):
    """The documented header: magic, uint32 version, uint32 dtype code, uint64 count (LE)."""
    return (
        b"RUDAXTOK"
        + struct.pack("<I", version)
        + struct.pack("<I", code)
        + count.to_bytes(8, "little")
    )


def reference_is_val(key, seed, fraction):
    h = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < fraction


# ----------------------------------------------------------------------------- shards
@pytest.mark.parametrize(("dtype", "code"), [(np.uint16, 1), (np.uint32, 2)])
def test_shard_round_trip(tmp_path, dtype, code):
    tokens = np.array([0, 1, 7, np.iinfo(dtype).max, 42], dtype)
    path = tmp_path / "train_000.bin"
    write_tokens(path, tokens)
    raw = path.read_bytes()
    assert raw == header(1, code, 5) + tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    back = read_tokens(path)
    assert isinstance(back, np.memmap) and back.dtype == dtype and not back.flags.writeable
    np.testing.assert_array_equal(back, tokens)
    assert os.listdir(tmp_path) == ["train_000.bin"]  # no temporary file left behind


def test_empty_shard_and_overwrite(tmp_path):
    path = tmp_path / "s.bin"
    write_tokens(path, np.zeros((0,), np.uint16))
    assert read_tokens(path).shape == (0,)
    write_tokens(path, np.array([3], np.uint32))
    assert read_tokens(path).tolist() == [3]


def test_token_dtype():
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(2**32) == np.uint32
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(2**32 + 1)


def test_write_refuses_what_it_would_have_to_cast(tmp_path):
    with pytest.raises(TypeError, match="dtype=int32"):
        write_tokens(tmp_path / "a.bin", np.array([1, 2], np.int32))
    with pytest.raises(TypeError, match="numpy array"):
        write_tokens(tmp_path / "a.bin", [1, 2])
    with pytest.raises(ValueError, match=r"1-D, got shape \(2, 2\)"):
        write_tokens(tmp_path / "a.bin", np.zeros((2, 2), np.uint16))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("cut", [1, 7, 30])
def test_truncated_shard_is_rejected(tmp_path, cut):
    path = tmp_path / "train_000.bin"
    write_tokens(path, np.arange(10, dtype=np.uint16))
    path.write_bytes(path.read_bytes()[:-cut])
    found = 24 + 20 - cut
    expected = "expected 44 bytes" if found >= 24 else "expected at least 24 bytes"
    with pytest.raises(ValueError, match=f"truncated or corrupted: {expected}.*found {found}") as e:
        read_tokens(path)
    assert str(path) in str(e.value)


def test_extra_bytes_are_rejected(tmp_path):
    path = tmp_path / "s.bin"
    path.write_bytes(header(1, 2, 2) + b"\0" * 12)
    with pytest.raises(ValueError, match=r"expected 32 bytes .* found 36"):
        read_tokens(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"print('hello, world')\n" * 3, "not a rudax token shard"),
        (b"", "truncated or corrupted"),
        (header(2, 1, 0), "format version 2 is not supported"),
        (header(1, 9, 0), "unknown token dtype code 9"),
    ],
)
def test_foreign_and_future_files_are_rejected(tmp_path, content, message):
    path = tmp_path / "val_000.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as e:
        read_tokens(path)
    assert str(path) in str(e.value)


# ----------------------------------------------------------------------------- loader
@pytest.fixture
def stream_shards(tmp_path):
    """Shards of 7, 0, 5 and 30 tokens (mixed dtypes) whose concatenation is 100..141."""
    stream = np.arange(100, 142)
    sizes, dtypes, paths, start = [7, 0, 5, 30], [np.uint16, np.uint32, np.uint32, np.uint16], [], 0
    for k, (size, dtype) in enumerate(zip(sizes, dtypes, strict=True)):
        paths.append(tmp_path / f"train_{k:03d}.bin")
        write_tokens(paths[-1], stream[start : start + size].astype(dtype))
        start += size
    return paths, stream


def test_batches_are_contiguous_windows_of_the_stream(stream_shards):
    paths, stream = stream_shards
    loader = TokenLoader(paths, seq_len=8, batch_size=4, seed=3)
    assert loader.num_tokens == 42
    starts = set()
    for i in range(200):
        batch = loader.batch(i)
        assert batch.shape == (4, 9) and batch.dtype == np.int32
        for row in batch:
            o = int(row[0]) - 100
            np.testing.assert_array_equal(row, stream[o : o + 9])
            starts.add(o)
    # Every window, the first, the last and those across shard boundaries, is drawn.
    assert starts == set(range(42 - 9 + 1))


def test_batch_is_a_pure_function_of_seed_and_index(stream_shards):
    paths, _ = stream_shards
    a = TokenLoader(paths, seq_len=8, batch_size=4, seed=3)
    b = TokenLoader(paths, seq_len=8, batch_size=4, seed=3)
    forward = [a.batch(i) for i in range(6)]
    backward = [b.batch(i) for i in reversed(range(6))][::-1]
    for x, y in zip(forward, backward, strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.batch(2), forward[2])  # and again, after others
    assert not np.array_equal(a.batch(0), a.batch(1))
    c = TokenLoader(paths, seq_len=8, batch_size=4, seed=4)
    assert not all(np.array_equal(c.batch(i), forward[i]) for i in range(6))


def test_batch_offsets_follow_the_documented_generator(stream_shards):
    paths, stream = stream_shards
    loader = TokenLoader(paths, seq_len=8, batch_size=4, seed=3)
    rng = np.random.Generator(np.random.Philox(key=np.array([3, 17], np.uint64)))
    offsets = rng.integers(0, 42 - 9 + 1, size=4)
    np.testing.assert_array_equal(loader.batch(17), [stream[o : o + 9] for o in offsets])


def test_host_shards_concatenate_to_the_global_batch(stream_shards):
    paths, _ = stream_shards
    loader = TokenLoader(paths, seq_len=8, batch_size=6, seed=1)
    for i in range(3):
        parts = [loader.batch(i, shard=s, num_shards=3) for s in range(3)]
        assert all(p.shape == (2, 9) for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), loader.batch(i))
    with pytest.raises(ValueError, match="num_shards must divide batch_size=6"):
        loader.batch(0, shard=0, num_shards=4)
    with pytest.raises(ValueError, match="shard=3"):
        loader.batch(0, shard=3, num_shards=3)
    with pytest.raises(ValueError, match="i=-1"):
        loader.batch(-1)


def test_eval_batches_are_fixed_and_cover_the_stream(stream_shards):
    paths, stream = stream_shards
    loader = TokenLoader(paths, seq_len=8, batch_size=2, seed=0)
    first = loader.eval_batches(3)
    again = TokenLoader(paths, seq_len=8, batch_size=2, seed=9).eval_batches(3)
    assert len(first) == 3
    for x, y in zip(first, again, strict=True):
        np.testing.assert_array_equal(x, y)
    rows = np.concatenate(first)
    expected_starts = np.round(np.linspace(0, 42 - 9, 6)).astype(int)
    np.testing.assert_array_equal(rows, [stream[o : o + 9] for o in expected_starts])
    assert rows[0, 0] == stream[0] and rows[-1, -1] == stream[-1]
    halves = [loader.eval_batches(3, shard=s, num_shards=2) for s in range(2)]
    for k in range(3):
        np.testing.assert_array_equal(np.concatenate([halves[0][k], halves[1][k]]), first[k])


def test_loader_rejects_bad_arguments(stream_shards):
    paths, _ = stream_shards
    with pytest.raises(ValueError, match=r"seq_len=42 needs windows of 43 tokens.*42 tokens"):
        TokenLoader(paths, seq_len=42, batch_size=1, seed=0)
    TokenLoader(paths, seq_len=41, batch_size=1, seed=0)  # exactly one window fits
    with pytest.raises(ValueError, match="at least one"):
        TokenLoader([], seq_len=4, batch_size=1, seed=0)
    with pytest.raises(TypeError, match="sequence of shard paths"):
        TokenLoader(str(paths[0]), seq_len=4, batch_size=1, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        TokenLoader(paths, seq_len=0, batch_size=1, seed=0)
    with pytest.raises(TypeError, match="batch_size"):
        TokenLoader(paths, seq_len=4, batch_size=2.0, seed=0)
    with pytest.raises(ValueError, match="seed=-1"):
        TokenLoader(paths, seq_len=4, batch_size=1, seed=-1)


def test_ids_beyond_int32_are_an_error_not_a_wrap(tmp_path):
    path = tmp_path / "s.bin"
    write_tokens(path, np.full((10,), 2**31, np.uint32))
    with pytest.raises(ValueError, match="2147483648 does not fit the int32"):
        TokenLoader([path], seq_len=4, batch_size=1, seed=0).batch(0)


# ----------------------------------------------------------------------------- checksums
def _first_shard(folder, split="train"):
    meta = json.loads((folder / "prepared.json").read_text())
    return folder / meta["splits"][split]["shards"][0]["file"], meta


def _rewrite(path, edit):
    """Applies edit to the shard's ids in place; the size, and so the header, are unchanged."""
    tokens = np.fromfile(path, np.uint16, offset=24)
    edit(tokens)
    path.write_bytes(path.read_bytes()[:24] + tokens.tobytes())


def _open(folder, split="train"):
    return prepare.open_split(folder, split, seq_len=16, batch_size=8, seed=0)


def test_prepare_records_every_shards_sha256(own_data):
    _, folder = own_data
    meta = json.loads((folder / "prepared.json").read_text())
    for split in ("train", "val"):
        for shard in meta["splits"][split]["shards"]:
            digest = hashlib.sha256((folder / shard["file"]).read_bytes()).hexdigest()
            assert shard["sha256"] == digest
    assert _open(folder).batch(0).shape == (8, 17)


def test_a_shard_changed_in_place_is_refused_on_open(own_data):
    _, folder = own_data
    path, _ = _first_shard(folder)
    _rewrite(path, lambda t: t.__setitem__(100, (int(t[100]) + 1) % 300))  # still in range
    with pytest.raises(ShardError, match=r"its SHA-256 is [0-9a-f]{64}, but [0-9a-f]{64} was"):
        _open(folder)
    with pytest.raises(ShardError, match=re.escape(str(path))):
        _open(folder)
    _open(folder, "val")  # the other split's shards are intact


def test_ids_outside_the_vocabulary_are_refused_on_open(own_data):
    # A shard with the right checksum but ids the tokenizer cannot have made: another
    # tokenizer's shard, or a tool that wrote both shard and manifest.
    _, folder = own_data
    path, meta = _first_shard(folder)
    _rewrite(path, lambda t: t.__setitem__(1234, 65535))
    meta["splits"]["train"]["shards"][0]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (folder / "prepared.json").write_text(json.dumps(meta))
    message = r"token id 65535 at position 1234 is outside the vocabulary of 300 ids"
    with pytest.raises(ShardError, match=message):
        _open(folder)
    # TokenLoader checks on its own too, given the vocabulary.
    with pytest.raises(ShardError, match=message):
        TokenLoader([path], seq_len=4, batch_size=1, seed=0, vocab_size=300)
    TokenLoader([path], seq_len=4, batch_size=1, seed=0, vocab_size=65536)


def test_loader_checksums_must_match_the_paths(stream_shards):
    paths, _ = stream_shards
    with pytest.raises(ValueError, match=r"checksums must hold one SHA-256 per path \(4\)"):
        TokenLoader(paths, seq_len=4, batch_size=1, seed=0, checksums=["0" * 64])
    digests = [shard_sha256(p) for p in paths]
    TokenLoader(paths, seq_len=4, batch_size=1, seed=0, checksums=digests)
    with pytest.raises(ShardError, match=re.escape(str(paths[0]))):
        TokenLoader(paths, seq_len=4, batch_size=1, seed=0, checksums=digests[::-1])


def test_a_preparation_without_checksums_is_explained_and_rebuilt_the_same(
    own_data, prepared_corpus
):
    corpus, _ = prepared_corpus
    _, folder = own_data
    path, meta = _first_shard(folder)
    before = path.read_bytes()
    for split in ("train", "val"):  # as the code before shard checksums wrote it
        for shard in meta["splits"][split]["shards"]:
            del shard["sha256"]
    (folder / "prepared.json").write_text(json.dumps(meta))
    with pytest.raises(CorpusError, match=r"records no checksum for train_000\.bin: .*older"):
        _open(folder)
    prepare.prepare(corpus, folder, vocab_size=300, verbose=False)  # what the trainer calls
    assert path.read_bytes() == before  # the same tokens, now with their checksums
    assert _open(folder).batch(0).shape == (8, 17)


# ----------------------------------------------------------------------------- corpus
def make_corpus(root: Path, n: int = 8) -> dict[str, str]:
    """n small Python modules and an empty __init__.py; returns {relative path: text}."""
    texts = {"pkg/__init__.py": ""}
    for i in range(n):
        texts[f"pkg/mod{i}.py"] = "".join(
            f'def func_{i}_{j}(value, other):\n    """Return value plus {j}."""\n'
            f"    return value + other * {j}\n\n"
            for j in range(20)
        )
    for name, text in texts.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return texts


def split_of(texts, seed=0, fraction=0.3):
    val = {k for k in texts if reference_is_val(k, seed, fraction)}
    return [k for k in sorted(texts) if k not in val and texts[k]], sorted(
        k for k in val if texts[k]
    )


def decoded_stream(out, split):
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    paths = prepare.shard_paths(out, split)
    stream = np.concatenate([read_tokens(p) for p in paths])
    return tokenizer.decode(stream.tolist(), skip_special_tokens=False)


def test_default_corpus_is_the_stdlib_sources():
    corpus = open_corpus()
    keys = [f.relative_to(corpus.root).as_posix() for f in corpus.files]
    assert corpus.root == stdlib_root() and len(keys) > 500 and keys == sorted(keys)
    assert all(k.endswith(".py") for k in keys)
    assert not any("site-packages" in k.split("/") for k in keys)
    assert "json/decoder.py" in keys
    assert corpus.fingerprint() == open_corpus().fingerprint()


def test_split_is_a_keyed_hash_of_the_name():
    keys = [f"pkg/m{i}.py" for i in range(400)]
    from examples.lm.corpus import is_val

    for seed in (0, 1):
        got = [is_val(k, seed=seed, val_fraction=0.25) for k in keys]
        assert got == [reference_is_val(k, seed, 0.25) for k in keys]
        assert 60 < sum(got) < 140
    assert [is_val(k, seed=0, val_fraction=0.25) for k in keys] != [
        is_val(k, seed=1, val_fraction=0.25) for k in keys
    ]


def test_bpe_sample_is_bounded_and_spread():
    docs = [Document(f"d{i}", "val" if i % 5 == 0 else "train", f"<{i:03d}>") for i in range(100)]
    sample = list(bpe_sample(docs, budget=100, expected_chars=80 * 5))
    assert sum(map(len, sample)) == 100
    assert all(int(s[1:4]) % 5 for s in sample)  # validation never enters
    assert sample[0] == "<001>" and int(sample[-1][1:4]) > 90  # first to last, not a prefix


# ----------------------------------------------------------------------------- prepare
def run_prepare(src, out, **kw):
    kw = {"vocab_size": 300, "val_fraction": 0.3, "verbose": False} | kw
    return prepare.prepare(src, out, **kw)


def test_prepare_writes_tokenizer_shards_and_record(tmp_path):
    texts = make_corpus(tmp_path / "src")
    out = run_prepare(tmp_path / "src", tmp_path / "out", shard_tokens=1000)
    train, val = split_of(texts)
    assert train and val, "the fixture must put files in both splits"
    meta = prepare.read_prepared(out)
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16" and meta["eot_id"] == 0
    assert meta["splits"]["train"]["documents"] == len(train)
    assert meta["splits"]["val"]["documents"] == len(val)
    empty_in_val = reference_is_val("pkg/__init__.py", 0, 0.3)
    assert meta["splits"]["val"]["empty_documents"] == empty_in_val  # pkg/__init__.py
    assert meta["splits"]["train"]["empty_documents"] == 1 - empty_in_val
    assert len(meta["splits"]["train"]["shards"]) > 1  # shard_tokens=1000 cuts it up
    names = sorted(p.name for p in out.iterdir())
    shards = [s["file"] for split in ("train", "val") for s in meta["splits"][split]["shards"]]
    assert names == sorted(["prepared.json", "tokenizer.json", *shards])
    assert (
        meta["tokenizer"]["sha256"]
        == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    )
    # The shards hold each split's files in order, each followed by <|endoftext|>.
    for split, keys in (("train", train), ("val", val)):
        assert decoded_stream(out, split) == "".join(texts[k] + EOT for k in keys)
        sizes = [read_tokens(p).size for p in prepare.shard_paths(out, split)]
        assert sum(sizes) == meta["splits"][split]["tokens"]
        assert all(s == 1000 for s in sizes[:-1])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_prepare_twice_is_a_no_op_and_force_rebuilds_the_same(tmp_path, monkeypatch):
    make_corpus(tmp_path / "src")
    out = run_prepare(tmp_path / "src", tmp_path / "out")
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    with monkeypatch.context() as m:
        m.setattr(prepare, "tokenize_corpus", lambda *a, **k: pytest.fail("tokenized again"))
        run_prepare(tmp_path / "src", tmp_path / "out")
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()} == before
    run_prepare(tmp_path / "src", tmp_path / "out", force=True)
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    assert after.keys() == before.keys()
    assert all(after[n][0] != before[n][0] for n in after)  # rewritten ...
    for name in after:  # ... to the same bytes: tokenizer training is deterministic
        if name != "prepared.json":
            assert after[name][1] == before[name][1], name


def test_prepare_rebuilds_incomplete_or_stale_and_refuses_other_settings(tmp_path):
    texts = make_corpus(tmp_path / "src")
    out = run_prepare(tmp_path / "src", tmp_path / "out")
    (out / "val_000.bin").unlink()  # a preparation that lost a file
    run_prepare(tmp_path / "src", out)
    assert read_tokens(out / "val_000.bin").size > 0
    first = sorted(texts)[1]
    (tmp_path / "src" / first).write_text("x = 1\n")  # the source changed
    run_prepare(tmp_path / "src", out)
    assert "x = 1\n" + EOT in decoded_stream(out, "train") + decoded_stream(out, "val")
    with pytest.raises(CorpusError, match=r"vocab_size: 300 there, 400 asked.*force"):
        run_prepare(tmp_path / "src", out, vocab_size=400)
    run_prepare(tmp_path / "src", out, vocab_size=400, force=True)
    meta = prepare.read_prepared(out)
    # The tiny corpus runs out of pairs to merge before 400: the record says both.
    assert meta["settings"]["vocab_size"] == 400 and 300 < meta["vocab_size"] <= 400


def test_prepare_never_overwrites_a_folder_that_is_not_a_preparation(tmp_path):
    make_corpus(tmp_path / "src")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    for force in (False, True):
        with pytest.raises(CorpusError, match=r"no prepared\.json: not overwriting"):
            run_prepare(tmp_path / "src", tmp_path / "mine", force=force)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(CorpusError, match="inside the data folder"):
        run_prepare(tmp_path / "src", tmp_path / "src" / "out")


def test_prepare_removes_what_a_dead_preparation_left(tmp_path):
    make_corpus(tmp_path / "src")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    leftover = tmp_path / f".out.partial-{int(dead.stdout)}-abcd1234"
    leftover.mkdir()
    (leftover / "train_000.bin").write_bytes(b"RUDAX")
    alive = tmp_path / f".out.partial-{os.getpid()}-abcd1234"  # a live process's: kept
    alive.mkdir()
    run_prepare(tmp_path / "src", tmp_path / "out")
    assert not leftover.exists() and alive.exists()


def test_prepare_skips_and_reports_files_that_are_not_text(tmp_path):
    texts = make_corpus(tmp_path / "src")
    (tmp_path / "src" / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    (tmp_path / "src" / "image.bin").write_bytes(b"\x89PNG\0\0\0")
    (tmp_path / "src" / ".hidden").write_text("not a document")
    out = run_prepare(tmp_path / "src", tmp_path / "out")
    skipped = {d["key"]: d["reason"] for d in prepare.read_prepared(out)["skipped"]}
    assert set(skipped) == {"latin1.txt", "image.bin"}
    assert "NUL" in skipped["image.bin"] and "UnicodeDecodeError" in skipped["latin1.txt"]
    _, val = split_of(texts)
    assert decoded_stream(out, "val") == "".join(texts[k] + EOT for k in val)


def test_prepare_single_text_file_splits_at_a_line(tmp_path):
    lines = [f"line {i:04d}: the quick brown fox\n" for i in range(100)]  # all as long
    (tmp_path / "input.txt").write_text("".join(lines))
    out = run_prepare(tmp_path / "input.txt", tmp_path / "out", val_fraction=0.1)
    train, val = decoded_stream(out, "train"), decoded_stream(out, "val")
    assert train == "".join(lines[:90]) + EOT and val == "".join(lines[90:]) + EOT
    # A cut inside a line moves to the next line's start: the line stays whole.
    (tmp_path / "input.txt").write_text("".join(lines) + "x" * 5)
    out = run_prepare(tmp_path / "input.txt", tmp_path / "out", val_fraction=0.1)
    assert decoded_stream(out, "val") == "".join(lines[91:]) + "x" * 5 + EOT


def test_prepare_jsonl(tmp_path):
    docs = [f"document number {i}: " + "lorem ipsum dolor " * (i + 3) for i in range(12)]
    rows = [json.dumps({"id": i, "content": d}) for i, d in enumerate(docs)]
    (tmp_path / "c.jsonl").write_text("\n".join([*rows[:5], "", *rows[5:]]) + "\n")
    out = run_prepare(tmp_path / "c.jsonl", tmp_path / "out", text_column="content")
    # Line numbers are the keys; the blank 6th line shifts the later documents by one.
    lines = {(i + 1 if i < 5 else i + 2): d for i, d in enumerate(docs)}
    val = [n for n in lines if reference_is_val(f"line {n}", 0, 0.3)]
    assert val and len(val) < len(lines)
    assert decoded_stream(out, "val") == "".join(lines[n] + EOT for n in val)
    assert prepare.read_prepared(out)["settings"]["text_column"] == "content"
    with pytest.raises(
        CorpusError, match=r"c.jsonl:1: no field 'text' \(fields: \['content', 'id'\]\)"
    ):
        run_prepare(tmp_path / "c.jsonl", tmp_path / "out2")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": 3}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: field 'text' must be a string, got 3"):
        run_prepare(tmp_path / "bad.jsonl", tmp_path / "out3")


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    with pytest.raises(
        CorpusError, match="needs pyarrow, which is not installed: pip install pyarrow"
    ):
        run_prepare(tmp_path / "c.parquet", tmp_path / "out")


# ----------------------------------------------------------------------------- command line
def test_cli_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        prepare.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    flags = ["--data", "--out", "--vocab-size", "--val-fraction", "--seed", "--text-column"]
    flags += ["--bpe-sample-mb", "--shard-tokens", "--force"]
    assert all(f in text for f in flags)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--vocab-size", "256"], "vocab_size must be in [257, 2**32]"),
        (["--vocab-size", str(2**32 + 1)], "vocab_size must be in [257, 2**32]"),
        (["--vocab-size", "big"], "argument --vocab-size: invalid int value: 'big'"),
        (["--val-fraction", "0"], "val_fraction must be in (0.0, 1.0), got val_fraction=0.0"),
        (["--val-fraction", "1"], "val_fraction must be in (0.0, 1.0)"),
        (["--seed", "-1"], "seed must be >= 0"),
        (["--bpe-sample-mb", "0"], "argument --bpe-sample-mb: must be positive"),
        (["--data", "/no/such/corpus"], "data path does not exist"),
    ],
)
def test_cli_bad_values_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        prepare.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err


def test_cli_empty_split_and_empty_corpus_are_one_line_errors(tmp_path, capsys):
    make_corpus(tmp_path / "src", n=2)
    (tmp_path / "empty").mkdir()
    for data, message in [
        (tmp_path / "src", "the val split of folder:.* has no documents with val_fraction=0.01"),
        (tmp_path / "empty", "the data folder .*empty holds no files"),
    ]:
        argv = ["--data", str(data), "--out", str(tmp_path / "out"), "--val-fraction", "0.01"]
        with pytest.raises(SystemExit) as e:
            prepare.main([*argv, "--vocab-size", "300"])
        assert e.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert re.match(f"python -m examples.lm.prepare: error: {message}", last), last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "src"]  # nothing left


def test_cli_runs_as_a_module_from_the_repo_root(tmp_path):
    make_corpus(tmp_path / "src")
    argv = ["--data", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--vocab-size", "300"]
    proc = subprocess.run(
        [sys.executable, "-m", "examples.lm.prepare", *argv, "--val-fraction", "0.3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "vocabulary 300" in proc.stdout and (tmp_path / "out" / "prepared.json").exists()


@pytest.mark.parametrize("name", ["data", "corpus", "tokenizer", "prepare", "guard"])
def test_docstring_examples(name):
    module = importlib.import_module(f"examples.lm.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
