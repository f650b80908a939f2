"""What ``impl="auto"`` runs on a GPU: each kernel's Pallas path only where it was measured
faster, on that GPU (or the nearest one measured), than the kernel's own XLA path.

The measurements are one committed file, ``rudax/kernels/auto_table.json``, written by one
script (``python -m benchmarks.tune_gpu`` on the GPU, then ``--merge`` into the file). Per
GPU name, each row is one kernel at one size and dtype: the speeds of its Pallas and XLA
arms against the same baseline, medians over alternating rounds. A kernel's *size* is the
one number its speed turns on: the feature width for ``rms_norm``, ``layer_norm``,
``silu_mul`` and ``nf4_matmul`` (its in-features); the parameter count of the call for
``adamw_update`` and ``global_norm`` (``fused_adamw``'s two kernels: every leaf it updates,
or one leaf called alone).

Which row a call reads (``auto_takes_pallas``):

* the GPU: the one the computation is lowered for (``_target.target_gpu``), by name
  (``jax.Device.device_kind``, or the device of ``rudax.kernels.gpu_export_target`` when
  exporting from a host without one). A GPU the table does not hold takes the nearest one
  it does: the same compute capability major version first, then the closest capability;
  an unknown capability (an export target's name alone) takes the table's first GPU, the
  reference. If that GPU has no row for the kernel, the next nearest that has one.
* the row: the call's dtype if measured (else any dtype), then the size nearest the call's
  on a log scale (no size given: the largest measured, the size the table was made for).

``auto`` takes Pallas for a row whose Pallas arm was measured faster, the XLA path otherwise;
off a GPU it is always the XLA path (``rudax.kernels._compat.resolve_impl``). Kernels without
any row decide for themselves and say so in their docstrings. ``flash_attention``'s rows
(size: the head dimension) time its Pallas kernels against cuDNN, not against its XLA path (a
blocked loop of jnp), and ``auto`` keeps them on a GPU.

A row's ``block`` is the block its Pallas arm was fastest with among the sweep's candidates:
a kernel called with ``block=None`` and lowered for a GPU uses it
(``tuned_block``); off a GPU, and for rows without one, the block
dataclass's defaults. ``tests/kernels/test_auto.py`` checks the file against
``docs/gpu_results.md`` and that ``auto`` never takes an arm its row measured slower.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from rudax.kernels import _target

__all__ = [
    "TABLE_PATH",
    "GpuTable",
    "Measured",
    "auto_takes_pallas",
    "load_table",
    "load_table_text",
    "lookup",
    "nearest_gpus",
    "tuned_block",
]

B = TypeVar("B")

TABLE_PATH = Path(__file__).with_name("auto_table.json")
SCHEMA = 1


@dataclasses.dataclass(frozen=True)
class Measured:
    """One kernel at one size and dtype on one GPU: its Pallas and XLA arms' speeds, and
    the block the Pallas arm was fastest with."""

    kernel: str
    size: int  # the kernel's size class (module docstring)
    dtype: str  # the inputs' dtype, a numpy name
    group: str  # the benchmark's group and arms, as its table names them
    pallas_arm: str
    xla_arm: str  # "" where the XLA path was not measured (flash_attention: against cuDNN)
    pallas: float  # speed vs the group's baseline (median over rounds)
    xla: float | None
    # The Pallas arm's block, the fastest of the sweep's candidates: the fields of the
    # kernel's block dataclass that differ from its defaults ({}: the defaults themselves;
    # None: the kernel's own choice when called with block=None, as without a table).
    block: dict[str, int] | None = None

    @property
    def pallas_wins(self) -> bool:
        return self.xla is None or self.pallas > self.xla


@dataclasses.dataclass(frozen=True)
class GpuTable:
    """One GPU's rows, and where they came from."""

    name: str  # jax.Device.device_kind, e.g. "NVIDIA H200"
    compute_capability: str  # "9.0"
    measured: str  # date, jax version, commit
    command: str  # what wrote the rows
    kernels: tuple[Measured, ...]


