"""impl="auto" on a GPU takes the arm measured faster there (rudax.kernels._auto.MEASURED):
the table is docs/gpu_results.md's numbers, each kernel's auto resolves to its faster arm,
and exported for CUDA an auto call holds a Pallas kernel exactly where Pallas won."""

import re
from pathlib import Path

import pytest

from rudax.kernels import _auto, _compat

ROOT = Path(__file__).resolve().parents[2]


def _doc_rows():
    """{(group, arm): speed} of docs/gpu_results.md's "Kernels" table."""
    text = (ROOT / "docs" / "gpu_results.md").read_text()
    section = text.split("\n## Kernels\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and (m := re.fullmatch(r"([\d.]+)x \[[\d.]+, [\d.]+\]", cells[5])):
            rows[cells[0], cells[1]] = float(m.group(1))
    return rows


@pytest.mark.parametrize("kernel", sorted(_auto.MEASURED))
def test_the_table_is_the_measured_documents(kernel):
    rows = _doc_rows()
    m = _auto.MEASURED[kernel]
    assert rows[m.group, m.pallas_arm] == m.pallas
    assert rows[m.group, m.xla_arm] == m.xla


@pytest.mark.parametrize("kernel", sorted(_auto.MEASURED))
def test_auto_takes_the_arm_measured_faster_on_a_gpu(kernel, monkeypatch):
    monkeypatch.setattr(_compat, "gpu_lowering_available", lambda: True)
    m = _auto.MEASURED[kernel]
    path = _compat.resolve_impl("auto", kernel=kernel)
    # "auto" lowers Pallas for a GPU (and XLA elsewhere); "xla" is the XLA path everywhere
    assert path == ("auto" if m.pallas > m.xla else "xla"), (kernel, m)


def test_every_kernel_name_the_kernels_pass_is_a_row_of_the_table():
    """A name the table does not hold reads as "decides itself" (Pallas on a GPU): a typo in
    a kernel's ``kernel=`` would silently undo its row."""
    names = set()
    for path in (ROOT / "rudax" / "kernels").glob("*.py"):
        names |= set(re.findall(r'kernel="(\w+)"', path.read_text()))
    assert names == set(_auto.MEASURED), names ^ set(_auto.MEASURED)


def test_every_kernel_with_a_pallas_path_is_in_the_table_or_decides_itself():
    # flash_attention's kernels were measured against cuDNN, not against their XLA path:
    # auto keeps them on a GPU, as its docstring says. Every other Pallas op has a row.
    assert set(_auto.MEASURED) == {
        "rms_norm", "layer_norm", "silu_mul", "adamw_update", "global_norm", "nf4_matmul",
    }  # fmt: skip
    assert _auto.auto_takes_pallas("flash_attention")
