"""rudax.models.SafetensorsFile and save_safetensors against the safetensors library, the
reference: the files it reads we read bit for bit, the headers it refuses we refuse (a
ValueError naming the file, the tensor and the value), and the files we write it reads back
bit for bit, laid out byte for byte as its own writer lays them out."""

import json
import re
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from rudax.models import SafetensorsFile, save_safetensors


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


def _raw(tmp_path, header, data=b"", *, length=None):
    """A file of ``header`` (a dict, or the header's bytes as they are) and ``data``."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    n = len(blob) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return path


def _library_reads(path, framework="numpy"):
    with safe_open(str(path), framework=framework) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _ours_reads(path):
    f = SafetensorsFile(path)
    return {k: f.get_tensor(k) for k in f.keys()}


def _torch_bytes(t):
    import torch

    t = t.reshape(-1)
    if t.dtype not in (torch.bool, torch.uint8, torch.int8, torch.complex64) and (
        t.dtype.is_floating_point and t.dtype not in (torch.float16, torch.float32, torch.float64)
    ):
        t = t.view(torch.uint8)  # bfloat16 and float8: no NumPy type on torch's side
    return t.numpy().tobytes()


# ---------------------------------------------------------------------- files both read


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


def test_float8_and_complex_files_torch_writes_are_read_bit_for_bit(tmp_path):
    """Dtypes safetensors' NumPy side cannot read (float8) or write: torch writes them."""
    import torch
    from safetensors.torch import save_file as save_torch

    bits = torch.arange(64, dtype=torch.uint8).reshape(4, 16)
    tensors = {
        name: bits.clone().view(dtype)
        for name, dtype in {
            "e4m3": torch.float8_e4m3fn,
            "e5m2": torch.float8_e5m2,
            "e8m0": torch.float8_e8m0fnu,
            "e4m3fnuz": torch.float8_e4m3fnuz,
            "e5m2fnuz": torch.float8_e5m2fnuz,
        }.items()
    }
    tensors["c64"] = torch.complex(torch.arange(6.0), -torch.arange(6.0)).reshape(2, 3)
    path = tmp_path / "t.safetensors"
    save_torch(tensors, str(path))
    f = SafetensorsFile(path)
    want_dtypes = {
        "e4m3": ml_dtypes.float8_e4m3fn,
        "e5m2": ml_dtypes.float8_e5m2,
        "e8m0": ml_dtypes.float8_e8m0fnu,
        "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
        "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
        "c64": np.complex64,
    }
    for name, t in tensors.items():
        got = f.get_tensor(name)
        assert got.dtype == want_dtypes[name] and got.shape == tuple(t.shape), name
        assert got.tobytes() == _torch_bytes(t), name


def test_the_cpu_device_adopts_the_tensor_without_a_copy(tmp_path):
    """What load_hf's memory bound rests on: jax.device_put takes the array's own memory."""
    path = tmp_path / "m.safetensors"
    save_file({"w": np.ones((256, 64), np.float32)}, path)
    tensor = SafetensorsFile(path).get_tensor("w")
    assert jax.device_put(tensor).unsafe_buffer_pointer() == tensor.ctypes.data


