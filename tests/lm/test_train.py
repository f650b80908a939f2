"""examples.lm.train end to end on a tiny corpus: learning, exact resume, mesh, CLI errors.

Each ``main`` call compiles its own steps (a few seconds), so the runs are shared: one
straight MoE run (module fixture) serves the learning, report, resume and --init-from tests.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.run as rr
from examples.lm import timing, train
from rudax.run import read_metrics
from tests.lm.conftest import TINY

REPO = Path(__file__).resolve().parents[2]

# The straight run: MoE (2 of 4 experts), two microbatches per update, bf16 storage, fused
# AdamW (--init-from below trains with the default, Muon; the mesh test with AdamW).
MOE = ["--moe", "--num-experts", "4", "--top-k", "2", "--grad-accum", "2"]
STRAIGHT = [*MOE, "--optimizer", "fused_adamw"]


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    """A straight 8-update MoE run: (its summary, its flags)."""
    run_dir = tmp_path_factory.mktemp("runs") / "straight"
    flags = [*data, *TINY, *STRAIGHT]
    return train.main([*flags, "--run-dir", str(run_dir)]), flags


def _losses(path):
    """Every train/eval row's step, kind and losses: what must match between runs."""
    keep = ("kind", "step", "loss", "val_loss", "grad_norm", "aux_loss", "lr", "tokens")
    return [{k: r[k] for k in keep if k in r} for r in read_metrics(path) if r["kind"] != "end"]


