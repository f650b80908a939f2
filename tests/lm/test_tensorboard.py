"""examples.lm.train --tensorboard: the event files hold metrics.jsonl's scalars, no more.

The event files are read back with TensorBoard's own reader (``EventAccumulator`` on the
folder, as ``tensorboard --logdir`` reads a run: several files in order, a resumed session's
purge applied), not with tensorboardX, which wrote them.
"""

import contextlib
import io
import shutil
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from examples.lm import train
from examples.lm.data import TokenLoader
from rudax.run import read_metrics
from tests.lm.conftest import TINY

# fused_adamw: its rows carry the optimizer's skip count too.
FLAGS = [*TINY, "--optimizer", "fused_adamw", "--tensorboard"]


def _events(folder):
    """{(tag, step): value} of every scalar TensorBoard shows for the folder."""
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep them all
    acc.Reload()
    got = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            assert (tag, event.step) not in got, f"{tag} twice at step {event.step}"
            got[tag, event.step] = event.value
    return got


def _rows(metrics):
    """{(tag, step): value} of metrics.jsonl, tags as the trainer documents them (train/<key>,
    val/<key> for val_<key>); each end row's values checked against the rows they repeat."""
    want, ends = {}, []
    for row in read_metrics(metrics):
        if row["kind"] == "end":
            ends.append(row)
            continue
        section = {"train": "train", "eval": "val"}[row["kind"]]
        for key, value in row.items():
            if key not in ("kind", "step") and value is not None:
                want[f"{section}/{key.removeprefix('val_')}", row["step"]] = value
    for end in ends:
        for key, value in end.items():
            if key not in ("kind", "step"):
                tag = "val/loss" if key == "val_loss" else f"train/{key}"
                assert want.get((tag, end["step"])) == value, (end, tag)
    return want


def assert_same_scalars(metrics, folder):
    want, got = _rows(metrics), _events(folder)
    assert sorted(got) == sorted(want)  # every scalar, at its step, and nothing else
    keys = sorted(want)
    # Event files store float32: each value is the row's rounded to float32, exactly.
    np.testing.assert_array_equal(
        np.array([got[k] for k in keys], np.float32),
        np.array([want[k] for k in keys], np.float32),
    )


@pytest.fixture(scope="module")
def halted(data, tmp_path_factory):
    """A run that halts at update 8, after logging update 7 (past its last checkpoint, 6):
    update 8's batch holds an id past the vocabulary, so its loss is not finite. Its folder."""
    run_dir = tmp_path_factory.mktemp("halted") / "run"
    real = TokenLoader.batch

    def batch(self, i, **kwargs):
        out = real(self, i, **kwargs)
        if i == 7:  # update s reads training batch s - 1; the validation batches stay clean
            out = out.copy()
            out[0, 3] = 65535
        return out

    err = io.StringIO()
    with pytest.MonkeyPatch.context() as m, contextlib.redirect_stderr(err):
        m.setattr(TokenLoader, "batch", batch)
        with pytest.raises(SystemExit) as e:
            train.main([*data, *FLAGS, "--run-dir", str(run_dir)])
    assert e.value.code == 1 and "update 8: the training loss is nan" in err.getvalue()
    return run_dir


def test_event_files_hold_the_metrics_rows_scalars(halted):
    assert_same_scalars(halted / "metrics.jsonl", halted / "tensorboard")
    got = _events(halted / "tensorboard")
    assert {tag for tag, _ in got} == {
        *("train/loss", "train/lr", "train/grad_norm", "train/tokens", "train/tokens_per_s"),
        *("train/skipped", "val/loss"),
    }
    # Closed on the halt: the rows after the last flush (the evaluation at 4) are there too.
    assert {step for _, step in got} == set(range(8))


def test_a_resumed_run_reads_as_its_metrics_rows(halted, tmp_path):
    run_dir = shutil.copytree(halted, tmp_path / "run")
    before = {f.name: f.read_bytes() for f in (run_dir / "tensorboard").iterdir()}
    # The resumed session drops metrics.jsonl's row 7 and logs it again; its new event
    # file hides the first one's update 7 from TensorBoard, so each step has one value.
    out = train.main(["--resume", "--run-dir", str(run_dir), "--tensorboard"])
    assert out["step"] == 8 and out["tensorboard"] == str(run_dir / "tensorboard")
    assert_same_scalars(out["metrics"], out["tensorboard"])
    after = {f.name: f.read_bytes() for f in (run_dir / "tensorboard").iterdir()}
    assert len(after) == 2 and after.items() >= before.items()  # appended; the first kept


def test_missing_tensorboardx_is_refused_before_any_work(prepared_corpus, tmp_path, capsys):
    corpus, _ = prepared_corpus
    fresh = tmp_path / "fresh"  # would be prepared, with a tokenizer trained, if not refused
    argv = ["--data", str(corpus), "--data-dir", str(fresh), *FLAGS]
    with pytest.MonkeyPatch.context() as m:
        m.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` raises
        with pytest.raises(SystemExit) as e:
            train.main([*argv, "--run-dir", str(tmp_path / "run")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --tensorboard writes its event files with tensorboardX" in err
    assert "pip install tensorboardX" in err and "Traceback" not in err
    assert not fresh.exists() and not (tmp_path / "run").exists()
