"""examples/finetune/bench.py: the benchmark's own logic at a tiny size (its figures are the
run's, not the test's): per-round ratios to transformers + peft, the table, the byte counts."""

from __future__ import annotations

import json
import statistics

import pytest

from examples.finetune import bench

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


@pytest.mark.standard_promotion  # the children run in their own processes; this one only parses
def test_one_round_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    arms = "rudax_nf4,rudax_bf16,torch"
    report = bench.main(
        ["--rounds", "1", "--steps", "1", "--arms", arms, *TINY, "--json", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rounds, s = report["rounds"], report["summary"]
    assert sorted(rounds) == sorted(arms.split(",")) and all(len(r) == 1 for r in rounds.values())
    for arm, (r,) in rounds.items():
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["seconds"])
        assert r["maxrss_bytes"] > r["anon_peak_bytes"] > 0
        ratio = r["tokens_per_s"] / rounds["torch"][0]["tokens_per_s"]
        assert s["arms"][arm]["tokens_per_s_vs_torch"] == [ratio] * 3
    # The seven projections of the one block, counted independently: q, o 64x64; k, v 64x32
    # (1 kv head of 32); gate, up, down 64 x 192 (SwiGLU's hidden, 8/3 * 64 rounded up to 64).
    n = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192
    assert rounds["rudax_bf16"][0]["projection_bytes"] == 2 * n
    assert rounds["torch"][0]["projection_bytes"] == 4 * n  # fp32 in torch
    # NF4: n/2 bytes of codes, n/64 of absmax codes, a fp32 scale per 256 absmax (one block of
    # 256 or less per layer here, since each layer's absmax are quantized on their own) and
    # its fp32 offset.
    per_layer = [64 * 64] * 2 + [64 * 32] * 2 + [64 * 192] * 3
    nf4 = sum(w // 2 + w // 64 + 4 * -(-(w // 64) // 256) + 4 for w in per_layer)
    assert rounds["rudax_nf4"][0]["projection_bytes"] == nf4
    assert s["nf4_over_bf16_projection_bytes"] == nf4 / (2 * n) < 0.27
    # B = 0 at the start: the first loss is the base's, the same function in rudax and torch.
    first = {arm: rounds[arm][0]["first_loss"] for arm in rounds}
    assert first["rudax_bf16"] == pytest.approx(first["torch"], rel=1e-5)
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 3 and rows[0].startswith("| arm | tokens/s | peak host memory")
    assert "rudax QLoRA / transformers + peft LoRA: " in printed
