"""bitsandbytes' ``dequantize_4bit`` as a reference that holds on every CPU.

NF4's 64-blocks run over the flattened tensor, and bitsandbytes quantizes them so. Its native
CPU dequantize kernel (bitsandbytes 0.50.2, ``backends/cpu/ops.py``) takes the tensor as
``[m, n]`` and, on some CPUs, misplaces the blocks when ``n`` is not a multiple of the block
size: on an AMD EPYC with AVX-512 its output for a (256, 96) weight disagrees with its own
codes and absmax in 90% of the values, where on an earlier CI machine it agreed. Dequantizing
the same state as ``[numel / block, block]`` is the same function of the same codes and
absmax, and takes the kernel only where it is right.

bitsandbytes is the ``reference`` extra; the GPU machine's image has none. Without it
``bnbf`` is None and ``needs_bitsandbytes`` skips the tests that compare with it, so the
numpy-reference tests beside them still run there.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

try:
    import bitsandbytes.functional as bnbf
except ImportError:  # the GPU image: no bitsandbytes
    bnbf = None

needs_bitsandbytes = pytest.mark.skipif(
    bnbf is None,
    reason="bitsandbytes (the reference extra) is not installed, as on the GPU image; the "
    "numpy-reference tests still run",
)


def dequantize_4bit(codes: torch.Tensor, state) -> torch.Tensor:
    """``bnbf.dequantize_4bit(codes, state)``, taken over whole blocks, in ``state.shape``."""
    assert bnbf is not None, "needs_bitsandbytes"
    n = math.prod(state.shape)
    if n % state.blocksize:
        raise ValueError(f"{tuple(state.shape)} is not a whole number of {state.blocksize}-blocks")
    blocks = copy.copy(state)
    blocks.shape = torch.Size([n // state.blocksize, state.blocksize])
    return bnbf.dequantize_4bit(codes, blocks).reshape(state.shape)
