"""``save_pretrained``: a ``LlamaForCausalLM`` written as a Hugging Face checkpoint folder.

Writing puts every file ``from_pretrained`` needs into the folder (``config.json``,
``model.safetensors``, ``generation_config.json``) and copies the tokenizer's files and chat
template through from a source folder, each written beside its final name and renamed, so an
interrupted save never leaves a half-written file under a real name. Parameters keep their
storage dtype (a bf16 base is written as bf16).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import rudax.layers as rl
from rudax.models import _llama, _llama_layers, _mixtral
from rudax.models._hf_files import CONFIG, GENERATION, INDEX, TOKENIZER_FILES, WEIGHTS
from rudax.models._hf_names import state_dict
from rudax.models._llama import LlamaForCausalLM
from rudax.models._safetensors_writer import save_safetensors

__all__ = ["save_pretrained"]


def save_pretrained(
    model: LlamaForCausalLM,
    directory: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
) -> None:
    """Writes ``model`` as a checkpoint folder transformers' ``from_pretrained`` loads.

    ``config.json`` (``LlamaConfig.to_hf``), ``model.safetensors`` (each parameter in its
    storage dtype, in torch's layout, a tied head once), ``generation_config.json`` (the
    config's bos/eos/pad ids), and, given ``tokenizer``, that folder's tokenizer files and
    chat template (``TOKENIZER_FILES``) copied through unchanged.

    Args:
      model: a ``LlamaForCausalLM`` of plain layers: fold LoRA adapters in first
        (``rudax.layers.merge_lora``), or save them alone (``rudax.layers.save_adapter``).
      directory: the folder; created if need be. One that holds a sharded checkpoint
        (``model.safetensors.index.json``) is refused: transformers would read the new
        ``model.safetensors``, other readers the old shards.
      tokenizer: a folder holding a tokenizer (the base checkpoint's, say), or None.
    """
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"model must be a rudax.models.LlamaForCausalLM, got {model!r}")
    folder = Path(directory)
    if (folder / INDEX).exists():
        raise ValueError(
            f"{folder} holds a sharded checkpoint ({INDEX}) beside which a new {WEIGHTS} would "
            "be ambiguous: remove it, or save elsewhere"
        )
    source = None if tokenizer is None else Path(tokenizer)
    if source is not None and not source.is_dir():
        raise ValueError(f"tokenizer={str(tokenizer)!r} is not a folder")
    odd = [
        (path, node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module) and not isinstance(node, _PLAIN)
    ]
    if odd:
        path, node = min(odd, key=lambda item: len(item[0]))
        raise TypeError(
            f"save_pretrained: {'.'.join(map(str, path))} is a {type(node).__name__}, which "
            "has no Hugging Face form: fold LoRA adapters into the base with "
            "rudax.layers.merge_lora(model) first (or save them alone with "
            "rudax.layers.save_adapter)"
        )
    tensors: dict[str, np.ndarray] = {}
    for name, value in state_dict(model).items():
        if not isinstance(value, jax.Array | np.ndarray):
            raise TypeError(f"save_pretrained: {name} holds {type(value).__name__}, no array")
        tensors[name] = np.asarray(value)
    config = model.config
    generation = {
        k: v
        for k, v in config.to_hf().items()
        if k in ("bos_token_id", "eos_token_id", "pad_token_id") and v is not None
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(folder / WEIGHTS, tensors, metadata={"format": "pt"})
    _write_text(folder / CONFIG, json.dumps(config.to_hf(), indent=2) + "\n")
    _write_text(folder / GENERATION, json.dumps(generation, indent=2) + "\n")
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file() and (source / name).resolve() != (folder / name).resolve():
                partial = folder / (name + ".partial")
                shutil.copyfile(source / name, partial)
                os.replace(partial, folder / name)


# The modules a checkpoint file can express: anything else (LoRALinear, NF4Linear, a sharded
# module) has parameters with no Hugging Face name.
_PLAIN = (
    LlamaForCausalLM,
    _llama.LlamaModel,
    _llama_layers.LlamaDecoderLayer,
    _llama_layers.LlamaAttention,
    _llama_layers.LlamaMLP,
    _mixtral.MixtralSparseMoeBlock,
    rl.MoEExperts,
    nnx.List,
    rl.Linear,
    rl.RMSNorm,
    rl.Embedding,
    rl.TiedProjection,
)


def _write_text(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
