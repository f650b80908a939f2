"""rudax.sharding's mesh functions (parse_mesh, make_mesh, state_shardings, place, replicate,
put_batch) on 8 simulated CPU devices; over several processes they run in the programs'
two-process tests (tests/lm/test_processes.py, tests/finetune/test_mesh.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import rudax.models as rm
import rudax.optim as ro
import rudax.sharding as rs

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def test_parse_mesh_orders_the_axes_and_mesh_text_writes_it_back():
    assert rs.parse_mesh("fsdp=4,data=2") == {"data": 2, "fsdp": 4}
    assert rs.mesh_text(rs.parse_mesh(" data=8 ")) == "data=8"
    assert rs.parse_mesh("b=2,a=3", axes=("a", "b")) == {"a": 3, "b": 2}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpu=2", r"expected axis=size pairs with axes \('data', 'fsdp'\), e.g. .*got 'gpu=2'"),
        ("data2", r"expected axis=size pairs .* got 'data2'"),
        ("data=2,data=4", r"axis 'data' given twice in 'data=2,data=4'"),
        ("data=0", r"data size must be >= 1, got 'data=0'"),
        ("fsdp=two", r"fsdp size must be an int, got 'fsdp=two'"),
    ],
)
def test_parse_mesh_names_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        rs.parse_mesh(text)


def test_make_mesh_takes_every_device_in_process_order_and_names_a_wrong_count():
    mesh = rs.make_mesh({"data": 2, "fsdp": 4})
    assert mesh.axis_names == ("data", "fsdp") and mesh.devices.shape == (2, 4)
    assert [d.id for d in mesh.devices.flat] == sorted(d.id for d in jax.devices())
    with pytest.raises(ValueError, match=r"data=2,fsdp=2 needs 4 devices, the run has 8 \(1 "):
        rs.make_mesh({"data": 2, "fsdp": 2})


def _state(mesh):
    """A sharded model's parameters and their AdamW state."""
    config = rm.LlamaConfig.tiny(64, hidden_size=64, num_hidden_layers=1)
    model = rm.LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    if "fsdp" in mesh.axis_names:
        model = rm.shard(model, rs.ShardingContext(mesh, "fsdp"))
    params = nnx.state(model, nnx.Param)
    return params, ro.adamw(1e-3).init(params)


@pytest.mark.parametrize("spec", [{"data": 2, "fsdp": 4}, {"data": 8}])
def test_place_splits_fsdp_storage_and_replicates_the_rest(spec):
    mesh = rs.make_mesh(spec)
    params, opt_state = _state(mesh)
    placed = rs.place((params, opt_state), mesh)
    leaves = jax.tree.leaves(placed)
    specs = [x.sharding.spec for x in leaves]
    if "fsdp" in spec:  # every vector and moment split over fsdp, the step count replicated
        assert {s for x, s in zip(leaves, specs, strict=True) if x.ndim} == {P("fsdp")}
        assert all(s == P() for x, s in zip(leaves, specs, strict=True) if not x.ndim)
    else:
        assert set(specs) == {P()}
    assert all(x.sharding.mesh == mesh for x in leaves)
    for got, want in zip(leaves, jax.tree.leaves((params, opt_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # inside a step, state_shardings gives the same layout for tracers
    shardings = jax.tree.leaves(rs.state_shardings((params, opt_state), mesh))
    assert [s.spec for s in shardings] == specs


def test_replicate_keeps_a_typed_key_and_its_bits():
    mesh = rs.make_mesh({"fsdp": 8})
    key = jax.random.key(7, impl="rbg")
    got = rs.replicate(key, mesh)
    assert jax.random.key_impl(got) == jax.random.key_impl(key)
    assert got.sharding.spec == P() and len(got.sharding.device_set) == 8
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(key))
    x = rs.replicate(np.arange(6, dtype=np.int32), mesh)
    assert x.sharding.spec == P() and x.dtype == jnp.int32
    np.testing.assert_array_equal(x, np.arange(6))


def test_put_batch_splits_the_rows_over_every_axis():
    mesh = rs.make_mesh({"data": 2, "fsdp": 4})
    rows = {"tokens": np.arange(16 * 3).reshape(16, 3), "labels": np.ones((16, 3), np.int32)}
    batch = rs.put_batch(rows, mesh, 16)
    assert rs.batch_sharding(mesh).spec == P(("data", "fsdp"))
    for key, x in batch.items():
        assert x.sharding == rs.batch_sharding(mesh) and x.shape == (16, 3)
        np.testing.assert_array_equal(x, rows[key])
        assert [s.data.shape for s in x.addressable_shards] == [(2, 3)] * 8
