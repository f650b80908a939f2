"""examples.lm.train under faults: pretrained weights, bad data, divergence, damaged checkpoints.

Each case trains the tiniest model of ``tests/lm/conftest.py`` for a few updates; the
faults are real ones (out-of-range ids in a batch, a learning rate that overflows, a
truncated checkpoint file) or, where no input produces them, injected at the one place the
fault would arise (gradients that are NaN while the loss is finite).
"""

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.checkpoint as rc
import rudax.sharding as rs
from examples.lm import train
from examples.lm.data import TokenLoader
from rudax.run import read_metrics
from tests.lm.conftest import TINY


def _fails(argv, capsys, code):
    """train.main(argv) ends with exit ``code`` and a one-line error: its stderr."""
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    assert "Traceback" not in err
    return err


def _evals(summary):
    return {
        r["step"]: r["val_loss"] for r in read_metrics(summary["metrics"]) if r["kind"] == "eval"
    }


def _steps(run_dir):
    return sorted(int(n) for n in os.listdir(run_dir / "checkpoints") if n.isdigit())


def _all_finite(run_dir, step):
    """Whether every model array of checkpoint ``step`` is finite (read without a template)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as plain:
        model = plain.restore(run_dir / "checkpoints" / str(step) / "arrays")["model"]
    return all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(model))


# ----------------------------------------------------------------------------- --init-from
@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def source(request, data, tmp_path_factory):
    """A source run of 8 updates with storage dtype ``param``: (summary, flags of that dtype)."""
    dtype = request.param
    flags = [*data, *TINY, "--param-dtype", dtype]
    run_dir = tmp_path_factory.mktemp("source") / dtype
    summary = train.main([*flags, "--optimizer", "fused_adamw", "--run-dir", str(run_dir)])
    return summary, flags


@pytest.mark.parametrize("optimizer", ["muon", "adamw", "fused_adamw"])
def test_init_from_keeps_the_source_runs_validation_loss(source, optimizer, tmp_path):
    summary, flags = source
    src = _evals(summary)
    random_init, trained = src[0], src[8]
    assert random_init - trained > 1.0  # the level to keep is well below the random init's
    out = train.main(
        [
            *flags,
            *("--optimizer", optimizer, "--steps", "5", "--eval-every", "5"),
            *("--run-dir", str(tmp_path / "ft"), "--init-from", summary["run_dir"]),
        ]
    )
    got = _evals(out)
    assert got[0] == trained  # the source's weights, exactly
    # Five more updates on the same data keep (or lower) the level: the weights were not
    # reverted to the random init the optimizer state was built from (that gives ~4.9).
    assert got[5] < trained + 0.1 * (random_init - trained), (got, src)


# ----------------------------------------------------------------------------- non-finite
def _corrupt_batches_from(monkeypatch, first):
    """Training batches >= first hold id 65535 (vocabulary 300), as a corrupted shard would;
    the validation batches stay clean."""
    real = TokenLoader.batch

    def batch(self, i, **kwargs):
        out = real(self, i, **kwargs)
        if i >= first:
            out = out.copy()
            out[0, 3] = 65535
        return out

    monkeypatch.setattr(TokenLoader, "batch", batch)


@pytest.mark.parametrize("optimizer", ["muon", "fused_adamw"])
def test_a_nonfinite_loss_stops_the_run_and_keeps_the_good_checkpoints(
    data, optimizer, tmp_path, monkeypatch, capsys
):
    _corrupt_batches_from(monkeypatch, 4)  # update 5 onwards (update s reads batch s - 1)
    run_dir = tmp_path / "run"
    argv = [*data, *TINY, "--optimizer", optimizer, "--run-dir", str(run_dir)]
    err = _fails(argv, capsys, code=1)
    assert re.search(r"update 5: the training loss is nan", err), err
    # Before the fix: muon checkpointed NaN weights at 6 and 8 over the good ones (keep=2),
    # fused_adamw skipped every update from 5 on and finished as if nothing happened.
    assert _steps(run_dir) == [3] and _all_finite(run_dir, 3)
    assert "checkpoint 3" in err


def _poison_gradients(monkeypatch, bad_updates):
    """Every microbatch of the given updates gets NaN gradients, its loss stays finite: the
    fault the optimizer's non-finite skip exists for (an overflow in the backward pass)."""
    real = rs.make_train_steps

    def make_steps(*args, **kwargs):
        steps = real(*args, **kwargs)

        @jax.jit
        def poisoned(params, rngs, acc, rest, batch):
            acc, rngs, metrics = steps.micro(params, rngs, acc, rest, batch)
            sums = jax.tree.map(lambda x: x * jnp.nan, acc.sums)
            return dataclasses.replace(acc, sums=sums), rngs, metrics

        update = 0

        def micro(*args):
            nonlocal update
            update += 1  # one microbatch per update in these runs
            return (poisoned if update in bad_updates else steps.micro)(*args)

        micro._cache_size = steps.micro._cache_size
        return steps._replace(micro=micro)

    monkeypatch.setattr(rs, "make_train_steps", make_steps)


