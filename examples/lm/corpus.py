"""The text behind examples/lm: where its documents come from and which split each is in.

A corpus is a sequence of documents in a fixed order, each with a stable ``key`` (its path
relative to the corpus folder, ``line N`` of a JSON Lines file, ``row N`` of a Parquet file).
A document goes to validation when a keyed hash of ``(seed, key)`` falls below
``val_fraction``: the split is deterministic on every machine (Python's own ``hash`` is
salted per process), needs no pass over the corpus first, and a file keeps its split when
others are added or removed. A single text file is one document and is split instead at the
line boundary that leaves the last ``val_fraction`` of it to validation.

A file that does not decode as text is skipped, never altered, and reported by its key and
reason (``Document.skipped``) so ``prepare`` can list it.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import io
import json
import os
import sysconfig
import tokenize
from collections.abc import Iterator
from pathlib import Path

# Folders of a standard library tree that hold installed packages, not the library itself.
_NOT_STDLIB = ("site-packages", "dist-packages")


class CorpusError(ValueError):
    """The corpus or the output folder cannot be used as asked; the message says why."""


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: its stable key, its split ("train" or "val") and its text.

    ``skipped`` is empty for a usable document; otherwise it says why the document could not
    be read as text, and ``text`` is empty.
    """

    key: str
    split: str
    text: str
    skipped: str = ""


def is_val(key: str, *, seed: int, val_fraction: float) -> bool:
    """Whether the document named ``key`` belongs to the validation split.

    The first 8 bytes of ``blake2b(f"{seed}/{key}")``, read as a little-endian integer ``h``,
    put it there when ``h / 2**64 < val_fraction``.

    Example:
      >>> from examples.lm.corpus import is_val
      >>> is_val("json/decoder.py", seed=0, val_fraction=0.0)
      False
      >>> is_val("json/decoder.py", seed=0, val_fraction=1.0)
      True
    """
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def decode(path: Path, data: bytes) -> tuple[str, str]:
    """``(text, "")``, or ``("", reason)`` when the bytes are not text.

    Python sources are decoded as Python reads them (a PEP 263 coding cookie, else UTF-8);
    everything else as UTF-8. A NUL byte marks a binary file.
    """
    if b"\0" in data:
        return "", "binary (contains a NUL byte)"
    try:
        encoding = "utf-8"
        if path.suffix == ".py":
            encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding), ""
    except (SyntaxError, LookupError, UnicodeDecodeError) as e:
        return "", f"does not decode as text: {type(e).__name__}: {e}"


class Corpus(abc.ABC):
    """A source of documents: see ``open_corpus``.

    Attributes:
      description: what it is and where, as recorded in ``prepared.json``.
      size_bytes: the bytes it reads (an estimate of its text's size).
      uses_text_column: whether its documents come from a table column.
    """

    description: str
    size_bytes: int
    uses_text_column: bool = False

    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A hash of the names, sizes and modification times of the files read."""

    @abc.abstractmethod
    def documents(self, *, val_fraction: float, seed: int) -> Iterator[Document]:
        """Every document in the corpus's order, with its split."""


