"""examples/finetune/train.py, the QLoRA program, run as a user runs it: the loss falls, peft
loads the adapter onto transformers' model of the dequantized base and computes rudax's
logits, a resumed run in a fresh process is the uninterrupted one bit for bit, and a changed
base or bad data is refused by name."""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

import rudax.kernels as rk
import rudax.layers as rl
import rudax.run as rr
from examples.finetune import instructions
from examples.finetune.train import main
from tests.finetune.conftest import tiny_base, write_jsonl
from tests.lm.test_tensorboard import assert_same_scalars

ROOT = Path(__file__).resolve().parents[2]
FLAGS = [
    *("--seq-len", "64", "--batch-size", "4", "--steps", "8", "--warmup", "1"),
    *("--lr", "1e-2", "--eval-every", "4", "--checkpoint-every", "4", "--eval-batches", "2"),
]


def _flags(base_dir, data_files, run_dir, *extra):
    train, val = data_files
    return [
        "--base",
        str(base_dir),
        "--data",
        str(train),
        "--val-data",
        str(val),
        "--run-dir",
        str(run_dir),
        *FLAGS,
        *extra,
    ]


def _train_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"]


@pytest.fixture(scope="module")
def full_run(base_dir, data_files, tmp_path_factory):
    """8 uninterrupted updates of QLoRA with fp32 storage of the unquantized parts, and
    TensorBoard's events."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    flags = _flags(base_dir, data_files, run_dir, "--param-dtype", "float32", "--tensorboard")
    return run_dir, main(flags)


def test_validation_loss_falls_and_the_base_is_nf4(full_run):
    run_dir, result = full_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_loss"] for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 4, 8]
    assert evals[-1] < evals[0] - 0.1, evals
    assert (run_dir / "loss.png").stat().st_size > 0
    model = result["model"]
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, rl.LoRALinear) and isinstance(layer.base, rl.NF4Linear)
    assert len(result["adapted"]) == 14  # 7 projections x 2 blocks
    # The host's peak RSS (issue 29): JAX and the model at least; the process's peak only grows.
    peak_now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    assert 100e6 < result["peak_rss_bytes"] <= peak_now


def test_tensorboard_events_hold_the_metrics_scalars(full_run):
    run_dir, _ = full_run
    assert_same_scalars(run_dir / "metrics.jsonl", run_dir / "tensorboard")


def test_a_sample_is_printed_before_and_after_training(full_run):
    _, result = full_run
    samples = result["samples"]
    assert sorted(samples) == [0, 8]
    # The same greedy prompt, the base's random completion, then the tuned model's: 8 updates
    # on signatures and their docs move it to the data's words.
    assert samples[0] != samples[8]
    assert any(word in samples[8] for word in ("Return", "times", "plus")), samples


def test_peft_loads_the_adapter_and_computes_rudax_logits(full_run, base_dir):
    run_dir, result = full_run
    model = result["model"]  # eval mode: no dropout
    twin = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for i, layer in enumerate(twin.model.layers):
            ours = model.model.layers[i]
            pairs = [
                (layer.self_attn.q_proj, ours.self_attn.q_proj),
                (layer.self_attn.k_proj, ours.self_attn.k_proj),
                (layer.self_attn.v_proj, ours.self_attn.v_proj),
                (layer.self_attn.o_proj, ours.self_attn.o_proj),
                (layer.mlp.gate_proj, ours.mlp.gate_proj),
                (layer.mlp.up_proj, ours.mlp.up_proj),
                (layer.mlp.down_proj, ours.mlp.down_proj),
            ]
            for theirs, lora in pairs:
                w = np.asarray(rk.nf4_dequantize(lora.base.weight, jnp.float32))
                theirs.weight.copy_(torch.from_numpy(w.copy()))
    tuned = peft.PeftModel.from_pretrained(twin, str(run_dir / "adapter")).eval()
    ids = np.random.default_rng(0).integers(0, 300, size=(2, 32))
    with torch.no_grad():
        want = tuned(torch.tensor(ids)).logits.double().numpy()
    got = np.asarray(model(jnp.asarray(ids, jnp.int32)), np.float64)
    # The adapters moved: the adapted logits differ from the base's by far more than rounding.
    with torch.no_grad(), tuned.disable_adapter():
        plain = tuned(torch.tensor(ids)).logits.double().numpy()
    scale = np.max(np.abs(want))
    assert np.max(np.abs(want - plain)) > 1e-3 * scale
    assert np.max(np.abs(got - want)) < 2e-5 * scale


def test_generate_puts_the_adapter_on_the_base_as_it_was_trained(full_run, base_dir, capsys):
    """Issue 39: examples.generate --adapter put a QLoRA adapter on the unquantized base, a
    function the run never trained (a tuned SmolLM's logits 0.54 apart, relative). The run's
    adapter records how it held the base (NF4 from --param-dtype float32 here); generate loads
    the base so: the tuned model's logits bit for bit, and its greedy completion."""
    from tokenizers import Tokenizer

    from examples import generate as program
    from rudax.models import generate

    run_dir, result = full_run
    tuned, adapter = result["model"], run_dir / "adapter"  # eval mode: no dropout
    held = json.loads((adapter / "rudax_base.json").read_text())
    assert held == dict(
        quantize="nf4", param_dtype="float32", dtype="float32", absmax_rounding="cuda"
    )
    # Through the command line: the tuned model's greedy completion (a validation prompt whose
    # completion on the base as stored differs after a few tokens).
    prompt = "def total_109(beta, n=4):\n"
    tokenizer = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    tokens = generate(tuned, [tokenizer.encode(prompt).ids], 16, stop_tokens=[0])[0]
    capsys.readouterr()
    argv = ["--model", str(base_dir), "--adapter", str(adapter), "--max-new-tokens", "16"]
    completion = program.main([*argv, "--prompt", prompt])
    assert completion == tokenizer.decode(tokens, skip_special_tokens=True)
    assert "quantize nf4, param_dtype float32" in capsys.readouterr().err
    assert completion != program.main([*argv, "--prompt", prompt, "--quantize", "none"])
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 300, size=(2, 32)), jnp.int32)
    want = np.asarray(tuned(ids))
    model, how = program.load(base_dir, adapter, dict.fromkeys(program.BASE_FLAGS))
    assert isinstance(model.model.layers[0].mlp.down_proj.base, rl.NF4Linear)
    np.testing.assert_array_equal(np.asarray(model(ids)), want)
    assert how.endswith(f"(as the adapter was trained: {adapter / 'rudax_base.json'})")
    # The old reading, the base as stored, is another function: asked for, it is still there.
    plain, _ = program.load(base_dir, adapter, {"quantize": "none", "param_dtype": "float32"})
    assert np.max(np.abs(np.asarray(plain(ids)) - want)) > 1e-3 * np.max(np.abs(want))


