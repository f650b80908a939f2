"""Checkpointer(zeros_as_metadata=True): all-zero leaves are listed in the meta item, not written.

What is checked: which leaves count as zero (bitwise, computed here with NumPy, so -0.0 and a
leaf zero in one process only do not), that every leaf comes back bit for bit in the
template's placement and dtype, what plain orbax reads (None for such a leaf, everything
else as saved), that the option off writes no zeros field, and that a meta item whose
zeros field disagrees with the checksums or the layout is refused.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import rudax.checkpoint as rc
import rudax.optim as ro
import rudax.sharding as rs
from rudax.checkpoint import _meta
from tests.checkpoint import _sharded_worker as worker
from tests.sharding._multiprocess import run_processes


def _record():
    params = {
        "w": jnp.arange(6.0, dtype=jnp.bfloat16).reshape(2, 3),
        "b": jnp.zeros(3, jnp.bfloat16),
        "neg": jnp.array([-0.0, 0.0]),  # bits not all zero: stored
    }
    tx = ro.fp32_master(ro.adamw(1e-3))
    state = {
        "key": jax.random.key_data(jax.random.key(42)),  # key(0)'s data is zeros
        "acc": jnp.zeros((2, 2)),
        "flags": np.zeros(4, np.bool_),  # a NumPy leaf
        "n": 3,
    }
    return rc.TrainingRecord.capture(model=params, optimizer=tx.init(params), state=state)


def _zero_paths(tree):
    """The independent rule: array leaves of at least one element whose bytes are all zero."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array | np.ndarray) and np.size(x) > 0:
            if not np.asarray(x).reshape(-1).view(np.uint8).any():
                out.append(jax.tree_util.keystr(path))
    return out


def _meta_of(directory, step):
    return json.loads((directory / str(step) / "meta" / "metadata").read_text())


def _assert_bitwise(got, want):
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        assert type(a) is type(b) or isinstance(a, jax.Array) == isinstance(b, jax.Array), path
        assert np.asarray(a).dtype == np.asarray(b).dtype, path
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), path


@pytest.mark.parametrize("async_save", [False, True])
def test_zero_leaves_are_listed_not_written_and_restore_bitwise(tmp_path, async_save):
    record = _record()
    with rc.Checkpointer(tmp_path, zeros_as_metadata=True, async_save=async_save) as ckpt:
        ckpt.save(1, record)
        ckpt.wait()
        restored = ckpt.restore(record)
    meta = _meta_of(tmp_path, 1)
    assert meta["format"] == 4
    arrays, _ = rc._record.split_state(record.state)
    want = {
        "model": _zero_paths(record.model),
        "optimizer": _zero_paths(record.optimizer),
        "state": _zero_paths(arrays),
    }
    assert "['neg']" not in want["model"] and "['b']" in want["model"]  # the rule's edges
    assert {p: sorted(v) for p, v in meta["zeros"].items()} == {
        p: sorted(v) for p, v in want.items() if v
    }
    _assert_bitwise(restored, record)
    assert type(restored.state["flags"]) is np.ndarray
    assert not restored.model["b"].committed  # as the uncommitted template leaf was
    assert restored.state["n"] == 3


def test_plain_orbax_reads_none_for_a_listed_leaf(tmp_path):
    record = _record()
    with rc.Checkpointer(tmp_path, zeros_as_metadata=True) as ckpt:
        ckpt.save(1, record)
    arrays = ocp.StandardCheckpointer().restore(tmp_path / "1" / "arrays")
    model, state = arrays["model"], arrays["state"]
    assert model["b"] is None
    assert state["flags"] is None and state["acc"] is None
    assert np.asarray(state["key"]).tobytes() == np.asarray(record.state["key"]).tobytes()
    assert np.asarray(model["w"]).tobytes() == np.asarray(record.model["w"]).tobytes()
    assert np.asarray(model["neg"]).tobytes() == np.asarray(record.model["neg"]).tobytes()


def test_off_by_default_writes_every_leaf(tmp_path):
    record = _record()
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        _assert_bitwise(ckpt.restore(record), record)
    meta = _meta_of(tmp_path, 1)
    assert meta["format"] == 4 and "zeros" not in meta
    model = ocp.StandardCheckpointer().restore(tmp_path / "1" / "arrays")["model"]
    assert np.asarray(model["b"]).tobytes() == bytes(6)


def test_no_zero_leaf_writes_no_zeros_field(tmp_path):
    record = rc.TrainingRecord.capture(model={"w": jnp.ones(3)}, optimizer=())
    with rc.Checkpointer(tmp_path, zeros_as_metadata=True) as ckpt:
        ckpt.save(1, record)
    meta = _meta_of(tmp_path, 1)
    assert meta["format"] == 4 and "zeros" not in meta