_U8 = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
# Headers the library reads, unusual as they are; refusing them would refuse real files.
ACCEPTED = {
    "empty": (b"{}      ", b""),
    "leading-and-trailing-whitespace": (b" \t\r\n{}  ", b""),
    "null-metadata": ({"__metadata__": None, "a": _U8}, b""),
    "unknown-entry-fields": ({"a": {**_U8, "x": [-1, {"y": 1.5}]}}, b""),
    "zero-size-tensors-share-an-offset": (
        {
            "z1": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "z2": {"dtype": "I64", "shape": [3, 0], "data_offsets": [8, 8]},
            "b": {"dtype": "U8", "shape": [], "data_offsets": [8, 9]},
        },
        b"\0" * 9,
    ),
    "odd-names": ({"__x__": _U8, "": _U8, "\0é/": _U8}, b""),
    "nested-127-levels": (
        b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":'
        + b"[" * 125
        + b"]" * 125
        + b"}}",
        b"",
    ),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_headers_the_library_reads_are_read(tmp_path, case):
    header, data = ACCEPTED[case]
    path = _raw(tmp_path, header, data)
    theirs = _library_reads(path)
    ours = _ours_reads(path)
    assert sorted(ours) == sorted(theirs)
    for name, want in theirs.items():
        assert ours[name].dtype == want.dtype and ours[name].tobytes() == want.tobytes(), name


# --------------------------------------------------------------------- files both refuse

_F32 = {"dtype": "F32", "shape": [2]}


def _at(offsets):
    return {**_F32, "data_offsets": offsets}


def _entry(**fields):
    return {"a": {**_F32, "data_offsets": [0, 8], **fields}}


_JSON = r"the \d+-byte header is not the format's JSON: "
# case -> (header, data bytes, the message after the file's path). Each one the library
# refuses; here each is a ValueError naming the file, the tensor (where there is one) and
# the value.
REFUSED = {
    # The byte ranges: sorted, they must tile the data section.
    "overlap": (
        {"a": _at([0, 8]), "b": _at([4, 12])},
        12,
        r"tensor 'b': data_offsets \[4, 12\] overlap tensor 'a' \(data_offsets \[0, 8\]\)",
    ),
    "same-range": (
        {"a": _at([0, 8]), "b": _at([0, 8])},
        8,
        r"tensor 'b': data_offsets \[0, 8\] overlap tensor 'a'",
    ),
    "empty-tensor-inside-another": (
        {"a": _at([0, 8]), "z": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}},
        8,
        r"tensor 'z': data_offsets \[4, 4\] overlap tensor 'a'",
    ),
    "gap": (
        {"a": _at([0, 8]), "b": _at([12, 20])},
        20,
        r"tensor 'b': data_offsets \[12, 20\] leave bytes \[8, 12\) after tensor 'a'",
    ),
    "gap-at-the-start": (
        {"a": _at([4, 12])},
        12,
        r"tensor 'a': data_offsets \[4, 12\] leave bytes \[0, 4\) after the header",
    ),
    "trailing-bytes": (
        {"a": _at([0, 8])},
        16,
        r"8 trailing bytes \[8, 16\) after tensor 'a' \(data_offsets \[0, 8\]\)",
    ),
    "trailing-bytes-no-tensors": ({}, 4, r"4 trailing bytes \[0, 4\) after the header"),
    "range-past-the-end": (
        {"a": _at([0, 8])},
        4,
        r"tensor 'a' \(data_offsets \[0, 8\]\) runs past the end of the file \(4 bytes",
    ),
    "begin-after-end": (
        {"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}},
        8,
        r"tensor 'a': data_offsets \[8, 0\] end before they begin",
    ),
    # An entry's own consistency.
    "wrong-byte-count": (
        {"a": _at([0, 4])},
        4,
        r"tensor 'a': F32 \[2\] is 8 bytes, but data_offsets \[0, 4\] hold 4",
    ),
    "unknown-dtype": (_entry(dtype="F33"), 8, r"tensor 'a': dtype 'F33' is not one of BOOL, "),
    "lowercase-dtype": (_entry(dtype="f32"), 8, r"tensor 'a': dtype 'f32' is not one of"),
    "negative-shape": (
        _entry(shape=[-1], data_offsets=[0, 0]),
        0,
        r"tensor 'a': shape \[-1\] is not a list of non-negative integers",
    ),
    "float-shape": (_entry(shape=[2.0]), 8, r"tensor 'a': shape \[2\.0\] is not"),
    "exponent-shape": (
        b'{"a":{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}}',
        8,
        r"tensor 'a': shape \[2\.0\] is not",
    ),
    "minus-zero-shape": (
        b'{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}',
        0,
        r"tensor 'a': shape \[-0\.0\] is not",
    ),
    "bool-shape": (
        _entry(shape=[True, True], data_offsets=[0, 4]),
        4,
        r"tensor 'a': shape \[True, True\] is not",
    ),
    "string-shape": (_entry(shape="2"), 8, r"tensor 'a': shape '2' is not"),
    "shape-past-u64": (
        _entry(shape=[2**64, 0], data_offsets=[0, 0]),
        0,
        r"tensor 'a': shape \[18446744073709551616, 0\] is not",
    ),
    "size-overflows-u64": (
        _entry(dtype="U16", shape=[2**32, 2**31], data_offsets=[0, 0]),
        0,
        r"tensor 'a': U16 \[4294967296, 2147483648\] is \d+ bits, past",
    ),
    "packed-dtype-in-part-of-a-byte": (
        _entry(dtype="F4", shape=[3], data_offsets=[0, 2]),
        2,
        r"tensor 'a': F4 \[3\] is 12 bits, not a whole number of bytes",
    ),
    "float-offsets": (
        _entry(data_offsets=[0, 8.0]),
        8,
        r"tensor 'a': data_offsets \[0, 8\.0\] is not \[begin, end\]",
    ),
    "three-offsets": (
        _entry(data_offsets=[0, 8, 8]),
        8,
        r"tensor 'a': data_offsets \[0, 8, 8\] is not \[begin, end\]",
    ),
    "string-offsets": (
        _entry(data_offsets=["0", "8"]),
        8,
        r"tensor 'a': data_offsets \['0', '8'\] is not",
    ),
    "missing-shape": (
        {"a": {"dtype": "F32", "data_offsets": [0, 8]}},
        8,
        r"tensor 'a': the header entry .* has no shape",
    ),
    "entry-not-an-object": ({"a": [1]}, 0, r"tensor 'a': the header entry \[1\] is not an object"),
    "repeated-entry-field": (
        b'{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
        8,
        _JSON + r"key 'dtype' appears twice in one object",
    ),
    # __metadata__: absent, null, or strings to strings.
    "metadata-not-a-dict": (
        {"__metadata__": ["format", "pt"], "a": _at([0, 8])},
        8,
        r"__metadata__ must map strings to strings, got \['format', 'pt'\]",
    ),
    "metadata-a-string": (
        {"__metadata__": "pt", "a": _at([0, 8])},
        8,
        r"__metadata__ must map strings to strings, got 'pt'",
    ),
    "metadata-not-strings": (
        {"__metadata__": {"format": 1}, "a": _at([0, 8])},
        8,
        r"__metadata__ must map strings to strings, got \{'format': 1\}",
    ),
    "metadata-twice": (
        b'{"__metadata__":{},"__metadata__":{}}',
        0,
        _JSON + r"key '__metadata__' appears twice",
    ),
    # The header itself.
    "header-not-json": (
        b"{x}",
        0,
        _JSON + "Expecting property name",
    ),
    "header-not-utf8": (
        b'{"\xff":1}',
        0,
        _JSON + "'utf-8' codec can't decode byte 0xff",
    ),
    "header-a-list": (b"[]", 0, r"the header is a JSON list, not an object"),
    "header-empty": (b"", 0, _JSON + "Expecting value"),
    "header-nul-padded": (b"{}\0\0\0\0\0\0", 0, _JSON + "Extra data"),
    "header-utf8-bom": (b"\xef\xbb\xbf{}", 0, _JSON + "Unexpected UTF-8 BOM"),
    "header-nan": (
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":NaN}}',
        8,
        _JSON + "NaN is not JSON",
    ),
    "header-number-out-of-range": (
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1e999}}',
        8,
        _JSON + "number out of range: 1e999",
    ),
    "header-lone-surrogate": (
        rb'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":"\ud800"}}',
        8,
        _JSON + r"the string '\\ud800' is not UTF-8: a lone surrogate",
    ),
    "header-nested-128-levels": (
        b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":'
        + b"[" * 126
        + b"]" * 126
        + b"}}",
        0,
        _JSON + "nested more than 127 levels deep",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_headers_the_library_refuses_are_refused_naming_file_tensor_and_value(tmp_path, case):
    header, data_bytes, match = REFUSED[case]
    path = _raw(tmp_path, header, b"\0" * data_bytes)
    with pytest.raises(SafetensorError):
        _library_reads(path)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + match):
        SafetensorsFile(path)


