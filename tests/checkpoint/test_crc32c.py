"""The CRC-32C checksum (rudax/checkpoint/_crc.py) against a bitwise CRC written here, for every
sharding, and checkpoints of both formats: new ones record "crc32c", old ones still restore."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.checkpoint as rc
import rudax.optim as ro
from rudax.checkpoint import _crc, _integrity, _meta
from rudax.checkpoint._integrity import checksums
from rudax.checkpoint._keys import key_data
from rudax.checkpoint._record import split_state
from tests.checkpoint._assertions import assert_bitwise_equal
from tests.checkpoint.golden import FORMATS_2_3 as GOLDEN
from tests.checkpoint.golden.make import record as golden_record


def _bitwise_crc32c(data: bytes, register: int = 0) -> int:
    """CRC-32C one bit at a time (reflected, polynomial 0x82F63B78), from ``register``."""
    for byte in data:
        register ^= byte
        for _ in range(8):
            register = (register >> 1) ^ (0x82F63B78 if register & 1 else 0)
    return register


def _reference(a) -> tuple[bytes, int]:
    """An array's bytes and their linear CRC-32C (no inversions), one bit at a time."""
    data = np.ascontiguousarray(a).tobytes()
    return data, _bitwise_crc32c(data)


def test_the_bitwise_reference_is_crc32c():
    # The standard check value of CRC-32C ("123456789"), with its inversions.
    assert _bitwise_crc32c(b"123456789", 0xFFFFFFFF) ^ 0xFFFFFFFF == 0xE3069283


@pytest.mark.skipif(not _crc.available(), reason="google-crc32c is not installed")
def test_checksum_is_the_documented_rule():
    """T = raw(bytes) * x**(-8 N), checked as T * x**(8 N) == raw with x**(8 N) made by
    8 N multiplications by x (not by the library's shift_back)."""
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    data, raw = _reference(x)
    assert _crc.raw(np.ascontiguousarray(x)) == raw
    t = int(checksums([x], "crc32c")["[0]"], 16)
    power = 1 << 31  # the polynomial 1, reflected
    for _ in range(8 * len(data)):
        power = _crc.multiply(power, 1 << 30)  # times x
    assert _crc.multiply(t, power) == raw


@pytest.mark.skipif(not _crc.available(), reason="google-crc32c is not installed")
def test_same_for_every_sharding_padding_free_and_damage_seen():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py simulates 8 CPU devices)")
    x = np.random.default_rng(0).standard_normal((8, 6, 4)).astype(np.float32)
    x[1, 2] = 0.0
    expected = checksums([x], "crc32c")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    for spec in (P(), P("a"), P(None, "b"), P("a", "b"), P("b", None, "a"), P(("a", "b"))):
        y = jax.device_put(x, NamedSharding(mesh, spec))
        assert checksums([y], "crc32c") == expected, spec
    flat = x.reshape(-1)
    assert checksums([np.concatenate([flat, np.zeros(5, np.float32)])], "crc32c") == expected
    for position in (0, 17, flat.size - 1):
        flipped = flat.copy()
        flipped.view(np.uint32)[position] ^= 1
        assert checksums([flipped], "crc32c") != expected, position
    # Zeros inside (not at the end) are data: moving a value changes the checksum.
    moved = np.roll(flat, 1)
    assert checksums([moved], "crc32c") != expected


@pytest.mark.skipif(not _crc.available(), reason="google-crc32c is not installed")
def test_every_dtype_host_and_device_alike():
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint8, jnp.bool_, jnp.complex64):
        a = np.asarray(x.astype(dtype) if dtype != jnp.bool_ else x > 0)
        base = checksums([a, jnp.asarray(a)], "crc32c")
        assert base["[0]"] == base["[1]"], dtype
        b = a.copy()
        b.view(np.uint8).reshape(-1)[3] ^= 0x10
        assert checksums([b], "crc32c")["[0]"] != base["[0]"], dtype
    assert checksums([np.float32(2.5)], "crc32c") == checksums(
        [np.array([2.5], np.float32)], "crc32c"
    )