def test_a_signal_then_resume_in_a_fresh_process_is_bit_for_bit(
    full_run, base_dir, data_files, tmp_path, monkeypatch, capsys
):
    full_dir, _ = full_run
    run_dir = tmp_path / "run"
    real_check = rr.check_loss

    def check_loss(loss, *, step, latest):  # inside each update, after its steps
        if step == 3:  # --checkpoint-every 4 would not save it: the interruption does
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption's notice
        real_check(loss, step=step, latest=latest)

    monkeypatch.setattr(rr, "check_loss", check_loss)
    # The first session checkpoints each block's activations (--remat, a session flag): the
    # same gradients, so the same run, as the rows compared below show.
    flags = _flags(base_dir, data_files, run_dir, "--param-dtype", "float32")
    with pytest.raises(SystemExit) as exit_:
        main([*flags, "--remat", "full"])
    monkeypatch.undo()
    assert exit_.value.code == 128 + signal.SIGTERM
    assert (
        f"stopped at update 3 of 8 (SIGTERM); continue with: python -m examples.finetune "
        f"--resume --run-dir {run_dir}" in capsys.readouterr().out
    )
    assert [s for s, *_ in _train_rows(run_dir)] == [1, 2, 3]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", "examples.finetune", "--resume", "--run-dir", str(run_dir)],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    assert _train_rows(run_dir) == _train_rows(full_dir)  # losses and norms, every bit
    ours = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    theirs = load_file(full_dir / "adapter" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_scanned_layers_train_the_same_qlora_run(base_dir, data_files, tmp_path, capsys):
    # The NF4 base and the adapters under --scan-layers (no dropout: see the bad flags).
    runs = {}
    for name, extra in (("plain", ()), ("scanned", ("--scan-layers", "--remat", "full"))):
        run_dir = tmp_path / name
        main(_flags(base_dir, data_files, run_dir, "--dropout", "0", "--stop-at", "2", *extra))
        runs[name] = _train_rows(run_dir)
    (step, loss, _), later = runs["scanned"][0], runs["scanned"][1]
    assert (step, loss) == runs["plain"][0][:2]  # the first loss: the forward is bitwise
    # Then the gradients' rounding (tests/lm/test_scan_layers.py), one update's worth.
    assert later[1] == pytest.approx(runs["plain"][1][1], rel=1e-5)
    # The checkpoints hold the layers' adapters stacked: --scan-layers is the run's flag. A
    # plain run resumed with it is refused; the scanned run resumes scanned (the checkpoint's
    # layout) and writes peft's per-layer adapter file.
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(_flags(base_dir, data_files, tmp_path / "plain", "--dropout", "0", "--resume",
                    "--scan-layers"))  # fmt: skip
    assert "--scan-layers True (the run has False)" in capsys.readouterr().err
    result = main(_flags(base_dir, data_files, tmp_path / "scanned", "--dropout", "0", "--resume"))
    # The final line reports the host's peak RSS, the returned summary its bytes (issue 29).
    assert f"host peak RSS {result['peak_rss_bytes'] / 1e9:.2f} GB\n" in capsys.readouterr().out
    adapter = load_file(tmp_path / "scanned" / "adapter" / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    assert adapter[key].shape == (8, 64) and len(_train_rows(tmp_path / "scanned")) == 8


def _readme_resume_commands() -> list[list[str]]:
    """The README's stop-and-resume line, each command's flags."""
    line = next(
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if "--stop-at" in line and "--resume" in line
    )
    prog = ["python", "-m", "examples.finetune"]
    commands = [shlex.split(c) for c in line.split("&&")]
    assert all(c[:3] == prog for c in commands), line
    return [c[3:] for c in commands]


@pytest.mark.slow  # tests/test_readme_commands.py runs these commands (with fewer updates)
def test_readme_stop_and_resume_with_the_default_base(data_files, tmp_path_factory, monkeypatch):
    # As the README runs it: no --base (hf/base) and no --data (data/instructions), both
    # relative to the working directory, and the program's default flags.
    cwd = tmp_path_factory.mktemp("cwd")
    tiny_base(cwd / "hf" / "base", seq_len=256)  # the default --seq-len 256
    for path, name in zip(data_files, (instructions.TRAIN, instructions.VAL), strict=True):
        (cwd / "data" / "instructions").mkdir(parents=True, exist_ok=True)
        shutil.copy(path, cwd / "data" / "instructions" / name)
    monkeypatch.chdir(cwd)
    first, then = _readme_resume_commands()
    assert main(first)["step"] == 20
    result = main(then)
    assert result["step"] == 40
    name = first[first.index("--name") + 1]  # the README's run name
    assert [s for s, *_ in _train_rows(cwd / "runs" / name)] == list(range(1, 41))


def test_readme_lora_and_merged_command(data_files, tmp_path_factory, monkeypatch):
    # The "Fine-tune a Hugging Face model" section's command, as written: LoRA on the
    # unquantized hf/base, the default data, 30 updates, the merged model out.
    text = (ROOT / "README.md").read_text()
    start = text.index("python -m examples.finetune --base hf/base --quantize none")
    line = text[start : text.index("\n", text.index("--merged", start))]
    command = shlex.split(line.replace("\\\n", " "), comments=True)
    assert command[:3] == ["python", "-m", "examples.finetune"], command
    cwd = tmp_path_factory.mktemp("cwd")
    tiny_base(cwd / "hf" / "base", seq_len=256)
    for path, name in zip(data_files, (instructions.TRAIN, instructions.VAL), strict=True):
        (cwd / "data" / "instructions").mkdir(parents=True, exist_ok=True)
        shutil.copy(path, cwd / "data" / "instructions" / name)
    monkeypatch.chdir(cwd)
    result = main(command[3:])
    assert result["step"] == 30 and (cwd / "runs" / "base-lora" / "adapter").is_dir()
    merged = transformers.AutoModelForCausalLM.from_pretrained(cwd / "hf" / "base-tuned")
    assert merged.dtype == torch.bfloat16  # --param-dtype's default: how the base was held
    ids = torch.tensor(np.random.default_rng(0).integers(0, 300, size=(1, 16)))
    with torch.no_grad():
        want = merged.float()(ids).logits.double().numpy()
    got = np.asarray(result["model"](jnp.asarray(ids.numpy(), jnp.int32)), np.float64)
    assert np.max(np.abs(got - want)) < 2e-2 * np.max(np.abs(got))


def _snapshot(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def test_a_failed_resume_changes_nothing_and_says_what_to_do(
    base_dir, data_files, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    flags = _flags(base_dir, data_files, run_dir, "--steps", "4", "--checkpoint-every", "1")
    main([*flags, "--stop-at", "2"])
    config = run_dir / "config.json"
    started = config.read_text()
    config.write_text(started.replace('"lr": 0.01', '"lr": 0.02'))  # edited by hand
    before = _snapshot(run_dir)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--resume", "--run-dir", str(run_dir)])
    assert _snapshot(run_dir) == before
    err = capsys.readouterr().err
    assert "config['lr']: saved 0.01, template 0.02" in err
    assert "put back the config.json the run was started with" in err
    config.write_text(started)
    # A damaged checkpoint.
    latest = run_dir / "checkpoints" / "2"
    files = [p for p in latest.rglob("*") if p.is_file()]
    path = max(files, key=lambda p: p.stat().st_size)  # the array data
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    before = _snapshot(run_dir)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--resume", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert _snapshot(run_dir) == before  # config.json, metrics.jsonl, checkpoints: untouched
    assert f"checkpoint 2 in {run_dir / 'checkpoints'} is damaged" in err
    assert "to resume from update 1" in err
    # The advice works.
    shutil.move(latest, tmp_path / "aside")
    assert main(["--resume", "--run-dir", str(run_dir)])["step"] == 4


def test_resume_refuses_a_changed_base(base_dir, data_files, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(base_dir, base)
    run_dir = tmp_path / "run"
    main(_flags(base, data_files, run_dir, "--steps", "2", "--warmup", "1", "--stop-at", "1"))
    capsys.readouterr()
    # The config is part of the base's identity: the same tensors computing another function.
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-2}))
    with pytest.raises(SystemExit):
        main(["--resume", "--run-dir", str(run_dir)])
    assert "--resume: the run was tuned on a base that hashes to" in capsys.readouterr().err
    (base / "config.json").write_text(json.dumps(config))
    tensors = load_file(base / "model.safetensors")
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key] = tensors[key] * np.float32(1.01)
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SystemExit):
        main(["--resume", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert "--resume: the run was tuned on a base that hashes to" in err
    assert "a different model" in err


def test_a_trainer_run_of_the_same_name_is_named_and_left_as_it_was(
    base_dir, data_files, tmp_path, capsys
):
    # Issue 40: the README named a trainer run and a fine-tuning run both `--name a`, both
    # under runs/; the fine-tuner's hint led to "a base that hashes to None (None)".
    run_dir = tmp_path / "a"
    run_dir.mkdir()
    trainer_config = '{"steps": 200, "seq_len": 128, "model": "gpt"}\n'
    (run_dir / "config.json").write_text(trainer_config)
    flags = _flags(base_dir, data_files, run_dir, "--steps", "1")
    for extra in ([], ["--resume"]):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main([*flags, *extra])
        err = capsys.readouterr().err
        assert f"{run_dir} holds a run that is not a fine-tuning run" in err, extra
        assert "give this run another --name or --run-dir" in err
    assert (run_dir / "config.json").read_text() == trainer_config
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json"]


def test_a_run_that_recorded_the_models_digest_resumes_and_still_refuses_a_changed_base(
    base_dir, data_files, tmp_path, capsys, monkeypatch
):
    # Runs started before the files' digest recorded the model's (examples/finetune/base.py):
    # simulated by that session's choice, their config.json has no "base_digest".
    from examples.finetune import base as base_

    base = tmp_path / "base"
    shutil.copytree(base_dir, base)
    run_dir, flags = tmp_path / "run", ("--steps", "2", "--warmup", "1")
    with monkeypatch.context() as m:
        m.setattr(base_, "legacy_run", lambda run_dir, resume: True)
        main(_flags(base, data_files, run_dir, *flags, "--stop-at", "1"))
    saved = json.loads((run_dir / "config.json").read_text())
    assert "base_digest" not in saved and len(saved["base_sha256"]) == 64
    want = main(_flags(base_dir, data_files, tmp_path / "straight", *flags))
    got = main(["--resume", "--run-dir", str(run_dir)])
    assert got["step"] == 2 and got["loss"] == want["loss"]
    assert json.loads((run_dir / "config.json").read_text())["base_sha256"] == saved["base_sha256"]
    # the legacy digest is still checked: a changed tensor is refused
    tensors = load_file(base / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight"
    tensors[key] = tensors[key] * np.float32(1.01)
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--resume", "--run-dir", str(run_dir), "--steps", "2"])
    assert "--resume: the run was tuned on a base that hashes to" in capsys.readouterr().err


def test_resume_before_any_checkpoint_starts_over_and_a_moved_base_is_found(
    base_dir, data_files, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    flags = _flags(base_dir, data_files, run_dir, "--steps", "2", "--warmup", "1")
    main([*flags, "--stop-at", "1"])
    shutil.rmtree(run_dir / "checkpoints")  # interrupted before its first checkpoint
    moved = tmp_path / "moved"
    shutil.copytree(base_dir, moved)  # the same base, elsewhere: its contents are checked
    capsys.readouterr()
    result = main(["--resume", "--run-dir", str(run_dir), "--base", str(moved)])
    assert "has no checkpoint yet: starting from update 0" in capsys.readouterr().out
    assert result["step"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("eval", 0),
        ("train", 1),
        ("train", 2),
        ("eval", 2),
    ]


def test_absmax_rounding_is_a_flag_of_the_run(base_dir, data_files, tmp_path, capsys):
    """Issue 39: the run quantized with the CUDA kernel's 8-bit absmax codes and gave no way to
    choose the CPU kernel's (0.23% of a real model's codes differ). --absmax-rounding cpu is
    saved with the run, a resume keeps it (and refuses another), and the model it tunes holds
    from_pretrained's codes of that rounding."""
    import rudax.models as rm

    run_dir = tmp_path / "run"
    flags = _flags(base_dir, data_files, run_dir, "--steps", "2", "--checkpoint-every", "1")
    main([*flags, "--absmax-rounding", "cpu", "--stop-at", "1"])
    assert json.loads((run_dir / "config.json").read_text())["absmax_rounding"] == "cpu"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--resume", "--run-dir", str(run_dir), "--absmax-rounding", "cuda"])
    assert "--absmax-rounding 'cuda' (the run has 'cpu')" in capsys.readouterr().err
    result = main(["--resume", "--run-dir", str(run_dir)])
    assert result["step"] == 2
    codes = lambda model: {
        jax.tree_util.keystr(path).replace("['base']", ""): np.asarray(leaf)  # under LoRA
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, rl.Quantized))
        if "absmax_codes" in jax.tree_util.keystr(path)
    }
    got = codes(result["model"])
    kw = dict(quantize="nf4", param_dtype=jnp.bfloat16)  # the run's default --param-dtype
    cpu = codes(rm.from_pretrained(base_dir, absmax_rounding="cpu", **kw))
    cuda = codes(rm.from_pretrained(base_dir, absmax_rounding="cuda", **kw))
    assert got.keys() == cpu.keys() and len(got) == 14
    assert all(np.array_equal(got[k], cpu[k]) for k in got)
    assert any(not np.array_equal(got[k], cuda[k]) for k in got)  # 2 of the 1536 codes


def test_help_names_every_choice_of_absmax_rounding(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--absmax-rounding {cuda,cpu}" in text and "(default: cuda)" in text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--dropout", "1.5"), "--dropout must be in [0, 1), got 1.5"),
        (("--alpha", "0"), "--alpha must be positive, got 0.0"),
        (("--lr", "-1"), "--lr must be positive, got -1.0"),
        (("--warmup", "-1"), "--warmup must be in [0, --steps), got --warmup -1, --steps"),
        (("--min-lr-ratio", "2"), "--min-lr-ratio must be in [0, 1], got 2.0"),
        (("--scan-layers",), "--scan-layers needs --dropout 0, got --dropout 0.05"),
        # issue 29: a raw FileNotFoundError traceback, after hf/base had been exported
        (("--data", "/nonexistent.jsonl"), "--data /nonexistent.jsonl: no such file"),
        (("--val-data", "/nonexistent.jsonl"), "--val-data /nonexistent.jsonl: no such file"),
    ],
)
def test_bad_flags_are_named(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit):
        main(["--run-dir", str(tmp_path / "r"), *flags])
    assert message in capsys.readouterr().err


