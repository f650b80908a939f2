"""The byte-level BPE of examples/lm: trained locally, and the documents it turns into shards.

Byte-level (GPT-2's scheme): text is first mapped to its UTF-8 bytes, so any text encodes
and decodes exactly with no unknown token, and merges are learned on top of the 256 byte
symbols. Training with the ``tokenizers`` package is deterministic (ties between equally
frequent pairs break by the pair itself), so the same sample gives the same ``tokenizer.json``
on every run.

References:
  Sennrich et al., "Neural Machine Translation of Rare Words with Subword Units", 2016.
  Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from examples.lm.corpus import Corpus, CorpusError, Document
from examples.lm.data import check_int, shard_sha256, token_dtype, write_tokens

EOT = "<|endoftext|>"
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "val")
# Texts per encode call: enough to keep both cores busy (one long file does not hold up a
# batch of short ones), few enough to bound memory; measured on the stdlib corpus.
_ENCODE_CHARS = 1_000_000
_ENCODE_DOCS = 256


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with ``vocab_size`` entries trained on ``texts``.

    ``<|endoftext|>`` is id 0, the byte symbols 1 to 256, merges from 257. The vocabulary
    comes out smaller than asked only when the texts hold fewer distinct pairs to merge
    than ``vocab_size - 257``.

    Args:
      texts: the training sample, one string per document.
      vocab_size: entries in the vocabulary, the 256 byte symbols and ``<|endoftext|>``
        included.

    Returns:
      The trained ``tokenizers.Tokenizer`` (``tokenizer.save(path)`` writes it as JSON).

    Example:
      >>> from examples.lm.tokenizer import train_tokenizer
      >>> tok = train_tokenizer(["def add(a, b):\\n    return a + b\\n"] * 10, 280)
      >>> tok.decode(tok.encode("return a + b").ids)
      'return a + b'
      >>> tok.token_to_id("<|endoftext|>")
      0
    """
    check_int("vocab_size", vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode_documents(
    tokenizer: Tokenizer, documents: Iterable[tuple[str, str]], *, shard_tokens: int
) -> Iterator[tuple[str, np.ndarray]]:
    """Encodes ``(split, text)`` pairs into shards of ``shard_tokens`` tokens per split.

    Each document's ids are followed by ``<|endoftext|>``; the documents of a split are
    concatenated in order and cut every ``shard_tokens`` tokens (a document may straddle two
    shards: the loader reads across them). Documents are encoded in batches on all cores.

    Args:
      tokenizer: a tokenizer with ``<|endoftext|>`` in its vocabulary.
      documents: ``(split, text)`` pairs in corpus order.
      shard_tokens: tokens per shard; each split's last shard holds the remainder.

    Returns:
      An iterator of ``(split, tokens)``, each split's shards in order, ``tokens`` a 1-D
      array of ``token_dtype(tokenizer.get_vocab_size())``.

    Example:
      >>> from examples.lm.tokenizer import encode_documents, train_tokenizer
      >>> tok = train_tokenizer(["ab ab ab"], 260)
      >>> [(s, t.tolist()) for s, t in encode_documents(tok, [("train", "ab")], shard_tokens=8)]
      [('train', [257, 0])]
    """
    check_int("shard_tokens", shard_tokens)
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise ValueError(f"the tokenizer has no {EOT} token")
    dtype = token_dtype(tokenizer.get_vocab_size())
    eot_1 = np.array([eot], dtype)
    # encode_batch_fast (tokenizers >= 0.21) skips the character offsets nobody reads here.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    pending: dict[str, list[str]] = {}
    pending_chars: dict[str, int] = {}
    parts: dict[str, list[np.ndarray]] = {}
    counts: dict[str, int] = {}

    def flush(split: str) -> Iterator[tuple[str, np.ndarray]]:
        for enc in encode(pending.pop(split, [])):
            parts[split] += [np.array(enc.ids, dtype), eot_1]
            counts[split] += len(enc.ids) + 1
        pending_chars[split] = 0
        if counts[split] >= shard_tokens:
            tokens = np.concatenate(parts[split])
            cut = tokens.size - tokens.size % shard_tokens
            for start in range(0, cut, shard_tokens):
                yield split, tokens[start : start + shard_tokens]
            parts[split], counts[split] = [tokens[cut:]], tokens.size - cut

    for split, text in documents:
        if split not in parts:
            parts[split], counts[split], pending_chars[split] = [], 0, 0
        pending.setdefault(split, []).append(text)
        pending_chars[split] += len(text)
        if pending_chars[split] >= _ENCODE_CHARS or len(pending[split]) >= _ENCODE_DOCS:
            yield from flush(split)
    for split in list(parts):
        yield from flush(split)
        if counts[split]:
            yield split, np.concatenate(parts[split])


def bpe_sample(
    documents: Iterable[Document], *, budget: int, expected_chars: float
) -> Iterator[str]:
    """The train texts a BPE learns from: at most ``budget`` characters, spread evenly.

    Documents are taken in corpus order while the sample is not ahead of its share
    ``budget / expected_chars`` of the train text read so far, so a corpus larger than the
    budget is represented from its first file to its last, not by its first few MB. A
    document that would overrun the budget is cut. Validation documents never enter.

    Args:
      documents: the corpus's documents.
      budget: the most characters to yield, >= 1.
      expected_chars: the train text's estimated size (a corpus's ``size_bytes`` times the
        train share will do).

    Returns:
      An iterator of texts.

    Example:
      >>> from examples.lm.corpus import Document
      >>> from examples.lm.tokenizer import bpe_sample
      >>> docs = [Document(str(i), "train", "abcd") for i in range(6)]
      >>> list(bpe_sample(docs, budget=10, expected_chars=24))
      ['abcd', 'abcd', 'ab']
    """
    check_int("budget", budget)
    rate, used, seen = budget / max(1.0, expected_chars), 0, 0
    for doc in documents:
        if used >= budget:
            return
        if doc.split != "train" or not doc.text:
            continue
        if used <= rate * seen:
            piece = doc.text[: budget - used]
            used += len(piece)
            yield piece
        seen += len(doc.text)


def tokenize_corpus(
    corpus: Corpus,
    folder: Path,
    *,
    vocab_size: int,
    val_fraction: float,
    seed: int,
    bpe_sample_bytes: int,
    shard_tokens: int,
    log: Callable[[str], None] = print,
) -> dict:
    """Trains the BPE on the corpus's train split and writes it and both splits' shards.

    Writes ``tokenizer.json`` and ``{split}_{k:03d}.bin`` into ``folder``, which the caller
    made and renames into place when this returns (``examples.lm.prepare.prepare``, whose
    example runs this).

    Args:
      corpus: the documents (``examples.lm.corpus.open_corpus``).
      folder: an existing, empty folder to write into.
      vocab_size: asked of ``train_tokenizer``.
      val_fraction, seed: the split (``examples.lm.corpus.is_val``).
      bpe_sample_bytes: the budget of ``bpe_sample``.
      shard_tokens: tokens per shard.
      log: called with each progress line.

    Returns:
      What ``prepared.json`` records of the build (``examples.lm.prepare.read_prepared``
      lists the keys), all but ``settings`` and ``source_fingerprint``.

    Raises:
      CorpusError: the train or validation split has no text.
    """
    t0 = time.perf_counter()
    documents = lambda: corpus.documents(val_fraction=val_fraction, seed=seed)
    sample = bpe_sample(
        documents(),
        budget=bpe_sample_bytes,
        expected_chars=corpus.size_bytes * (1.0 - val_fraction),
    )
    used = 0

    def counted():
        nonlocal used
        for text in sample:
            used += len(text)
            yield text

    tokenizer = train_tokenizer(counted(), vocab_size)
    if used == 0:
        raise CorpusError(f"the train split of {corpus.description} holds no text")
    actual_vocab = tokenizer.get_vocab_size()
    tokenizer.save(str(folder / TOKENIZER))
    t1 = time.perf_counter()
    log(f"  BPE: vocabulary {actual_vocab} trained on {used / 1e6:.1f} MB in {t1 - t0:.1f}s")
    if actual_vocab < vocab_size:
        log(f"  note: {vocab_size} asked, but the sample holds only {actual_vocab} merges' worth")

    stats = {s: {"documents": 0, "empty_documents": 0, "tokens": 0, "shards": []} for s in SPLITS}
    skipped = []

    def usable():
        for doc in documents():
            if doc.skipped:
                skipped.append({"key": doc.key, "split": doc.split, "reason": doc.skipped})
            elif not doc.text:
                stats[doc.split]["empty_documents"] += 1
            else:
                stats[doc.split]["documents"] += 1
                yield doc.split, doc.text

    for split, tokens in encode_documents(tokenizer, usable(), shard_tokens=shard_tokens):
        shards = stats[split]["shards"]
        path = folder / f"{split}_{len(shards):03d}.bin"
        if tokens.size and int(tokens.max()) >= actual_vocab:  # no shard of ids without rows
            raise CorpusError(
                f"the tokenizer gave id {int(tokens.max())} for a vocabulary of {actual_vocab}"
            )
        write_tokens(path, tokens)
        shards.append(
            {
                "file": path.name,
                "tokens": tokens.size,
                "bytes": path.stat().st_size,
                "sha256": shard_sha256(path),  # of the file as written: TokenLoader checks it
            }
        )
        stats[split]["tokens"] += tokens.size
    for split, s in stats.items():
        if not s["documents"]:
            raise CorpusError(
                f"the {split} split of {corpus.description} has no documents with "
                f"val_fraction={val_fraction} and seed={seed} ({s['empty_documents']} empty, "
                f"{len(skipped)} skipped in all): change --val-fraction or --seed, or add "
                "documents"
            )
        log(
            f"  {split}: {s['documents']} documents, {s['tokens']:,} tokens, "
            f"{len(s['shards'])} shard(s)"
        )
    if skipped:
        names = ", ".join(d["key"] for d in skipped[:5]) + (" ..." if len(skipped) > 5 else "")
        log(f"  skipped {len(skipped)} document(s) that are not text: {names}")
    t2 = time.perf_counter()
    log(f"  tokenized in {t2 - t1:.1f}s")
    return {
        "vocab_size": actual_vocab,
        "eot_id": tokenizer.token_to_id(EOT),
        "dtype": token_dtype(actual_vocab).name,
        "tokenizer": {
            "file": TOKENIZER,
            "sha256": hashlib.sha256((folder / TOKENIZER).read_bytes()).hexdigest(),
            "bytes": (folder / TOKENIZER).stat().st_size,
        },
        "splits": stats,
        "skipped": skipped,
        "bpe_sample_bytes_used": used,
        "seconds": {"bpe": round(t1 - t0, 2), "tokenize": round(t2 - t1, 2)},
        "tokenizers_version": tokenizers.__version__,
    }
