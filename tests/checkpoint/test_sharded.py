"""rudax.checkpoint with sharded states: saved shard by shard, restored onto other device counts.

References are written here: the logical values a record was built from (NumPy), and for the
optimizer the same update run on plain, unsharded arrays on one device. Every comparison is
bitwise: restoring moves bytes, it computes nothing.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import rudax.checkpoint as rc
import rudax.optim as ro
import rudax.sharding as rs
from rudax.checkpoint import _sharded as sharded
from tests.checkpoint import _sharded_worker as worker
from tests.sharding._multiprocess import run_processes

N = 8
AX = "fsdp"

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")


def _mesh(kind, n, axis=AX):
    if kind == "explicit":
        return jax.make_mesh((n,), (axis,), devices=jax.devices()[:n])
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), (axis,))


def _bits(x):
    x = np.asarray(x)
    return x.dtype, x.shape, x.tobytes()


def _is_sp(x):
    return isinstance(x, rs.ShardedParameter)


def _logical(tree):
    """The leaves of tree with each ShardedParameter replaced by its logical value, as bits."""
    leaves = jax.tree.leaves(tree, is_leaf=_is_sp)
    return [_bits(x.unshard() if _is_sp(x) else x) for x in leaves]


def _assert_padding_zero(tree):
    for p in jax.tree.leaves(tree, is_leaf=_is_sp):
        if _is_sp(p):
            flat = np.asarray(p.local)
            assert flat.shape == (p.num_shards * p.shard_size,)
            np.testing.assert_array_equal(flat[p.size :], np.zeros(flat.size - p.size, p.dtype))


def _assert_sharding(tree, want):
    """Every array leaf of tree is placed with want(leaf path) (a Sharding)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array):
            assert leaf.sharding == want(path), jax.tree_util.keystr(path)


# ---------------------------------------------------------------------- plain sharded arrays


SPECS = {"a": P(AX, None), "b": P(AX), "c": P(), "d": P()}


def _arrays():
    return {
        "a": np.arange(48, dtype=np.float32).reshape(16, 3) * 0.5 - 7.0,
        "b": np.linspace(-3, 3, 8, dtype=np.float32).astype(jnp.bfloat16),
        "c": np.array([1e-30, -0.0, np.inf, 3.25, -2.5], np.float32),
        "d": np.array(12345, np.int32),
    }


def _placed(values, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in values.items()}


def _record(params):
    # A real optimizer state is tested below; here only the model's placement matters. Built
    # directly, not with capture, since a template may hold ShapeDtypeStructs.
    count = np.zeros((), np.int32)
    return rc.TrainingRecord(model=params, optimizer={"count": count}, accumulator=None, state=None)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_arrays_restore_onto_4_then_1_then_8_devices(tmp_path, kind):
    values = _arrays()
    mesh8, mesh4 = _mesh(kind, N), _mesh(kind, 4)
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _record(_placed(values, mesh8)))

        zeros4 = _placed(jax.tree.map(np.zeros_like, values), mesh4)
        on4 = ckpt.restore(_record(zeros4))
        _assert_sharding(on4.model, lambda path: NamedSharding(mesh4, SPECS[path[0].key]))
        assert _logical(on4.model) == _logical(values)

        one = SingleDeviceSharding(jax.devices()[5])  # not the default device: placement kept
        abstract = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in values.items()
        }
        on1 = ckpt.restore(_record(abstract))
        _assert_sharding(on1.model, lambda path: one)
        assert _logical(on1.model) == _logical(values)

        ckpt.save(2, on4)  # saved from 4 devices, read back onto 8
        on8 = ckpt.restore(_record(_placed(jax.tree.map(np.zeros_like, values), mesh8)), step=2)
    _assert_sharding(on8.model, lambda path: NamedSharding(mesh8, SPECS[path[0].key]))
    assert _logical(on8.model) == _logical(values)


