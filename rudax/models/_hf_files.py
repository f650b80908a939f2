"""Hugging Face checkpoint folders read: ``open_checkpoint`` and ``from_pretrained``
(``save_pretrained``, the writing, is ``_hf_save.py``).

Reading follows transformers' own precedence and refuses what it refuses:

* ``model.safetensors`` when present, else ``model.safetensors.index.json`` and its shards
  (transformers reads the single file first, so a stale index beside it is never read);
* a shard the index names must lie inside the folder, symlinks resolved (an index naming
  ``../outside.safetensors`` is refused, as transformers refuses it);
* every tensor is read once, one at a time, and cast to the parameter's dtype; nothing the
  model does not read may be in the files (a checkpoint of another shape or family).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import rudax.kernels as rk
import rudax.layers as rl
from rudax.models._hf_mesh_load import Rounding, load_onto_mesh
from rudax.models._hf_names import hf_name, load_state
from rudax.models._llama import LlamaForCausalLM
from rudax.models._llama_config import LlamaConfig
from rudax.models._safetensors import SafetensorsFile

__all__ = ["TOKENIZER_FILES", "from_pretrained", "open_checkpoint"]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION = "generation_config.json"
# What transformers' tokenizers write and read back (AutoTokenizer.from_pretrained), copied
# through as they are: the tokenizer, its config (special tokens, chat template in 4.x), the
# 5.x chat template file, and the legacy special-tokens map.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e})") from e


def _inside(directory: Path, name: Any, index: Path) -> Path:
    """The shard ``name`` an index lists, refused unless it resolves inside ``directory``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{index}: weight_map holds {name!r}, not a file name")
    path = (directory / name).resolve()
    if not path.is_relative_to(directory.resolve()):
        raise ValueError(
            f"{index}: names {name!r}, which resolves to {path}, outside {directory}: refused"
        )
    if not path.is_file():
        raise ValueError(f"{index}: lists {name}, which is not a file in {directory}")
    return path


def open_checkpoint(directory: str | os.PathLike) -> dict[str, SafetensorsFile]:
    """{tensor name: the safetensors file holding it} of a checkpoint folder, as transformers
    finds them (module docstring): headers read and checked, no tensor read yet.

    Example:
      >>> import tempfile, numpy as np
      >>> from rudax.models import open_checkpoint, save_safetensors
      >>> folder = tempfile.mkdtemp()
      >>> save_safetensors(folder + "/model.safetensors", {"w": np.ones(2, np.float32)})
      >>> files = open_checkpoint(folder)
      >>> list(files), files["w"].get_tensor("w").tolist()
      (['w'], [1.0, 1.0])
    """
    directory = Path(directory)
    single, index = directory / WEIGHTS, directory / INDEX
    weight_map: dict[str, Any] | None = None
    if single.is_file():
        paths = [single]
    elif index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map of tensor names to files")
        paths = sorted({_inside(directory, name, index) for name in weight_map.values()})
    else:
        found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        bins = [n for n in found if n.endswith(".bin")]
        hint = f" (it holds {bins}: rudax reads safetensors only)" if bins else ""
        if os.path.lexists(single):  # there, but not a file: exists() is False for a loop
            hint = f" ({WEIGHTS} is not a regular file: a folder, a broken symlink or a loop)"
        raise ValueError(f"{directory}: no {WEIGHTS} or {INDEX}{hint}")
    where: dict[str, SafetensorsFile] = {}
    for path in paths:
        handle = SafetensorsFile(path)
        for key in handle.keys():
            if key in where:
                raise ValueError(f"{directory}: tensor {key} is in two files")
            if weight_map is not None:
                listed = weight_map.get(key)
                if listed is None or (directory / str(listed)).resolve() != path:
                    raise ValueError(f"{path}: holds {key}, which {INDEX} puts in {listed!r}")
            where[key] = handle
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(where))
        if absent:
            raise ValueError(
                f"{index}: lists {absent[0]} in {weight_map[absent[0]]}, which lacks it"
            )
    return where


# Formats from_pretrained quantizes the projections to as it reads them.
QUANTIZE = (None, "nf4")
# The decoder layers' projections, by their Hugging Face (and peft target) names: what QLoRA
# quantizes and adapts (the embedding, norms and head stay).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Elements quantized per step: small and of one size, so each step's temporaries are freed
# and reused (measured on the host peak of a Llama 3 8B load).
_QUANTIZE_CHUNK = 2**16


