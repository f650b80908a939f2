"""impl="auto" on a GPU takes the arm measured faster there (rudax/kernels/auto_table.json,
read by rudax.kernels._auto): the table is docs/gpu_results.md's numbers, every row's auto
resolves to its faster arm, a GPU or size the table lacks reads the nearest measured, and
exported for a named GPU an auto call holds a Pallas kernel exactly where that GPU's row
says Pallas won."""

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import rudax.kernels as rk
from rudax.kernels import _auto, _compat, _target
from tests.kernels._lowering import gpu_calls

ROOT = Path(__file__).resolve().parents[2]
TABLE = _auto.load_table()
ROWS = [(gpu, row) for gpu in TABLE for row in gpu.kernels]
ROW_IDS = [f"{gpu.name}-{row.kernel}-{row.size}-{row.dtype}" for gpu, row in ROWS]


def _doc_rows(text=None):
    """{(group, arm): {speeds}} of every 6-column table row in docs/gpu_results.md (or
    ``text``) whose last cell is a speed ("1.328x [1.130, 1.641]")."""
    if text is None:
        text = (ROOT / "docs" / "gpu_results.md").read_text()
    rows: dict = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and (m := re.fullmatch(r"([\d.]+)x \[[\d.]+, [\d.]+\]", cells[5])):
            rows.setdefault((cells[0], cells[1]), set()).add(float(m.group(1)))
    return rows


@pytest.mark.parametrize(("gpu", "row"), ROWS, ids=ROW_IDS)
def test_the_table_is_the_measured_documents(gpu, row):
    rows = _doc_rows()
    assert row.pallas in rows[row.group, row.pallas_arm], (gpu.name, row)
    assert row.xla in rows[row.group, row.xla_arm], (gpu.name, row)


@pytest.mark.parametrize(("gpu", "row"), ROWS, ids=ROW_IDS)
def test_auto_takes_the_arm_measured_faster_on_that_gpu(gpu, row, monkeypatch):
    monkeypatch.setattr(_compat, "gpu_lowering_available", lambda: True)
    monkeypatch.setattr(_target, "target_gpu", lambda: (gpu.name, gpu.compute_capability))
    path = _compat.resolve_impl("auto", kernel=row.kernel, size=row.size, dtype=row.dtype)
    # "auto" lowers Pallas for a GPU (and XLA elsewhere); "xla" is the XLA path everywhere
    assert path == ("auto" if row.pallas > row.xla else "xla"), (gpu.name, row)


def test_every_kernel_name_the_kernels_pass_is_in_the_table():
    """A name the table does not hold reads as "decides itself" (Pallas on a GPU): a typo in
    a kernel's ``kernel=`` would silently undo its rows."""
    names = set()
    for path in (ROOT / "rudax" / "kernels").glob("*.py"):
        names |= set(re.findall(r'kernel="(\w+)"', path.read_text()))
    measured = {row.kernel for _, row in ROWS}
    assert names == measured, names ^ measured


def test_every_kernel_with_a_pallas_path_is_in_the_table_or_decides_itself():
    # flash_attention's kernels are measured against cuDNN, not against their XLA path:
    # auto keeps them on a GPU, as its docstring says, with a row (its tuned blocks) or
    # without. Every other Pallas op has a row.
    assert {row.kernel for _, row in ROWS} - {"flash_attention"} == {
        "rms_norm", "layer_norm", "silu_mul", "adamw_update", "global_norm", "nf4_matmul",
    }  # fmt: skip
    assert _auto.auto_takes_pallas("flash_attention")


# ----------------------------------------------------------------------------- nearest
def _row(kernel, size, dtype, pallas, xla):
    return _auto.Measured(kernel, size, dtype, "g", "p", "x", pallas, xla)


def _gpu(name, capability, *rows):
    return _auto.GpuTable(name, capability, "today", "cmd", tuple(rows))


H200 = _gpu("NVIDIA H200", "9.0", _row("rms_norm", 4096, "bfloat16", 1.3, 1.0))
A100 = _gpu(
    "NVIDIA A100-SXM4-80GB",
    "8.0",
    _row("rms_norm", 4096, "bfloat16", 0.9, 1.0),
    _row("silu_mul", 1024, "bfloat16", 1.2, 1.0),
    _row("silu_mul", 8192, "bfloat16", 0.8, 1.0),
    _row("silu_mul", 8192, "float32", 1.1, 1.0),
)
GPUS = (H200, A100)


def _which(kernel, gpu, **call):
    table, row = _auto.lookup(kernel, gpu=gpu, gpus=GPUS, **call)
    return table.name, row


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        (("NVIDIA A100-SXM4-80GB", "8.0"), "NVIDIA A100-SXM4-80GB"),  # measured: its own
        (("NVIDIA H100 80GB HBM3", "9.0"), "NVIDIA H200"),  # same major version
        (("NVIDIA A10G", "8.6"), "NVIDIA A100-SXM4-80GB"),  # same major, nearest minor
        (("NVIDIA B200", "10.0"), "NVIDIA H200"),  # nearest capability
        (("NVIDIA L4", "8.9"), "NVIDIA A100-SXM4-80GB"),
        (("NVIDIA H100", None), "NVIDIA H200"),  # an export target's name alone: the first
        (None, "NVIDIA H200"),  # no GPU known: the first (the reference)
    ],
)
def test_a_gpu_the_table_lacks_reads_the_nearest_measured(gpu, expected):
    assert _which("rms_norm", gpu)[0] == expected


def test_a_kernel_the_nearest_gpu_lacks_reads_the_next_nearest():
    # silu_mul was measured on the A100 only: an H100 reads it there
    name, row = _which("silu_mul", ("NVIDIA H100", "9.0"), size=1024, dtype=jnp.bfloat16)
    assert (name, row.size) == ("NVIDIA A100-SXM4-80GB", 1024)
    assert _auto.lookup("flash_attention", gpus=GPUS) is None