def test_template_leaves_that_name_no_placement(tmp_path):
    values = _arrays()
    on3 = SingleDeviceSharding(jax.devices()[3])
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _record(_placed(values, _mesh("auto", N))))
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in values.items()}
        from_structs = ckpt.restore(_record(abstract))
        fresh = ckpt.restore(_record(jax.tree.map(jnp.zeros_like, values)))  # uncommitted
        committed = ckpt.restore(_record(jax.device_put(jax.tree.map(jnp.zeros_like, values), on3)))
        as_numpy = ckpt.restore(_record(jax.tree.map(np.zeros_like, values)))
    # As jnp.zeros would make them: on the default device, uncommitted, so that jit moves
    # them next to committed arguments (tx.init's count beside parameters on a mesh).
    default = SingleDeviceSharding(jax.local_devices()[0])
    for restored in (from_structs, fresh):
        _assert_sharding(restored.model, lambda path: default)
        assert not any(x.committed for x in restored.model.values())
    _assert_sharding(committed.model, lambda path: on3)
    assert all(x.committed for x in committed.model.values())
    assert all(type(x) is np.ndarray for x in as_numpy.model.values())
    for restored in (from_structs, fresh, committed, as_numpy):
        assert _logical(restored.model) == _logical(values)


# -------------------------------------------------------------------- FSDP ShardedParameter

# logical shape, dtype; flat lengths over 8 / 4 / 1 shards in the comments
PARAMS = {
    "w": ((3, 3), np.float32),  # 16 (7 padding) / 12 (3) / 9
    "b": ((3,), jnp.bfloat16),  # 8 (5) / 4 (1) / 3
    "v": ((4, 5), np.float16),  # 24 (4) / 20 / 20
}


def _values():
    out = {}
    for i, (name, (shape, dtype)) in enumerate(PARAMS.items()):
        x = np.sin(np.arange(np.prod(shape), dtype=np.float32) + i) * 3
        out[name] = x.reshape(shape).astype(dtype)
    return out


def _fsdp(values, mesh, axis=AX):
    return {k: rs.ShardedParameter.from_full(v, mesh, axis) for k, v in values.items()}


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_sharded_parameters_restore_onto_4_then_1_then_8_shards(tmp_path, kind):
    values = _values()
    zeros = jax.tree.map(np.zeros_like, values)
    mesh8, mesh4 = _mesh(kind, N), _mesh(kind, 4)
    with rc.Checkpointer(tmp_path) as ckpt:
        saved = _fsdp(values, mesh8)
        ckpt.save(1, _record(saved))

        on4 = ckpt.restore(_record(_fsdp(zeros, mesh4)))
        assert {p.num_shards for p in on4.model.values()} == {4}
        assert {k: p.local.shape for k, p in on4.model.items()} == {
            "w": (12,),
            "b": (4,),
            "v": (20,),
        }
        _assert_sharding(on4.model, lambda path: NamedSharding(mesh4, P(AX)))

        # One device, as abstract storage on a 1-device mesh with another axis name.
        mesh1 = _mesh(kind, 1, "x")
        one = NamedSharding(mesh1, P("x"))
        abstract = {
            k: rs.ShardedParameter(
                jax.ShapeDtypeStruct((v.size,), v.dtype, sharding=one), v.shape, "x", 1
            )
            for k, v in values.items()
        }
        on1 = ckpt.restore(_record(abstract))
        assert {(p.num_shards, p.axis_name) for p in on1.model.values()} == {(1, "x")}
        _assert_sharding(on1.model, lambda path: one)

        ckpt.save(2, on4)  # 4 shards to 8: the stored vectors are shorter than the target's
        on8 = ckpt.restore(_record(_fsdp(zeros, mesh8)), step=2)
        _assert_sharding(on8.model, lambda path: NamedSharding(mesh8, P(AX)))
    for restored in (on4, on1, on8):
        assert _logical(restored.model) == _logical(values)
        _assert_padding_zero(restored.model)
    assert {k: _bits(p.local) for k, p in on8.model.items()} == {
        k: _bits(p.local) for k, p in saved.items()
    }


def test_meta_records_the_padded_layout_and_plain_orbax_reads_the_flat_vectors(tmp_path):
    values = _values()
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, _record(_fsdp(values, _mesh("auto", N))))
    with open(tmp_path / "3" / "meta" / "metadata") as f:
        meta = json.load(f)
    assert meta["sharded"]["model"]["['w'].local"] == {
        "logical_shape": [3, 3],
        "flat_length": 16,
        "num_shards": 8,
        "axis_name": AX,
    }
    assert [row for row in meta["layout"]["model"] if row[0] == "['w'].local"] == [
        ["['w'].local", [3, 3], "float32"]
    ]
    with ocp.StandardCheckpointer() as plain:
        stored = plain.restore(tmp_path / "3" / "arrays")["model"]
    for name, layout in meta["sharded"]["model"].items():
        flat = np.asarray(stored[name[2:-8]]["local"])
        assert flat.shape == (layout["flat_length"],)
        size = int(np.prod(layout["logical_shape"]))
        logical = flat[:size].reshape(layout["logical_shape"])
        assert _bits(logical) == _bits(values[name[2:-8]])


