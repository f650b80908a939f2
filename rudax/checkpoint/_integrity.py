"""Checksums of a checkpoint's arrays and the error a damaged checkpoint raises.

orbax stores arrays as zstd-compressed zarr chunks in OCDBT files and checks neither:
orbax-checkpoint 0.12.8 with tensorstore, zarr v2, zstd level 1 and no frame checksum
(``tensorstore_utils._build_zarr2_metadata``). A truncated file is an error from tensorstore,
but bytes flipped in the middle of a data file decode without complaint into other values
(seen for every one of seven positions tried in a 4 MB chunk). So rudax keeps its own checksum
of every saved leaf in the meta item and verifies it after each restore.

Two checksums, named in the meta item (``checksum_algorithm``); both are 32 bits per leaf,
computed from the host copy of each addressable shard (replica 0 only) with each element's
*global* position, and combined over shards and processes (a few integers each): no array is
gathered, and the value is the same for every sharding and device count the array is saved
from or restored onto; zero padding at the end of a flat vector (an FSDP ``ShardedParameter``
restored onto another number of shards) leaves either unchanged.

* ``"crc32c"`` (``_crc.py``; saved whenever ``google_crc32c`` is installed): a CRC-32C of the
  array's bytes, moved back by its length, so that each contiguous run of a shard contributes
  a term and the terms are XORed. Hardware CRC instructions: about 8 ms per 100 MB here.
* ``"fmix32-sum"`` (every checkpoint before it, and saves without ``google_crc32c``): a
  32-bit sum over the array's elements, in row-major order, of a hash of each nonzero
  element's bits and its flat index::

      h(w, i) = fmix32(w ^ (i * 0x9E3779B9))  if w != 0 else 0
      checksum = sum over elements of h(bits, flat index)  (mod 2**32)

  where ``bits`` is the element's bit pattern widened to uint32 (8- and 16-bit types
  zero-extended; 64-bit and complex elements as their 32-bit words, in memory order) and
  ``fmix32`` is MurmurHash3's finalizer, a bijection. Any one changed element changes the
  sum. NumPy in cache-sized chunks on a thread per core: about 50 ms per 100 MB here.

Random damage goes unnoticed by either with probability about 2**-32. A save takes the host
copies on the caller's thread (``host_copies``: the device-to-host copy orbax makes anyway)
and hashes them in orbax's background commit (``_meta_handler.py``); a restore hashes what it
read.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from rudax.checkpoint import _crc

_GOLDEN = 0x9E3779B9

LEGACY = "fmix32-sum"
ALGORITHMS = (LEGACY, _crc.NAME)


def default_algorithm() -> str:
    """The checksum a save records: CRC-32C where ``google_crc32c`` is installed."""
    return _crc.NAME if _crc.available() else LEGACY


def check_algorithm(algorithm: str) -> None:
    """A ValueError for an unknown name; an ImportError for CRC-32C without its package."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"checksum algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == _crc.NAME and not _crc.available():
        raise ImportError(
            "this checkpoint's checksums are CRC-32C, which needs the google-crc32c package "
            "(a rudax dependency): pip install google-crc32c"
        )


class CheckpointCorruptedError(ValueError):
    """A checkpoint step on disk is not what rudax wrote: truncated, altered or unsafe.

    Raised by ``Checkpointer.restore`` when a step's files cannot be read (a truncated or
    missing file, a meta item that is not valid JSON or lacks a field), when a restored
    array's checksum differs from the one saved with it (bytes changed on disk), or when a
    step directory is a symlink or leads outside the checkpoint root. The message names the
    step directory and what failed; the exception that revealed it, if any, is chained as
    ``__cause__``. A ``ValueError``, so code that treats a bad checkpoint as bad input keeps
    working; catch this class to fall back to an earlier step.

    Example:
      >>> import rudax.checkpoint as rc
      >>> issubclass(rc.CheckpointCorruptedError, ValueError)
      True
    """


# Elements hashed per NumPy pass: the temporaries stay in cache.
_CHUNK = 1 << 16
# Below this many chunks (4 MB of float32) threads cost more than they save.
_PARALLEL_JOBS = 16
_ARANGE = np.arange(_CHUNK, dtype=np.uint32)


def _hash_words(w: np.ndarray, index: np.ndarray) -> int:
    """Sum of h(w, index) over a 1-D run of words (uint8/16/32) and their uint32 flat indices."""
    w = w.astype(np.uint32)
    h = index * np.uint32(_GOLDEN)
    h ^= w
    # MurmurHash3's fmix32, a bijection of uint32.
    h ^= h >> 16
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> 13
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> 16
    h[w == 0] = 0
    return int(h.sum(dtype=np.uint64))


