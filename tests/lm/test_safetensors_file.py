"""examples.lm.safetensors_file against the safetensors library's own reader, and bad files."""

import json
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from examples.lm.safetensors_file import SafetensorsFile


def _tensors():
    rng = np.random.default_rng(0)
    out = {
        f"t.{dtype}": rng.standard_normal((3, 5)).astype(dtype)
        for dtype in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)
    }
    out["ints"] = rng.integers(-100, 100, (7,), dtype=np.int32)
    out["bytes"] = rng.integers(0, 255, (2, 3, 4), dtype=np.uint8)
    out["scalar"] = np.array(3.5, np.float32)
    out["empty"] = np.zeros((0, 4), np.float32)
    return out


def test_every_tensor_is_the_librarys_bit_for_bit_aligned_and_read_only(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(_tensors(), path, metadata={"format": "np"})
    theirs = load_file(path)
    f = SafetensorsFile(path)
    assert sorted(f.keys()) == sorted(theirs) and f.metadata == {"format": "np"}
    for name, want in theirs.items():
        got = f.get_tensor(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name
        assert not got.flags.writeable, name
        if got.size:
            assert got.ctypes.data % 64 == 0, name


def test_the_cpu_device_adopts_the_tensor_without_a_copy(tmp_path):
    """What load_hf's memory bound rests on: jax.device_put takes the array's own memory."""
    path = tmp_path / "m.safetensors"
    save_file({"w": np.ones((256, 64), np.float32)}, path)
    tensor = SafetensorsFile(path).get_tensor("w")
    assert jax.device_put(tensor).unsafe_buffer_pointer() == tensor.ctypes.data


def _raw(tmp_path, header, data=b""):
    blob = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def test_bad_files_are_errors_naming_the_file_and_the_tensor(tmp_path):
    with pytest.raises(ValueError, match=r"bad\.safetensors: 3 bytes, too short"):
        (tmp_path / "bad.safetensors").write_bytes(b"abc")
        SafetensorsFile(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match=r"header length 4096 exceeds the file"):
        (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 4096) + b"{}")
        SafetensorsFile(tmp_path / "bad.safetensors")
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    with pytest.raises(ValueError, match=r"tensor 'w': data_offsets \[0, 16\] for F32 \[2, 2\]"):
        SafetensorsFile(_raw(tmp_path, {"w": entry}, b"\0" * 8))  # truncated data
    with pytest.raises(ValueError, match=r"tensor 'w': data_offsets \[0, 12\]"):
        SafetensorsFile(_raw(tmp_path, {"w": {**entry, "data_offsets": [0, 12]}}, b"\0" * 16))
    with pytest.raises(ValueError, match=r"tensor 'w': bad header entry .*'F33'"):
        SafetensorsFile(_raw(tmp_path, {"w": {**entry, "dtype": "F33"}}, b"\0" * 16))
    with pytest.raises(ValueError, match=r"the header is not JSON"):
        path = tmp_path / "bad.safetensors"
        path.write_bytes(struct.pack("<Q", 3) + b"{x}")
        SafetensorsFile(path)