def test_tiny_run_learns_compiles_once_and_writes_its_report(straight):
    summary, _ = straight
    rows = read_metrics(summary["metrics"])
    train_rows = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train_rows] == list(range(1, 9))
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert rows[-1]["kind"] == "end" and rows[-1]["step"] == 8
    # The loss falls: training and validation.
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.5
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5
    # Every row is token-weighted over 2 microbatches of 8 x 16 tokens; MoE logs its aux loss.
    assert all(r["tokens"] == 256 * r["step"] for r in train_rows)
    # E * sum_e f_e P_e with sum_e f_e = 1 and every P_e <= 1: in (0, E], 1 when balanced.
    assert all(0.0 < r["aux_loss"] <= 4.0 for r in train_rows)
    # Warmup of one update, then cosine from 1e-2 to 1e-3 over the other seven.
    lr = [r["lr"] for r in train_rows]
    expected = [0.0] + [1e-3 + 9e-3 * 0.5 * (1 + np.cos(np.pi * k / 7)) for k in range(7)]
    np.testing.assert_allclose(lr, expected, rtol=1e-6, atol=1e-9)
    # One compilation each over 16 microbatches, 8 updates and 3 evaluations.
    assert summary["compilations"] == {"micro": 1, "apply": 1, "evaluate": 1}
    png = Path(summary["plot"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert sorted(os.listdir(Path(summary["run_dir"]) / "checkpoints")) == ["6", "8"]  # keep=2


def test_interrupted_then_resumed_run_matches_the_straight_run_bit_for_bit(straight, tmp_path):
    summary, flags = straight
    run_dir = str(tmp_path / "interrupted")
    first = train.main([*flags, "--run-dir", run_dir, "--stop-at", "5"])
    assert first["step"] == 5
    # Checkpoints at 3 and 5; rows up to 5 are kept, the run continues from update 5.
    resumed = train.main(["--resume", "--run-dir", run_dir, "--log-every", "1"])
    assert resumed["step"] == 8
    got, want = _losses(resumed["metrics"]), _losses(summary["metrics"])
    assert len(got) == len(want) == 11
    assert got == want  # floats compared exactly


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_saves_the_update_and_resumes_bit_for_bit(
    straight, tmp_path, monkeypatch, capsys, sig
):
    """Ctrl-C (or a preemption's SIGTERM) during update 4, which --checkpoint-every 3 would
    not save: the update finishes, checkpoint 4 is written, the resume line is printed, the
    status is 128 + the signal, and the resumed run is the straight run's, bit for bit."""
    summary, flags = straight
    run_dir = tmp_path / "signalled"
    real_check = rr.check_loss

    def check_loss(loss, *, step, latest):  # runs inside each update, after its steps
        if step == 4:
            os.kill(os.getpid(), sig)  # a real signal, delivered to the handler in this thread
        real_check(loss, step=step, latest=latest)

    monkeypatch.setattr(rr, "check_loss", check_loss)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_:
        train.main([*flags, "--run-dir", str(run_dir)])
    assert exit_.value.code == 128 + sig
    monkeypatch.undo()
    out = capsys.readouterr().out
    name = signal.Signals(sig).name
    assert f"stopped at update 4 of 8 ({name}); continue with: " in out
    assert f"--resume --run-dir {run_dir}" in out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [
        "3",
        "4",
    ]
    # the old handlers are back (Python's own, or SIG_IGN where the shell ignores SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    resumed = train.main(["--resume", "--run-dir", str(run_dir)])
    assert resumed["step"] == 8 and resumed["interrupted"] is None
    got, want = _losses(resumed["metrics"]), _losses(summary["metrics"])
    assert len(got) == len(want) == 11
    assert got == want  # floats compared exactly


def test_resume_refuses_flags_that_contradict_the_run(straight, capsys):
    summary, _ = straight
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", "--run-dir", summary["run_dir"], "--lr", "0.5"])
    assert e.value.code == 2
    assert "--lr 0.5 (the run has 0.01)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the run has reached --steps
        train.main(["--resume", "--run-dir", summary["run_dir"]])
    assert "the run is at update 8 already" in capsys.readouterr().err


def test_init_from_reads_the_weights_and_never_writes_the_source(straight, tmp_path):
    summary, flags = straight
    source = Path(summary["run_dir"])

    def snapshot():
        return {
            str(p.relative_to(source)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in source.rglob("*")
        }

    before = snapshot()
    # Muon (the default) this time; the weights are the straight run's last ones.
    out = train.main(
        [
            *flags,
            "--steps",
            "2",
            "--optimizer",
            "muon",
            "--run-dir",
            str(tmp_path / "ft"),
            "--init-from",
            str(source),
        ]
    )
    assert snapshot() == before
    first_eval = next(r for r in read_metrics(out["metrics"]) if r["kind"] == "eval")
    last_eval = [r for r in read_metrics(summary["metrics"]) if r["kind"] == "eval"][-1]
    assert first_eval["step"] == 0 and first_eval["val_loss"] == last_eval["val_loss"]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_mesh_data2_fsdp4_matches_one_device(data, tmp_path, optimizer):
    # muon over fsdp: rudax.sharding.fsdp_muon, each matrix orthogonalized on one device
    fp32 = ["--param-dtype", "float32", "--compute-dtype", "float32", "--eval-every", "8"]
    flags = [*data, *TINY, *fp32, "--optimizer", optimizer, "--checkpoint-every", "8"]
    one = train.main([*flags, "--run-dir", str(tmp_path / "one")])
    mesh = train.main([*flags, "--mesh", "data=2,fsdp=4", "--run-dir", str(tmp_path / "mesh")])
    assert mesh["compilations"] == {"micro": 1, "apply": 1, "evaluate": 1}
    got, want = _losses(mesh["metrics"]), _losses(one["metrics"])
    # Muon's Newton-Schulz runs in bf16: the gradients' last fp32 bits (summed across the
    # mesh in another order) can move a bf16 rounding (2**-9 relative) in an update; 7e-5
    # relative in the gradient norm after 4 updates here
    rtol = 1e-5 if optimizer == "adamw" else 1e-3
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "val_loss", "grad_norm"):
            if key in w:
                np.testing.assert_allclose(g[key], w[key], rtol=rtol, err_msg=f"{key} {w}")


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    # the model it trains, a rudax.models Llama (the trainer's GPT is gone)
    assert "Train a small Llama" in " ".join(text.split()) and "GPT" not in text
    parser = train.cfg.build_parser()
    for action in parser._actions:
        for option in action.option_strings:
            assert option in text
        # A default of 0 is shown too (0 == False once hid --seed's).
        if action.default is not None and action.default is not False and action.dest != "help":
            assert f"(default: {action.default})" in " ".join(text.split())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "-5"], "argument --steps: must be >= 1, got -5"),
        (["--lr", "nan"], "argument --lr: must be >= 0, got nan"),
        (["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'"),
        (["--mesh", "gpu=2"], "expected axis=size pairs"),
        (["--mesh", "data=3"], "--batch-size must be divisible by the mesh's 3 devices"),
        (
            ["--mesh", "data=2,fsdp=2", "--optimizer", "adamw"],
            "--mesh data=2,fsdp=2 needs 4 devices, the run has",
        ),
        (
            ["--warmup", "10", "--steps", "10"],
            "--warmup must be < --steps, got --warmup 10, --steps 10",
        ),
        (
            ["--steps", "20", "--stop-at", "30"],
            "--stop-at must be <= --steps, got --stop-at 30, --steps 20",
        ),
        (
            ["--moe", "--top-k", "5"],
            "--top-k must be <= --num-experts, got --top-k 5, --num-experts",
        ),
        (["--resume"], "--resume needs the run to continue"),
        (["--trace", "t"], "--trace DIR writes the trace of --profile"),
    ],
)
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_run_directories_are_one_line_errors(tmp_path, capsys):
    cases = [
        (["--resume", "--run-dir", str(tmp_path / "none")], "holds no run (no config.json)"),
        (["--init-from", str(tmp_path)], "--init-from: no checkpoint in"),
    ]
    (tmp_path / "crashed").mkdir()
    (tmp_path / "crashed" / "config.json").write_text(
        json.dumps(vars(train.cfg.build_parser().parse_args([])))
    )
    cases.append((["--resume", "--run-dir", str(tmp_path / "crashed")], "no checkpoint directory"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            train.main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_module_entry_point_reports_a_bad_flag_without_a_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "examples.lm.train", "--grad-accum", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].endswith("error: argument --grad-accum: must be >= 1, got 0")
    assert "Traceback" not in proc.stderr


def test_profile_times_each_phase_and_writes_a_trace(tmp_path):
    calls = []

    def phase(name):
        def run(*args):
            calls.append(name)
            return jnp.ones(3)

        return run

    steps = SimpleNamespace(
        forward=phase("forward"),
        gradients=phase("gradients"),
        micro=lambda params, rngs, acc, rest, batch: (calls.append("micro") or acc, rngs, {}),
        apply=phase("apply"),
    )
    batches = [np.zeros((2, 5), np.int32)] * 3  # 3 microbatches of 2 x 4 tokens
    table = timing.profile(
        steps,
        (None, None, None),
        None,
        jnp.zeros(()),
        batches,
        flops_per_token=10.0,
        repeats=2,
        trace_dir=str(tmp_path / "trace"),
    )
    lines = table.splitlines()
    assert [line.split("  ")[0] for line in lines[2:7]] == [
        "forward",
        "backward (forward+backward - forward)",
        "optimizer (pop, clip, update)",
        "sum of the phases",
        "whole update, measured",
    ]
    assert "ms per update (3 microbatches)" in lines[0] and "tokens/s" in lines[7]
    # Warm-up + 2 timed runs per phase; the whole update runs 3 micro + 1 apply each time,
    # and 3 more times under the trace.
    assert calls.count("forward") == calls.count("gradients") == 3
    assert calls.count("micro") == 1 + 3 * 3 + 3 * 3 and calls.count("apply") == 3 + 3 + 3
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))
