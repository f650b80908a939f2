"""``.safetensors`` files: read one tensor at a time into memory JAX takes without a copy,
their headers checked as strictly as the safetensors library checks them; written atomically,
laid out as that library lays them out.

``safetensors.safe_open(..., framework="numpy").get_tensor`` returns a fresh array that JAX
then copies again (``jnp.asarray`` copies; ``jax.device_put`` on the CPU aliases only a
64-byte-aligned array). A loader holding the model being built pays that second copy at its
largest tensor. Here ``get_tensor`` reads the tensor's bytes straight from the file into a
new 64-byte-aligned array, so ``jax.device_put`` on the CPU adopts it as it is, and on a GPU
copies it once to the device.

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes, a little-endian
u64 ``N``; ``N`` bytes of UTF-8 JSON, an object mapping each name to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (offsets into the bytes after the header), plus an optional
``"__metadata__"`` (string to string); then the data, little-endian, C order. The byte
ranges, sorted, tile the data section exactly: each starts where the previous one ends, the
first at 0, the last at the file's end. The safetensors library (the reference, whose Rust
core every HF loader uses) refuses a file that breaks any of this, and so does this reader:
overlapping ranges would read one tensor's bytes as another's, and a gap or trailing bytes
hide data that no reader sees.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import ml_dtypes
import numpy as np


class _Dtype(NamedTuple):
    numpy: np.dtype | None  # None: packed sub-byte values, which NumPy has no type for
    bits: int  # per element


# safetensors' dtype names, in the order of the library's Rust enum ``Dtype`` (increasing
# alignment): its writer lays tensors out in the reverse of this order, so that each one starts
# aligned to its element size, and save_safetensors does the same.
_DTYPES: dict[str, _Dtype] = {
    "BOOL": _Dtype(np.dtype("?"), 8),
    "F4": _Dtype(None, 4),
    "F6_E2M3": _Dtype(None, 6),
    "F6_E3M2": _Dtype(None, 6),
    "U8": _Dtype(np.dtype("u1"), 8),
    "I8": _Dtype(np.dtype("i1"), 8),
    "F8_E5M2": _Dtype(np.dtype(ml_dtypes.float8_e5m2), 8),
    "F8_E4M3": _Dtype(np.dtype(ml_dtypes.float8_e4m3fn), 8),
    "F8_E8M0": _Dtype(np.dtype(ml_dtypes.float8_e8m0fnu), 8),
    "F8_E4M3FNUZ": _Dtype(np.dtype(ml_dtypes.float8_e4m3fnuz), 8),
    "F8_E5M2FNUZ": _Dtype(np.dtype(ml_dtypes.float8_e5m2fnuz), 8),
    "I16": _Dtype(np.dtype("<i2"), 16),
    "U16": _Dtype(np.dtype("<u2"), 16),
    "F16": _Dtype(np.dtype("<f2"), 16),
    "BF16": _Dtype(np.dtype(ml_dtypes.bfloat16), 16),
    "I32": _Dtype(np.dtype("<i4"), 32),
    "U32": _Dtype(np.dtype("<u4"), 32),
    "F32": _Dtype(np.dtype("<f4"), 32),
    "C64": _Dtype(np.dtype("<c8"), 64),
    "F64": _Dtype(np.dtype("<f8"), 64),
    "I64": _Dtype(np.dtype("<i8"), 64),
    "U64": _Dtype(np.dtype("<u8"), 64),
}
_NAMES = {d.numpy: name for name, d in _DTYPES.items() if d.numpy is not None}
_RANK = {name: rank for rank, name in enumerate(_DTYPES)}
# XLA's CPU client adopts a host buffer aligned to this without copying it.
_ALIGN = 64
# The library's MAX_HEADER_SIZE: a longer header is refused unread.
_MAX_HEADER = 100_000_000
# serde_json, the library's parser, refuses a 128th level of nested arrays and objects.
_MAX_DEPTH = 127
# Sizes are usize in the library: a tensor of 2**64 bits or more is an overflow it refuses.
_MAX_BITS = 2**64


class _Entry(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """One ``.safetensors`` file: its header parsed and checked, its tensors read on demand.

    The header is checked when the file is opened, as the safetensors library checks it: the
    length within the file, strict UTF-8 JSON, ``__metadata__`` strings to strings, each
    entry's dtype, shape and ``data_offsets`` consistent, and the byte ranges tiling the data
    section with no overlap, gap or trailing byte. A damaged or inconsistent file is a
    ValueError naming the file, the tensor and the offending value before any tensor is read.

    Attributes:
      path: the file.
      metadata: its ``__metadata__``, or None if it has none.

    Example:
      >>> import tempfile, numpy as np
      >>> from safetensors.numpy import save_file
      >>> path = tempfile.mkdtemp() + "/t.safetensors"
      >>> save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, path)
      >>> f = SafetensorsFile(path)
      >>> f.keys(), f.get_tensor("w")[1]
      (['w'], array([3., 4., 5.], dtype=float32))
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n, header = _read_header(self.path, f, size)
        self._data_start = 8 + n
        self.metadata = _checked_metadata(self.path, header.pop("__metadata__", None))
        self._entries = {
            name: _checked_entry(self.path, name, entry) for name, entry in header.items()
        }
        _check_layout(self.path, self._entries, size - self._data_start)

    def keys(self) -> list[str]:
        """The tensors' names, in the header's order."""
        return list(self._entries)

    def get_tensor(self, name: str) -> np.ndarray:
        """The tensor, read into a new 64-byte-aligned, read-only array.

        Read-only because on the CPU ``jax.device_put`` adopts the memory itself: a loaded
        parameter would change with any write to the array.

        Raises:
          KeyError: the file has no tensor ``name``.
          ValueError: NumPy cannot hold it (a packed 4- or 6-bit dtype, a dimension of 2**63
            or more), or the file was cut short since it was opened.
        """
        entry = self._entry(name)
        dtype = self._numpy_dtype(name, entry)
        if any(d >= 2**63 for d in entry.shape):  # NumPy's sizes are signed 64-bit
            raise ValueError(
                f"{self.path}: tensor {name!r}: shape {list(entry.shape)} has a dimension of "
                "2**63 or more, which NumPy cannot index"
            )
        tensor = self._read(name, entry, dtype, 0, math.prod(entry.shape)).reshape(entry.shape)
        tensor.flags.writeable = False
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the header (nothing read)."""
        return self._entry(name).shape

    def get_elements(self, name: str, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of the tensor flattened in C order, read alone.

        Only those bytes are read from the file (what a process loading its own shard of a
        parameter needs): a new, writable, 64-byte-aligned 1-D array.
        """
        entry = self._entry(name)
        size = math.prod(entry.shape)
        if not 0 <= start <= stop <= size:
            raise ValueError(
                f"{self.path}: tensor {name!r} has {size} elements; cannot read [{start}, {stop})"
            )
        return self._read(name, entry, self._numpy_dtype(name, entry), start, stop)

    def get_columns(self, name: str, start: int, stop: int) -> np.ndarray:
        """Columns ``[start, stop)`` of a 2-D tensor, ``tensor[:, start:stop]``, read alone.

        Each row's run of bytes is read on its own: the process holds the slice, never the
        tensor (a ``Linear`` kernel is the file's tensor transposed, so its rows are the
        file's columns).
        """
        entry = self._entry(name)
        if len(entry.shape) != 2 or not 0 <= start <= stop <= entry.shape[1]:
            raise ValueError(
                f"{self.path}: tensor {name!r} has shape {list(entry.shape)}; cannot read "
                f"columns [{start}, {stop}) of it"
            )
        dtype = self._numpy_dtype(name, entry)
        rows, cols = entry.shape
        width = (stop - start) * dtype.itemsize
        raw = _aligned(rows * width).reshape(rows, width)  # bytes: bf16 has no buffer format
        with open(self.path, "rb") as f:
            for r in range(rows):
                f.seek(self._data_start + entry.begin + (r * cols + start) * dtype.itemsize)
                if f.readinto(raw[r].data) != width:
                    raise ValueError(f"{self.path}: tensor {name!r}: the file was cut short")
        return raw.view(dtype)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    def _numpy_dtype(self, name: str, entry: _Entry) -> np.dtype:
        dtype = _DTYPES[entry.dtype].numpy
        if dtype is None:
            raise ValueError(
                f"{self.path}: tensor {name!r}: dtype {entry.dtype} packs values into parts "
                "of a byte, which NumPy has no type for"
            )
        return dtype

    def _read(self, name: str, entry: _Entry, dtype: np.dtype, start: int, stop: int) -> np.ndarray:
        nbytes = (stop - start) * dtype.itemsize
        out = _aligned(nbytes)
        with open(self.path, "rb") as f:
            f.seek(self._data_start + entry.begin + start * dtype.itemsize)
            got = f.readinto(out.data)
        if got != nbytes:  # the file shrank since its header was read
            raise ValueError(f"{self.path}: tensor {name!r}: read {got} of its {nbytes} bytes")
        return out.view(dtype)


