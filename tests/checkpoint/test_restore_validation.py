"""Restore validation: the run's config is compared path by path, strict=False restores part."""

import json
import os
import struct

import jax
import jax.numpy as jnp
import pytest

import rudax.checkpoint as rc
import rudax.optim as ro
from tests.checkpoint._assertions import assert_bitwise_equal

CONFIG = {
    "optimizer": {"name": "adamw", "lr": 3e-4, "b1": 0.9, "b2": 0.95, "weight_decay": 0.1},
    "schedule": {"name": "warmup_cosine", "peak": 3e-4, "warmup": 100, "total": 2000},
    "clip": [1.0, None],
}


def _record(config=CONFIG):
    params = {"w": jax.random.normal(jax.random.key(0), (4, 3)), "b": jnp.arange(3.0)}
    tx = ro.adamw(1e-2)
    opt_state = tx.init(params)
    _, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    acc = ro.GradientAccumulator.init(params).add(jax.tree.map(jnp.ones_like, params), weight=2)
    return rc.TrainingRecord.capture(
        model=params,
        optimizer=opt_state,
        accumulator=acc,
        state={"pos": 7, "key": jax.random.key_data(jax.random.key(1))},
        config=config,
    )


def _like(record):
    """A template of ShapeDtypeStructs for the arrays; Python state leaves stay as they are."""
    sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x
    return jax.tree.map(sds, record)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation")
    record = _record()
    with rc.Checkpointer(root) as ckpt:
        ckpt.save(5, record)
    return root, record


def test_config_is_saved_exactly_and_checked(tmp_path):
    tricky = {
        "floats": [0.1, 1 / 3, 5e-324, 1.7976931348623157e308, -0.0, 2.0**-1074 * 3],
        "big": 2**70 + 1,
        "text": "warmup→cosine",
        "flags": [True, False, None],
        "nested": {"a": {"b": [[], {}]}},
    }
    record = _record(tricky)
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        restored = ckpt.restore(_like(record))
    with open(tmp_path / "1" / "meta" / "metadata") as f:  # orbax JsonSave's file
        on_disk = json.load(f)["config"]
    assert on_disk == tricky
    bits = lambda xs: [struct.pack("<d", x) for x in xs]  # -0.0 == 0.0, so compare the bits
    assert bits(on_disk["floats"]) == bits(tricky["floats"])
    assert type(on_disk["big"]) is int and on_disk["big"] == 2**70 + 1
    assert restored.config == tricky
    assert_bitwise_equal(restored, record)


def _set(config, path, value):
    out = json.loads(json.dumps(config))
    *keys, last = path
    target = out
    for key in keys:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return out


@pytest.mark.parametrize(
    "template_config, message",
    [
        (
            _set(CONFIG, ("optimizer", "lr"), 1e-3),
            r"config\['optimizer'\]\['lr'\]: saved 0\.0003, template 0\.001",
        ),
        (
            _set(CONFIG, ("schedule", "warmup"), 100.0),  # same number, another JSON value
            r"config\['schedule'\]\['warmup'\]: saved 100, template 100\.0",
        ),
        (
            _set(CONFIG, ("optimizer", "b2"), KeyError),
            r"config\['optimizer'\]\['b2'\] is only in the saved config \(saved 0\.95\)",
        ),
        (
            _set(CONFIG, ("optimizer", "eps"), 1e-8),
            r"config\['optimizer'\]\['eps'\] is only in the template's config \(template 1e-08\)",
        ),
        (_set(CONFIG, ("clip",), [1.0]), r"config\['clip'\]\[1\] is only in the saved config"),
        (_set(CONFIG, ("clip", 1), False), r"config\['clip'\]\[1\]: saved None, template False"),
        (None, r"config: saved \{'optimizer'.*template None"),
    ],
)
def test_a_different_config_names_the_first_differing_path(saved, template_config, message):
    root, record = saved
    like = _like(record)._replace(config=template_config)
    with rc.Checkpointer(root) as ckpt:
        with pytest.raises(ValueError, match=message):
            ckpt.restore(like)
        # On purpose (fine-tuning with another learning rate): strict=False; the returned
        # record carries the template's config, the one the run goes on with.
        restored = ckpt.restore(like, strict=False)
    assert restored.config == template_config
    assert_bitwise_equal(restored._replace(config=CONFIG), record)


def test_model_only_restore_reads_the_model_out_of_the_one_item(saved):
    # The parts share one orbax item: orbax's partial restore reads only the model's arrays
    # (a restore of a format-3 step reads only its model item: test_old_formats.py).
    copy, record = saved
    like = rc.TrainingRecord(
        model=_like(record).model, optimizer=None, accumulator=None, state=None
    )
    with rc.Checkpointer(copy) as ckpt:
        with pytest.raises(ValueError, match=r"holds parts .*strict=False"):
            ckpt.restore(like)
        restored = ckpt.restore(like, strict=False)
    assert restored.optimizer is None and restored.accumulator is None and restored.state is None
    assert_bitwise_equal(restored.model, record.model)


def test_a_part_that_was_not_saved_is_an_error_in_both_modes(tmp_path):
    record = _record()._replace(accumulator=None)
    with rc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, record)
        for strict in (True, False):
            with pytest.raises(ValueError, match=r"record\.accumulator was not saved"):
                ckpt.restore(_record(), strict=strict)


def test_layout_is_checked_within_a_part_when_not_strict(saved):
    root, record = saved
    model = dict(_like(record).model, w=jax.ShapeDtypeStruct((4, 4), jnp.float32))
    like = rc.TrainingRecord(model=model, optimizer=None, accumulator=None, state=None)
    with rc.Checkpointer(root) as ckpt:
        with pytest.raises(ValueError, match=r"record\.model\['w'\]: saved shape \(4, 3\)"):
            ckpt.restore(like, strict=False)


@pytest.mark.parametrize(
    "change, strict, error, message",
    [
        (lambda r: r._replace(config={"lr": (1, 2)}), True, TypeError, r"like\.config\['lr'\]"),
        (lambda r: r._replace(model=[1.0]), True, ValueError, r"record\.model structure"),
        (lambda r: r, "yes", TypeError, r"strict must be a bool, got strict='yes'"),
        (lambda r: r.model, True, TypeError, r"like must be a TrainingRecord, got dict"),
    ],
)
def test_bad_templates_are_refused(saved, change, strict, error, message):
    root, record = saved
    with rc.Checkpointer(root) as ckpt:
        with pytest.raises(error, match=message):
            ckpt.restore(change(_like(record)), strict=strict)


def test_meta_item_holds_the_parts_saved(saved):
    root, _ = saved
    with open(os.path.join(root, "5", "meta", "metadata")) as f:
        meta = json.load(f)
    assert meta["parts"] == ["model", "optimizer", "accumulator", "state"]
    assert meta["config"] == CONFIG and meta["storage_dtypes"] is None
    assert sorted(meta["checksums"]) == sorted(meta["parts"])
    assert sorted(meta["checksums"]["model"]) == ["['b']", "['w']"]
