"""Checkpoints an older rudax wrote (meta formats 2 and 3, one orbax item per part) restore.

``golden/formats_2_3`` was written by rudax at d23ac91 (``golden/make.py`` says how), before
format 4 put every part into one orbax item. Restoring it is the path of a user who upgrades
rudax in the middle of a run: the old steps restore bit for bit and are checked as before, a
model-only restore still reads only the model's item, and the next save writes format 4
beside them.
"""

import json
import shutil

import jax
import pytest

import rudax.checkpoint as rc
from rudax.checkpoint import _meta
from tests.checkpoint._assertions import assert_bitwise_equal
from tests.checkpoint.golden import FORMATS_2_3 as GOLDEN
from tests.checkpoint.golden.make import record


@pytest.fixture
def old(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(GOLDEN, root)
    return root


def _same(got, want):
    """Bitwise, typed PRNG keys compared by impl and key data."""

    def data(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return (str(jax.random.key_impl(x)), jax.random.key_data(x))
        return x

    assert_bitwise_equal(jax.tree.map(data, got), jax.tree.map(data, want))


def _meta_of(root, step):
    return json.loads((root / str(step) / "meta" / "metadata").read_text())


def test_the_golden_steps_are_of_the_old_layout():
    for step, fmt in ((2, 2), (3, 3)):
        assert _meta_of(GOLDEN, step)["format"] == fmt
        assert not (GOLDEN / str(step) / "arrays").exists()
    assert (GOLDEN / "2" / "optimizer").is_dir()
    assert not (GOLDEN / "3" / "optimizer").exists()  # all of it listed as zeros


@pytest.mark.parametrize("step", [2, 3])
def test_an_old_step_restores_bitwise(old, step):
    with rc.Checkpointer(old, read_only=True) as ckpt:
        _same(ckpt.restore(record(), step=step), record())


def test_an_old_steps_checksums_are_still_verified(old):
    meta = _meta_of(old, 2)
    del meta["digest"]
    first = next(iter(meta["checksums"]["state"]))
    meta["checksums"]["state"][first] = "00000000"
    meta["digest"] = _meta._digest(meta)
    (old / "2" / "meta" / "metadata").write_text(json.dumps(meta))
    with rc.Checkpointer(old, read_only=True) as ckpt:
        with pytest.raises(rc.CheckpointCorruptedError, match=r"record\.state.*checksum"):
            ckpt.restore(record(), step=2)


def test_an_old_model_only_restore_reads_only_the_models_item(old):
    for part in ("optimizer", "accumulator", "state"):
        shutil.rmtree(old / "2" / part)  # not read at all: they may as well be gone
    like = record()._replace(optimizer=None, accumulator=None, state=None)
    with rc.Checkpointer(old, read_only=True) as ckpt:
        restored = ckpt.restore(like, step=2, strict=False)
    _same(restored.model, record().model)
    assert restored.optimizer is None and restored.state is None


def test_the_next_save_writes_format_4_beside_the_old_steps(old):
    with rc.Checkpointer(old, zeros_as_metadata=True) as ckpt:
        resumed = ckpt.restore(record())  # the latest, step 3
        ckpt.save(4, resumed)
        for step in (2, 3, 4):
            _same(ckpt.restore(record(), step=step), record())
    assert _meta_of(old, 4)["format"] == 4
    assert sorted(p.name for p in (old / "4").iterdir() if p.is_dir()) == ["arrays", "meta"]
