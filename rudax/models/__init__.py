"""rudax.models: Llama-family models read from and written to Hugging Face checkpoints.

``LlamaConfig`` is the architecture in Hugging Face's field names: ``from_hf`` reads a
``config.json`` as transformers 4.4x and 5.x write it for Llama, Qwen2 and Mistral
checkpoints, refusing (and naming) only a field that would change what the model computes;
``to_hf`` writes one both versions read.
"""

# Public names, re-exported one per line (``from rudax.models._x import a as a``), sorted as
# isort sorts them, and listed again in __all__.
from rudax.models._chat import ChatTemplate as ChatTemplate
from rudax.models._chat import load_chat_template as load_chat_template
from rudax.models._generate import generate as generate
from rudax.models._llama import KVCache as KVCache
from rudax.models._llama import LlamaForCausalLM as LlamaForCausalLM
from rudax.models._llama_config import LlamaConfig as LlamaConfig

__all__ = [
    "ChatTemplate",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "generate",
    "load_chat_template",
]
