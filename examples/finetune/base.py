"""The base model of a fine-tuning run: loaded with its adapters, and identified.

- ``load``: the base with LoRA on, whole on one device, or, over a mesh with an ``fsdp``
  axis, read straight onto the mesh (``rudax.models.from_pretrained(..., mesh=)``): each
  process reads from the files only its own shards and quantizes only its own NF4 blocks, so
  no process ever holds the whole base. The adapters are put on by ``prepare`` before the
  layers are stacked and sharded, from the same seed either way, so both start from the same
  adapters.
- the base's identity is ``rudax.models.checkpoint_digest``, the SHA-256 of its config.json and
  of the safetensors files it is read from. It needs no loaded model, so a run loaded onto a mesh
  has it too, and it is the same whichever way the run loads the base. Runs started before it
  recorded ``model_digest`` (the model as loaded, leaf by leaf), which ``--resume`` still
  checks for them (``is_legacy``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import rudax.models as rm

# The kind of digest a run records beside ``base_sha256``; runs without it used model_digest.
DIGEST_KIND = "config.json and safetensors files"


def load(
    base_dir: Path,
    mesh: Mesh | None,
    prepare: Callable[[Any], None],
    *,
    loaded: Callable[[Any], None] | None = None,
    **kw: Any,
) -> tuple[rm.LlamaForCausalLM | None, rm.LlamaForCausalLM]:
    """``(model, trained)``: the base with ``prepare``'s adapters on. ``trained`` is the model
    the step holds when ``mesh`` has an ``fsdp`` axis: read straight onto it, and ``model`` is
    None; otherwise both are the one model, held whole (the step shards or replicates it).
    ``loaded``: called with the model held whole as loaded, before its adapters (not over an
    ``fsdp`` mesh). ``kw``: ``from_pretrained``'s dtypes and quantization, and
    ``scan_layers``."""
    if mesh is not None and "fsdp" in mesh.axis_names:
        return None, rm.from_pretrained(base_dir, mesh=mesh, prepare=prepare, **kw)
    scan = kw.pop("scan_layers")
    model = rm.from_pretrained(base_dir, **kw)
    if loaded is not None:
        loaded(model)
    prepare(model)
    # Stacked once, after the adapters are on: the scan then reads the layers as stored.
    model.scan_layers = scan
    return model, model


def parameter_count(config: rm.LlamaConfig) -> int:
    """The base's parameters (an NF4 weight counts its elements), from shapes alone."""
    shapes = nnx.eval_shape(lambda: rm.LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(shapes)))


def model_digest(hf_config: dict[str, Any], model: rm.LlamaForCausalLM) -> str:
    """The digest runs recorded before ``checkpoint_digest``: the base's config.json, then every
    leaf of the whole model as loaded (path, dtype, shape, bytes), before its adapters."""
    digest = hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode())
    for path, leaf in jax.tree.leaves_with_path(nnx.state(model)):
        if isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1:
            leaf = leaf.addressable_data(0)  # replicated over a data-parallel mesh
        array = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype.name}:{array.shape};".encode())
        digest.update(np.ascontiguousarray(array).view(np.uint8).data)
    return digest.hexdigest()


def legacy_run(run_dir: Path, resume: bool) -> bool:
    """Whether this session continues a run whose config.json records a ``model_digest``
    (started before ``checkpoint_digest``): it is checked against that digest."""
    if not resume:
        return False
    saved = json.loads((run_dir / "config.json").read_text())
    return "base_sha256" in saved and "base_digest" not in saved


def identity(digest: str, legacy: bool) -> dict[str, str]:
    """The base's part of a run's identity: its digest, and which kind (none for legacy)."""
    return {"base_sha256": digest} | ({} if legacy else {"base_digest": DIGEST_KIND})
