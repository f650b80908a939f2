"""Token shards on disk and the deterministic loader the trainer reads its batches from.

A shard is a flat array of token ids behind a fixed little-endian header::

    magic   8 bytes   b"RUDAXTOK"
    version uint32    1
    dtype   uint32    1 = uint16, 2 = uint32
    count   uint64    number of tokens
    tokens  count * itemsize bytes

The header is checked on load, so a truncated file, a file of another format or of a future
version is a clear error naming the file instead of a silent read of garbage. Ids are uint16
while the vocabulary fits (half the disk and page cache of uint32), uint32 beyond.

The header cannot tell a changed id from the right one: a shard whose bytes changed in place
(a bad disk, a stray write) has the right size and would train on. So ``prepare`` records each
shard's SHA-256 (``shard_sha256``) and ``TokenLoader`` checks it on open, together with the
largest id against the vocabulary: an id >= the vocabulary would look up no embedding row
and give a NaN loss. Both read each shard once when the loader is built (SHA-256 runs at
about 1-2 GB/s, so ~0.1 s for the stdlib corpus's 16 MB), and nothing per batch.

``TokenLoader`` reads windows of ``seq_len + 1`` tokens (inputs and their next-token targets)
at random offsets of the shards' concatenation. Batch ``i`` is a pure function of
``(seed, i)``: its offsets come from a counter-based generator keyed by both, not from a
stateful stream, so a resumed run needs only its step to see the same data, and any batch
can be read in any order.
"""

from __future__ import annotations

import hashlib
import numbers
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"RUDAXTOK"
VERSION = 1


