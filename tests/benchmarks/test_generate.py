"""benchmarks/generate.py runs, at a tiny size, and its arms agree token for token."""

import json

from benchmarks import generate as bench


def test_generation_benchmark_runs_and_the_arms_agree(tmp_path, capsys):
    out = tmp_path / "generate.json"
    argv = ["--preset", "tiny", "--batch", "2", "--prompt-len", "12", "--new-tokens", "6"]
    r = bench.main([*argv, "--rounds", "1", "--json", str(out)])
    assert json.loads(out.read_text())["greedy_outputs_equal"] is True
    assert r["prompt_lengths"] == [12, 5]
    for arm in ("rudax", "transformers"):
        assert r["arms"][arm]["prefill_tokens_per_s"] > 0
    assert "decode: rudax" in capsys.readouterr().out
