"""benchmarks/post_train.py's DPO and GRPO sections run at a tiny size: the shared and the unshared
layout give the same loss, and each holds the tokens its layout says."""

from benchmarks import post_train as bench


def test_dpo_section_runs_and_the_layouts_agree(capsys):
    argv = ["dpo", "--preset", "tiny", "--pairs", "3", "--prompt-len", "20"]
    r = bench.main([*argv, "--answer-len", "5", "--rounds", "1"])
    assert r["loss_relative_difference"] < 1e-5
    # shared: one row a pair, the prompt once and each answer after a copy of its last token;
    # unshared: one row a pair, prompt + answer twice
    assert r["arms"]["shared"]["tokens"] == 3 * (19 + 2 * 6)
    assert r["arms"]["unshared"]["tokens"] == 3 * 2 * 25
    assert "| shared prompt |" in capsys.readouterr().out


def test_grpo_section_runs_and_the_layouts_agree(capsys):
    argv = ["grpo", "--preset", "tiny", "--samples", "3", "--prompt-len", "20"]
    r = bench.main([*argv, "--new-tokens", "5", "--rounds", "1"])
    assert r["logprob_relative_difference"] < 1e-5
    # shared: the prompt once, each completion after a copy of its last token; unshared:
    # G rows of prompt + completion
    assert r["arms"]["shared"]["tokens"] == 19 + 3 * 6
    assert r["arms"]["unshared"]["tokens"] == 3 * 25
    for arm in ("shared", "unshared"):
        assert r["arms"][arm]["sampling_s"] > 0 and r["arms"][arm]["training_s"] > 0
    assert "| shared prompt |" in capsys.readouterr().out