def check_int(name: str, value: Any, *, positive: bool = True) -> None:
    """The programs' argument check: a TypeError naming ``name`` unless ``value`` is an int
    (not a bool); a ValueError unless it is > 0 when ``positive``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")


_HEADER = struct.Struct("<8sIIQ")  # magic, version, dtype code, token count
HEADER_BYTES = _HEADER.size
_DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}


class ShardError(ValueError):
    """A token shard on disk is not what was written: foreign, truncated, changed or holding
    ids outside the vocabulary. The message names the file; preparing the data again fixes it."""


def shard_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes (header included), as hex; read in 1 MiB chunks.

    It detects accidents (a damaged disk, a stray write), not tampering: whoever can change a
    shard can change the manifest that records its digest.

    Example:
      >>> import numpy as np, tempfile, pathlib
      >>> from examples.lm.data import shard_sha256, write_tokens
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "train_000.bin"
      >>> write_tokens(path, np.array([5, 0, 7], np.uint16))
      >>> len(shard_sha256(path))
      64
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """The shard dtype for a vocabulary: uint16 up to 65536 ids, uint32 up to 2**32.

    Example:
      >>> from examples.lm.data import token_dtype
      >>> token_dtype(8192), token_dtype(100_000)
      (dtype('uint16'), dtype('uint32'))
    """
    check_int("vocab_size", vocab_size)
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size must be at most 2**32, got {vocab_size=}")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_tokens(path: str | Path, tokens: np.ndarray) -> None:
    """Writes a 1-D uint16 or uint32 array as a token shard, atomically.

    The file appears complete or not at all: it is written beside ``path`` under a temporary
    name, flushed to disk and renamed over ``path``. Other dtypes are refused rather than cast
    (choose with ``token_dtype``).

    Args:
      path: the shard's file name (conventionally ``*.bin``).
      tokens: the token ids, shape (n,), dtype uint16 or uint32.

    Example:
      >>> import numpy as np, tempfile, pathlib
      >>> from examples.lm.data import read_tokens, write_tokens
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "train_000.bin"
      >>> write_tokens(path, np.array([5, 0, 7], np.uint16))
      >>> read_tokens(path).tolist()
      [5, 0, 7]
    """
    if not isinstance(tokens, np.ndarray):
        raise TypeError(f"tokens must be a numpy array, got {type(tokens).__name__}")
    codes = [c for c, d in _DTYPE_CODES.items() if d == tokens.dtype.newbyteorder("<")]
    if not codes:
        raise TypeError(f"tokens must have dtype uint16 or uint32, got dtype={tokens.dtype}")
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, codes[0], tokens.size))
            np.ascontiguousarray(tokens, _DTYPE_CODES[codes[0]]).tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_tokens(path: str | Path, *, sha256: str | None = None) -> np.ndarray:
    """A token shard's ids, memory-mapped read-only after its header is checked.

    Args:
      path: a file written by ``write_tokens``.
      sha256: if given, the file's ``shard_sha256`` as recorded when it was written; a file
        whose bytes differ is a ``ShardError`` (this reads the whole file once).

    Returns:
      A read-only ``np.memmap`` of shape (count,) and the shard's dtype (an empty array for
      a shard of no tokens, which cannot be mapped).

    Raises:
      ShardError: a ValueError naming the path, if the file is not a rudax token shard (wrong
        magic), has a format version or dtype code this code does not know, its size is not
        that of the header plus ``count`` tokens (truncated or corrupted), or its SHA-256
        differs from ``sha256``.

    Example:
      >>> import numpy as np, tempfile, pathlib
      >>> from examples.lm.data import read_tokens, write_tokens
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "val_000.bin"
      >>> write_tokens(path, np.arange(4, dtype=np.uint32))
      >>> tokens = read_tokens(path)
      >>> tokens.dtype, tokens.shape
      (dtype('uint32'), (4,))
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise ShardError(f"{path}: not a rudax token shard (its first bytes are {head[:8]!r})")
    if len(head) < HEADER_BYTES:
        raise ShardError(
            f"{path}: truncated or corrupted: expected at least {HEADER_BYTES} bytes of header, "
            f"found {size}"
        )
    _, version, code, count = _HEADER.unpack(head)
    if version != VERSION:
        raise ShardError(
            f"{path}: token shard format version {version} is not supported "
            f"(this code reads version {VERSION})"
        )
    if code not in _DTYPE_CODES:
        raise ShardError(f"{path}: unknown token dtype code {code} (known: {_DTYPE_CODES})")
    dtype = _DTYPE_CODES[code]
    expected = HEADER_BYTES + count * dtype.itemsize
    if size != expected:
        raise ShardError(
            f"{path}: truncated or corrupted: expected {expected} bytes "
            f"({count} tokens of {dtype.name}), found {size}"
        )
    if sha256 is not None and (found := shard_sha256(path)) != sha256:
        raise ShardError(
            f"{path}: its SHA-256 is {found}, but {sha256} was recorded when it was written: "
            "the file was changed or damaged since"
        )
    if count == 0:
        return np.zeros((0,), dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


class TokenLoader:
    """Random windows of a token stream, batch ``i`` a pure function of ``(seed, i)``.

    The stream is the concatenation of the shards in the order given. Row ``r`` of global
    batch ``i`` is the window ``stream[o : o + seq_len + 1]``, ``o`` drawn uniformly from
    ``[0, num_tokens - seq_len - 1]`` by a Philox generator keyed by ``(seed, i)``; windows
    may cross shard (and document) boundaries, as they would in one long file. Batches are
    drawn with replacement: there is no epoch, and no state to save but the step.

    Args:
      paths: token shards (``write_tokens``), at least one.
      seq_len: tokens a model sees per row; rows hold ``seq_len + 1`` (inputs and targets).
      batch_size: rows of a global batch.
      seed: a non-negative int that, with the batch index, fixes every window.
      checksums: if given, each shard's SHA-256 (``shard_sha256``) in the order of ``paths``,
        as ``prepare`` records them; each is verified on open (``read_tokens``).
      vocab_size: if given, every id must be below it: each shard's largest id is checked
        on open (one pass over it), so no batch can hold an id without an embedding row.

    Raises:
      ShardError: a shard is damaged (``read_tokens``) or holds an id >= ``vocab_size``.

    Example:
      >>> import numpy as np, tempfile, pathlib
      >>> from examples.lm.data import TokenLoader, write_tokens
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "train_000.bin"
      >>> write_tokens(path, np.arange(100, dtype=np.uint16))
      >>> loader = TokenLoader([path], seq_len=8, batch_size=4, seed=0)
      >>> batch = loader.batch(3)
      >>> batch.shape, batch.dtype
      ((4, 9), dtype('int32'))
      >>> bool(np.all(np.diff(batch, axis=1) == 1))  # each row is a contiguous slice
      True
      >>> np.array_equal(batch, TokenLoader([path], seq_len=8, batch_size=4, seed=0).batch(3))
      True
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        checksums: Sequence[str] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if isinstance(paths, str | Path) or not isinstance(paths, Sequence):
            raise TypeError(f"paths must be a sequence of shard paths, got {paths=}")
        if not paths:
            raise ValueError("paths must name at least one token shard, got paths=[]")
        check_int("seq_len", seq_len)
        check_int("batch_size", batch_size)
        check_int("seed", seed, positive=False)
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed=}")
        if checksums is not None and (isinstance(checksums, str) or len(checksums) != len(paths)):
            raise ValueError(
                f"checksums must hold one SHA-256 per path ({len(paths)}), got {checksums=}"
            )
        if vocab_size is not None:
            check_int("vocab_size", vocab_size)
        self.paths = [Path(p) for p in paths]
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        digests = [None] * len(paths) if checksums is None else list(checksums)
        self._shards = [read_tokens(p, sha256=d) for p, d in zip(self.paths, digests, strict=True)]
        if vocab_size is not None:
            for path, shard in zip(self.paths, self._shards, strict=True):
                _check_ids(path, shard, vocab_size)
        sizes = [s.size for s in self._shards]
        # _starts[k] is shard k's first position in the stream; _starts[-1] its length.
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.num_tokens = int(self._starts[-1])
        if self.num_tokens < seq_len + 1:
            raise ValueError(
                f"seq_len={seq_len} needs windows of {seq_len + 1} tokens, but the shards hold "
                f"{self.num_tokens} tokens in all: {[str(p) for p in self.paths]}"
            )
        # Ids >= 2**31 would wrap in the int32 batches; only a uint32 shard can hold them,
        # and none can if every id was checked against a vocabulary that small.
        self._check_int32 = any(s.dtype.itemsize == 4 for s in self._shards) and not (
            vocab_size is not None and vocab_size <= 2**31
        )

    def batch(self, i: int, *, shard: int = 0, num_shards: int = 1) -> np.ndarray:
        """Global batch ``i``, or this host's share of it.

        With ``num_shards`` hosts each feeding its own devices (multi-host data parallel),
        host ``shard`` gets rows ``[shard * b, (shard + 1) * b)`` of global batch ``i``,
        ``b = batch_size // num_shards``: the hosts' results, concatenated in shard order,
        are exactly ``batch(i)``, so the global batch does not depend on the host count.

        Args:
          i: the batch index (the trainer's step or microbatch counter), >= 0.
          shard: this host's index in ``[0, num_shards)``.
          num_shards: the number of hosts; must divide ``batch_size``.

        Returns:
          int32 array of shape (batch_size // num_shards, seq_len + 1).
        """
        self._check_shard(shard, num_shards)
        check_int("i", i, positive=False)
        if not 0 <= i < 2**64:
            raise ValueError(f"i must be in [0, 2**64), got {i=}")
        rng = np.random.Generator(np.random.Philox(key=np.array([self.seed, i], np.uint64)))
        offsets = rng.integers(0, self.num_tokens - self.seq_len, size=self.batch_size)
        return self._gather(self._rows(offsets, shard, num_shards))

    def eval_batches(self, n: int, *, shard: int = 0, num_shards: int = 1) -> list[np.ndarray]:
        """``n`` fixed batches spread evenly over the whole stream, for validation.

        The ``n * batch_size`` windows start at evenly spaced offsets from the first token to
        the last full window, so every part of the validation data weighs in and the
        estimate is the same on every call and for every seed. ``shard``/``num_shards`` split
        each batch's rows as in ``batch``.

        Args:
          n: number of batches, >= 1.
          shard: this host's index in ``[0, num_shards)``.
          num_shards: the number of hosts; must divide ``batch_size``.

        Returns:
          A list of ``n`` int32 arrays of shape (batch_size // num_shards, seq_len + 1).
        """
        check_int("n", n)
        self._check_shard(shard, num_shards)
        last = self.num_tokens - self.seq_len - 1
        offsets = np.round(np.linspace(0, last, n * self.batch_size)).astype(np.int64)
        return [
            self._gather(self._rows(rows, shard, num_shards))
            for rows in offsets.reshape(n, self.batch_size)
        ]

    def _check_shard(self, shard: int, num_shards: int) -> None:
        check_int("num_shards", num_shards)
        check_int("shard", shard, positive=False)
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, {num_shards=}), got {shard=}")
        if self.batch_size % num_shards:
            raise ValueError(
                f"num_shards must divide batch_size={self.batch_size}, got {num_shards=}"
            )

    def _rows(self, offsets: np.ndarray, shard: int, num_shards: int) -> np.ndarray:
        per_host = self.batch_size // num_shards
        return offsets[shard * per_host : (shard + 1) * per_host]

    def _gather(self, offsets: np.ndarray) -> np.ndarray:
        width = self.seq_len + 1
        out = np.empty((offsets.size, width), np.int32)
        for row, start in enumerate(offsets.tolist()):
            end, filled = start + width, 0
            k = int(np.searchsorted(self._starts, start, side="right")) - 1
            while filled < width:  # a window may span several (small) shards
                lo = start + filled - int(self._starts[k])
                hi = min(end - int(self._starts[k]), self._shards[k].size)
                piece = self._shards[k][lo:hi]
                if self._check_int32 and piece.size and int(piece.max()) >= 2**31:
                    raise ShardError(
                        f"{self.paths[k]}: token id {int(piece.max())} does not fit the int32 "
                        "batches (ids must be < 2**31)"
                    )
                out[row, filled : filled + piece.size] = piece
                filled += piece.size
                k += 1
        return out


def _check_ids(path: Path, shard: np.ndarray, vocab_size: int) -> None:
    if not shard.size or int(shard.max()) < vocab_size:
        return
    position = int(np.argmax(shard >= vocab_size))
    raise ShardError(
        f"{path}: token id {int(shard[position])} at position {position} is outside the "
        f"vocabulary of {vocab_size} ids (ids must be < {vocab_size}): the shard is damaged "
        "or was made with another tokenizer"
    )