def from_pretrained(
    directory: str | os.PathLike,
    *,
    param_dtype: Any = None,
    dtype: Any = None,
    quantize: str | None = None,
    absmax_rounding: Literal["cuda", "cpu"] = "cuda",
    prepare: Callable[[LlamaForCausalLM], Any] | None = None,
    scan_layers: bool = False,
    mesh: Mesh | None = None,
    gather_dtype: Any = None,
) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` read from a Hugging Face checkpoint folder.

    Args:
      directory: a folder with ``config.json`` and ``model.safetensors`` (or a sharded
        ``model.safetensors.index.json`` and its shards), as transformers 4.4x and 5.x write.
      param_dtype: the storage dtype; None for the checkpoint's.
      dtype: the compute dtype; None for the storage dtype.
      quantize: None, or ``"nf4"``: each decoder projection (``PROJECTIONS``) becomes a
        frozen ``rudax.layers.NF4Linear`` as it is read (rounded to ``param_dtype`` first, then
        ``rudax.kernels.nf4_quantize`` with double quantization in blocks of 64, a chunk at a
        time), QLoRA's base: the whole model in ``param_dtype`` never exists. The embedding,
        norms and head stay in ``param_dtype``, as bitsandbytes leaves them, and so do a
        Mixtral's router and experts (stacked, not ``Linear`` layers). A projection
        holding NaN or inf is refused, naming it: NF4 cannot store it.
      absmax_rounding: under ``quantize="nf4"``, whose 8-bit absmax codes to reproduce:
        ``"cuda"`` (bitsandbytes' CUDA kernel, which quantized the checkpoints people share)
        or ``"cpu"`` (its CPU kernel); see ``rudax.kernels.nf4_quantize``.
      prepare: a function that changes the loaded model in place, as
        ``rudax.layers.apply_lora`` does (``lambda m: rl.apply_lora(m, ...)``; what it returns
        is ignored), applied before the layers are stacked and sharded.
        With a ``mesh`` it runs on the model built abstractly (no arrays), and what it adds
        (LoRA adapters) starts at the values it would have on the whole model.
      scan_layers: store the decoder layers stacked (``LlamaForCausalLM.scan_layers``).
      mesh: a ``jax.sharding.Mesh`` with an ``fsdp`` axis (and any others, such as
        ``data``): the model comes back in ``rudax.models.shard``'s form over it, and each
        process reads from the files only the bytes of its own devices' shards (an NF4
        projection: quantizes only its own blocks, the processes sharing the blocks' scales
        for the double quantization; the same bits as quantizing the whole tensor). No
        process ever holds a whole tensor. Every process of a multi-process run calls it.
      gather_dtype: with a ``mesh``, ``rudax.models.shard``'s ``compute_dtype``: the dtype
        parameters are cast to before their all-gather; None gathers the storage dtype.

    Returns:
      The model; its ``config`` keeps the checkpoint's token ids. The weights are read
      tensor by tensor into a model built without initializing anything.

    Example:
      >>> import tempfile
      >>> from flax import nnx
      >>> from rudax.models import LlamaConfig, LlamaForCausalLM, from_pretrained, save_pretrained
      >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
      ...                      num_hidden_layers=1, num_attention_heads=4)
      >>> folder = tempfile.mkdtemp()
      >>> save_pretrained(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), folder)
      >>> from_pretrained(folder).config == config
      True
    """
    folder = Path(directory)
    if not (folder / CONFIG).is_file():
        raise ValueError(f"{folder}: no {CONFIG} (not a Hugging Face checkpoint folder)")
    hf = _read_json(folder / CONFIG)
    try:
        config = LlamaConfig.from_hf(hf, param_dtype=param_dtype)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{folder}: {e}") from e
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize=}")
    if absmax_rounding not in ("cuda", "cpu"):
        raise ValueError(f'absmax_rounding must be "cuda" or "cpu", got {absmax_rounding=}')
    if prepare is not None and not callable(prepare):
        raise TypeError(f"prepare must be a function of the model, got {prepare!r}")
    if not isinstance(scan_layers, bool):
        raise TypeError(f"scan_layers must be a bool, got {scan_layers!r}")
    if mesh is not None and (not isinstance(mesh, Mesh) or "fsdp" not in mesh.axis_names):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with an 'fsdp' axis, got {mesh=}")
    where = open_checkpoint(folder)
    if mesh is not None:

        def build() -> LlamaForCausalLM:
            model = LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))
            if quantize == "nf4":
                for parent, attr, linear, _, _ in _projections(model):
                    w = linear.kernel[...].T.astype(config.param_dtype)
                    bias = None if linear.bias is None else linear.bias[...]
                    q = rk.nf4_quantize(w, absmax_rounding=absmax_rounding)
                    setattr(parent, attr, rl.NF4Linear(q, bias, dtype=linear.dtype))
            return _finish(model, prepare, scan_layers)

        return load_onto_mesh(
            folder, where, build, mesh, absmax_rounding=absmax_rounding, gather_dtype=gather_dtype
        )
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    names = set(where)
    if quantize == "nf4":
        names -= _quantize_projections(model, where, folder, absmax_rounding)
    load_state(model, lambda name: where[name].get_tensor(name), names, where=str(folder))
    return _finish(model, prepare, scan_layers)


def _finish(
    model: LlamaForCausalLM,
    prepare: Callable[[LlamaForCausalLM], Any] | None,
    scan_layers: bool,
) -> LlamaForCausalLM:
    """``prepare(model)``, its layers then stacked if asked."""
    if prepare is not None:
        prepare(model)
    model.scan_layers = scan_layers
    return model


def _projections(
    model: LlamaForCausalLM,
) -> Iterator[tuple[nnx.Module, str, rl.Linear, str, str | None]]:
    """(parent, attribute, Linear, its weight's and bias's file names) of each decoder
    projection (``PROJECTIONS``), the names from ``_hf_names``' table; a Mixtral's experts are
    stacked arrays, not ``Linear`` layers. The layers are not stacked yet: one name each."""
    nodes = dict(nnx.iter_graph(model))
    for path, node in nodes.items():
        if isinstance(node, rl.Linear) and path and path[-1] in PROJECTIONS:
            weight = hf_name((*path, "kernel"), node.kernel.shape)[0][0]
            bias = None if node.bias is None else hf_name((*path, "bias"), node.bias.shape)[0][0]
            yield nodes[path[:-1]], str(path[-1]), node, weight, bias


def _quantize_projections(
    model: LlamaForCausalLM, where: dict[str, SafetensorsFile], folder: Path, rounding: Rounding
) -> set[str]:
    """Replaces each decoder projection by an NF4Linear of its tensor; the names it read."""
    used: set[str] = set()
    dtype = model.config.param_dtype
    for parent, attr, linear, name, bias_name in list(_projections(model)):
        if name not in where:
            raise ValueError(f"{folder}: no tensor {name!r}")
        tensor = where[name].get_tensor(name)
        if not np.isfinite(tensor).all():
            # NF4 would store a damaged weight as NaN blocks (bitsandbytes' result): refused
            # here, where the file can still be named.
            raise ValueError(
                f"{folder}: {name} holds non-finite values (NaN or inf), which NF4 "
                "cannot store: the checkpoint is damaged, or load it unquantized"
            )
        if tensor.shape != (linear.out_features, linear.in_features):
            raise ValueError(
                f"{folder}: {name} has shape {tensor.shape}, the model's "
                f"{(linear.out_features, linear.in_features)}"
            )
        try:
            # Rounded to the storage dtype first, as transformers loads a checkpoint in its
            # dtype before bitsandbytes quantizes it; waited for, so that the chunks' device
            # copies do not outlive the step.
            q = rk.nf4_quantize(
                tensor.astype(dtype), chunk_size=_QUANTIZE_CHUNK, absmax_rounding=rounding
            )
            q = jax.block_until_ready(q)
        except ValueError as e:  # a size NF4's blocks do not divide
            raise ValueError(f"{folder}: {name} cannot be quantized to NF4 ({e})") from e
        bias = None
        if bias_name is not None:
            bias = np.asarray(where[bias_name].get_tensor(bias_name)).astype(dtype)
            used.add(bias_name)
        setattr(parent, attr, rl.NF4Linear(q, bias, dtype=linear.dtype))
        used.add(name)
    return used
