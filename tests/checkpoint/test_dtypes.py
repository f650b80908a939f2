"""capture_with_dtypes / restore_with_dtypes: mixed-precision storage comes back bit for bit."""

import functools
import json

import jax
import jax.numpy as jnp
import pytest

import rudax.checkpoint as rc
import rudax.optim as ro
from tests.checkpoint._assertions import assert_bitwise_equal

TX = ro.fp32_master(ro.adamw(1e-2, weight_decay=0.1))
UPDATE = jax.jit(TX.update)  # one compilation for every update in this file


def _params(dtypes=("bfloat16", "float16", "float32")):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "emb": jax.random.normal(k1, (5, 4)).astype(dtypes[0]),
        "norm": (1.0 + 0.1 * jax.random.normal(k2, (4,))).astype(dtypes[1]),
        "head": jax.random.normal(k3, (4, 3)).astype(dtypes[2]),
    }


@functools.cache  # records are immutable: the tests share one
def _trained_record():
    """A mixed bf16/fp16/fp32 model after three fp32_master(adamw) updates."""
    params = _params()
    opt_state = TX.init(params)
    for i in range(3):
        scale = 0.1 * (i + 1)
        grads = jax.tree.map(lambda p, s=scale: jnp.full(p.shape, s, p.dtype), params)
        updates, opt_state = UPDATE(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    acc = ro.GradientAccumulator.init(params, dtype=jnp.float32)
    acc = acc.add(jax.tree.map(lambda p: jnp.ones(p.shape, p.dtype), params), weight=3)
    return rc.TrainingRecord.capture_with_dtypes(
        model=params, optimizer=opt_state, accumulator=acc, state={"step": 3}
    )


def _fp32_template():
    """What a restarted run builds first: the fp32 model's shapes, and tx.init of them."""
    params = jax.eval_shape(lambda: _params(("float32",) * 3))
    return rc.TrainingRecord(
        model=params,
        optimizer=jax.eval_shape(TX.init, params),
        accumulator=jax.eval_shape(ro.GradientAccumulator.init, params),
        state={"step": 0},
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtypes")
    record = _trained_record()
    with rc.Checkpointer(root) as ckpt:
        ckpt.save(3, record)
    return root, record


def test_mixed_precision_restores_from_an_fp32_template(saved):
    root, record = saved
    like = _fp32_template()
    assert {str(x.dtype) for x in jax.tree.leaves(like.model)} == {"float32"}
    with rc.Checkpointer(root) as ckpt:
        restored = ckpt.restore_with_dtypes(like)
    assert {k: str(v.dtype) for k, v in restored.model.items()} == {
        "emb": "bfloat16",
        "norm": "float16",
        "head": "float32",
    }
    assert_bitwise_equal(restored, record)
    assert restored.dtypes == record.dtypes
    # The restored state carries on exactly: one more update equals one on the original.
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), record.model)
    expected = UPDATE(grads, record.optimizer, record.model)
    assert_bitwise_equal(UPDATE(grads, restored.optimizer, restored.model), expected)


def test_plain_restore_still_wants_the_saved_dtypes(saved):
    root, _ = saved
    with rc.Checkpointer(root) as ckpt:
        with pytest.raises(
            ValueError,
            match=r"record\.model\['emb'\]: saved shape \(5, 4\) dtype bfloat16, "
            r"template shape \(5, 4\) dtype float32",
        ):
            ckpt.restore(_fp32_template())


def test_the_meta_item_records_the_dtypes(saved):
    root, record = saved
    with open(root / "3" / "meta" / "metadata") as f:
        meta = json.load(f)
    assert meta["storage_dtypes"] == record.dtypes
    assert meta["storage_dtypes"]["model['emb']"] == "bfloat16"
    assert meta["storage_dtypes"]["optimizer.master['emb']"] == "float32"


@pytest.mark.parametrize(
    "change, message",
    [
        (  # an integer leaf (adam's count) where a float was saved, and the reverse
            lambda like: like._replace(
                accumulator=like.accumulator.__class__(
                    sums=like.accumulator.sums,
                    count=jax.ShapeDtypeStruct((), jnp.float32),
                    total_weight=like.accumulator.total_weight,
                )
            ),
            r"record\.accumulator\.count: saved shape \(\) dtype int32, template shape \(\) "
            r"dtype float32",
        ),
        (
            lambda like: like._replace(
                model=dict(like.model, head=jax.ShapeDtypeStruct((4, 3), jnp.int32))
            ),
            r"record\.model\['head'\]: saved shape \(4, 3\) dtype float32, template shape "
            r"\(4, 3\) dtype int32",
        ),
        (
            lambda like: like._replace(
                model=dict(like.model, head=jax.ShapeDtypeStruct((3, 4), jnp.float32))
            ),
            r"record\.model\['head'\]: saved shape \(4, 3\)",
        ),
    ],
)
def test_restore_with_dtypes_still_checks_kinds_and_shapes(saved, change, message):
    root, _ = saved
    with rc.Checkpointer(root) as ckpt:
        with pytest.raises(ValueError, match=message):
            ckpt.restore_with_dtypes(change(_fp32_template()))


def test_a_checkpoint_without_recorded_dtypes_is_refused(tmp_path):
    record = _trained_record()
    plain = rc.TrainingRecord.capture(model=record.model, optimizer=record.optimizer)
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, plain)
        like = _fp32_template()._replace(accumulator=None, state=None)
        with pytest.raises(ValueError, match=r"without recorded dtypes.*capture_with_dtypes"):
            ckpt.restore_with_dtypes(like)


def test_saving_never_casts_a_record_whose_dtypes_changed(tmp_path):
    record = _trained_record()
    # Cast after capture: the recorded dtypes no longer describe the leaves.
    upcast = jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x,
        record,
    )
    assert upcast.dtypes == record.dtypes
    with rc.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(
            ValueError, match=r"record\.dtypes records record\.model\['emb'\] as bfloat16, but "
        ):
            ckpt.save(1, upcast)
        assert ckpt.all_steps() == []
