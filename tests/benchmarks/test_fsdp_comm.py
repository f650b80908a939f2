"""benchmarks/fsdp_comm.py (issue 30): its HLO reading on a hand-written module, and its
programs at a tiny size (the figures are the benchmark run's, not the test's): state bytes per
device within padding of 1/F, and collectives at least what FSDP must move."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import pytest

import rudax.sharding as rs
from benchmarks import fsdp_comm as bench

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

TINY = dict(
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    vocab_size=128,
    seq_len=16,
    batch_size=8,
)

# Four collectives in the three spellings of replica groups, an async all-gather, and an
# all-to-all in a while body run 3 times.
HLO = """\
HloModule m, entry_computation_layout={(f32[4]{0})->f32[16]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], bf16[2,8])) -> (s32[], bf16[2,8]) {
  %p = (s32[], bf16[2,8]{1,0}) parameter(0)
  %x = bf16[2,8]{1,0} get-tuple-element(%p), index=1
  %a2a = bf16[2,8]{1,0} all-to-all(%x), channel_id=4, replica_groups=[2,4]<=[8], dimensions={1}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], bf16[2,8]{1,0}) tuple(%i, %a2a)
}

%cond (p.1: (s32[], bf16[2,8])) -> pred[] {
  %p.1 = (s32[], bf16[2,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (param.0: f32[4], param.1: bf16[2,8]) -> f32[16] {
  %param.0 = f32[4]{0} parameter(0)
  %param.1 = bf16[2,8]{1,0} parameter(1)
  %ag = f32[16]{0} all-gather(%param.0), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(%param.0), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %agd = f32[16]{0} all-gather-done(%ags)
  %rs = f32[4]{0} reduce-scatter(%ag), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %ar = f32[4]{0} all-reduce(%rs), channel_id=5, replica_groups=mesh['data'=2,'fsdp'=4] {'data'}, to_apply=%add
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2,8]{1,0}) tuple(%zero, %param.1)
  %loop = (s32[], bf16[2,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[16]{0} add(%ag, %agd)
}
"""  # noqa: E501 (HLO's lines, as XLA prints them)


def test_collectives_reads_bytes_groups_async_starts_and_loop_trips():
    found = sorted((c.kind, c.group, c.times) for c in bench.collectives(HLO))
    assert found == [
        ("all-gather", 4, 1),
        ("all-gather", 4, 1),
        ("all-reduce", 2, 1),
        ("all-to-all", 4, 3),
        ("reduce-scatter", 4, 1),
    ]
    s = bench.summarize(bench.collectives(HLO))
    # the sync and the async all-gather: 16 bytes in, 64 out each (the start's tuple holds
    # its operand too, not counted as result)
    assert (s["all-gather"]["count"], s["all-gather"]["operand_bytes"]) == (2, 32)
    assert s["all-gather"]["result_bytes"] == 128
    assert s["all-gather"]["sent_bytes"] == 2 * 64 * 3 / 4
    assert (s["reduce-scatter"]["operand_bytes"], s["reduce-scatter"]["result_bytes"]) == (64, 16)
    assert s["all-reduce"]["groups"] == [2] and s["all-reduce"]["sent_bytes"] == 2 * 16 / 2
    assert s["all-to-all"]["count"] == 3 and s["all-to-all"]["operand_bytes"] == 3 * 32
    assert s["all-to-all"]["dtypes"] == ["bf16"]
    unknown = HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    with pytest.raises(ValueError, match="unknown trip count"):
        bench.collectives(unknown)


@pytest.fixture(scope="module")
def muon():
    one = bench.trainer(TINY, optimizer="muon", mesh=None)
    sharded = bench.trainer(TINY, optimizer="muon", mesh="data=2,fsdp=4")
    return one, sharded, bench.traffic(sharded)


def test_trainer_state_is_a_quarter_per_device_up_to_padding(muon):
    one, sharded, _ = muon
    whole, quarter = bench.state_bytes(one), bench.state_bytes(sharded)
    assert (
        whole.keys()
        == quarter.keys()
        == {
            "params",
            "fp32 masters",
            "optimizer state",
            "accumulator",
        }
    )
    for part, b in whole.items():
        padded = rs.bytes_per_device(one.logical[part], 4)
        assert b / 4 <= quarter[part] <= padded, part
        assert padded - b / 4 < 64 * 8, part  # under one padded vector per leaf
    # the masters are fp32 copies of bf16 parameters
    assert quarter["fp32 masters"] == 2 * quarter["params"]


def test_trainer_collectives_move_at_least_what_fsdp_must(muon):
    _, sharded, moved = muon
    micro, apply = moved["micro"], moved["apply"]
    params = sharded.logical["params"]
    need = bench.padded_bytes(params, 4, jnp.float32)  # gathered in fp32
    assert micro["all-gather"]["result_bytes"] >= need
    assert micro["all-gather"]["operand_bytes"] >= need // 4
    assert micro["all-gather"]["groups"] == [4]
    assert micro["reduce-scatter"]["operand_bytes"] >= need
    assert any(c == 2 for c in micro["all-reduce"]["groups"])  # the data axis
    assert micro["all-reduce"]["operand_bytes"] >= need // 4
    # the update gathers nothing; Muon's matrices travel by all-to-all, bf16 or (XLA:CPU) f32
    assert "all-gather" not in apply and "reduce-scatter" not in apply
    a2a = apply["all-to-all"]["operand_bytes"]
    low, high = (bench.analytic_muon(params, 4, cpu=cpu) for cpu in (False, True))
    assert low <= a2a <= high
    rows = {"muon": {"traffic": moved, "analytic": {"micro": {}, "apply": {}}}}
    rows["muon"]["analytic_cpu"] = rows["muon"]["analytic"]
    table = bench.traffic_table(rows).splitlines()
    assert len(table) == 2 + len(micro) + len(apply)
    assert all(r.count("|") == 13 for r in table)


def test_finetuner_base_and_adapters_are_an_eighth_and_only_adapters_are_reduced(tmp_path):
    args = argparse.Namespace(
        d_model=64, n_layers=1, n_heads=2, vocab_size=128, seq_len=16, batch_size=8, rank=4
    )
    base = bench.tiny_base(tmp_path / "hf", args)
    one = bench.finetuner(base, args, mesh=None)
    eighth = bench.finetuner(base, args, mesh="fsdp=8")
    whole, got = bench.state_bytes(one), bench.state_bytes(eighth)
    assert set(whole) == {*bench.FINETUNE_PARTS, "AdamW moments"}
    assert whole["NF4 codes"] > 0 and whole["NF4 scales"] > 0
    for part, b in whole.items():
        assert b / 8 <= got[part] <= rs.bytes_per_device(one.logical[part], 8), part
    micro = bench.traffic(eighth, ("micro",))["micro"]
    # the base is gathered as stored (its codes as bytes) with the adapters
    assert "u8" in micro["all-gather"]["dtypes"]
    assert micro["all-gather"]["result_bytes"] >= sum(
        bench.padded_bytes(one.logical[k], 8) for k in bench.FINETUNE_PARTS
    )
    # only the adapters' fp32 gradients are reduce-scattered: the base has none
    assert micro["reduce-scatter"]["operand_bytes"] == bench.padded_bytes(
        one.logical["adapters"], 8, jnp.float32
    )
