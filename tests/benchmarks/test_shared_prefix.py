"""benchmarks/shared_prefix.py's sampling section runs at a tiny size: both arms give the same
greedy rows, and the shared prompt's cache is the one written out from the shapes."""

import json

from benchmarks import shared_prefix as bench


def test_sampling_section_runs_and_the_arms_agree(tmp_path, capsys):
    out = tmp_path / "shared_prefix.json"
    argv = ["--json", str(out), "sampling", "--preset", "tiny", "--samples", "4"]
    r = bench.main([*argv, "--prompt-len", "40", "--new-tokens", "6", "--rounds", "1"])
    assert json.loads(out.read_text())["greedy_outputs_equal"] is True
    # tiny: 2 layers of 2 kv heads of 16, fp32; the prompt padded to 64 slots, 6 tokens to 16
    slot = 2 * 2 * 2 * 16 * 4
    assert r["arms"]["shared"]["kv_cache_bytes"] == (64 + 4 * 16) * slot
    assert r["arms"]["repeated"]["kv_cache_bytes"] == 4 * (64 + 16) * slot
    for arm in ("shared", "repeated"):
        assert r["arms"][arm]["tokens_per_s"] > 0
    assert "| shared prompt (num_samples=4) |" in capsys.readouterr().out


def test_training_section_runs_and_the_layouts_agree(capsys):
    argv = ["training", "--preset", "tiny", "--samples", "3", "--prompt-len", "30"]
    r = bench.main([*argv, "--completion-len", "7", "--rounds", "1"])
    assert r["max_relative_difference"] < 1e-5
    # shared: the prompt once, each completion with the prompt's last token; unshared: G rows
    assert r["arms"]["shared"]["tokens"] == 29 + 3 * 8
    assert r["arms"]["unshared"]["tokens"] == 3 * 37
    assert "| shared row (branch_ids) |" in capsys.readouterr().out
