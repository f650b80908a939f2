"""bitsandbytes' ``dequantize_4bit`` as a reference that holds on every CPU.

NF4's 64-blocks run over the flattened tensor, and bitsandbytes quantizes them so. Its native
CPU dequantize kernel (bitsandbytes 0.50.2, ``backends/cpu/ops.py``) takes the tensor as
``[m, n]`` and, on some CPUs, misplaces the blocks when ``n`` is not a multiple of the block
size: on an AMD EPYC with AVX-512 its output for a (256, 96) weight disagrees with its own
codes and absmax in 90% of the values, where on an earlier CI machine it agreed. Dequantizing
the same state as ``[numel / block, block]`` is the same function of the same codes and
absmax, and takes the kernel only where it is right.
"""

from __future__ import annotations

import copy
import math

import bitsandbytes.functional as bnbf
import torch


def dequantize_4bit(codes: torch.Tensor, state) -> torch.Tensor:
    """``bnbf.dequantize_4bit(codes, state)``, taken over whole blocks, in ``state.shape``."""
    n = math.prod(state.shape)
    if n % state.blocksize:
        raise ValueError(f"{tuple(state.shape)} is not a whole number of {state.blocksize}-blocks")
    blocks = copy.copy(state)
    blocks.shape = torch.Size([n // state.blocksize, state.blocksize])
    return bnbf.dequantize_4bit(codes, blocks).reshape(state.shape)