def _aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` new bytes starting on a multiple of ``_ALIGN`` (what XLA's CPU adopts)."""
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return raw[skip : skip + nbytes]


def _read_header(path: Path, f: BinaryIO, size: int) -> tuple[int, dict[str, Any]]:
    """The header's length and its JSON object, parsed as strictly as serde_json parses it."""
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{path}: {size} bytes, too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER:
        raise ValueError(f"{path}: header length {n} exceeds the format's {_MAX_HEADER} bytes")
    if 8 + n > size:
        raise ValueError(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
    blob = f.read(n)
    try:
        if len(blob) != n:  # the file shrank since its size was read
            raise ValueError(f"read {len(blob)} of {n} bytes")
        # Decoded first: json.loads on bytes would also take UTF-16 and UTF-32.
        header = json.loads(
            blob.decode("utf-8"),
            object_pairs_hook=_object,
            parse_int=_int,
            parse_float=_float,
            parse_constant=_constant,
        )
        _check_strict_json(header)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError included
        raise ValueError(f"{path}: the {n}-byte header is not the format's JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    return n, header


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A repeated key: RFC 8259 leaves which one counts to the parser, so two readers could
    # read two different tensors (or metadata) from one file.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def _int(text: str) -> int | float:
    # serde_json reads -0 as a float, which no size or offset may be.
    return -0.0 if text == "-0" else int(text)


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text}")
    return value


def _constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")  # Python's json takes NaN and Infinity


def _check_strict_json(value: Any) -> None:
    # What serde_json refuses that Python's json takes: deep nesting and lone surrogates.
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:  # an escape like "\ud800": half of a UTF-16 pair
                raise ValueError(f"the string {value!r} is not UTF-8: a lone surrogate") from None
        elif isinstance(value, dict | list):
            if depth > _MAX_DEPTH:
                raise ValueError(f"nested more than {_MAX_DEPTH} levels deep")
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


def _checked_metadata(path: Path, metadata: Any) -> dict[str, str] | None:
    # The library's type: Option<HashMap<String, String>>, so null is no metadata.
    if metadata is None or (
        isinstance(metadata, dict)
        and all(isinstance(v, str) for v in metadata.values())  # keys are strings in JSON
    ):
        return metadata
    raise ValueError(f"{path}: __metadata__ must map strings to strings, got {metadata!r}")


def _is_size(x: Any) -> bool:
    return type(x) is int and 0 <= x < 2**64  # not bool, not float: the library's usize


def _checked_entry(path: Path, name: str, entry: Any) -> _Entry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: the header entry {entry!r} is not an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise ValueError(f"{where}: the header entry {entry!r} has no {', '.join(missing)}")
    # Other keys are ignored, as the library ignores them.
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    if not (isinstance(shape, list) and all(_is_size(d) for d in shape)):
        raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_size, offsets))):
        raise ValueError(f"{where}: data_offsets {offsets!r} is not [begin, end] in bytes")
    begin, end = offsets
    if begin > end:
        raise ValueError(f"{where}: data_offsets {offsets} end before they begin")
    bits = math.prod(shape) * _DTYPES[dtype].bits
    if bits >= _MAX_BITS:
        raise ValueError(f"{where}: {dtype} {shape} is {bits} bits, past the format's sizes")
    if bits % 8:  # packed 4- and 6-bit values must fill whole bytes
        raise ValueError(f"{where}: {dtype} {shape} is {bits} bits, not a whole number of bytes")
    if end - begin != bits // 8:
        raise ValueError(
            f"{where}: {dtype} {shape} is {bits // 8} bytes, but data_offsets {offsets} "
            f"hold {end - begin}"
        )
    return _Entry(dtype, tuple(shape), begin, end)


def _check_layout(path: Path, entries: Mapping[str, _Entry], data_bytes: int) -> None:
    """The ranges, sorted, tile ``[0, data_bytes)``: no overlap, no gap, no trailing byte."""
    # The library's order: by (begin, end); the name only makes the messages deterministic.
    ordered = sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end, item[0]))
    at, before = 0, "the header"  # where the previous range ends, and what it is
    for name, e in ordered:
        ranges = f"data_offsets [{e.begin}, {e.end}]"
        if e.begin < at:
            raise ValueError(f"{path}: tensor {name!r}: {ranges} overlap {before}")
        if e.begin > at:
            raise ValueError(
                f"{path}: tensor {name!r}: {ranges} leave bytes [{at}, {e.begin}) after "
                f"{before} that no tensor owns"
            )
        at, before = e.end, f"tensor {name!r} ({ranges})"
    if at > data_bytes:
        raise ValueError(
            f"{path}: {before} runs past the end of the file ({data_bytes} bytes after the header)"
        )
    if at < data_bytes:
        raise ValueError(
            f"{path}: {data_bytes - at} trailing bytes [{at}, {data_bytes}) after {before} "
            "that no tensor owns"
        )
