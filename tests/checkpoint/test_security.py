"""Security: no pickle, meta read as checked data, safe step directories, damage detected."""

import json
import os
import pickle
import random
import re
import shutil
from copy import deepcopy

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.checkpoint as rc
import rudax.optim as ro
from rudax.checkpoint._integrity import checksums
from rudax.checkpoint._meta import parse_meta
from tests.checkpoint._assertions import assert_bitwise_equal


def _record():
    params = {"w": jax.random.normal(jax.random.key(0), (64, 64)), "b": jnp.arange(4.0)}
    tx = ro.sgd(0.1, momentum=0.9)
    return rc.TrainingRecord.capture(
        model=params,
        optimizer=tx.init(params),
        state={"pos": 5, "run": "exp"},
        config={"lr": 0.1},
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    record = _record()
    with rc.Checkpointer(root) as ckpt:
        ckpt.save(1, record)
        ckpt.save(2, record)
    return root, record


@pytest.fixture
def copy(saved, tmp_path):
    root, _ = saved
    target = tmp_path / "ckpt"
    shutil.copytree(root, target, symlinks=True)
    return target


def _restore(root, record, step=2):
    with rc.Checkpointer(root) as ckpt:
        return ckpt.restore(record, step=step)


# --- no pickle -----------------------------------------------------------------------------


def test_no_pickle_in_save_or_restore(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")

    for name in ("load", "loads", "dump", "dumps", "Unpickler", "Pickler"):
        monkeypatch.setattr(pickle, name, refuse)
    record = _record()
    for async_save in (False, True):
        with rc.Checkpointer(tmp_path / str(async_save), async_save=async_save) as ckpt:
            ckpt.save(1, record)
            ckpt.wait()
            assert_bitwise_equal(ckpt.restore(record), record)
    # Nor does any file written look like a pickle (protocol 2+ starts with b"\x80" + version).
    for parent, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(parent, name), "rb") as f:
                head = f.read(2)
            assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


# --- step names and directories --------------------------------------------------------------


@pytest.mark.parametrize(
    "step, error, message",
    [
        (True, TypeError, "step must be an int, got step=True"),
        (-1, ValueError, "step must be >= 0, got step=-1"),
        ("3", TypeError, "step must be an int"),
        ("../x", TypeError, "step must be an int"),
        (2.0, TypeError, "step must be an int"),
    ],
)
def test_steps_are_non_negative_ints(tmp_path, step, error, message):
    with rc.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(error, match=message):
            ckpt.save(step, _record())
        with pytest.raises(error, match=message):
            ckpt.restore(_record(), step=step)


def test_only_plain_decimal_names_are_steps(copy, saved):
    _, record = saved
    for name in ("00012", "12.tmp", "-1", "run_7", "\u0663", "13.orbax-checkpoint-tmp-99"):
        shutil.copytree(copy / "2", copy / name)
    (copy / "40").write_text("not a directory")
    with rc.Checkpointer(copy) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        assert ckpt.latest_step() == 2
        assert_bitwise_equal(ckpt.restore(record), record)


def test_a_symlinked_step_is_refused(copy, saved, tmp_path):
    _, record = saved
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(copy / "2", elsewhere)
    os.symlink(elsewhere, copy / "30")
    # Not a step (issue 11: listed, it was "the latest" and turned every later save into a
    # no-op); ignored with a warning, and refused by name if asked for.
    with pytest.warns(RuntimeWarning, match=r"30 is not a checkpoint step \(the step directory"):
        ckpt = rc.Checkpointer(copy)
    with ckpt:
        assert ckpt.latest_step() == 2
        with pytest.raises(
            rc.CheckpointCorruptedError, match=r"30: the step directory is a symlink"
        ):
            ckpt.restore(record, step=30)
        assert_bitwise_equal(ckpt.restore(record), record)


def test_a_symlink_inside_a_step_is_refused(copy, saved, tmp_path):
    _, record = saved
    shutil.move(copy / "2" / "arrays", tmp_path / "arrays")
    os.symlink(tmp_path / "arrays", copy / "2" / "arrays")
    with pytest.raises(rc.CheckpointCorruptedError, match=r"2: arrays is a symlink"):
        _restore(copy, record)


def test_the_directory_is_normalized(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with rc.Checkpointer(f"{tmp_path}/link/../link/./") as ckpt:
        assert ckpt.directory == os.path.realpath(tmp_path / "real")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="directory must be a directory"):
        rc.Checkpointer(tmp_path / "file")
    with pytest.raises(TypeError, match="directory"):
        rc.Checkpointer(3)


# --- damaged files ---------------------------------------------------------------------------


def _largest_file(directory):
    sizes = [
        (os.path.getsize(os.path.join(p, f)), os.path.join(p, f))
        for p, _, files in os.walk(directory)
        for f in files
    ]
    return max(sizes)[1]


def test_a_truncated_data_file_is_a_clear_error(copy, saved):
    _, record = saved
    path = _largest_file(copy / "2")
    assert "ocdbt" in path  # the array data, not a metadata file
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(rc.CheckpointCorruptedError, match=r"ckpt/2: reading record\.model") as e:
        _restore(copy, record)
    assert e.value.__cause__ is not None


def test_flipped_bytes_never_restore_silently(copy, saved):
    _, record = saved
    path = _largest_file(copy / "2")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        middle = f.read(4)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in middle))
    # What orbax alone does with it (orbax-checkpoint 0.12.8: decodes the damaged zstd chunk
    # into other values, no error); whichever it does, rudax must raise.
    try:
        with ocp.StandardCheckpointer() as plain:
            arrays = plain.restore(copy / "2" / "arrays")
    except Exception:
        arrays = None
    if arrays is None:
        message = r"ckpt/2: reading record\.model"
    else:  # rudax must name a leaf whose values changed
        want = {"model": record.model, "optimizer": record.optimizer}
        changed = [
            re.escape(f"record.{path[0].key}{jax.tree_util.keystr(path[1:])}")
            for (path, b), a in zip(
                jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(arrays), strict=True
            )
            if not np.array_equal(np.asarray(a), np.asarray(b))
        ]
        assert changed
        message = rf"ckpt/2: ({'|'.join(changed)}) was read back with checksum [0-9a-f]{{8}}, saved"
    with pytest.raises(rc.CheckpointCorruptedError, match=message):
        _restore(copy, record)
    assert_bitwise_equal(_restore(copy, record, step=1), record)  # the other step is intact