def _record():
    params = {"w": jax.random.normal(jax.random.key(0), (64, 64)), "b": jnp.arange(4.0)}
    tx = ro.adamw(0.1)
    return rc.TrainingRecord.capture(model=params, optimizer=tx.init(params), state={"pos": 5})


def _meta_file(root, step):
    return root / str(step) / "meta" / "metadata"


@pytest.mark.skipif(not _crc.available(), reason="google-crc32c is not installed")
def test_a_new_checkpoint_records_crc32c_and_detects_damage(tmp_path):
    record = _record()
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
    meta = json.loads(_meta_file(tmp_path, 1).read_text())
    assert meta["format"] == 4 and meta["checksum_algorithm"] == "crc32c"
    assert meta["checksums"]["model"] == checksums(record.model, "crc32c")
    with rc.Checkpointer(tmp_path) as ckpt:
        assert_bitwise_equal(ckpt.restore(record, step=1), record)


def test_a_format_1_checkpoint_restores_and_is_still_checked(tmp_path):
    # Format 1 is format 2 (one orbax item per part, as the golden step written by an older
    # rudax) without checksum_algorithm, its checksums all fmix32-sum.
    shutil.copytree(GOLDEN, tmp_path, dirs_exist_ok=True)
    record = golden_record()
    path = _meta_file(tmp_path, 2)
    meta = json.loads(path.read_text())
    del meta["checksum_algorithm"], meta["digest"]
    meta["format"] = 1
    arrays, _ = split_state(record.state)
    parts = {"model": record.model, "optimizer": record.optimizer, "state": arrays}
    parts["accumulator"] = record.accumulator
    meta["checksums"] = {
        p: checksums(key_data(tree), _integrity.LEGACY) for p, tree in parts.items()
    }
    meta["digest"] = _meta._digest(meta)
    path.write_text(json.dumps(meta))
    with rc.Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore(record, step=2)
    assert_bitwise_equal(key_data(restored.model), key_data(record.model))
    assert_bitwise_equal(key_data(restored.state), key_data(record.state))
    # Its checksums are still verified, with the algorithm it was written with.
    damaged = dict(meta)
    damaged["checksums"] = json.loads(json.dumps(meta["checksums"]))
    first = next(iter(damaged["checksums"]["model"]))
    damaged["checksums"]["model"][first] = "00000000"
    del damaged["digest"]
    damaged["digest"] = _meta._digest(damaged)
    path.write_text(json.dumps(damaged))
    with rc.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(rc.CheckpointCorruptedError, match=r"record\.model.*checksum"):
            ckpt.restore(record, step=2)


def test_without_google_crc32c_a_save_records_fmix32_sum(tmp_path, monkeypatch):
    monkeypatch.setattr(_crc, "google_crc32c", None)
    record = _record()
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        assert_bitwise_equal(ckpt.restore(record, step=1), record)
    meta = json.loads(_meta_file(tmp_path, 1).read_text())
    assert meta["format"] == 4 and meta["checksum_algorithm"] == "fmix32-sum"


@pytest.mark.skipif(not _crc.available(), reason="google-crc32c is not installed")
def test_a_crc32c_checkpoint_without_google_crc32c_says_what_to_install(tmp_path, monkeypatch):
    record = _record()
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
    monkeypatch.setattr(_crc, "google_crc32c", None)
    with rc.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ImportError, match=r"pip install google-crc32c"):
            ckpt.restore(record, step=1)


def test_an_unknown_algorithm_or_format_is_a_checkpoint_error(tmp_path):
    record = _record()
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
    path = _meta_file(tmp_path, 1)
    original = json.loads(path.read_text())
    for field, value, match in (
        ("checksum_algorithm", "md5", r"checksum_algorithm must be one of"),
        ("format", 5, r"format must be one of \(1, 2, 3, 4\)"),
    ):
        meta = {k: v for k, v in original.items() if k != "digest"}
        meta[field] = value
        meta["digest"] = _meta._digest(meta)
        path.write_text(json.dumps(meta))
        with rc.Checkpointer(tmp_path) as ckpt:
            with pytest.raises(rc.CheckpointCorruptedError, match=match):
                ckpt.restore(record, step=1)
    shutil.rmtree(tmp_path / "1")
