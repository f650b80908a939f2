"""``.safetensors`` files: read one tensor at a time into memory JAX takes without a copy,
their headers checked as the format specifies; written atomically.

``safetensors.safe_open(..., framework="numpy").get_tensor`` returns a fresh array that JAX
then copies again (``jnp.asarray`` copies; ``jax.device_put`` on the CPU aliases only a
64-byte-aligned array). A loader holding the model being built pays that second copy at its
largest tensor. Here ``get_tensor`` reads the tensor's bytes straight from the file into a
new 64-byte-aligned array, so ``jax.device_put`` on the CPU adopts it as it is, and on a GPU
copies it once to the device.

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes, a little-endian
u64 ``N``; ``N`` bytes of JSON mapping each name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (offsets into the bytes after the header), plus an optional
``"__metadata__"`` (string to string); then the data, little-endian, C order. The byte
ranges, in order, tile the data section exactly: each starts where the previous one ends, the
first at 0, the last at the file's end (the safetensors library refuses anything else, and
so does this reader: overlapping ranges would read one tensor's bytes as another's).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

# safetensors' dtype names -> NumPy dtypes (little-endian, as the format stores them).
DTYPES: dict[str, Any] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
# XLA's CPU client adopts a host buffer aligned to this without copying it.
_ALIGN = 64
# A header larger than this is not a safetensors file (the library's own limit is 100 MB).
_MAX_HEADER = 100 * 2**20


class SafetensorsFile:
    """One ``.safetensors`` file: its header parsed and checked, its tensors read on demand.

    Every entry's dtype, shape and byte range are checked when the file is opened, so a
    truncated or inconsistent file is a ValueError naming the file and the tensor before any
    tensor is read.

    Example:
      >>> import tempfile, numpy as np
      >>> from safetensors.numpy import save_file
      >>> path = tempfile.mkdtemp() + "/t.safetensors"
      >>> save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, path)
      >>> f = SafetensorsFile(path)
      >>> f.keys(), f.get_tensor("w")[1]
      (['w'], array([3., 4., 5.], dtype=float32))
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path}: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError(f"{self.path}: header length {n} exceeds the file ({size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{self.path}: the header is not JSON ({e})") from e
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: the header is {type(header).__name__}, not an object")
        self._data_start = 8 + n
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not (
            isinstance(metadata, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise ValueError(
                f"{self.path}: __metadata__ must map strings to strings, got {metadata!r}"
            )
        self.metadata: dict[str, str] | None = metadata
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        ranges = []
        for name, entry in header.items():
            self._entries[name] = self._checked(name, entry, size - self._data_start)
            begin, end = (int(o) for o in entry["data_offsets"])
            ranges.append((begin, end, name))
        # The ranges must tile the data section: sorted, each from the previous one's end.
        at, previous = 0, None
        for begin, end, name in sorted(ranges):
            if begin != at:
                what = "overlaps" if begin < at else "leaves a gap after"
                other = f"tensor {previous!r}" if previous is not None else "the start"
                raise ValueError(
                    f"{self.path}: tensor {name!r} data_offsets [{begin}, {end}] {what} "
                    f"{other} (which ends at {at})"
                )
            at, previous = end, name
        if at != size - self._data_start:
            raise ValueError(
                f"{self.path}: the tensors' data ends at byte {at} of {size - self._data_start} "
                "data bytes: the file has trailing bytes no tensor owns"
            )

    def _checked(self, name: str, entry: Any, data_bytes: int) -> tuple[np.dtype, tuple, int]:
        where = f"{self.path}: tensor {name!r}"
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: bad header entry {entry!r} ({e!r})") from e
        want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_bytes or end - begin != want:
            raise ValueError(
                f"{where}: data_offsets [{begin}, {end}] for {entry['dtype']} {list(shape)} "
                f"({want} bytes) do not fit the file's {data_bytes} data bytes"
            )
        return dtype, shape, begin

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_tensor(self, name: str) -> np.ndarray:
        """The tensor, read into a new 64-byte-aligned, read-only array.

        Read-only because on the CPU ``jax.device_put`` adopts the memory itself: a loaded
        parameter would change with any write to the array.
        """
        dtype, shape, begin = self._entries[name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = np.empty(nbytes + _ALIGN, np.uint8)
        skip = -raw.ctypes.data % _ALIGN
        out = raw[skip : skip + nbytes]
        with open(self.path, "rb") as f:
            f.seek(self._data_start + begin)
            got = f.readinto(out.data)
        if got != nbytes:  # the file shrank since its header was read
            raise ValueError(f"{self.path}: tensor {name!r}: read {got} of its {nbytes} bytes")
        tensor = out.view(dtype).reshape(shape)
        tensor.flags.writeable = False
        return tensor


_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def save_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, Any],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes ``tensors`` as a ``.safetensors`` file that the safetensors library reads.

    Tensors in sorted name order, their ranges tiling the data; the header padded with
    spaces to a multiple of 8 bytes, as the library writes it. The file is written beside
    ``path`` and renamed onto it: an interrupted write never leaves a partial file there.

    Args:
      path: the file to write (replaced if it exists).
      tensors: name -> array (NumPy or JAX, any dtype of ``DTYPES``); names must not start
        with ``"__"``.
      metadata: string -> string, stored as ``__metadata__``; None for none.

    Example:
      >>> import tempfile, numpy as np
      >>> from rudax.models import SafetensorsFile, save_safetensors
      >>> path = tempfile.mkdtemp() + "/t.safetensors"
      >>> save_safetensors(path, {"b": np.ones(2, np.float16), "a": np.arange(3)})
      >>> f = SafetensorsFile(path)
      >>> f.keys(), f.get_tensor("b").dtype
      (['a', 'b'], dtype('float16'))
    """
    header: dict[str, Any] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError(f"metadata must map strings to strings, got {dict(metadata)!r}")
        header["__metadata__"] = dict(metadata)
    arrays = []
    offset = 0
    for name in sorted(tensors):
        if not isinstance(name, str) or name.startswith("__"):
            raise ValueError(f"tensor name {name!r}: a string not starting with '__' is needed")
        array = np.ascontiguousarray(np.asarray(tensors[name]))
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        if dtype not in _NAMES:
            raise TypeError(f"tensor {name!r}: dtype {array.dtype} has no safetensors name")
        array = array.astype(dtype, copy=False)
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for array in arrays:
                f.write(array.reshape(-1).view(np.uint8).data)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