def test_a_batch_the_mesh_cannot_split_is_named(base_dir, data_files, tmp_path, capsys):
    """Issue 39: --mesh data=3 --batch-size 4 (on 3 devices) ended in jax's IndivisibleError
    traceback after the base was loaded; refused first, as examples.lm.train refuses it. The
    rows are split over every axis, fsdp's too."""
    flags = _flags(base_dir, data_files, tmp_path / "run", "--mesh", "data=2,fsdp=4")
    with pytest.raises(SystemExit):
        main([*flags, "--batch-size", "6"])
    assert (
        "error: --batch-size must be divisible by the mesh's 8 devices (each holds an equal "
        "slice), got --batch-size 6, --mesh data=2,fsdp=4" in capsys.readouterr().err
    )
    assert not (tmp_path / "run").exists()


def test_bad_data_is_refused_by_line_and_field(base_dir, data_files, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "c"}])
    with pytest.raises(SystemExit):
        main(
            [
                "--base",
                str(base_dir),
                "--data",
                str(bad),
                "--run-dir",
                str(tmp_path / "r"),
                "--seq-len",
                "64",
            ]
        )
    assert f"{bad}:2" in capsys.readouterr().err
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x " * 200, "completion": "y"}])
    with pytest.raises(SystemExit):
        main(
            [
                "--base",
                str(base_dir),
                "--data",
                str(long),
                "--run-dir",
                str(tmp_path / "r2"),
                "--seq-len",
                "64",
            ]
        )
    assert f"{long}:1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(
            [
                "--base",
                str(base_dir),
                "--data",
                str(data_files[0]),
                "--seq-len",
                "65",
                "--run-dir",
                str(tmp_path / "r3"),
            ]
        )
    assert "--seq-len 65: the base has 64 positions" in capsys.readouterr().err


