"""``python -m examples.dpo`` as users run it: it learns the pairs, resumes bit for bit after a
SIGKILL, runs over two processes as on one, and refuses bad data and flags by name, having
written nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from examples.dpo.train import main
from tests._launch import launch_program
from tests.post_train_programs._run import assert_same_adapter, kill_at, resume, rows

MODULE = "examples.dpo"


def flags(base_dir: Path, pair_files: tuple[Path, Path], run_dir: Path, *extra: str) -> list[str]:
    train, val = pair_files
    return [
        "--base", str(base_dir), "--data", str(train), "--val-data", str(val),
        "--run-dir", str(run_dir), "--seq-len", "64", "--steps", "8", "--batch-size", "4",
        "--grad-accum", "2", "--lr", "5e-3", "--eval-every", "4", "--checkpoint-every", "2",
        "--param-dtype", "float32", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def full_run(base_dir, pair_files, tmp_path_factory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("dpo") / "full"
    return run_dir, main(flags(base_dir, pair_files, run_dir))


def test_dpo_raises_the_held_out_margin(full_run):
    run_dir, result = full_run
    evals = rows(run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 4, 8]
    # LoRA's B starts at 0: the policy is the reference, every reward 0, the loss log 2
    assert evals[0]["val_margins"] == 0 and evals[0]["val_loss"] == pytest.approx(np.log(2))
    # 8 updates of a random model: the held-out pairs' margin rises (their accuracy, over 8
    # pairs, is noise here: the README's arithmetic task measures it on a model that learned)
    assert evals[-1]["val_margins"] > 0.01
    assert evals[-1]["val_loss"] < np.log(2) - 0.005
    train = rows(run_dir)
    assert [r["step"] for r in train] == list(range(1, 9))
    assert train[0]["loss"] == pytest.approx(np.log(2)) and train[0]["margins"] == 0
    assert result["step"] == 8 and result["interrupted"] is None
    for name in ("loss.png", "margin.png", "config.json"):
        assert (run_dir / name).is_file()
    adapter = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 8
    held = json.loads((run_dir / "adapter" / "rudax_base.json").read_text())
    assert held["quantize"] == "nf4"


def test_killed_mid_run_then_resumed_is_bit_for_bit(full_run, base_dir, pair_files, tmp_path):
    full_dir, _ = full_run
    run_dir = tmp_path / "killed"
    # killed after update 5 is logged: checkpoint 4 is the latest, update 5's row is dropped
    kill_at(MODULE, flags(base_dir, pair_files, run_dir), run_dir, 5, tmp_path)
    resume(MODULE, run_dir, tmp_path)
    assert rows(run_dir) == rows(full_dir)  # losses, rewards, norms: every bit
    assert rows(run_dir, "eval") == rows(full_dir, "eval")
    assert_same_adapter(run_dir, full_dir)


def test_two_processes_train_the_one_device_run(full_run, base_dir, pair_files, tmp_path):
    full_dir, _ = full_run
    run_dir = tmp_path / "two"
    # 8 rows over 8 devices, 4 updates: the one-device run's first 4 (4 rows x 2 microbatches:
    # the same 8 pairs an update, the gradient the mean over them either way). Data parallel:
    # each process holds the adapters whole (the GRPO test runs FSDP over processes).
    mesh = ["--mesh", "data=8", "--batch-size", "8", "--grad-accum", "1", "--steps", "4"]
    args = flags(base_dir, pair_files, run_dir, *mesh)  # the last of a repeated flag counts
    code, out = launch_program(MODULE, 2, args, timeout=300)
    assert code == 0, out[-3000:]
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert adapter and all(np.isfinite(v).all() for v in adapter.values())
    ours, theirs = rows(run_dir), rows(full_dir)[:4]
    for key in ("loss", "margins", "accuracies", "grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in ours], [r[key] for r in theirs], rtol=1e-4, atol=1e-6, err_msg=key
        )


BAD_LINES = [
    ({"prompt": "def f(x):\n", "chosen": "Return x."}, "no 'rejected'"),
    ({"prompt": "def f(x):\n", "chosen": "Return x.", "rejected": "Return x."}, "are the same"),
    ({"prompt": "def f(x):\n" * 40, "chosen": "Return x.", "rejected": "Return y."}, "positions"),
    # each answer fits the context with the prompt, both do not fit a row
    (
        {
            "prompt": "def f(x):\n",
            "chosen": "Return x times n plus 3. " * 4,
            "rejected": "Return n times x plus 2. " * 4,
        },
        "more than --seq-len 64",
    ),
]


@pytest.mark.parametrize("row,message", BAD_LINES, ids=["missing", "same", "context", "long"])
def test_bad_pairs_are_named_by_file_and_line_and_nothing_is_written(
    row, message, base_dir, pair_files, tmp_path, capsys
):
    bad = tmp_path / "bad.jsonl"
    good = pair_files[0].read_text().splitlines()
    bad.write_text("\n".join([*good[:2], json.dumps(row), *good[2:]]) + "\n")
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(flags(base_dir, (bad, pair_files[1]), run_dir))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{bad}:3: " in err and message in err, err
    assert not run_dir.exists()


def test_a_refused_resume_changes_nothing(full_run, base_dir, pair_files, tmp_path, capsys):
    run_dir = tmp_path / "run"
    main(flags(base_dir, pair_files, run_dir, "--stop-at", "2"))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    other = tmp_path / "other.jsonl"
    other.write_text("".join(pair_files[0].read_text().splitlines(True)[1:]))
    with pytest.raises(SystemExit) as exit_:
        main(["--resume", "--run-dir", str(run_dir), "--data", str(other)])
    assert exit_.value.code == 2
    assert "--resume: the run's data_identity is" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--resume", "--run-dir", str(run_dir), "--beta", "0.5"])
    assert "--beta 0.5 (the run has 0.1)" in capsys.readouterr().err
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before


def test_a_run_of_another_program_is_named_and_left_alone(base_dir, pair_files, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"program": "examples.grpo"}))
    for extra in ([], ["--resume"]):
        with pytest.raises(SystemExit):
            main(flags(base_dir, pair_files, run_dir, *extra))
        err = capsys.readouterr().err
        assert f"{run_dir} holds a examples.grpo run, not a examples.dpo run" in err
    assert [p.name for p in run_dir.iterdir()] == ["config.json"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--beta", "0"], "--beta must be positive, got 0.0"),
        (["--label-smoothing", "0.5"], "--label-smoothing must be in [0, 0.5), got 0.5"),
        (["--mesh", "data=3"], "--batch-size must be divisible by the mesh's 3 devices"),
        (["--warmup", "8"], "--warmup must be in [0, --steps), got --warmup 8, --steps 8"),
    ],
)
def test_bad_flags_are_named(extra, message, base_dir, pair_files, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(flags(base_dir, pair_files, tmp_path / "run", *extra))
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