def _update(tx):
    @jax.jit
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _grads(t, like):
    """The step-t gradient, {name: logical value} in each parameter's dtype."""
    return {
        k: (np.cos(np.arange(v.size, dtype=np.float32) * (t + 1)) * 0.5)
        .reshape(v.shape)
        .astype(v.dtype)
        for k, v in like.items()
    }


def test_stacked_sharded_parameters_restore_onto_4_then_8_shards(tmp_path):
    """Layers stored stacked: each row (one layer's parameter) padded on its own; restored
    onto another shard count each row is read to its logical size and re-padded."""
    mesh8, mesh4 = _mesh("auto", N), _mesh("auto", 4)
    values = {
        "w": np.sin(np.arange(3 * 5 * 3, dtype=np.float32)).reshape(3, 5, 3),  # 15 per layer
        "b": np.cos(np.arange(3 * 7, dtype=np.float32)).reshape(3, 7).astype(np.float16),
    }
    stacked = lambda vs, mesh: {
        k: rs.ShardedParameter.from_full(v, mesh, AX, stacked=True) for k, v in vs.items()
    }
    zeros = jax.tree.map(np.zeros_like, values)
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _record(stacked(values, mesh8)))
        on4 = ckpt.restore(_record(stacked(zeros, mesh4)))
        assert {k: p.local.shape for k, p in on4.model.items()} == {"w": (3, 16), "b": (3, 8)}
        _assert_sharding(on4.model, lambda path: NamedSharding(mesh4, P(None, AX)))
        ckpt.save(2, on4)  # 4 shards to 8: each stored row is shorter than the target's
        on8 = ckpt.restore(_record(stacked(zeros, mesh8)), step=2)
        assert {k: p.local.shape for k, p in on8.model.items()} == {"w": (3, 16), "b": (3, 8)}
    for restored in (on4, on8):
        for k, v in values.items():
            p = restored.model[k]
            assert _bits(p.unshard()) == _bits(v), k
            # every row's padding is zero
            local = np.asarray(p.local)
            np.testing.assert_array_equal(local[:, p.size :], 0)
    with rc.Checkpointer(tmp_path) as ckpt:  # another number of layers is another layout
        fewer = stacked(jax.tree.map(lambda v: v[:2], zeros), mesh8)
        with pytest.raises(ValueError, match=r"\['b'\].local: saved shape \(3, 7\).*\(2, 7\)"):
            ckpt.restore(_record(fewer), step=2)


def test_fsdp_train_state_continues_on_4_and_on_1_device_as_unsharded(tmp_path):
    tx = ro.fp32_master(ro.adamw(1e-2, weight_decay=0.1))
    step = _update(tx)
    values = _values()
    mesh8 = _mesh("auto", N)
    params, ref_params = _fsdp(values, mesh8), {k: jnp.asarray(v) for k, v in values.items()}
    state, ref_state = tx.init(params), tx.init(ref_params)
    for t in range(2):
        grads = _grads(t, values)
        params, state = step(params, state, _fsdp(grads, mesh8))
        ref_params, ref_state = step(ref_params, ref_state, grads)
    record = rc.TrainingRecord.capture(model=params, optimizer=state)
    # fp32 masters and both AdamW moments are ShardedParameters shaped like their parameter.
    assert sum(map(_is_sp, jax.tree.leaves(state, is_leaf=_is_sp))) == 3 * len(PARAMS)
    assert _logical(record) == _logical((ref_params, ref_state))
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, record)
        restored = {}
        for n in (4, 1):
            mesh = _mesh("auto", n)
            like = _fsdp(jax.tree.map(np.zeros_like, values), mesh)
            restored[n] = ckpt.restore(
                rc.TrainingRecord.capture(model=like, optimizer=tx.init(like))
            )
    grads = _grads(2, values)
    ref_after = _logical(step(ref_params, ref_state, grads))
    assert _logical(step(params, state, _fsdp(grads, mesh8))) == ref_after
    for n, r in restored.items():
        assert _logical(r) == _logical(record), n
        _assert_padding_zero(r)
        assert {p.num_shards for p in jax.tree.leaves(r, is_leaf=_is_sp) if _is_sp(p)} == {n}
        after = step(r.model, r.optimizer, _fsdp(grads, _mesh("auto", n)))
        assert _logical(after) == ref_after, n
        _assert_padding_zero(after)


