"""``python -m examples.grpo`` as users run it: it samples, rewards and trains, resumes bit for
bit after a SIGKILL, runs over two processes as on one, and stops on what would make its
updates wrong: a failing reward, a sampler that disagrees with the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from examples.grpo.train import main
from tests._launch import launch_program
from tests.post_train_programs._run import assert_same_adapter, kill_at, resume, rows

MODULE = "examples.grpo"
SHORT = "tests.post_train_programs.rewards:short"


def flags(base_dir: Path, files: tuple[Path, Path], run_dir: Path, *extra: str) -> list[str]:
    train, val = files
    return [
        "--base", str(base_dir), "--data", str(train), "--val-data", str(val),
        "--run-dir", str(run_dir), "--steps", "4", "--num-iterations", "2",
        "--batch-size", "2", "--grad-accum", "2", "--num-samples", "4",
        "--max-new-tokens", "8", "--eval-every", "2", "--checkpoint-every", "2",
        "--lr", "5e-3", "--param-dtype", "float32", "--reward", "exact_match",
        "--reward", SHORT, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def full_run(base_dir, prompt_files, tmp_path_factory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("grpo") / "full"
    return run_dir, main(flags(base_dir, prompt_files, run_dir))


def test_grpo_samples_rewards_and_trains(full_run):
    run_dir, result = full_run
    train = rows(run_dir)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        # the sampler's log-probs are the trainer's forward's, within fp32 rounding
        assert r["logprob_error"] < 1e-4
        assert r["rewards/exact_match_reward"] == 0  # a random model matches nothing
        assert 0 < r["rewards/short"] < 1 and r["reward_std"] > 0
        assert np.isfinite([r["loss"], r["grad_norm"]]).all() and r["grad_norm"] > 0
    # two updates per generation: the same rewards, the second with a ratio away from 1
    assert train[0]["reward"] == train[1]["reward"] != train[2]["reward"]
    assert train[0]["clip_ratio"] == 0
    assert [r["step"] for r in rows(run_dir, "eval")] == [0, 2, 4]
    assert result["step"] == 4 and result["interrupted"] is None
    for name in ("reward.png", "loss.png", "adapter/adapter_model.safetensors"):
        assert (run_dir / name).is_file()


def test_killed_mid_run_then_resumed_is_bit_for_bit(full_run, base_dir, prompt_files, tmp_path):
    full_dir, _ = full_run
    run_dir = tmp_path / "killed"
    # killed after update 3 (generation 1's first): checkpoint 2 is the latest
    kill_at(MODULE, flags(base_dir, prompt_files, run_dir), run_dir, 3, tmp_path)
    resume(MODULE, run_dir, tmp_path)
    assert rows(run_dir) == rows(full_dir)  # rewards, losses, norms: every bit
    assert rows(run_dir, "eval") == rows(full_dir, "eval")
    assert_same_adapter(run_dir, full_dir)


def test_groups_of_equal_rewards_train_nothing_and_give_no_nan(base_dir, prompt_files, tmp_path):
    run_dir = tmp_path / "run"
    args = flags(base_dir, prompt_files, run_dir)
    main(args[: args.index("--reward")])  # exact_match alone: every reward 0
    for r in rows(run_dir):
        assert r["reward"] == 0 and r["reward_std"] == 0
        assert r["loss"] == 0 and r["grad_norm"] == 0  # zero advantages, no NaN
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    for key, value in adapter.items():
        if "lora_B" in key:
            assert not value.any(), key  # still LoRA's zero B: nothing was learned


@pytest.mark.long(1)  # minutes: started first (tests/conftest.py)
def test_two_processes_train_the_one_device_run(base_dir, prompt_files, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    # 8 prompts a generation: 4 rows x 2 microbatches on one device, 8 rows over 8 devices
    main(flags(base_dir, prompt_files, one, "--batch-size", "4", "--steps", "2"))
    mesh = ["--mesh", "data=2,fsdp=4", "--batch-size", "8", "--grad-accum", "1", "--steps", "2"]
    code, out = launch_program(MODULE, 2, flags(base_dir, prompt_files, two, *mesh), timeout=300)
    assert code == 0, out[-3000:]
    ours, theirs = rows(two), rows(one)
    for key in ("reward", "completion_length", "loss", "grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in ours], [r[key] for r in theirs], rtol=1e-4, atol=1e-6, err_msg=key
        )
    for ours_eval, theirs_eval in zip(rows(two, "eval"), rows(one, "eval"), strict=True):
        assert ours_eval.keys() == theirs_eval.keys()
        for key in ours_eval.keys() - {"kind", "step"}:
            np.testing.assert_allclose(ours_eval[key], theirs_eval[key], rtol=1e-4, err_msg=key)


@pytest.mark.parametrize(
    "reward,message",
    [
        (
            "raises",
            "reward function 'raises' raised ValueError: invalid literal for int() with "
            "base 10: 'x' on completion",
        ),
        ("nan", "reward function 'nan' returned nan"),
    ],
)
def test_a_failing_reward_stops_the_run_naming_it(
    reward, message, base_dir, prompt_files, tmp_path, capsys
):
    args = flags(base_dir, prompt_files, tmp_path / "run", "--reward", f"{SHORT[:-6]}:{reward}")
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    # the held-out evaluation before the first update is the first to call it
    assert "python -m examples.grpo: error: held-out evaluation at update 0: " in err, err
    assert message in err, err


def test_a_sampler_the_trainer_disagrees_with_stops_the_run(
    base_dir, prompt_files, tmp_path, capsys
):
    # The cached-KV sampler and the packed forward round differently (about 5e-7 here): no
    # tolerance at all stops the first generation, naming the token.
    args = flags(base_dir, prompt_files, tmp_path / "run", "--logprob-tolerance", "0")
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "generation 0: the sampler gives completion" in err
    assert "logprob_tolerance=0.0" in err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--steps", "5"], "--steps 5 must be a multiple of --num-iterations 2"),
        (["--stop-at", "3"], "--stop-at 3 must be a multiple of --num-iterations 2"),
        (["--num-samples", "1"], "--num-samples must be >= 2"),
        (["--reward-weights", "1"], "--reward-weights has 1 weights for 2 --reward functions"),
        (["--reward", "no_such_module:f"], "--reward no_such_module:f: reward"),
        (["--temperature", "0"], "--temperature must be positive"),
    ],
)
def test_bad_flags_are_named_and_nothing_is_written(
    extra, message, base_dir, prompt_files, tmp_path, capsys
):
    with pytest.raises(SystemExit) as exit_:
        main(flags(base_dir, prompt_files, tmp_path / "run", *extra))
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_prompts_are_checked_by_file_and_line(base_dir, prompt_files, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    cases = [
        ({"question": "1+1="}, "no 'prompt'"),
        ({"prompt": 3, "answer": "3"}, "'prompt' must be text or chat messages, got int"),
        ({"prompt": "def f(x):\n" * 40, "answer": "x"}, "--max-new-tokens 8 take more than"),
    ]
    for row, message in cases:
        good = prompt_files[0].read_text().splitlines()
        bad.write_text("\n".join([good[0], json.dumps(row), *good[1:]]) + "\n")
        with pytest.raises(SystemExit) as exit_:
            main(flags(base_dir, (bad, prompt_files[1]), tmp_path / "run"))
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"{bad}:2: " in err and message in err, err
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    with pytest.raises(SystemExit):
        main(flags(base_dir, (no_answer, prompt_files[1]), tmp_path / "run"))
    assert "--reward exact_match reads each row's 'answer'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_chat_prompts_are_sampled_after_the_bases_own_template(chat_base, prompt_files, tmp_path):
    from examples.grpo.data import PromptData
    from rudax.models import load_tokenizer

    records = [json.loads(line) for line in prompt_files[0].read_text().splitlines()]
    chats = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
             for r in records]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chats))
    tok = load_tokenizer(chat_base)
    prompts = PromptData(data, tok, positions=64, max_new_tokens=8)
    text = tok.chat.render(chats[0]["prompt"], add_generation_prompt=True)
    assert text.endswith("### assistant:\n")
    assert prompts.prompts[0] == tok.tokenizer.encode(text, add_special_tokens=False).ids
    run_dir = tmp_path / "run"
    args = flags(chat_base, (data, data), run_dir, "--steps", "2", "--eval-every", "2")
    main(args)
    assert [r["step"] for r in rows(run_dir)] == [1, 2]
    assert all(r["logprob_error"] < 1e-4 for r in rows(run_dir))