def test_qlora_trains_chats_in_the_bases_own_chat_template(base_dir, tmp_path):
    """A base whose tokenizer folder has a chat template: the program trains `messages`
    records rendered by it (the data reader's ids are the template's), and learns them."""
    import shutil

    from examples.finetune.data import FinetuneData
    from examples.lm.tokenizer import EOT
    from rudax.models import load_tokenizer
    from tests.finetune.conftest import examples as pairs

    base = tmp_path / "chat-base"
    shutil.copytree(base_dir, base)
    template = (
        "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n"
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}### assistant:\n{% endif %}"
    )
    (base / "chat_template.jinja").write_text(template)
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT}))
    rows = [
        {"messages": [{"role": "user", "content": r["prompt"]},
                      {"role": "assistant", "content": r["completion"]}]}
        for r in pairs(112, seed=1)
    ]  # fmt: skip
    train = tmp_path / "train.jsonl"
    val = tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:96]))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[96:]))
    tok = load_tokenizer(base)
    data = FinetuneData(val, tok, seq_len=64, batch_size=1, seed=0, pack=False, shuffle=False)
    first = data.batch(0)["tokens"][0]
    text = tok.chat.render(rows[96]["messages"])
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert first[: len(ids)].tolist() == ids  # the template's text, its eos included
    run_dir = tmp_path / "run"
    main(_flags(base, (train, val), run_dir, "--param-dtype", "float32"))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_loss"] for r in metrics if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 0.1, evals