# --------------------------------------------------------------------------------- bad input


def _saved(tmp_path):
    ckpt = rc.Checkpointer(tmp_path)
    ckpt.save(1, _record(_fsdp(_values(), _mesh("auto", N))))
    return ckpt


def test_other_logical_shape_names_the_path_and_both_shapes(tmp_path):
    values = dict(_values(), w=np.zeros((9,), np.float32))  # 9 elements, as saved, not (3, 3)
    with _saved(tmp_path) as ckpt:
        with pytest.raises(
            ValueError,
            match=r"record\.model\['w'\]\.local: saved shape \(3, 3\) dtype float32, "
            r"template shape \(9,\)",
        ):
            ckpt.restore(_record(_fsdp(values, _mesh("auto", 4))))


def test_other_dtype_names_the_path(tmp_path):
    values = dict(_values(), b=np.zeros(3, np.float32))
    with _saved(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"record\.model\['b'\]\.local: .*bfloat16.*float32"):
            ckpt.restore(_record(_fsdp(values, _mesh("auto", 4))))


def test_inconsistent_sharded_parameter_is_refused(tmp_path):
    mesh = _mesh("auto", 4)
    like = _fsdp(jax.tree.map(np.zeros_like, _values()), mesh)
    bad = rs.ShardedParameter(like["w"].local[:8], (3, 3), AX, 4)  # 8 elements, needs 12
    with _saved(tmp_path) as ckpt:
        with pytest.raises(
            ValueError,
            match=r"\['w'\]\.local: .*num_shards=4 must store a flat "
            r"vector of 12 elements \(or a stack of them\), got local of shape \(8,\)",
        ):
            ckpt.restore(_record(dict(like, w=bad)))
        with pytest.raises(ValueError, match=r"\['w'\]\.local: .*12 elements"):
            ckpt.save(2, _record(dict(like, w=bad)))


def test_stored_shapes_are_checked_before_padding_or_cutting(tmp_path):
    _saved(tmp_path).close()
    item = tmp_path / "1" / "arrays"
    mesh4 = _mesh("auto", 4)
    like = _fsdp(jax.tree.map(np.zeros_like, _values()), mesh4)
    good = {"model": sharded.restore_target(like)}  # the item holds {part: tree}
    lengths = {
        "['model']['w'].local": (16, 12),
        "['model']['b'].local": (8, 4),
        "['model']['v'].local": (24, 20),
    }
    sharded.check_stored_shapes(item, good, lengths)  # as saved: passes
    with pytest.raises(
        ValueError,
        match=r"\['w'\]\.local is stored .* with shape \(16,\), "
        r"the checkpoint's layout says \(15,\)",
    ):
        sharded.check_stored_shapes(item, good, dict(lengths, **{"['model']['w'].local": (15, 12)}))
    # A leaf not being re-padded must be stored at its target shape: v (24,) is not (20,).
    not_v = {k: v for k, v in lengths.items() if k != "['model']['v'].local"}
    with pytest.raises(
        ValueError,
        match=r"\['v'\]\.local is stored .* with shape \(24,\), "
        r"the checkpoint's layout says \(20,\)",
    ):
        sharded.check_stored_shapes(item, good, not_v)


# ----------------------------------------------------------------------- 2 processes x 2 devices


