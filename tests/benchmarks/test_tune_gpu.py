"""benchmarks/tune_gpu: the sweep that writes impl="auto"'s table, checked on the CPU at toy
sizes with Pallas in interpret mode (its timings mean nothing here; its file, its budget and
its merge into the table and the document are what is checked)."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import pytest

import rudax.kernels as rk
import rudax.optim as ro
from benchmarks import tune_gpu
from benchmarks.kernels import adamw_arms, pallas_arm_name
from rudax.kernels import _auto
from tests.kernels._lowering import export, gpu_calls
from tests.kernels.test_auto import _doc_rows


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "tune.json"
    result = tune_gpu.sweep(
        out, small=True, interpret=True, budget_s=600, rounds=1, iters=1, command="test"
    )
    return out, result


def test_the_sweep_gives_every_kernel_of_the_table_a_row(swept):
    out, result = swept
    assert json.loads(out.read_text()) == result  # the file is the whole result
    assert result["left_out"] == []
    measured = {row["kernel"] for row in result["gpu"]["kernels"]}
    table = {row.kernel for gpu in _auto.load_table() for row in gpu.kernels}
    assert measured == table | {"flash_attention"}
    # and so does the full sweep, the one run on a GPU
    assert {k for case in tune_gpu.cases() for k in case.kernels} == measured


def test_each_row_keeps_the_block_its_pallas_arm_was_fastest_with(swept):
    _, result = swept
    for row in result["gpu"]["kernels"]:
        case = next(c for c in tune_gpu.cases(small=True) if c.group == row["group"])
        candidates = {pallas_arm_name(case.pallas_arm, b) for b in case.blocks}
        speeds = [r["speed_vs_baseline"][0] for r in result["groups"]
                  if r["group"] == row["group"] and r["arm"] in candidates]  # fmt: skip
        assert len(speeds) == len(candidates) and row["pallas"] == round(max(speeds), 3), row
        block = next(
            b for b in case.blocks if pallas_arm_name(case.pallas_arm, b) == row["pallas_arm"]
        )
        # fused_adamw's candidates are its update kernel's: the norm's row keeps its default
        mine = case.block_kernel in (None, row["kernel"])
        assert row["block"] == (tune_gpu._block_fields(block) if mine else None)
        if block is not None and mine:  # the row rebuilds the very block
            assert type(block)(**row["block"]) == block


def test_a_case_that_cannot_be_built_is_named_and_the_sweep_goes_on():
    def build(impls, interpret):
        raise MemoryError("RESOURCE_EXHAUSTED: Out of memory allocating 4000000000 bytes")

    small = tune_gpu.cases(small=True)
    case = dataclasses.replace(small[0], build=build)
    assert tune_gpu.measure(case, interpret=True, rounds=1, iters=1) == (
        [],
        [],
        {case.group: "RESOURCE_EXHAUSTED: Out of memory allocating 4000000000 bytes"},
    )


def test_at_1b_parameters_the_adamw_case_keeps_to_four_arms():
    # Each arm holds 12 bytes a parameter: the chain, XLA, one Pallas arm and the copy fit
    # an H100 at 1B; the candidate blocks are tried at 125M, the skipping twin left out.
    big = next(c for c in tune_gpu.cases() if c.group.startswith("AdamW step, 1,000,000,000"))
    assert big.blocks == (None,)
    arms = adamw_arms(["xla", "pallas"], 4096, interpret=True, skip_twin=False)
    assert list(arms) == ["adamw unfused chain", "fused_adamw xla", "fused_adamw pallas"]


def test_an_arm_that_does_not_compile_is_dropped_and_named():
    def bad():
        raise ValueError("out of resources: shared memory, Required: 300000")

    ok, failed = tune_gpu._compiled({"good": lambda: 1, "pallas q=256": bad})
    assert list(ok) == ["good"]
    assert failed == {"pallas q=256": "out of resources: shared memory, Required: 300000"}


def test_the_full_sweep_starts_with_llama_8b_sizes_and_attention_at_head_dim_128():
    first = tune_gpu.cases()[:6]
    assert [(c.kernels[0], c.size) for c in first] == [
        ("rms_norm", 4096), ("layer_norm", 4096), ("silu_mul", 14336),
        ("flash_attention", 128), ("nf4_matmul", 4096), ("nf4_matmul", 14336),
    ]  # fmt: skip


def test_a_budget_spent_leaves_the_rest_out_whole(tmp_path):
    out = tmp_path / "tune.json"
    result = tune_gpu.sweep(
        out, small=True, interpret=True, budget_s=0, rounds=1, iters=1, command="test"
    )
    assert result["gpu"]["kernels"] == []
    assert result["left_out"] == [c.group for c in tune_gpu.cases(small=True)]
    with pytest.raises(SystemExit, match="no case finished, nothing to merge"):
        tune_gpu.merge(out, table=tmp_path / "t.json", doc=tmp_path / "d.md")
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "d.md").exists()


def test_measuring_the_cpu_without_interpret_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="measures a GPU; this host's device is"):
        tune_gpu.main(["--out", str(tmp_path / "x.json"), "--small"])
    assert not (tmp_path / "x.json").exists()


def test_merge_adds_the_gpu_after_the_reference_and_documents_every_row(swept, tmp_path):
    out, result = swept
    table, doc = tmp_path / "auto_table.json", tmp_path / "gpu_results.md"
    shutil.copy(_auto.TABLE_PATH, table)
    shutil.copy(tune_gpu.DOC, doc)
    before = _auto.load_table(table)
    for _ in range(2):  # merged twice: replaced, not listed twice
        name = tune_gpu.merge(out, table=table, doc=doc, commit="abc1234")
    gpus = _auto.load_table(table)
    assert name == "cpu" and [g.name for g in gpus] == [*(g.name for g in before), "cpu"]
    assert gpus[0] == before[0]  # the reference is untouched
    assert gpus[-1].measured == f"{result['date']}, jax {result['jax']}, commit abc1234"
    documented = _doc_rows(doc.read_text())
    for row in gpus[-1].kernels:
        assert row.pallas in documented[row.group, row.pallas_arm]
        assert row.xla in documented[row.group, row.xla_arm]
    assert doc.read_text().count("## Tuned: cpu") == 2


def test_an_interpret_sweep_never_enters_the_committed_table(swept):
    out, _ = swept
    table_before = _auto.TABLE_PATH.read_text()
    doc_before = tune_gpu.DOC.read_text()
    with pytest.raises(SystemExit, match=r"interpret mode .* not go into the committed table"):
        tune_gpu.main(["--merge", str(out)])
    assert _auto.TABLE_PATH.read_text() == table_before
    assert tune_gpu.DOC.read_text() == doc_before


def test_gpu_checks_summary_shows_the_sweep(swept):
    from benchmarks import gpu_check

    _, result = swept
    lines = gpu_check._tune(result)
    assert lines[0] == "tune (cpu, for rudax/kernels/auto_table.json):"
    # autodiff, xla, pallas twice (two candidate blocks) and the copy
    assert sum(line.startswith("| rms_norm fwd+bwd (64, 256) bf16 |") for line in lines) == 5
    assert sum(line.startswith("| flash_attention causal") for line in lines) == 3


def _candidate_exports():
    """(name, function, abstract arguments) of every candidate block at the sweep's sizes."""
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    out = []
    for b in tune_gpu.ROW_BLOCKS[1:]:
        for width in (1024, 4096, 8192):
            args = (s((8192, width), bf16), s((width,), bf16))
            rms = lambda x, v, b=b: rk.rms_norm(x, v, impl="pallas", block=b)
            layer = lambda x, v, b=b: rk.layer_norm(x, v, v, impl="pallas", block=b)
            out += [(f"rms_norm {b} {width}", rms, args), (f"layer_norm {b} {width}", layer, args)]
    for b in tune_gpu.SILU_BLOCKS[1:]:
        x = s((8192, 14336), bf16)
        silu = lambda g, u, b=b: rk.silu_mul(g, u, impl="pallas", block=b)
        out.append((f"silu_mul {b}", silu, (x, x)))
    for b in tune_gpu.NF4_BLOCKS[1:]:
        for k, n in ((4096, 14336), (14336, 4096)):
            q = jax.eval_shape(rk.nf4_quantize, s((n, k), jnp.float32))
            nf4 = lambda x, q, b=b: rk.nf4_matmul(x, q, impl="pallas", block=b)
            out.append((f"nf4_matmul {b} {k}", nf4, (s((4096, k), bf16), q)))
    for b in tune_gpu.ATTENTION_BLOCKS[1:]:
        for kd in (64, 128):
            x = s((2, 4096, 32, kd), bf16)
            fn = lambda q, k, v, b=b: rk.flash_attention(
                q, k, v, causal=True, impl="pallas", block=b
            )
            out.append((f"flash_attention {b} {kd}", fn, (x, x, x)))
    return out