def test_plain_text_lora_learns_and_the_merged_model_loads_in_transformers(base_dir, tmp_path):
    """A .txt corpus, LoRA on a bf16 base (no quantization), --merged: the validation loss
    falls, and the merged folder is a bf16 checkpoint transformers and AutoTokenizer load,
    computing what the tuned model computes up to one bf16 rounding of each merged weight."""
    from tests.finetune.conftest import examples

    rows = examples(120, seed=2)
    text = lambda rs: "\n".join(r["prompt"] + r["completion"] for r in rs)
    (tmp_path / "train.txt").write_text(text(rows[:100]))
    (tmp_path / "val.txt").write_text(text(rows[100:]))
    merged = tmp_path / "merged"
    flags = _flags(
        base_dir, (tmp_path / "train.txt", tmp_path / "val.txt"), tmp_path / "run",
        "--quantize", "none", "--param-dtype", "bfloat16", "--merged", str(merged),
        "--sample-tokens", "0",
    )  # fmt: skip
    result = main(flags)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_loss"] for r in rows if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 0.1, evals
    assert result["samples"] == {}
    # Dropout drew a fresh mask in every adapted layer for each of the 8 microbatches; the
    # evaluations, run without dropout, drew none (examples.lm.lora's check, now here).
    counts = {
        int(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(result["model"], nnx.RngCount))
    }
    assert counts == {8}
    twin = transformers.AutoModelForCausalLM.from_pretrained(merged)
    assert twin.dtype == torch.bfloat16
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged)
    assert tokenizer.encode("def f") == transformers.AutoTokenizer.from_pretrained(base_dir).encode(
        "def f"
    )
    ids = np.random.default_rng(0).integers(0, 300, size=(2, 32))
    with torch.no_grad():
        want = twin.float()(torch.tensor(ids)).logits.double().numpy()
    got = np.asarray(result["model"](jnp.asarray(ids, jnp.int32)), np.float64)
    scale = np.max(np.abs(got))
    assert np.max(np.abs(got - want)) < 2e-2 * scale