@pytest.mark.parametrize(
    ("case", "length", "data", "match"),
    [
        (
            "past-the-file",
            4096,
            b"{}",
            r"header length 4096 runs past the end of the file \(10 bytes\)",
        ),
        (
            "past-the-format's-limit",
            100_000_001,
            b"{}",
            r"header length 100000001 exceeds the format's 100000000 bytes",
        ),
        ("u64-max", 2**64 - 1, b"{}", r"header length 18446744073709551615 exceeds"),
    ],
)
def test_header_lengths_the_library_refuses_are_refused(tmp_path, case, length, data, match):
    path = _raw(tmp_path, data, length=length)
    with pytest.raises(SafetensorError):
        _library_reads(path)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + match):
        SafetensorsFile(path)


def test_a_file_shorter_than_the_length_field_is_refused(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"abc")
    with pytest.raises(SafetensorError):
        _library_reads(path)
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": 3 bytes, too short"):
        SafetensorsFile(path)


def test_repeated_tensor_names_are_refused_though_the_library_reads_the_last(tmp_path):
    """The one header the library reads that we refuse: a name given twice. JSON leaves which
    one counts to the parser, so two readers of one file could load different tensors."""
    header = (
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    )
    path = _raw(tmp_path, header, b"\0" * 8)
    assert _library_reads(path)["a"].shape == (2,)
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": .*key 'a' appears twice"):
        SafetensorsFile(path)


