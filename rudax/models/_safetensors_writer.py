"""``save_safetensors``: a ``.safetensors`` file written as the safetensors library writes it,
atomically. The format and its checks are the reader's (``rudax.models._safetensors``)."""

from __future__ import annotations

import json
import math
import os
import secrets
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rudax.models._safetensors import _NAMES, _RANK

__all__ = ["save_safetensors"]


def save_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray | jax.Array],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes ``tensors`` as a ``.safetensors`` file, laid out as the safetensors library does.

    The library's layout: tensors by decreasing dtype alignment, then by name, so each starts
    aligned to its element size; the header compact JSON padded with spaces to a multiple of 8
    bytes. ``safetensors.numpy.save_file`` writes the same bytes (for at most one metadata key:
    it orders keys by hash). The file is written beside ``path``, flushed to disk and renamed
    onto it: an interrupted write never leaves a partial file there, nor spoils the old one.
    A JAX array is copied to the host one tensor at a time, as it is written.

    Args:
      path: the file to write (replaced if it exists).
      tensors: name -> array, NumPy or JAX, of a dtype safetensors names (bool, 8- to 64-bit
        ints and floats, bfloat16, float8 variants, complex64).
      metadata: strings to strings, stored as ``__metadata__``; None for none.

    Raises:
      TypeError: a name, a metadata key or value that is not a string, or a dtype
        safetensors has no name for.
      ValueError: a tensor named ``__metadata__``.

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
        for k, v in metadata.items():
            if not (isinstance(k, str) and isinstance(v, str)):
                raise TypeError(f"metadata must map strings to strings, got {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    # Checked in full before the file is opened: a bad tensor writes nothing.
    planned: dict[str, tuple[str, np.dtype, tuple[int, ...]]] = {}
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, got {name!r}")
        if name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is the format's metadata key")
        if not name.isascii():
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"tensor name {name!r} is not UTF-8: a lone surrogate") from None
        try:
            dtype = np.dtype(value.dtype)
            dtype = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
            kind = _NAMES[dtype]
        except (TypeError, KeyError, AttributeError):
            raise TypeError(
                f"tensors[{name!r}]: dtype {getattr(value, 'dtype', type(value))} has no "
                f"safetensors name; one of {', '.join(map(str, _NAMES))}"
            ) from None
        planned[name] = (kind, dtype, tuple(int(d) for d in value.shape))
    order = sorted(planned, key=lambda name: (-_RANK[planned[name][0]], name))
    offset = 0
    for name in order:
        kind, dtype, shape = planned[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": kind,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    # serde_json's output: no spaces, UTF-8 as is.
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    blob += b" " * (-len(blob) % 8)
    target = Path(path)
    partial = target.with_name(f"{target.name}.{secrets.token_hex(4)}.partial")
    try:
        with open(partial, "xb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name in order:
                _, dtype, shape = planned[name]
                array = np.asarray(tensors[name], dtype=dtype, order="C")
                if array.shape != shape:  # an object whose shape changed under us
                    raise ValueError(f"tensors[{name!r}]: shape {array.shape}, was {shape}")
                f.write(array.reshape(-1).view(np.uint8).data)
            f.flush()
            # On disk before the rename: otherwise a crash could leave the new name on an
            # empty file.
            os.fsync(f.fileno())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