def test_merged_is_refused_before_anything_is_written(base_dir, data_files, tmp_path, capsys):
    run_dir = tmp_path / "run"
    bad = [
        (["--merged", str(base_dir)], "is the base itself"),
        (["--merged", str(run_dir / "adapter")], "is the adapter's directory"),
        (["--merged", str(tmp_path / "m"), "--targets", "q_proj"], "needs every projection"),
    ]
    for extra, message in bad:
        with pytest.raises(SystemExit):
            main(_flags(base_dir, data_files, run_dir, *extra))
        assert message in capsys.readouterr().err
        assert not run_dir.exists(), message


def test_qlora_of_a_transformers_saved_chat_model_through_the_program(tmp_path):
    """The issue's acceptance path: a tiny random Llama saved by transformers (with
    unk_token_id and a tokenizer with a chat template), QLoRA through the program on chat
    records rendered in that template, the adapter loaded by peft on transformers' model of
    the dequantized base computing rudax's logits."""
    import tokenizers

    from tests.models.test_hf_files import CHAT_TEMPLATE, V, _hf

    base = tmp_path / "base"
    _hf(tie=False).save_pretrained(base)
    specials = ["<|user|>", "<|assistant|>", "<|end|>"]
    words = ["<unk>", "<s>", "</s>", "<pad>", *specials]
    words += [f"w{i}" for i in range(V - len(words))]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=specials,
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(base)
    rng = np.random.default_rng(0)
    chats = []
    for _ in range(60):  # "w{a} w{b}" -> "w{a+b}": something to learn
        a, b = (int(x) for x in rng.integers(7, 40, 2))
        chats.append(
            {
                "messages": [
                    {"role": "user", "content": f"w{a} w{b}"},
                    {"role": "assistant", "content": f"w{a + b}"},
                ]
            }
        )
    write_jsonl(tmp_path / "train.jsonl", chats[:50])
    write_jsonl(tmp_path / "val.jsonl", chats[50:])
    run_dir = tmp_path / "run"
    result = main(
        _flags(base, (tmp_path / "train.jsonl", tmp_path / "val.jsonl"), run_dir,
               "--seq-len", "32", "--param-dtype", "float32")
    )  # fmt: skip
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_loss"] for r in rows if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 0.1, evals
    # The sample's prompt is the template's rendering up to its generation prompt.
    assert result["samples"][0] != result["samples"][8]
    model = result["model"]
    twin = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for i, layer in enumerate(twin.model.layers):
            ours = model.model.layers[i]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                w = rk.nf4_dequantize(getattr(ours.self_attn, name).base.weight, jnp.float32)
                getattr(layer.self_attn, name).weight.copy_(torch.from_numpy(np.array(w)))
            for name in ("gate_proj", "up_proj", "down_proj"):
                w = rk.nf4_dequantize(getattr(ours.mlp, name).base.weight, jnp.float32)
                getattr(layer.mlp, name).weight.copy_(torch.from_numpy(np.array(w)))
    tuned = peft.PeftModel.from_pretrained(twin, str(run_dir / "adapter")).eval()
    text = fast.apply_chat_template(chats[55]["messages"], tokenize=False)
    ids = np.asarray([fast.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        want = tuned(torch.tensor(ids)).logits.double().numpy()
    got = np.asarray(model(jnp.asarray(ids, jnp.int32)), np.float64)
    assert np.max(np.abs(got - want)) < 2e-5 * np.max(np.abs(want))