def _small_file(tmp_path):
    path = tmp_path / "small.safetensors"
    tensors = {"weight": np.arange(6, dtype=np.float32).reshape(2, 3), "bias": np.ones(2, np.int16)}
    save_file(tensors, path, metadata={"format": "pt"})
    return path.read_bytes()


def test_one_byte_changed_anywhere_in_the_header_we_agree_with_the_library(tmp_path):
    """Every single-byte change to a real file's length and header, to a handful of values
    that make JSON, numbers and names go wrong: the library and we accept or refuse alike."""
    good = _small_file(tmp_path)
    (n,) = struct.unpack("<Q", good[:8])
    path = tmp_path / "bad.safetensors"
    disagree = []
    for i in range(8 + n):
        for byte in b'\x00\xff "0129-.,:[]{}':
            if good[i] == byte:
                continue
            path.write_bytes(good[:i] + bytes([byte]) + good[i + 1 :])
            try:
                theirs = {k: v.tobytes() for k, v in _library_reads(path).items()}
            except SafetensorError:
                theirs = None
            try:
                ours = {k: v.tobytes() for k, v in _ours_reads(path).items()}
            except ValueError as e:
                assert str(path) in str(e)
                ours = None
            if theirs != ours:
                disagree.append((i, bytes([byte]), theirs is None, ours is None))
    assert not disagree, disagree[:10]


def test_a_truncated_or_garbage_file_is_a_value_error_naming_it(tmp_path):
    good = _small_file(tmp_path)
    path = tmp_path / "bad.safetensors"
    rng = np.random.default_rng(0)
    damaged = [good[:k] for k in range(len(good))]
    damaged += [rng.bytes(int(rng.integers(0, 300))) for _ in range(200)]
    # Garbage after a plausible length, so the parser, not the length check, meets it.
    damaged += [
        struct.pack("<Q", 64) + rng.bytes(64 + int(rng.integers(0, 64))) for _ in range(200)
    ]
    for data in damaged:
        path.write_bytes(data)
        with pytest.raises(SafetensorError):
            _library_reads(path)
        with pytest.raises(ValueError, match=re.escape(str(path))):
            SafetensorsFile(path)


def test_get_tensor_errors_name_the_file_and_the_tensor(tmp_path):
    path = _raw(
        tmp_path,
        {"a": _at([0, 8]), "packed": {"dtype": "F4", "shape": [4], "data_offsets": [8, 10]}},
        b"\0" * 10,
    )
    f = SafetensorsFile(path)  # the header is the format's: F4 packs two values a byte
    assert f.keys() == ["a", "packed"]
    with pytest.raises(KeyError, match=re.escape(str(path)) + r": no tensor 'b'"):
        f.get_tensor("b")
    with pytest.raises(ValueError, match=r"tensor 'packed': dtype F4 packs values"):
        f.get_tensor("packed")
    path.write_bytes(path.read_bytes()[:-6])  # cut short after it was opened
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": tensor 'a': read 4 of its 8"):
        f.get_tensor("a")


# ------------------------------------------------------------------------ save_safetensors

ROUND_TRIP = {
    "fp32": np.float32,
    "fp16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "int8": np.int8,
    "uint8": np.uint8,
    "int32": np.int32,
    "int64": np.int64,
    "bool": np.bool_,
    "fp64": np.float64,
    "int16": np.int16,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
}


def _round_trip_tensors():
    rng = np.random.default_rng(1)
    out = {}
    for name, dtype in ROUND_TRIP.items():
        raw = rng.integers(0, 256, (3, 4, np.dtype(dtype).itemsize), dtype=np.uint8)
        if dtype is np.bool_:
            raw %= 2
        out[name] = raw.view(dtype).reshape(3, 4)  # every bit pattern, NaNs included
        out[name + ".0d"] = out[name][1, 2].copy().reshape(())
        out[name + ".empty"] = np.zeros((0, 3), dtype)
    out["big-endian"] = np.arange(5, dtype=">f4")
    out["strided"] = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]
    return out


