"""rudax.layers: flax.nnx Modules whose storage and compute dtypes are chosen separately.

Every layer casts explicitly (it runs under strict dtype promotion), takes a compute ``dtype``
(None: the input's dtype) apart from its parameters' ``param_dtype``, and uses rudax.kernels'
fused ops for its memory-bound parts (norms, SwiGLU). ``to_dtype`` converts a model's
parameter storage while keeping tied variables tied and frozen ones frozen. ``apply_lora``
puts LoRA on any Linear layers chosen by name, ``merge_lora`` folds it back,
``save_adapter`` / ``load_adapter`` read and write peft's adapter files, and
``adapters_disabled`` computes a model with its adapters off (post-training's reference
policy, without a second copy of the weights). ``NF4Linear`` is a frozen base stored in
4-bit NormalFloat (``Quantized`` variables), QLoRA's base, which
``apply_lora(..., quantize_base="nf4")`` builds while it adapts. ``remat`` checkpoints a
block's activations under a named policy (``REMAT_POLICIES``), ``scan_layers`` runs a stack
of identical layers as one ``lax.scan`` (``stack_layers`` / ``unstack_layers`` store them
stacked, so the scan copies nothing). ``MoE`` is a dropless top-k mixture of SwiGLU
experts with its load-balancing loss (``load_balancing_loss``). ``Attention`` is self-attention
with rotary positions (``apply_rope``, ``rope_frequencies``, ``Llama3RopeScaling``) over
rudax.kernels' ``flash_attention``: grouped-query heads, packed rows, windows and soft caps.
"""

# Public names, re-exported one per line (``from rudax.layers._x import a as a``), sorted as
# isort sorts them, and listed again in __all__.
from rudax.layers._adapters_off import adapters_disabled as adapters_disabled
from rudax.layers._apply_lora import ModuleNames as ModuleNames
from rudax.layers._apply_lora import apply_lora as apply_lora
from rudax.layers._apply_lora import lora_state as lora_state
from rudax.layers._attention import Attention as Attention
from rudax.layers._dropout import Dropout as Dropout
from rudax.layers._dtype import to_dtype as to_dtype
from rudax.layers._embedding import Embedding as Embedding
from rudax.layers._embedding import TiedProjection as TiedProjection
from rudax.layers._frozen import Frozen as Frozen
from rudax.layers._linear import Linear as Linear
from rudax.layers._lookup import lookup as lookup
from rudax.layers._lookup import sorted_segment_sum as sorted_segment_sum
from rudax.layers._lora import LoRALinear as LoRALinear
from rudax.layers._lora import LoRAParam as LoRAParam
from rudax.layers._merge_lora import merge_lora as merge_lora
from rudax.layers._mlp import GatedMLP as GatedMLP
from rudax.layers._moe import MoE as MoE
from rudax.layers._moe import MoEExperts as MoEExperts
from rudax.layers._moe import load_balancing_loss as load_balancing_loss
from rudax.layers._moe import routed_experts as routed_experts
from rudax.layers._nf4_linear import NF4Linear as NF4Linear
from rudax.layers._nf4_linear import Quantized as Quantized
from rudax.layers._norms import LayerNorm as LayerNorm
from rudax.layers._norms import RMSNorm as RMSNorm
from rudax.layers._peft import load_adapter as load_adapter
from rudax.layers._peft import save_adapter as save_adapter
from rudax.layers._remat import REMAT_POLICIES as REMAT_POLICIES
from rudax.layers._remat import remat as remat
from rudax.layers._residuals import saved_for_backward as saved_for_backward
from rudax.layers._rope import Llama3RopeScaling as Llama3RopeScaling
from rudax.layers._rope import apply_rope as apply_rope
from rudax.layers._rope import rope_frequencies as rope_frequencies
from rudax.layers._scan import is_stacked as is_stacked
from rudax.layers._scan import scan_layers as scan_layers
from rudax.layers._scan import stack_layers as stack_layers
from rudax.layers._scan import unstack_layers as unstack_layers

__all__ = [
    "REMAT_POLICIES",
    "Attention",
    "Dropout",
    "Embedding",
    "Frozen",
    "GatedMLP",
    "LayerNorm",
    "Linear",
    "Llama3RopeScaling",
    "LoRALinear",
    "LoRAParam",
    "MoE",
    "MoEExperts",
    "ModuleNames",
    "NF4Linear",
    "Quantized",
    "RMSNorm",
    "TiedProjection",
    "adapters_disabled",
    "apply_lora",
    "apply_rope",
    "is_stacked",
    "load_adapter",
    "load_balancing_loss",
    "lookup",
    "lora_state",
    "merge_lora",
    "remat",
    "rope_frequencies",
    "routed_experts",
    "save_adapter",
    "saved_for_backward",
    "scan_layers",
    "sorted_segment_sum",
    "stack_layers",
    "to_dtype",
    "unstack_layers",
]