def _edit_meta(copy, edit):
    path = copy / "2" / "meta" / "metadata"
    if edit is None:
        os.remove(path)
        return
    if isinstance(edit, str):
        path.write_text(edit)
        return
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _set(key, value):
    return lambda meta: meta.__setitem__(key, value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (None, r"the meta item cannot be read: FileNotFoundError"),
        ("{not json", r"the meta item cannot be read: JSONDecodeError"),
        ("", r"the meta item cannot be read: JSONDecodeError"),
        ("[1, 2]", r"meta field <root> must be a JSON object"),
        (lambda m: m.pop("checksums"), r"the meta item has no field 'checksums'"),
        (_set("format", 5), r"meta field format must be one of \(1, 2, 3, 4\)"),
        (_set("step", 7), r"meta field step must be 2, the directory's step, got 7"),
        (_set("parts", "model"), r"meta field parts must list distinct names"),
        (_set("parts", ["model", "weights"]), r"meta field parts must list distinct names"),
        (_set("parts", ["optimizer", "model"]), r"meta field parts must list .* in that order"),
        (_set("layout", {"model": []}), r"meta field layout must have one entry per saved part"),
        (
            lambda m: m["layout"]["model"].__setitem__(0, ["['b']", "4", "float32"]),
            r"meta field layout\.model has a shape that is not a list of ints",
        ),
        (
            lambda m: m["layout"]["model"].__setitem__(0, ["['b']", [4], "object"]),
            r"meta field layout\.model has an unknown dtype name",
        ),
        (
            lambda m: m["layout"]["model"].__setitem__(0, "['b']"),
            r"meta field layout\.model must hold rows",
        ),
        (
            lambda m: m["layout"]["model"].__setitem__(0, ["['b']", "python", ["int"]]),
            r"meta field layout\.model must hold rows",
        ),
        (_set("python_state", {"['pos']": 5}), r"meta field python_state must hold"),
        (
            lambda m: m["python_state"].__setitem__("['pos']", "5"),
            r"meta field python_state\[\"\['pos'\]\"\] must be of type int, got '5'",
        ),
        (_set("config", {"lr": float("nan")}), r"meta field config is not JSON data"),
        (_set("storage_dtypes", {"model['w']": "bfloat16"}), r"meta field storage_dtypes"),
        (
            lambda m: m["checksums"]["model"].__setitem__("['w']", "xyz"),
            r"meta field checksums\.model must map paths to 8 hex digits",
        ),
        # Well-formed, but not what was written: the digest notices.
        (lambda m: m["python_state"].__setitem__("['pos']", 6), r"digest does not match"),
        (lambda m: m.__setitem__("config", {"lr": 0.2}), r"digest does not match"),
    ],
)
def test_a_damaged_meta_item_is_a_clear_error(copy, saved, edit, message):
    _, record = saved
    _edit_meta(copy, edit)
    with pytest.raises(rc.CheckpointCorruptedError, match=r"ckpt/2: .*" + message):
        _restore(copy, record._replace(config=None), step=2)


