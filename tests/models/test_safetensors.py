"""rudax.models.SafetensorsFile and save_safetensors against the safetensors library's own
reader and writer, and the bad files both refuse."""

import json
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rudax.models import SafetensorsFile


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


# Headers the safetensors library refuses; each is refused here too, naming file and tensor.
_F32 = {"dtype": "F32", "shape": [2]}
HOSTILE = {
    "overlap": (
        {"a": {**_F32, "data_offsets": [0, 8]}, "b": {**_F32, "data_offsets": [4, 12]}},
        12,
        r"tensor 'b' data_offsets \[4, 12\] overlaps tensor 'a'",
    ),
    "same-range": (
        {"a": {**_F32, "data_offsets": [0, 8]}, "b": {**_F32, "data_offsets": [0, 8]}},
        8,
        r"tensor '[ab]' data_offsets \[0, 8\] overlaps",
    ),
    "gap": (
        {"a": {**_F32, "data_offsets": [0, 8]}, "b": {**_F32, "data_offsets": [12, 20]}},
        20,
        r"tensor 'b' data_offsets \[12, 20\] leaves a gap after tensor 'a'",
    ),
    "trailing-bytes": (
        {"a": {**_F32, "data_offsets": [0, 8]}},
        16,
        r"data ends at byte 8 of 16 .* trailing bytes",
    ),
    "wrong-size": ({"a": {**_F32, "data_offsets": [0, 4]}}, 4, r"tensor 'a': data_offsets"),
    "negative-shape": (
        {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}},
        0,
        r"tensor 'a'",
    ),
    "past-the-end": ({"a": {**_F32, "data_offsets": [0, 8]}}, 4, r"tensor 'a': data_offsets"),
    "metadata-not-strings": (
        {"__metadata__": {"format": 1}, "a": {**_F32, "data_offsets": [0, 8]}},
        8,
        r"__metadata__ must map strings to strings",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_headers_the_library_refuses_are_refused(tmp_path, case):
    from safetensors import safe_open

    header, data_bytes, match = HOSTILE[case]
    path = _raw(tmp_path, header, b"\0" * data_bytes)
    with pytest.raises(Exception):  # noqa: B017 (the reference: any refusal)
        with safe_open(str(path), framework="numpy") as f:
            [f.get_tensor(k) for k in f.keys()]
    with pytest.raises(ValueError, match=r"bad\.safetensors: .*" + match):
        SafetensorsFile(path)


def test_save_safetensors_is_read_bit_for_bit_by_the_library(tmp_path):
    import torch
    from safetensors.torch import load_file as load_torch

    from rudax.models import save_safetensors

    tensors = _tensors()
    tensors["flags"] = np.array([True, False, True])
    tensors["i64"] = np.arange(5, dtype=np.int64)
    tensors["i8"] = np.arange(-3, 3, dtype=np.int8)
    tensors["jax"] = jax.numpy.ones((2, 2), jax.numpy.bfloat16)
    path = tmp_path / "ours.safetensors"
    save_safetensors(path, tensors, metadata={"format": "pt"})
    theirs = load_file(path)
    assert sorted(theirs) == sorted(tensors)
    for name, want in tensors.items():
        want = np.asarray(want)
        assert theirs[name].dtype == want.dtype and theirs[name].tobytes() == want.tobytes(), name
    name = next(k for k, v in tensors.items() if np.asarray(v).dtype == ml_dtypes.bfloat16)
    bf16 = load_torch(path)[name]
    assert bf16.dtype == torch.bfloat16
    assert bf16.view(torch.int16).numpy().tobytes() == np.asarray(tensors[name]).tobytes()
    assert SafetensorsFile(path).metadata == {"format": "pt"}
    assert not (tmp_path / "ours.safetensors.partial").exists()
    with pytest.raises(TypeError, match="tensor 'c': dtype complex64 has no safetensors name"):
        save_safetensors(tmp_path / "bad.safetensors", {"c": np.zeros(2, np.complex64)})
    assert not (tmp_path / "bad.safetensors").exists()