def load_table(path: Path | str = TABLE_PATH) -> tuple[GpuTable, ...]:
    """The GPUs of a table file, in its order (the first is the reference). A ValueError
    naming the file and what is wrong for a file this version cannot read."""
    return load_table_text(Path(path).read_text(), str(path))


def load_table_text(text: str, path: str) -> tuple[GpuTable, ...]:
    """``load_table`` of a file's text (``path`` names it in errors)."""
    data = json.loads(text)
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema must be {SCHEMA}, got {data.get('schema')!r}")
    gpus = []
    for gpu in data["gpus"]:
        rows = tuple(Measured(**row) for row in gpu.pop("kernels"))
        gpus.append(GpuTable(**gpu, kernels=rows))
    names = [g.name for g in gpus]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a GPU is listed twice in {names}")
    return tuple(gpus)


@functools.cache
def _table() -> tuple[GpuTable, ...]:
    return load_table()


def _capability(text: str | None) -> tuple[int, int] | None:
    try:
        major, minor = str(text).split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def nearest_gpus(
    gpus: tuple[GpuTable, ...], name: str | None, capability: str | None
) -> list[GpuTable]:
    """The table's GPUs, nearest to the one named first (module docstring)."""
    exact = [g for g in gpus if g.name == name]
    rest = [g for g in gpus if g.name != name]
    want = _capability(capability)
    if want is not None:

        def distance(g: GpuTable) -> tuple[int, int]:
            have = _capability(g.compute_capability) or (0, 0)
            return abs(have[0] - want[0]), abs(have[1] - want[1])

        rest.sort(key=distance)  # stable: ties keep the table's order
    return exact + rest


def lookup(
    kernel: str,
    *,
    size: int | None = None,
    dtype: Any = None,
    gpu: tuple[str, str | None] | None = None,
    gpus: tuple[GpuTable, ...] | None = None,
) -> tuple[GpuTable, Measured] | None:
    """The GPU and row ``auto`` reads for ``kernel`` (module docstring); None without one."""
    gpus = _table() if gpus is None else gpus
    name, capability = gpu if gpu is not None else (None, None)
    for table in nearest_gpus(gpus, name, capability):
        rows = [r for r in table.kernels if r.kernel == kernel]
        if not rows:
            continue
        if dtype is not None:
            same = [r for r in rows if r.dtype == np.dtype(dtype).name]
            rows = same or rows
        if size is None:
            return table, max(rows, key=lambda r: r.size)
        return table, min(rows, key=lambda r: abs(math.log(r.size) - math.log(max(size, 1))))
    return None


def auto_takes_pallas(
    kernel: str,
    *,
    size: int | None = None,
    dtype: Any = None,
    gpu: tuple[str, str | None] | None = None,
) -> bool:
    """Whether ``impl="auto"`` runs ``kernel``'s Pallas path on ``gpu`` (``(device_kind,
    compute capability)`` of the GPU lowered for, ``rudax.kernels._target.target_gpu``):
    measured faster there (or on the nearest GPU measured), or not in the table at all (the
    kernel decides)."""
    found = lookup(kernel, size=size, dtype=dtype, gpu=gpu)
    return found is None or found[1].pallas_wins


def tuned_block(
    block_type: type[B],
    kernel: str,
    *,
    size: int,
    dtype: Any,
    default: Callable[[], B] | None = None,
    exact: bool = False,
) -> B:
    """The block a kernel called with ``block=None`` uses: where it is lowered for a GPU,
    the block its row of the measured table was fastest with (the
    row nearest ``size`` and ``dtype``; with ``exact``, only a row of this very size);
    elsewhere, or without one, ``default()`` (``block_type()`` if None).

    Example:
      >>> import jax.numpy as jnp, rudax.kernels as rk
      >>> tuned_block(rk.SiluMulBlock, "silu_mul", size=4096, dtype=jnp.bfloat16)  # no GPU
      SiluMulBlock(size=1024, num_warps=4)
    """
    default = block_type if default is None else default
    gpu = _target.target_gpu()
    found = None if gpu is None else lookup(kernel, size=size, dtype=dtype, gpu=gpu)
    if found is None or found[1].block is None or (exact and found[1].size != size):
        return default()
    return block_type(**found[1].block)