def _stat_hash(entries: list[tuple[str, os.stat_result]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, st in entries:
        h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


class FolderCorpus(Corpus):
    """Every file under ``root`` (recursive, sorted by relative path) is a document.

    Hidden files and folders (a name starting with ".") and folders named in ``exclude`` are
    left out; ``suffix`` keeps only files with that ending.
    """

    def __init__(self, root: Path, *, suffix: str = "", exclude: tuple[str, ...] = ()):
        self.root = root
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in exclude]
            files += [
                Path(folder, n) for n in names if not n.startswith(".") and n.endswith(suffix)
            ]
        self.files = sorted(files, key=lambda p: p.relative_to(root).as_posix())
        self._stats = [(p.relative_to(root).as_posix(), p.stat()) for p in self.files]
        self.size_bytes = sum(st.st_size for _, st in self._stats)
        self.description = f"folder:{root}"

    def fingerprint(self) -> str:
        return _stat_hash(self._stats)

    def documents(self, *, val_fraction: float, seed: int) -> Iterator[Document]:
        for path, (key, _) in zip(self.files, self._stats, strict=True):
            split = "val" if is_val(key, seed=seed, val_fraction=val_fraction) else "train"
            text, skipped = decode(path, path.read_bytes())
            yield Document(key, split, text, skipped)


class TextFileCorpus(Corpus):
    """One text file, one document, split in two: its tail from the first line start at or
    after ``round(len(text) * (1 - val_fraction))`` goes to validation."""

    def __init__(self, path: Path):
        self.path, self._stat = path, path.stat()
        self.size_bytes = self._stat.st_size
        self.description = f"text:{path}"

    def fingerprint(self) -> str:
        return _stat_hash([(self.path.name, self._stat)])

    def documents(self, *, val_fraction: float, seed: int) -> Iterator[Document]:
        text, skipped = decode(self.path, self.path.read_bytes())
        if skipped:
            yield Document(self.path.name, "train", "", skipped)
            return
        # The first line start at or after the cut, so no line is torn in two; without one
        # (a single line), the cut itself.
        cut = round(len(text) * (1.0 - val_fraction))
        newline = text.find("\n", max(cut - 1, 0))
        cut = newline + 1 if newline >= 0 else cut
        yield Document(f"{self.path.name}[:{cut}]", "train", text[:cut])
        yield Document(f"{self.path.name}[{cut}:]", "val", text[cut:])


class JsonlCorpus(Corpus):
    """JSON Lines: each non-blank line an object whose ``text_column`` is a document."""

    uses_text_column = True

    def __init__(self, path: Path, text_column: str):
        self.path, self.text_column, self._stat = path, text_column, path.stat()
        self.size_bytes = self._stat.st_size
        self.description = f"jsonl:{path}"

    def fingerprint(self) -> str:
        return _stat_hash([(self.path.name, self._stat)])

    def documents(self, *, val_fraction: float, seed: int) -> Iterator[Document]:
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{self.path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise CorpusError(f"{where}: not valid JSON: {e}") from None
                text = _column(record, self.text_column, where)
                key = f"line {number}"
                split = "val" if is_val(key, seed=seed, val_fraction=val_fraction) else "train"
                yield Document(key, split, text)


class ParquetCorpus(Corpus):
    """A Parquet table: each row's ``text_column`` is a document (needs pyarrow)."""

    uses_text_column = True

    def __init__(self, path: Path, text_column: str):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise CorpusError(
                f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
            ) from None
        self.path, self.text_column, self._stat = path, text_column, path.stat()
        self._file = pq.ParquetFile(path)
        names = self._file.schema_arrow.names
        if text_column not in names:
            raise CorpusError(
                f"{path}: no column {text_column!r} (columns: {names}); pass --text-column"
            )
        self.size_bytes = self._stat.st_size
        self.description = f"parquet:{path}"

    def fingerprint(self) -> str:
        return _stat_hash([(self.path.name, self._stat)])

    def documents(self, *, val_fraction: float, seed: int) -> Iterator[Document]:
        row = 0
        for batch in self._file.iter_batches(columns=[self.text_column]):
            for value in batch.column(0).to_pylist():
                text = _column(
                    {self.text_column: value}, self.text_column, f"{self.path} row {row}"
                )
                key = f"row {row}"
                split = "val" if is_val(key, seed=seed, val_fraction=val_fraction) else "train"
                yield Document(key, split, text)
                row += 1


def _column(record: object, column: str, where: str) -> str:
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if column not in record:
        raise CorpusError(
            f"{where}: no field {column!r} (fields: {sorted(record)}); pass --text-column"
        )
    text = record[column]
    if not isinstance(text, str):
        raise CorpusError(f"{where}: field {column!r} must be a string, got {text!r:.80}")
    return text


def stdlib_root() -> Path:
    """The folder of the running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def open_corpus(data: str | os.PathLike | None = None, *, text_column: str = "text") -> Corpus:
    """The corpus at ``data``: chosen by what the path is.

    * ``None``: the running Python's standard library, its ``.py`` files (test suites
      included; installed packages under ``site-packages`` not).
    * a folder: every file under it, recursively, each a document (``FolderCorpus``).
    * ``*.jsonl``: one document per line, from the field ``text_column``.
    * ``*.parquet``: one document per row, from the column ``text_column`` (needs pyarrow).
    * any other file: one text document, split by lines (``TextFileCorpus``).

    Args:
      data: the path, or None for the standard library.
      text_column: the field or column holding the text of a ``.jsonl``/``.parquet`` table.

    Returns:
      A ``Corpus``; nothing is read but the file listing until ``documents`` is iterated.

    Raises:
      CorpusError: the path does not exist, a table lacks the column, pyarrow is missing.

    Example:
      >>> from examples.lm.corpus import open_corpus
      >>> corpus = open_corpus()
      >>> corpus.description.startswith("python-stdlib:"), corpus.size_bytes > 1_000_000
      (True, True)
    """
    if data is None:
        corpus = FolderCorpus(stdlib_root(), suffix=".py", exclude=_NOT_STDLIB)
        corpus.description = f"python-stdlib:{corpus.root}"
        return corpus
    if not isinstance(data, str | os.PathLike):
        raise TypeError(f"data must be a path or None, got {data=}")
    path = Path(data).expanduser().resolve()
    if not path.exists():
        raise CorpusError(f"data path does not exist: {data=}")
    if path.is_dir():
        corpus = FolderCorpus(path)
        if not corpus.files:
            raise CorpusError(f"the data folder {path} holds no files (hidden ones aside)")
        return corpus
    if path.suffix == ".jsonl":
        return JsonlCorpus(path, text_column)
    if path.suffix == ".parquet":
        return ParquetCorpus(path, text_column)
    return TextFileCorpus(path)
