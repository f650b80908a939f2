"""benchmarks/tune_gpu: the sweep that writes impl="auto"'s table, checked on the CPU at toy
sizes with Pallas in interpret mode (its timings mean nothing here; its file, its budget and
its merge into the table and the document are what is checked)."""

import json
import shutil

import pytest

from benchmarks import tune_gpu
from rudax.kernels import _auto
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
    assert measured == {row.kernel for gpu in _auto.load_table() for row in gpu.kernels}
    # and so does the full sweep, the one run on a GPU
    assert {k for case in tune_gpu.cases() for k in case.kernels} == measured


def test_the_full_sweep_starts_with_llama_8b_sizes():
    first = tune_gpu.cases()[:5]
    assert [(c.kernels[0], c.size) for c in first] == [
        ("rms_norm", 4096), ("layer_norm", 4096), ("silu_mul", 14336),
        ("nf4_matmul", 4096), ("nf4_matmul", 14336),
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
    assert sum(line.startswith("| rms_norm fwd+bwd (64, 256) bf16 |") for line in lines) == 4