@pytest.mark.parametrize(
    ("name", "fn", "args"), _candidate_exports(), ids=[c[0] for c in _candidate_exports()]
)
def test_every_candidate_block_lowers_for_cuda_at_the_sweeps_sizes(name, fn, args):
    # What only the GPU lowering checks (block shapes, Triton's tensor-size limit), at the
    # sizes the sweep runs, forward and backward (with respect to the first operand, which
    # runs every backward kernel): a candidate failing here would fail on the GPU, where the
    # minutes are few.
    def forward_backward(x, *rest):
        y, vjp = jax.vjp(lambda x: fn(x, *rest), x)
        return vjp(y)

    assert gpu_calls(export(forward_backward, *args).mlir_module()) >= 2, name


@pytest.mark.parametrize("block", tune_gpu.ADAMW_BLOCKS[1:], ids=str)
def test_every_adamw_candidate_lowers_for_cuda_at_125m_parameters(block):
    params = {"w": jax.ShapeDtypeStruct((30517, 4096), jnp.float32)}
    tx = ro.fused_adamw(1e-3, max_grad_norm=1.0, impl="pallas", block=block)
    state = jax.eval_shape(tx.init, params)
    step = lambda p, s, g: ro.update_and_apply(tx, g, s, p)
    # the update kernel (the norm runs its Pallas kernel with hierarchical_stats only)
    assert gpu_calls(export(step, params, state, params).mlir_module()) == 1