def _words(x: np.ndarray) -> np.ndarray:
    """x's elements as unsigned words of at most 32 bits; 64-bit ones as a trailing pair."""
    if x.dtype == np.bool_:
        return x.view(np.uint8)
    if x.dtype.kind == "c":
        x = x.view(np.float32 if x.dtype.itemsize == 8 else np.float64).reshape((*x.shape, -1))
    if x.dtype.itemsize == 8:
        return x.view(np.uint32).reshape((*x.shape, 2))
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _hash_run(w: np.ndarray, start: np.uint32) -> int:
    return _hash_words(w, _ARANGE[: w.size] + start)


def _hash_rows(rows: np.ndarray, bases: np.ndarray, columns: np.ndarray) -> int:
    return _hash_words(rows.reshape(-1), (bases[:, None] + columns[None, :]).reshape(-1))


def _runs(
    w: np.ndarray, ndim: int, starts: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """A block's contiguous runs of the whole flat array: (rows, the flat index of each).

    Args:
      w: the block, C-contiguous, with trailing dimensions the block covers in full (an
        element's words or bytes) after its first ``ndim``.
      starts: the block's first index along each of the array's dimensions.
      shape: the whole array's shape.

    Returns:
      ``rows``, 2-D (one contiguous run of the flat array per row), and ``bases``, uint64:
      the flat index (in units of ``w``'s items) where each row starts.
    """
    extra = w.shape[ndim:]
    shape, starts = (*shape, *extra), (*starts, *(0 for _ in extra))
    strides = [int(np.prod(shape[d + 1 :], dtype=np.int64)) for d in range(len(shape))]
    # k: the last dimension the block does not cover in full. From there on the block is one
    # contiguous run of the flat array per index of the dimensions before k.
    partial = [d for d in range(w.ndim) if w.shape[d] != shape[d]]
    k = partial[-1] if partial else 0
    run = int(np.prod(w.shape[k:], dtype=np.int64))
    bases = np.zeros((), np.uint64) + np.uint64(starts[k] * strides[k])
    for d in range(k):
        offsets = np.arange(w.shape[d], dtype=np.uint64) + np.uint64(starts[d])
        bases = np.add.outer(bases, offsets * np.uint64(strides[d]))
    bases = bases.reshape(-1)
    return w.reshape(len(bases), run), bases


def _block_jobs(
    data: np.ndarray, starts: tuple[int, ...], shape: tuple[int, ...]
) -> Iterator[Callable[[], int]]:
    """Zero-argument jobs whose results add up to the fmix32 sum of one block of an array.

    Args:
      data: the block (a shard), row-major.
      starts: the block's first index along each dimension of the whole array.
      shape: the whole array's shape.
    """
    w = np.ascontiguousarray(_words(np.ascontiguousarray(data)))
    rows, bases = _runs(w, data.ndim, starts, shape)
    bases = bases.astype(np.uint32)  # flat indices count mod 2**32
    run = rows.shape[1]
    if run >= _CHUNK:
        for base, row in zip(bases, rows, strict=True):
            for o in range(0, run, _CHUNK):
                yield functools.partial(_hash_run, row[o : o + _CHUNK], base + np.uint32(o % 2**32))
    else:
        per = _CHUNK // run
        for r in range(0, len(bases), per):
            yield functools.partial(
                _hash_rows, rows[r : r + per], bases[r : r + per], _ARANGE[:run]
            )


def _crc_block(data: np.ndarray, starts: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The XOR of a block's CRC-32C run terms (``_crc.py``), positions in bytes."""
    # ascontiguousarray makes a 0-d array 1-d: the shape is put back.
    data = np.ascontiguousarray(data).reshape(data.shape)
    as_bytes = data.reshape(-1).view(np.uint8).reshape((*data.shape, data.dtype.itemsize))
    rows, bases = _runs(as_bytes, data.ndim, starts, shape)
    return _crc.block_term(rows, bases)


class HostCopy(NamedTuple):
    """The part of one array leaf this process hashes, in host memory."""

    blocks: list[tuple[np.ndarray, tuple[int, ...]]]  # (block, its first index per dimension)
    shape: tuple[int, ...]  # the whole array's
    spread: bool  # a jax.Array: its blocks are spread over processes, the sums added up


def host_copies(tree: Any, *, copy_numpy: bool = True) -> dict[str, HostCopy]:
    """{keystr path: HostCopy} of each array leaf of tree: its device-to-host copy.

    A ``jax.Array`` gives the addressable shards of replica 0 (each element once, on the
    device that owns it) as ``np.asarray(shard.data)``, every transfer started before the
    first is waited for, as orbax's ``replica_slices.transfer_arrays_to_host`` does. On an
    accelerator that is the transfer, and JAX keeps its result on the shard's array, the very
    object orbax reads (``Array.addressable_shards`` is cached), so one transfer serves both.
    On CPU it is a read-only view of the device buffer, and while a view lives XLA neither
    donates nor frees that buffer: a ``jit`` with ``donate_argnums`` writes its output
    elsewhere and ``Array.delete`` leaves the memory to the view, so the bytes stay those
    saved. A NumPy leaf is copied unless ``copy_numpy`` is False (orbax's ``NumpyHandler``
    copies it too): the caller may write into it once ``save`` returns.
    """
    flat = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
    owned = {
        where: [s for s in x.addressable_shards if s.replica_id == 0]
        for where, x in flat
        if isinstance(x, jax.Array)
    }
    for shards in owned.values():
        for shard in shards:
            shard.data.copy_to_host_async()
    out = {}
    for where, x in flat:
        if where in owned:
            blocks = [
                (np.asarray(s.data), tuple(i.start or 0 for i in s.index)) for s in owned[where]
            ]
            out[where] = HostCopy(blocks, tuple(x.shape), True)
        else:
            a = np.array(x, copy=True) if copy_numpy else np.asarray(x)
            out[where] = HostCopy([(a, (0,) * a.ndim)], a.shape, False)
    return out


def local_sums(copies: list[HostCopy], algorithm: str = LEGACY) -> np.ndarray:
    """Each copy's checksum (as uint64) over this process's blocks: its share.

    ``"fmix32-sum"`` hashes chunks on a thread per core (NumPy releases the GIL);
    ``"crc32c"`` runs at memory speed on the caller's thread.
    """
    if algorithm == _crc.NAME:
        out = np.zeros(len(copies), np.uint64)
        for i, copy in enumerate(copies):
            term = 0
            for block, starts in copy.blocks:
                term ^= _crc_block(block, starts, copy.shape)
            out[i] = term
        return out
    jobs = [
        (i, job)
        for i, copy in enumerate(copies)
        for block, starts in copy.blocks
        for job in _block_jobs(block, starts, copy.shape)
    ]
    if len(jobs) >= _PARALLEL_JOBS:
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            results = list(pool.map(lambda job: job[1](), jobs))
    else:
        results = [job() for _, job in jobs]
    sums = np.zeros(len(copies), np.uint64)
    for (i, _), value in zip(jobs, results, strict=True):
        sums[i] = (int(sums[i]) + value) % 2**32
    return sums


def combine_sums(
    sums: np.ndarray, others: list[np.ndarray], spread: np.ndarray, algorithm: str = LEGACY
) -> np.ndarray:
    """sums with the other processes' shares combined in where ``spread``: added mod 2**32
    (``"fmix32-sum"``) or XORed (``"crc32c"``).

    A leaf that is not spread (a NumPy array) is whole in every process: its own sum stands.
    """
    total = sums.astype(np.uint64)
    for other in others:
        other = other.astype(np.uint64)
        both = total ^ other if algorithm == _crc.NAME else (total + other) % 2**32
        total = np.where(spread, both, total)
    return total


def as_hex(paths: list[str], sums: np.ndarray) -> dict[str, str]:
    """{path: 8 hex digits}, the form the meta item stores."""
    return {where: f"{int(s) % 2**32:08x}" for where, s in zip(paths, sums, strict=True)}


def checksums(tree: Any, algorithm: str = LEGACY) -> dict[str, str]:
    """{keystr path: 8 hex digits} of the checksum of each array leaf of tree.

    In a multi-process run every process must call it (as every process calls restore): the
    sums of the processes' shards are added by one all-gather, a collective on the caller's
    thread. A save adds them in the background instead (``_meta_handler.py``).
    """
    copies = host_copies(tree, copy_numpy=False)  # nothing changes tree while this runs
    check_algorithm(algorithm)
    sums = local_sums(list(copies.values()), algorithm)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        # uint32 travels as is (JAX without x64 has no uint64); the adding is done here.
        gathered = np.asarray(multihost_utils.process_allgather(sums.astype(np.uint32)))
        spread = np.array([c.spread for c in copies.values()], bool)
        mine = jax.process_index()
        others = [g for i, g in enumerate(gathered) if i != mine]
        sums = combine_sums(sums, others, spread, algorithm)
    return as_hex(list(copies), sums)


def verify_checksums(
    where: str, part: str, expected: dict[str, str], tree: Any, algorithm: str = LEGACY
) -> None:
    """CheckpointCorruptedError naming the first leaf of tree whose checksum is not expected.

    Args:
      where: the step directory, for the message.
      part: the record part the tree is (``"model"``, ...).
      expected: the part's checksums as saved, {keystr path: 8 hex digits}.
      tree: the part as orbax restored it.
      algorithm: the checksum the meta item names.
    """
    got = checksums(tree, algorithm)
    for path, value in got.items():
        if expected.get(path) != value:
            raise CheckpointCorruptedError(
                f"{where}: record.{part}{path} was read back with checksum {value}, saved with "
                f"{expected.get(path)}: its data on disk changed after it was written"
            )
    missing = sorted(set(expected) - set(got))
    if missing:
        raise CheckpointCorruptedError(
            f"{where}: the meta item has checksums for record.{part}{missing[0]}, which the "
            "restored tree does not have"
        )