def test_two_processes_save_their_own_shards_restored_on_1_and_4_devices(tmp_path):
    results = run_processes(worker.__file__, 2, 2, timeout=90, args=[str(tmp_path)])
    assert [r["ranks"] for r in results] == [[0, 1], [2, 3]]
    # from_local asked each process for its own ranks only; every array spanned both.
    assert [r["asked"] for r in results] == [[0, 1], [2, 3]]
    assert all(r["not_fully_addressable"] == r["leaves"] > 0 for r in results)

    # Each process wrote its own shards into its own OCDBT database: rank r's slice of every
    # parameter is chunk r (orbax writes one chunk per shard), and no chunk of another
    # process's ranks is in a process's file.
    item = tmp_path / str(worker.STEP) / "arrays"
    for proc, ranks in ((0, [0, 1]), (1, [2, 3])):
        kv = ts.KvStore.open(
            {"driver": "ocdbt", "base": f"file://{item}/ocdbt.process_{proc}"}
        ).result()
        keys = {k.decode() for k in kv.list().result()}
        for name in worker.SHAPES:
            assert {
                k.split("/")[1]
                for k in keys
                if k.startswith(f"model.{name}.local/") and "." not in k.split("/")[1]
            } == {str(r) for r in ranks}, (proc, name, keys)
        # The replicated array is written once, by the process holding its replica 0.
        assert ("model.r/0" in keys) == (proc == 0), (proc, keys)

    # The reference: the same record computed on one device from the logical values.
    values = worker.record_values()
    tx = worker.make_tx()
    ref_params = {k: jnp.asarray(values[k]) for k in ("w", "b", "r")}
    ref_params, ref_state = jax.jit(worker.update)(ref_params, tx.init(ref_params))
    want = [*_logical((ref_params, ref_state)), _bits(values["order"])]

    for n in (1, 4):
        mesh = _mesh("auto", n)
        params = {
            k: rs.ShardedParameter.from_full(np.zeros_like(values[k]), mesh, AX)
            for k in worker.SHAPES
        }
        params["r"] = jax.device_put(np.zeros(6, np.float32), NamedSharding(mesh, P()))
        order = jax.device_put(np.zeros((8, 2), np.int32), NamedSharding(mesh, P(AX, None)))
        like = rc.TrainingRecord.capture(
            model=params, optimizer=tx.init(params), state={"order": order, "epoch": 0}
        )
        with rc.Checkpointer(tmp_path) as ckpt:
            restored = ckpt.restore(like)
        assert restored.state["epoch"] == 2
        got = [*_logical((restored.model, restored.optimizer)), _bits(restored.state["order"])]
        assert got == want, n
        _assert_padding_zero(restored)
        assert restored.state["order"].sharding == NamedSharding(mesh, P(AX, None))


def test_restore_with_dtypes_reads_fsdp_storage_onto_4_shards_from_an_fp32_template(tmp_path):
    values = _values()  # fp32, bf16 and fp16 storage
    mesh4 = _mesh("auto", 4)
    record = rc.TrainingRecord.capture_with_dtypes(
        model=_fsdp(values, _mesh("auto", N)), optimizer=()
    )
    fp32 = {
        k: rs.ShardedParameter(
            jax.ShapeDtypeStruct(
                (4 * -(-v.size // 4),), np.float32, sharding=NamedSharding(mesh4, P(AX))
            ),
            v.shape,
            AX,
            4,
        )
        for k, v in values.items()
    }
    like = rc.TrainingRecord(model=fp32, optimizer=(), accumulator=None, state=None)
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        restored = ckpt.restore_with_dtypes(like)
    assert {k: p.dtype for k, p in restored.model.items()} == {
        k: v.dtype for k, v in values.items()
    }
    assert _logical(restored.model) == _logical(values)
    _assert_padding_zero(restored.model)
    _assert_sharding(restored.model, lambda path: NamedSharding(mesh4, P(AX)))


def test_fused_adamw_state_of_fp32_fsdp_params_saves_and_restores(tmp_path):
    # fused_adamw keeps no master for an fp32 parameter: its state mirrors the parameters with
    # ShardedParameter(local=None) nodes, which hold nothing and must be skipped like None.
    values = {"w": np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)}
    mesh8, mesh4 = _mesh("auto", N), _mesh("auto", 4)
    tx = ro.fused_adamw(1e-2, impl="xla")
    params = _fsdp(values, mesh8)
    state = tx.init(params)
    assert state.master["w"].local is None
    record = rc.TrainingRecord(model=params, optimizer=state, accumulator=None, state=None)
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        like4 = _fsdp(jax.tree.map(np.zeros_like, values), mesh4)
        restored = ckpt.restore(
            rc.TrainingRecord(model=like4, optimizer=tx.init(like4), accumulator=None, state=None)
        )
    assert restored.optimizer.master["w"].local is None
    assert _logical(restored.model) == _logical(values)
    assert _logical(restored.optimizer.exp_avg) == _logical(state.exp_avg)
