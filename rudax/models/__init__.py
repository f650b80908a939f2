"""rudax.models: Llama-family models read from and written to Hugging Face checkpoints.

``LlamaConfig`` is the architecture in Hugging Face's field names: ``from_hf`` reads a
``config.json`` as transformers 4.4x and 5.x write it for Llama, Qwen2, Mistral and
Mixtral checkpoints, refusing (and naming) only a field that would change what the model
computes (an unknown field loads with one warning; an absent one takes transformers' default
for its ``model_type``); ``to_hf`` writes one both versions read. ``LlamaForCausalLM`` is the
model, with transformers' module names; ``from_pretrained`` / ``save_pretrained`` read and
write checkpoint folders (``from_pretrained(..., mesh=mesh)`` straight into the FSDP form,
each process reading only its shards; ``SafetensorsFile`` / ``save_safetensors`` the files),
``generate`` writes text with a
KV cache (``num_samples`` continuations of a prompt sharing its keys and values; with
``return_logprobs``, a ``Generation`` with each token's log-probability),
``causal_lm_loss_sum`` is the training loss (a sum over labelled tokens, for token-weighted
accumulation), ``causal_lm_token_logprobs`` each label's log-probability (post-training's,
at the sampling temperature), ``shard`` is a model's FSDP form, ``flops_per_token`` its
training FLOPs (for MFU), ``load_tokenizer`` reads a folder's ``tokenizer.json`` with its
eos id and chat template (``ChatTemplate`` renders a tokenizer's own template), and
``pack_shared_prefix`` lays out a prompt and its completions so the prompt is computed once.
The main job's recipe: ``ModelSpec`` (a model and how it computes), ``OptimizerSpec`` and
``decay_mask`` (its update rule), ``next_token_loss_sum`` (the loss of a token stream's rows).
"""

# Public names, re-exported one per line (``from rudax.models._x import a as a``), sorted as
# isort sorts them, and listed again in __all__.
from rudax.models._chat import ChatTemplate as ChatTemplate
from rudax.models._chat import load_chat_template as load_chat_template
from rudax.models._flops import flops_per_token as flops_per_token
from rudax.models._gather import gather_adapters as gather_adapters
from rudax.models._gather import gather_adapters_into as gather_adapters_into
from rudax.models._generate import Generation as Generation
from rudax.models._generate import generate as generate
from rudax.models._hf_digest import checkpoint_digest as checkpoint_digest
from rudax.models._hf_files import PROJECTIONS as PROJECTIONS
from rudax.models._hf_files import from_pretrained as from_pretrained
from rudax.models._hf_files import open_checkpoint as open_checkpoint
from rudax.models._hf_save import save_pretrained as save_pretrained
from rudax.models._kv_cache import KVCache as KVCache
from rudax.models._llama import LlamaForCausalLM as LlamaForCausalLM
from rudax.models._llama_config import LlamaConfig as LlamaConfig
from rudax.models._logprobs import causal_lm_token_logprobs as causal_lm_token_logprobs
from rudax.models._loss import IGNORE_INDEX as IGNORE_INDEX
from rudax.models._loss import causal_lm_loss_sum as causal_lm_loss_sum
from rudax.models._loss import next_token_loss_sum as next_token_loss_sum
from rudax.models._optimizer import OPTIMIZERS as OPTIMIZERS
from rudax.models._optimizer import OptimizerSpec as OptimizerSpec
from rudax.models._optimizer import decay_mask as decay_mask
from rudax.models._safetensors import SafetensorsFile as SafetensorsFile
from rudax.models._safetensors_writer import save_safetensors as save_safetensors
from rudax.models._shard import shard as shard
from rudax.models._shared_prefix import SharedPrefixBatch as SharedPrefixBatch
from rudax.models._shared_prefix import pack_shared_prefix as pack_shared_prefix
from rudax.models._spec import ModelSpec as ModelSpec
from rudax.models._tokenizer import ModelTokenizer as ModelTokenizer
from rudax.models._tokenizer import load_tokenizer as load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "OPTIMIZERS",
    "PROJECTIONS",
    "ChatTemplate",
    "Generation",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "ModelSpec",
    "ModelTokenizer",
    "OptimizerSpec",
    "SafetensorsFile",
    "SharedPrefixBatch",
    "causal_lm_loss_sum",
    "causal_lm_token_logprobs",
    "checkpoint_digest",
    "decay_mask",
    "flops_per_token",
    "from_pretrained",
    "gather_adapters",
    "gather_adapters_into",
    "generate",
    "load_chat_template",
    "load_tokenizer",
    "next_token_loss_sum",
    "open_checkpoint",
    "pack_shared_prefix",
    "save_pretrained",
    "save_safetensors",
    "shard",
]