def test_nonfinite_parameters_are_never_checkpointed(data, tmp_path, monkeypatch, capsys):
    # Muon has no skip: update 3's NaN gradients make every weight NaN, while update 3's
    # loss, computed before the update, is finite. Update 3 is a checkpoint step.
    _poison_gradients(monkeypatch, bad_updates={3})
    run_dir = tmp_path / "run"
    argv = [*data, *TINY, "--optimizer", "muon", "--checkpoint-every", "3"]
    err = _fails([*argv, "--run-dir", str(run_dir)], capsys, code=1)
    assert re.search(
        r"update 3: parameter params\['\w+'\]\S* is not finite \(inf or NaN\), and \d+ more", err
    ), err
    assert "not saving checkpoint 3" in err
    assert _steps(run_dir) == []  # before the fix: NaN weights at 3, 6 and 8


def test_consecutive_skipped_updates_stop_the_run(data, tmp_path, monkeypatch, capsys):
    _poison_gradients(monkeypatch, bad_updates=set(range(3, 100)))
    run_dir = tmp_path / "run"
    argv = [*data, *TINY, "--optimizer", "fused_adamw", "--max-skipped-updates", "4"]
    err = _fails([*argv, "--run-dir", str(run_dir)], capsys, code=1)
    assert re.search(r"updates 3 to 6: 4 updates in a row were skipped", err), err
    assert "--max-skipped-updates" in err
    assert _steps(run_dir) == [3] and _all_finite(run_dir, 3)


def test_isolated_skipped_updates_are_reported_and_the_run_goes_on(
    data, tmp_path, monkeypatch, capsys
):
    _poison_gradients(monkeypatch, bad_updates={2, 5, 6})
    argv = [*data, *TINY, "--optimizer", "fused_adamw", "--max-skipped-updates", "3"]
    out = train.main([*argv, "--run-dir", str(tmp_path / "run")])
    assert out["step"] == 8
    text = capsys.readouterr()
    assert "update 2: skipped" in text.err + text.out
    rows = [r for r in read_metrics(out["metrics"]) if r["kind"] == "train"]
    assert [r["skipped"] for r in rows] == [0, 1, 1, 1, 2, 3, 3, 3]  # skipped so far


# ----------------------------------------------------------------------------- clear errors
def test_a_run_dir_that_is_a_file_is_refused_before_the_data_is_prepared(
    prepared_corpus, tmp_path, capsys
):
    corpus, _ = prepared_corpus
    (tmp_path / "taken").write_text("not a directory\n")
    fresh = tmp_path / "fresh"  # would be prepared (tens of seconds on a real corpus)
    argv = ["--data", str(corpus), "--data-dir", str(fresh), *TINY]
    err = _fails([*argv, "--run-dir", str(tmp_path / "taken")], capsys, code=2)
    assert re.search(r"--run-dir .*taken is a file, not a directory", err), err
    assert not fresh.exists()
    err = _fails([*argv, "--runs-dir", str(tmp_path / "taken"), "--name", "a"], capsys, code=2)
    assert re.search(r"--runs-dir .*taken is a file, not a directory", err), err


def test_a_data_dir_of_other_settings_names_the_trainers_way_out(data, capsys):
    # The shared corpus is prepared with vocabulary 300; asking for 280 conflicts.
    argv = [*data, *TINY, "--vocab-size", "280"]
    err = _fails(argv, capsys, code=2)
    assert "vocab_size: 300 there, 280 asked" in err
    # The trainer has no --force: the message names what it does have, and the command that
    # rebuilds the folder.
    assert "choose another --data-dir" in err
    assert re.search(r"python -m examples\.lm\.prepare --data \S+ --out \S+ --vocab-size 280", err)
    assert "(--force)" not in err


def _damage(run_dir, step):
    """Truncates the largest file of checkpoint ``step`` (its array data) to half."""
    files = [
        os.path.join(p, f)
        for p, _, names in os.walk(run_dir / "checkpoints" / str(step))
        for f in names
    ]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_resume_from_a_damaged_latest_checkpoint_names_the_intact_steps(data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    flags = [*data, *TINY, "--optimizer", "adamw", "--run-dir", str(run_dir)]
    assert train.main([*flags, "--stop-at", "6"])["step"] == 6  # checkpoints 3 and 6
    _damage(run_dir, 6)
    resume = ["--resume", "--run-dir", str(run_dir), "--checkpoint-every", "3"]
    err = _fails(resume, capsys, code=2)
    assert re.search(r"checkpoint 6 .*is damaged", err), err
    assert "intact: 3; continue from one with --resume-step 3" in err
    err = _fails([*resume, "--resume-step", "4"], capsys, code=2)
    assert "--resume-step 4: no checkpoint 4" in err and "[3, 6]" in err
    out = train.main([*resume, "--resume-step", "3"])
    assert out["step"] == 8
    text = capsys.readouterr().out
    assert "resumed" in text and "at update 3" in text
    # Nothing is lost: the damaged step was moved aside, not deleted, and this session
    # saved its step number again (a save over it would have been refused or lost).
    assert _steps(run_dir) == [6, 8] and _all_finite(run_dir, 6)
    assert (run_dir / "superseded" / "6").is_dir()
    restored = rc.Checkpointer(run_dir / "checkpoints")
    try:
        assert restored.all_steps() == [6, 8]
    finally:
        restored.close()


def test_resume_step_needs_resume(capsys):
    err = _fails(["--resume-step", "3"], capsys, code=2)
    assert "--resume-step N picks the checkpoint of --resume: add --resume" in err
