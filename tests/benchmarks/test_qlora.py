"""benchmarks/qlora.py: the benchmark's own logic at a tiny size (its figures are the
run's, not the test's): per-round ratios to transformers + peft, the table, the byte counts."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import qlora as bench

TINY = ["--batch", "2", "--seq", "32", "--vocab", "256", "--d-model", "64", "--layers", "1"]
TINY += ["--heads", "2", "--kv-heads", "1"]


def _result(tokens_per_s, base_bytes, *, rss=100, anon=50, loss=5.0):
    return {
        "tokens_per_s": tokens_per_s,
        "maxrss_bytes": rss,
        "anon_peak_bytes": anon,
        "base_bytes": base_bytes,
        "projection_bytes": base_bytes // 2,
        "first_loss": loss,
    }


def test_ratios_are_taken_round_by_round_then_their_median_and_spread():
    rounds = {
        "rudax_nf4": [_result(30.0, 260), _result(10.0, 260), _result(40.0, 260)],
        "rudax_bf16": [_result(20.0, 1000), _result(20.0, 1000), _result(20.0, 1000)],
        "torch": [_result(10.0, 2000), _result(20.0, 2000), _result(10.0, 2000)],
        "bnb": [{"error": "RuntimeError: no CPU kernel"}] * 3,
    }
    s = bench.summarize(rounds)
    # Round by round: 30/10, 10/20, 40/10; not the ratio of the medians (30/10 = 3).
    per_round = [3.0, 0.5, 4.0]
    expected = [statistics.median(per_round), min(per_round), max(per_round)]
    assert s["rudax_nf4_over_torch_tokens_per_s"] == expected == [3.0, 0.5, 4.0]
    assert s["arms"]["rudax_nf4"]["tokens_per_s"] == 30.0
    assert s["arms"]["rudax_bf16"]["tokens_per_s_vs_torch"] == [2.0, 1.0, 2.0]  # 2, 1, 2
    assert s["arms"]["torch"]["tokens_per_s_vs_torch"] == [1.0, 1.0, 1.0]
    assert s["nf4_over_bf16_base_bytes"] == 0.26
    assert s["nf4_over_bf16_projection_bytes"] == 130 / 500
    assert s["arms"]["bnb"] == {"error": "RuntimeError: no CPU kernel"}

    rows = bench.table(s).splitlines()
    assert len(rows) == 2 + 4 and all(r.count("|") == 5 for r in rows)
    nf4_row = next(r for r in rows if r.startswith("| rudax QLoRA"))
    assert "| 30 (x3.000 [0.500, 4.000]) |" in nf4_row and "| 260 (130) |" in nf4_row
    assert "did not run: RuntimeError: no CPU kernel" in rows[-1]


def test_arms_must_include_the_baseline():
    with pytest.raises(SystemExit):
        bench.main(["--arms", "rudax_nf4,rudax_bf16"])
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])  # nothing to do without --prep


@pytest.mark.standard_promotion  # the arms run in their own processes; this one only parses
def test_one_round_end_to_end(tmp_path, capsys):
    # Two arms, each a fresh process (~15-20 s of CPU each: imports and the step's compilation),
    # the two the targets compare; the other two run the same code with another flag.
    out = tmp_path / "bench.json"
    argv = ["--rounds", "1", "--steps", "1", "--arms", "rudax_nf4,torch", *TINY]
    report = bench.main([*argv, "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rounds, s = report["rounds"], report["summary"]
    assert sorted(rounds) == ["rudax_nf4", "torch"] and all(len(r) == 1 for r in rounds.values())
    for arm, (r,) in rounds.items():
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["seconds"])
        assert r["maxrss_bytes"] > r["anon_peak_bytes"] > 0
        ratio = r["tokens_per_s"] / rounds["torch"][0]["tokens_per_s"]
        assert s["arms"][arm]["tokens_per_s_vs_torch"] == [ratio] * 3
    assert s["rudax_nf4_over_torch_tokens_per_s"] == s["arms"]["rudax_nf4"]["tokens_per_s_vs_torch"]
    # The seven projections of the one block, counted independently: q, o 64x64; k, v 64x32
    # (1 kv head of 32); gate, up, down 64 x 192 (SwiGLU's hidden, 8/3 * 64 rounded up to 64).
    per_layer = [64 * 64] * 2 + [64 * 32] * 2 + [64 * 192] * 3
    assert rounds["torch"][0]["projection_bytes"] == 4 * sum(per_layer)  # fp32 in torch
    rest = 2 * 256 * 64 + 3 * 64  # the embedding and head 256 x 64 each, 3 norms of 64
    assert rounds["torch"][0]["base_bytes"] == 4 * (sum(per_layer) + rest)
    # NF4: w/2 bytes of codes, w/64 of absmax codes, a fp32 scale per 256 absmax (each layer's
    # absmax are quantized on their own) and a fp32 offset.
    nf4 = sum(w // 2 + w // 64 + 4 * -(-(w // 64) // 256) + 4 for w in per_layer)
    assert rounds["rudax_nf4"][0]["projection_bytes"] == nf4
    assert nf4 / (2 * sum(per_layer)) < 0.27  # against the same weights in bf16
    assert rounds["rudax_nf4"][0]["base_bytes"] == nf4 + 2 * rest  # the rest stored bf16
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 2 and rows[0].startswith("| arm | tokens/s | peak host memory")
    assert all(r.count("|") == 5 for r in rows)
