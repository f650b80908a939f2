"""An NF4 projection loaded onto a mesh: each process quantizes only its own 64-blocks.

A process reads the blocks its devices' slices cover (of the codes and of the block scales),
quantizes them a run at a time, and the processes gather the blocks' scales (4 bytes per 64
weights) so that each finishes the double quantization from all of them
(``rudax.kernels.nf4_double_quantize``): the bits of quantizing the whole tensor, whose only
global step is the mean of the scales.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.kernels as rk
import rudax.sharding as rs
from rudax.models._safetensors import SafetensorsFile
from rudax.sharding._sharded_parameter import shard_size

__all__ = ["NF4Pieces", "Rounding"]

Rounding = Literal["cuda", "cpu"]  # NF4's absmax codes: whose kernel to reproduce
AXIS = "fsdp"
_BLOCK = 64  # NF4's block: what from_pretrained quantizes with
_READ_BLOCKS = 2**16  # blocks read and quantized at a time (8 MB of bf16)


class NF4Pieces:
    """Each NF4 projection's fields on this process's ranks, quantized once per tensor."""

    def __init__(
        self,
        where: dict[str, SafetensorsFile],
        folder: Path,
        mesh: Mesh,
        param_dtype: Any,
        rounding: Rounding,
    ):
        self.where, self.folder, self.mesh = where, folder, mesh
        self.param_dtype = param_dtype
        self.rounding: Rounding = rounding
        axis = mesh.axis_names.index(AXIS)
        me = jax.process_index()
        self.ranks = sorted(
            {int(i[axis]) for i, d in np.ndenumerate(mesh.devices) if d.process_index == me}
        )
        self.n = int(mesh.shape[AXIS])
        self._done: dict[str, dict[str, Any]] = {}

    def read(self, source: Any, start: int, stop: int, dtype: Any) -> np.ndarray:
        """Elements [start, stop) of ``source.field`` (of each layer's, for a stack)."""
        if not set(source.names) <= set(self._done):
            # A projection's fields are filled one after the other: the last one's codes
            # (this process's share of them, again) are let go before the next is quantized.
            self._done.clear()
        parts = []
        for name in source.names:
            if name not in self._done:
                self._done[name] = self._quantize(name, source.shape)
            field = self._done[name][source.field]
            parts.append(field(start, stop) if callable(field) else field[start:stop])
        out = np.stack(parts) if len(source.names) > 1 else parts[0]
        return out.astype(dtype, copy=False)

    def _quantize(self, name: str, shape: tuple[int, int]) -> dict[str, Any]:
        f = self.where[name]
        if f.shape(name) != shape:
            raise ValueError(
                f"{self.folder}: {name} has shape {f.shape(name)}, the model's {shape}"
            )
        size = math.prod(shape)
        if size % _BLOCK:
            raise ValueError(
                f"{self.folder}: {name} cannot be quantized to NF4 (size {size} is not a "
                f"multiple of the block size {_BLOCK})"
            )
        blocks = size // _BLOCK
        kc, ka = shard_size(size // 2, self.n), shard_size(blocks, self.n)
        # The 64-blocks this process needs: those its codes' slices cover and those whose
        # absmax its absmax slices hold (the same ones when N divides the blocks).
        spans = []
        for r in self.ranks:
            c0, c1 = min(r * kc, size // 2), min((r + 1) * kc, size // 2)
            spans.append((2 * c0 // _BLOCK, -(-2 * c1 // _BLOCK)))
            spans.append((min(r * ka, blocks), min((r + 1) * ka, blocks)))
        runs: dict[int, np.ndarray] = {}  # first block -> the codes of a run of blocks
        absmax = np.zeros(blocks, np.float32)
        for b0, b1 in _merge(spans):
            run = np.empty((b1 - b0) * _BLOCK // 2, np.uint8)
            # a few MB read at a time: the quantized run, not the weights, is what stays
            for c0 in range(b0, b1, _READ_BLOCKS):
                c1 = min(c0 + _READ_BLOCKS, b1)
                tensor = f.get_elements(name, c0 * _BLOCK, c1 * _BLOCK)
                if not np.isfinite(tensor).all():
                    raise ValueError(
                        f"{self.folder}: {name} holds non-finite values (NaN or inf), which "
                        "NF4 cannot store: the checkpoint is damaged, or load it unquantized"
                    )
                # rounded to the storage dtype first, as the whole-tensor load does
                q = rk.nf4_quantize(
                    tensor.astype(self.param_dtype), double_quant=False, chunk_size=2**16
                )
                run[(c0 - b0) * _BLOCK // 2 : (c1 - b0) * _BLOCK // 2] = np.asarray(q.codes)
                absmax[c0:c1] = np.asarray(q.absmax)
            runs[b0] = run
        # Every process's absmax slices, gathered: the offset is the mean of them all.
        held = rs.ShardedParameter.from_local(
            lambda r: absmax[min(r * ka, blocks) : min((r + 1) * ka, blocks)],
            (blocks,),
            self.mesh,
            AXIS,
            dtype=np.float32,
        )
        whole = jax.jit(lambda x: x, out_shardings=NamedSharding(self.mesh, P()))(held.local)
        full = np.asarray(whole.addressable_data(0))[:blocks]
        absmax_codes, scales, offset = rk.nf4_double_quantize(full, absmax_rounding=self.rounding)

        def codes(start: int, stop: int) -> np.ndarray:
            first = max(b for b in runs if b * _BLOCK // 2 <= start)
            at = first * _BLOCK // 2
            return runs[first][start - at : stop - at]

        return {
            "codes": codes,
            "absmax_codes": np.asarray(absmax_codes),
            "absmax_scales": np.asarray(scales),
            "absmax_offset": np.asarray(offset).reshape(1),
        }


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of half-open ranges, as sorted disjoint ranges (empty ones dropped)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
