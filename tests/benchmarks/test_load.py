"""benchmarks/load.py at a small size, on 2 processes x 2 devices: ``from_pretrained(...,
mesh=mesh)`` keeps each process within its share of the model plus one tensor's slice, and
each device within its 1/N; the whole load (today's path, the control) does not."""

import pytest

from benchmarks import load as bench

# A runtime's own allocations beside the arrays (threads, gloo buffers, arenas): measured
# 2 MiB over the arrays at this size; the whole load exceeds the bound by 90 MiB.
_RUNTIME_SLACK = 16 * 2**20


@pytest.mark.parametrize(
    "quantize",
    [pytest.param("none", marks=pytest.mark.slow), "nf4"],  # nf4 reads more kinds
)
def test_sharded_load_stays_within_each_process_share(tmp_path, quantize, capsys):
    argv = ["--dir", str(tmp_path / "ckpt"), "--vocab", "8192", "--hidden", "512"]
    argv += ["--intermediate", "1792", "--heads", "8", "--kv-heads", "2"]
    argv += ["--processes", "2", "--devices", "2", "--quantize", quantize, "--warmup"]
    out = bench.main([*argv, "--timeout", "300"])
    largest = out["checkpoint"]["largest_tensor_bytes"]
    for arm in ("whole", "sharded"):
        assert [r["process"] for r in out["arms"][arm]] == [0, 1]
    model = out["arms"]["sharded"][0]["model_bytes"]
    for r in out["arms"]["sharded"]:
        share = sum(r["device_bytes"].values())
        assert share <= model / 2 + 4 * 2**10, r  # its half, padding aside
        assert r["anon_peak_over_start"] <= share + largest / 2 + _RUNTIME_SLACK, r
        for held in r["device_bytes"].values():
            assert held <= model / 4 + 2**10, r
    for r in out["arms"]["whole"]:  # the control: every process held every tensor
        share = sum(r["device_bytes"].values())
        assert r["anon_peak_over_start"] > share + largest / 2 + _RUNTIME_SLACK, r
        assert r["first_device_bytes_before_shard"] >= 0.99 * model  # all of it (no padding)
    assert "| sharded | 1 |" in capsys.readouterr().out
