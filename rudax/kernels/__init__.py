"""rudax.kernels: Pallas kernels for the memory-bound parts of training, with exact XLA paths.

``flash_attention`` is attention in O(T) memory: Triton kernels on a GPU, the same blocked
algorithm in ``lax`` loops elsewhere, both with an ordered (atomic-free) backward.
``decode_attention`` is a decoding step's attention: one query per row over a KV cache (and a
block shared by a prompt's samples), two batched matmuls over the cache as stored.

Every Pallas op takes ``impl="auto"``, ``"pallas"`` or ``"xla"``, and an ``interpret`` flag
that runs its Pallas kernel on any backend (for tests). ``"auto"`` is the XLA path off a GPU;
on a GPU it is the Pallas kernel only where that was measured faster than the XLA path
(``docs/gpu_results.md``, on an H200): ``rms_norm`` and ``layer_norm`` (1.3x and 2.0x), and
``flash_attention`` (measured against cuDNN); ``silu_mul``, ``adamw_update``,
``global_norm_and_finite`` (``fused_adamw``) and ``nf4_matmul`` run their XLA path, which
was faster there (1.16x, 1.65x and 3.4x).
``linear_cross_entropy`` is XLA only: its fusion is the chunking, which saves memory, not a
kernel. Each op's ``*_reference`` is the pure-jnp definition it is tested against.
"""

# Public names, re-exported one per line (``from rudax.kernels._x import a as a``), each in its
# block below, and listed again, sorted, in __all__. The blocks are in module order, the order
# ruff's import sorting keeps, within each ``isort: split`` section.

# [block: adamw]
# isort: split
from rudax.kernels._adamw import AdamWBlock as AdamWBlock
from rudax.kernels._adamw import adamw_update as adamw_update
from rudax.kernels._adamw import adamw_update_reference as adamw_update_reference
from rudax.kernels._compat import EXPORT_DISABLED_CHECKS as EXPORT_DISABLED_CHECKS
from rudax.kernels._decode_attention import decode_attention as decode_attention
from rudax.kernels._decode_attention import (
    decode_attention_reference as decode_attention_reference,
)
from rudax.kernels._determinism import DETERMINISTIC_XLA_FLAGS as DETERMINISTIC_XLA_FLAGS
from rudax.kernels._determinism import enable_deterministic_gpu as enable_deterministic_gpu

# [block: flash_attention]
from rudax.kernels._flash_attention import FlashAttentionBlock as FlashAttentionBlock
from rudax.kernels._flash_attention import flash_attention as flash_attention
from rudax.kernels._flash_attention import (
    flash_attention_reference as flash_attention_reference,
)
from rudax.kernels._global_norm import GlobalNormBlock as GlobalNormBlock
from rudax.kernels._global_norm import global_norm_and_finite as global_norm_and_finite
from rudax.kernels._global_norm import (
    global_norm_and_finite_reference as global_norm_and_finite_reference,
)

# [block: norms]
from rudax.kernels._layer_norm import layer_norm as layer_norm
from rudax.kernels._layer_norm import layer_norm_reference as layer_norm_reference

# [block: nf4]
from rudax.kernels._nf4 import NF4Tensor as NF4Tensor
from rudax.kernels._nf4 import nf4_dequantize as nf4_dequantize
from rudax.kernels._nf4 import nf4_quantize as nf4_quantize
from rudax.kernels._nf4_double import nf4_double_quantize as nf4_double_quantize
from rudax.kernels._nf4_matmul import NF4MatmulBlock as NF4MatmulBlock
from rudax.kernels._nf4_matmul import nf4_matmul as nf4_matmul
from rudax.kernels._nf4_matmul import nf4_matmul_reference as nf4_matmul_reference
from rudax.kernels._rms_norm import rms_norm as rms_norm
from rudax.kernels._rms_norm import rms_norm_reference as rms_norm_reference
from rudax.kernels._rowwise import RowBlock as RowBlock
from rudax.kernels._target import gpu_export_target as gpu_export_target

# [block: linear_cross_entropy]
# isort: split
from rudax.kernels._linear_cross_entropy import linear_cross_entropy as linear_cross_entropy
from rudax.kernels._linear_cross_entropy import (
    linear_cross_entropy_reference as linear_cross_entropy_reference,
)

# [block: silu_mul]
from rudax.kernels._silu_mul import SiluMulBlock as SiluMulBlock
from rudax.kernels._silu_mul import silu_mul as silu_mul
from rudax.kernels._silu_mul import silu_mul_reference as silu_mul_reference

__all__: list[str] = [
    "DETERMINISTIC_XLA_FLAGS",
    "EXPORT_DISABLED_CHECKS",
    "AdamWBlock",
    "FlashAttentionBlock",
    "GlobalNormBlock",
    "NF4MatmulBlock",
    "NF4Tensor",
    "RowBlock",
    "SiluMulBlock",
    "adamw_update",
    "adamw_update_reference",
    "decode_attention",
    "decode_attention_reference",
    "enable_deterministic_gpu",
    "flash_attention",
    "flash_attention_reference",
    "global_norm_and_finite",
    "global_norm_and_finite_reference",
    "gpu_export_target",
    "layer_norm",
    "layer_norm_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "nf4_dequantize",
    "nf4_double_quantize",
    "nf4_matmul",
    "nf4_matmul_reference",
    "nf4_quantize",
    "rms_norm",
    "rms_norm_reference",
    "silu_mul",
    "silu_mul_reference",
]
