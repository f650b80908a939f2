"""A ``.safetensors`` file read one tensor at a time into memory JAX takes without a copy.

``safetensors.safe_open(..., framework="numpy").get_tensor`` returns a fresh array that JAX
then copies again (``jnp.asarray`` copies; ``jax.device_put`` on the CPU aliases only a
64-byte-aligned array). A loader holding the model being built pays that second copy at its
largest tensor. Here ``get_tensor`` reads the tensor's bytes straight from the file into a
new 64-byte-aligned array, so ``jax.device_put`` on the CPU adopts it as it is, and on a GPU
copies it once to the device.

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes, a little-endian
u64 ``N``; ``N`` bytes of JSON mapping each name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (offsets into the bytes after the header), plus an optional
``"__metadata__"``; then the data, little-endian, C order.
"""

from __future__ import annotations

import json
import os
import struct
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
        self.metadata = header.pop("__metadata__", None)
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        for name, entry in header.items():
            self._entries[name] = self._checked(name, entry, size - self._data_start)

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
            got = f.readinto(memoryview(out))
        if got != nbytes:  # the file shrank since its header was read
            raise ValueError(f"{self.path}: tensor {name!r}: read {got} of its {nbytes} bytes")
        tensor = out.view(dtype).reshape(shape)
        tensor.flags.writeable = False
        return tensor