# --- the checksum ------------------------------------------------------------------------------


def _reference_checksum(a):
    """The documented rule, one element at a time (float32 and other 32-bit types)."""
    total = 0
    for i, w in enumerate(np.ascontiguousarray(a).reshape(-1).view(np.uint32).tolist()):
        if w:
            h = w ^ (i * 0x9E3779B9 % 2**32)
            h ^= h >> 16
            h = h * 0x85EBCA6B % 2**32
            h ^= h >> 13
            h = h * 0xC2B2AE35 % 2**32
            h ^= h >> 16
            total += h
    return f"{total % 2**32:08x}"


def test_checksum_is_the_documented_rule_for_every_sharding():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py simulates 8 CPU devices)")
    x = np.random.default_rng(0).standard_normal((8, 6, 4)).astype(np.float32)
    x[1, 2] = 0.0
    expected = _reference_checksum(x)
    assert checksums([x]) == {"[0]": expected}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    for spec in (P(), P("a"), P(None, "b"), P("a", "b"), P("b", None, "a"), P(("a", "b"))):
        y = jax.device_put(x, NamedSharding(mesh, spec))
        assert checksums([y]) == {"[0]": expected}, spec
    # Zero padding at the end of a flat vector leaves it unchanged; any changed element not.
    flat = x.reshape(-1)
    assert checksums([np.concatenate([flat, np.zeros(5, np.float32)])]) == {"[0]": expected}
    flipped = flat.copy()
    flipped.view(np.uint32)[17] ^= 1
    assert checksums([flipped]) != {"[0]": expected}


def test_checksum_reads_every_dtype_bit_for_bit():
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint8, jnp.bool_, jnp.complex64):
        a = np.asarray(x.astype(dtype) if dtype != jnp.bool_ else x > 0)
        base = checksums([a, jnp.asarray(a)])
        assert base["[0]"] == base["[1]"], dtype  # host and device copies agree
        b = a.copy()
        b.view(np.uint8).reshape(-1)[3] ^= 0x10
        assert checksums([b])["[0]"] != base["[0]"], dtype
    f64 = np.linspace(-1, 1, 7)
    words = f64.view(np.uint32)
    assert checksums([f64]) == {"[0]": _reference_checksum(words)}


def test_any_mangled_meta_field_is_a_checkpoint_error(saved):
    """500 random edits (values of the wrong type, missing keys): never KeyError/TypeError."""
    root, _ = saved
    with open(root / "2" / "meta" / "metadata") as f:
        meta = json.load(f)
    parse_meta(meta, step=2, where="step 2")  # the original passes

    def paths(node, prefix=()):
        yield prefix
        items = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for key, child in items:
            yield from paths(child, (*prefix, key))

    everywhere = [p for p in paths(meta) if p]
    values = [None, -1, 1.5, "x", "python", "float32", "model", [], {}, ["a"], {"a": 1}, True]
    rng = random.Random(0)
    for _ in range(500):
        mangled = deepcopy(meta)
        *parents, last = rng.choice(everywhere)
        node = mangled
        for key in parents:
            node = node[key]
        if isinstance(node, dict) and rng.random() < 0.2:
            del node[last]
        else:
            node[last] = rng.choice(values)
        if json.dumps(mangled) == json.dumps(meta):
            continue  # the edit changed nothing
        with pytest.raises(rc.CheckpointCorruptedError, match="step 2: "):
            parse_meta(mangled, step=2, where="step 2")