def test_save_safetensors_is_read_bit_for_bit_by_the_librarys_numpy_and_torch_loaders(tmp_path):
    from safetensors.torch import load_file as load_torch

    tensors = _round_trip_tensors()
    tensors["jax.bf16"] = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
    tensors["jax.fp32"] = jnp.float32(1.5)
    path = tmp_path / "ours.safetensors"
    save_safetensors(path, tensors, metadata={"format": "pt"})
    theirs_np, theirs_pt = load_file(path), load_torch(path)
    assert sorted(theirs_np) == sorted(theirs_pt) == sorted(tensors)
    ours = SafetensorsFile(path)
    assert ours.metadata == {"format": "pt"}
    for name, value in tensors.items():
        want = np.asarray(value)
        want_bytes = np.ascontiguousarray(want.astype(want.dtype.newbyteorder("<"))).tobytes()
        got_np, got_pt = theirs_np[name], theirs_pt[name]
        assert got_np.dtype == want.dtype.newbyteorder("=") and got_np.shape == want.shape, name
        assert got_np.tobytes() == want_bytes, name
        assert tuple(got_pt.shape) == want.shape and _torch_bytes(got_pt) == want_bytes, name
        assert ours.get_tensor(name).tobytes() == want_bytes, name
    assert str(theirs_pt["bf16"].dtype) == "torch.bfloat16"
    assert [p.name for p in tmp_path.iterdir()] == ["ours.safetensors"]


def test_save_safetensors_writes_the_librarys_bytes(tmp_path):
    """Tensors by decreasing dtype alignment, then name; compact JSON padded to 8 bytes."""
    # safetensors.numpy.save_file fails on a 0-d array (it takes the scalar's .ctypes).
    leave_out = ("big-endian", "strided")
    tensors = {k: v for k, v in _round_trip_tensors().items() if k not in leave_out and v.ndim}
    tensors['é \u001f/\\"'] = np.ones(3, np.uint8)  # escapes and UTF-8 as serde_json writes them
    save_file(tensors, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    save_safetensors(tmp_path / "ours.safetensors", tensors, metadata={"format": "pt"})
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()
    save_file({}, tmp_path / "theirs.safetensors")
    save_safetensors(tmp_path / "ours.safetensors", {})
    assert (tmp_path / "ours.safetensors").read_bytes() == b"\x08" + b"\0" * 7 + b"{}      "
    assert (tmp_path / "theirs.safetensors").read_bytes() == b"\x08" + b"\0" * 7 + b"{}      "


def test_save_safetensors_writes_float8_and_complex_as_torch_reads_them(tmp_path):
    import torch
    from safetensors.torch import load_file as load_torch

    bits = np.arange(32, dtype=np.uint8)
    tensors = {
        "e4m3": bits.view(ml_dtypes.float8_e4m3fn),
        "e5m2": bits.view(ml_dtypes.float8_e5m2),
        "e8m0": bits.view(ml_dtypes.float8_e8m0fnu),
        "c64": bits.view(np.complex64),
    }
    save_safetensors(tmp_path / "t.safetensors", tensors)
    theirs = load_torch(tmp_path / "t.safetensors")
    assert theirs["e8m0"].dtype == torch.float8_e8m0fnu and theirs["c64"].dtype == torch.complex64
    for name, want in tensors.items():
        assert _torch_bytes(theirs[name]) == want.tobytes(), name


def test_a_failed_save_leaves_the_old_file_and_no_partial_one(tmp_path):
    path = tmp_path / "m.safetensors"
    save_safetensors(path, {"old": np.ones(2, np.float32)})
    before = path.read_bytes()

    class FailsWhileWritten:
        """Valid by its dtype and shape; its data cannot be had (a device lost mid-save)."""

        dtype, shape = np.dtype(np.float32), (2,)

        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("device lost")

    # "a" is written first (F64 before F32), then "b" fails.
    tensors = {"a": np.ones(1 << 16, np.float64), "b": FailsWhileWritten()}
    with pytest.raises(RuntimeError, match="device lost"):
        save_safetensors(path, tensors)  # type: ignore[arg-type]
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]

    with pytest.raises(
        TypeError, match=r"tensors\['c'\]: dtype complex128 has no safetensors name"
    ):
        save_safetensors(path, {"c": np.zeros(2, np.complex128)})
    with pytest.raises(TypeError, match=r"metadata must map strings to strings, got 'n': 1"):
        save_safetensors(path, {"a": np.zeros(2)}, metadata={"n": 1})  # type: ignore[dict-item]
    with pytest.raises(
        ValueError, match=r"tensor name '__metadata__' is the format's metadata key"
    ):
        save_safetensors(path, {"__metadata__": np.zeros(2)})
    with pytest.raises(ValueError, match=r"tensor name '\\ud800' is not UTF-8"):
        save_safetensors(path, {"\ud800": np.zeros(2)})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
