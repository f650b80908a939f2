"""``checkpoint_digest``: a Hugging Face checkpoint folder's identity, without loading it.

A fine-tuning or post-training run records the base it tunes and refuses to resume on
another: the SHA-256 of the base's ``config.json`` (parsed, so its formatting aside) and of
every safetensors file the model is read from (by name, streamed). It needs no loaded model,
so a run that reads the base straight onto a mesh (each process its own slices) has it too,
and it is the same whichever way the base is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from rudax.models._hf_files import open_checkpoint

__all__ = ["checkpoint_digest"]


def checkpoint_digest(directory: str | os.PathLike) -> str:
    """The SHA-256 (hex) of a checkpoint folder's config and weight files.

    ``sha256(json(config, sorted keys); ";name:" sha256(file) for each safetensors file in
    name order)``: the files that ``from_pretrained`` reads (an index's shards, or
    ``model.safetensors``), not the tokenizer or other files beside them. Under
    ``jax.distributed`` process 0 reads the files and broadcasts the digest, so a cluster
    reads them once; every process must call it.

    Args:
      directory: a folder with ``config.json`` and its safetensors files.

    Returns:
      64 hex characters.

    Example:
      >>> import tempfile
      >>> from flax import nnx
      >>> import rudax.models as rm
      >>> folder = tempfile.mkdtemp()
      >>> config = rm.LlamaConfig.tiny(64, hidden_size=32, num_hidden_layers=1)
      >>> rm.save_pretrained(rm.LlamaForCausalLM(config, rngs=nnx.Rngs(0)), folder)
      >>> len(rm.checkpoint_digest(folder))
      64
    """
    folder = Path(directory)
    digest = ""
    if jax.process_index() == 0:
        config = json.loads((folder / "config.json").read_text())
        h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
        for path in sorted({f.path for f in open_checkpoint(folder).values()}):
            h.update(f";{path.name}:".encode())
            with open(path, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        digest = h.hexdigest()
    if jax.process_count() == 1:
        return digest
    raw = np.frombuffer(digest.encode().ljust(64, b"\0"), np.uint8)
    return bytes(multihost_utils.broadcast_one_to_all(raw)).decode()