@pytest.mark.parametrize(
    ("size", "dtype", "expected"),
    [
        (512, jnp.bfloat16, (1024, "bfloat16")),
        (2896, jnp.bfloat16, (1024, "bfloat16")),  # nearer 1024 than 8192 on a log scale
        (2897, jnp.bfloat16, (8192, "bfloat16")),
        (100_000, jnp.bfloat16, (8192, "bfloat16")),
        (1024, jnp.float32, (8192, "float32")),  # the call's dtype first
        (1024, jnp.float16, (1024, "bfloat16")),  # a dtype not measured: any dtype
        (None, jnp.bfloat16, (8192, "bfloat16")),  # no size: the largest measured
    ],
)
def test_the_row_read_is_the_calls_dtype_then_the_nearest_size(size, dtype, expected):
    _, row = _which("silu_mul", ("NVIDIA A100-SXM4-80GB", "8.0"), size=size, dtype=dtype)
    assert (row.size, row.dtype) == expected


def test_the_gpu_lowered_for_is_the_export_targets():
    assert _target.target_gpu() is None  # this CPU host
    with rk.gpu_export_target("NVIDIA H200"):
        assert _target.target_gpu() == ("NVIDIA H200", None)


@pytest.mark.parametrize(("target", "pallas"), [("NVIDIA H200", True), ("NVIDIA A100", False)])
def test_an_export_for_a_named_gpu_holds_pallas_where_its_row_says(target, pallas, monkeypatch):
    # The H200 measured rms_norm's Pallas faster, the A100 slower: the same auto call
    # exported for each holds a Triton kernel, or none.
    monkeypatch.setattr(
        _auto, "_table", lambda: (H200, dataclasses.replace(A100, name="NVIDIA A100"))
    )
    fn = jax.jit(lambda x, s: rk.rms_norm(x, s, impl="auto"))
    args = (
        jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((4096,), jnp.float32),
    )
    with rk.gpu_export_target(target):
        exported = jax.export.export(
            fn, platforms=["cuda"], disabled_checks=rk.EXPORT_DISABLED_CHECKS
        )(*args)
    assert (gpu_calls(exported.mlir_module()) > 0) == pallas


# ----------------------------------------------------------------------------- the file
def _write(tmp_path, data):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    return path


def test_the_file_round_trips():
    data = json.loads(_auto.TABLE_PATH.read_text())
    assert [g.name for g in TABLE] == [g["name"] for g in data["gpus"]]
    assert sum(len(g.kernels) for g in TABLE) == sum(len(g["kernels"]) for g in data["gpus"])


def test_a_file_of_another_schema_is_refused_by_name(tmp_path):
    path = _write(tmp_path, {"schema": 2, "gpus": []})
    with pytest.raises(ValueError, match=r"table.json: schema must be 1, got 2"):
        _auto.load_table(path)


def test_a_gpu_listed_twice_is_refused(tmp_path):
    gpu = dict(name="X", compute_capability="9.0", measured="", command="", kernels=[])
    path = _write(tmp_path, {"schema": 1, "gpus": [gpu, gpu]})
    with pytest.raises(ValueError, match=r"a GPU is listed twice in \['X', 'X'\]"):
        _auto.load_table(path)


# ----------------------------------------------------------------------------- tuned blocks
def _triton_configs(fn, *args, target):
    with rk.gpu_export_target(target):
        text = jax.export.export(
            jax.jit(fn), platforms=["cuda"], disabled_checks=rk.EXPORT_DISABLED_CHECKS
        )(*args).mlir_module()
    return re.findall(r"grid_x = (\d+) : i32.*?num_warps\W+(\d+)", text)


def test_a_kernel_without_a_block_takes_its_rows_tuned_block_on_that_gpu(monkeypatch):
    row = dataclasses.replace(
        _row("silu_mul", 4096, "bfloat16", 1.2, 1.0), block={"size": 2048, "num_warps": 8}
    )
    tuned = dataclasses.replace(H200, kernels=(row,))
    monkeypatch.setattr(_auto, "_table", lambda: (tuned,))
    x = jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16)
    silu = lambda g, u: rk.silu_mul(g, u, impl="pallas")
    # 8 x 4096 elements in blocks of 2048 over 8 warps; the defaults are 1024 over 4
    assert _triton_configs(silu, x, x, target="NVIDIA H200") == [("16", "8")]
    given = lambda g, u: rk.silu_mul(g, u, impl="pallas", block=rk.SiluMulBlock())
    assert _triton_configs(given, x, x, target="NVIDIA H200") == [("32", "4")]  # given wins
    # off a GPU, the defaults (the interpreter's tests run what they always ran)
    assert _auto.tuned_block(rk.SiluMulBlock, "silu_mul", size=4096, dtype=jnp.bfloat16) == (
        rk.SiluMulBlock()
    )


def test_flash_attentions_tuned_block_is_for_its_own_head_dimension_only(monkeypatch):
    row = _auto.Measured(
        "flash_attention", 128, "bfloat16", "g", "p", "", 0.95, None, block={"q": 128}
    )
    monkeypatch.setattr(_auto, "_table", lambda: (dataclasses.replace(H200, kernels=(row,)),))
    assert row.pallas_wins  # no XLA arm measured: the kernel decides (Pallas)
    with rk.gpu_export_target("NVIDIA H200"):
        block = lambda kd: _auto.tuned_block(
            rk.FlashAttentionBlock, "flash_attention", size=kd, dtype=jnp.bfloat16, exact=True
        )
        assert block(128) == rk.FlashAttentionBlock(q=128)
        assert block(64) == rk.FlashAttentionBlock()