def test_a_part_of_zeros_only_and_restore_with_dtypes(tmp_path):
    params = {"w": jnp.zeros((2, 2), jnp.bfloat16), "v": jnp.zeros(3, jnp.float16)}
    record = rc.TrainingRecord.capture_with_dtypes(model=params, optimizer=())
    with rc.Checkpointer(tmp_path, zeros_as_metadata=True) as ckpt:
        ckpt.save(1, record)
        assert not (tmp_path / "1" / "arrays").exists()  # nothing for orbax to write
        fp32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
        like = rc.TrainingRecord(model=fp32, optimizer=(), accumulator=None, state=None)
        restored = ckpt.restore_with_dtypes(like)
    assert restored.model["w"].dtype == jnp.bfloat16 and restored.model["v"].dtype == jnp.float16
    _assert_bitwise(restored.model, params)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_zeros_come_back_in_the_template_placement(tmp_path):
    mesh8 = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    mesh4 = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    zeros = np.zeros((8, 5), np.float32)

    def record(mesh):
        params = {
            "m": jax.device_put(zeros, NamedSharding(mesh, P("fsdp", None))),
            "p": rs.ShardedParameter.from_full(np.zeros((3, 3), np.float32), mesh, "fsdp"),
            "one": jax.device_put(np.zeros(2, np.int8), jax.devices()[1]),
        }
        return rc.TrainingRecord.capture(model=params, optimizer=())

    with rc.Checkpointer(tmp_path, zeros_as_metadata=True) as ckpt:
        ckpt.save(1, record(mesh8))
        restored = ckpt.restore(record(mesh4))  # onto 4 devices: the parameter repadded
    assert sorted(_meta_of(tmp_path, 1)["zeros"]["model"]) == ["['m']", "['one']", "['p'].local"]
    model = restored.model
    assert model["m"].sharding == NamedSharding(mesh4, P("fsdp", None))
    assert model["p"].num_shards == 4 and model["p"].local.shape == (12,)
    assert model["p"].local.sharding == NamedSharding(mesh4, P("fsdp"))
    assert model["one"].sharding == SingleDeviceSharding(jax.devices()[1])
    assert model["one"].committed
    for x in (model["m"], model["p"].local, model["one"]):
        assert not np.asarray(x).any()


def _rewrite_meta(directory, step, change):
    path = directory / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    change(meta)
    fields = {k: v for k, v in meta.items() if k != "digest"}
    meta["digest"] = _meta._digest(fields)  # a consistent item: only the new check can object
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: m["zeros"]["model"].append("['w']"), "whose checksum is not zero"),
        (lambda m: m["zeros"]["model"].append("['nope']"), "must list array leaves"),
        (lambda m: m["zeros"].update(model=[]), "distinct paths"),
        (lambda m: m.pop("zeros"), "zeros"),
    ],
)
def test_a_zeros_field_that_disagrees_is_refused(tmp_path, change, match):
    record = _record()
    with rc.Checkpointer(tmp_path, zeros_as_metadata=True) as ckpt:
        ckpt.save(1, record)
        _rewrite_meta(tmp_path, 1, change)
        with pytest.raises(rc.CheckpointCorruptedError, match=match):
            ckpt.restore(record)


def test_a_leaf_neither_written_nor_listed_is_an_error(tmp_path):
    record = _record()
    with rc.Checkpointer(tmp_path, zeros_as_metadata=True) as ckpt:
        ckpt.save(1, record)
        _rewrite_meta(tmp_path, 1, lambda m: m["zeros"].pop("model"))
        with pytest.raises(rc.CheckpointCorruptedError, match=r"record.model\[.b.\] is neither"):
            ckpt.restore(record)  # orbax has no data for it: an error, not a silent zero


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices")
def test_two_processes_agree_on_which_leaves_are_zero(tmp_path):
    run_processes(worker.__file__, 2, 2, timeout=90, args=[str(tmp_path), True])
    meta = _meta_of(tmp_path, worker.STEP)
    # zero in both processes' shards: listed; zero in process 0's shards only: written.
    assert meta["format"] == 4 and meta["zeros"] == {"state": ["['zero']"]}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), (worker.AX,))
    rows = NamedSharding(mesh, P(worker.AX, None))
    state = {
        name: jax.device_put(np.ones((8, 2), np.int32), rows) for name in ("order", "zero", "half")
    }
    like = rc.TrainingRecord.capture(model=None, optimizer=None, state={**state, "epoch": 0})
    with rc.Checkpointer(tmp_path, read_only=True) as ckpt:
        restored = ckpt.restore(like, strict=False)
    zero0, half0 = worker.zero_rows(0)
    zero1, half1 = worker.zero_rows(1)
    np.testing.assert_array_equal(
        np.asarray(restored.state["zero"]), np.concatenate([zero0, zero1])
    )
    np.testing.assert_array_equal(
        np.asarray(restored.state["half"]), np.concatenate([half0, half1])
    )
    assert restored.state["zero"].sharding == rows
