"""The Hugging Face name of each parameter of a ``rudax.models`` model: a table, not code.

A module's nnx path is already its transformers name (``model.layers.0.self_attn.q_proj``);
only the leaf names differ, and a ``Linear`` kernel is stored transposed (rudax keeps
``[in, out]``, torch ``[out, in]``):

==================  ==================  ===========
rudax leaf          Hugging Face leaf   transposed
==================  ==================  ===========
``kernel``          ``weight``          yes
``bias``            ``bias``            no
``scale``           ``weight``          no
``embedding``       ``weight``          no
==================  ==================  ===========

and the output head's table, ``lm_head.embedding``, is ``lm_head.weight`` (the same
``[V, d]`` layout). A tied head shares the embedding's leaf, so it has no file name of its own.

Layers stored stacked (a model's ``scan_layers``) have no index in their path:
``model.layers.self_attn.q_proj.kernel`` is ``[L, in, out]``, and slice ``i`` is
``model.layers.{i}.self_attn.q_proj.weight``. A stacked leaf holds one tensor of the file
per index of its (next) leading axis, each transposed:

==================  ================================
rudax leaf          Hugging Face names (i = 0 .. n-1)
==================  ================================
``experts.w1``      ``experts.{i}.w1.weight``
``experts.w2``      ``experts.{i}.w2.weight``
``experts.w3``      ``experts.{i}.w3.weight``
==================  ================================

(Mixtral's experts, ``[E, in, out]`` here, ``E`` tensors ``[out, in]`` in the file.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["hf_names", "load_state", "state_dict"]

# rudax leaf name -> (Hugging Face leaf name, stored transposed)
LEAVES: Mapping[str, tuple[str, bool]] = {
    "kernel": ("weight", True),
    "bias": ("bias", False),
    "scale": ("weight", False),
    "embedding": ("weight", False),
}


# (parent module, rudax leaf) -> the file name of slice i along the leading axis
STACKED: Mapping[tuple[str, str], str] = {
    ("experts", "w1"): "{i}.w1.weight",
    ("experts", "w2"): "{i}.w2.weight",
    ("experts", "w3"): "{i}.w3.weight",
}


def hf_name(path: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[list[str], bool, int]:
    """``(names, transposed, axes)`` of the parameter at nnx ``path``: its file names, one per
    slice of its ``axes`` leading stacked axes (0, 1 or 2) in row-major order; a KeyError for
    a leaf the tables do not name."""
    parts = [str(p) for p in path]
    *modules, leaf = parts
    out: list[str] = []  # the name's parts, with "{n}" where stacked axis n's index goes
    axes = 0
    for k, part in enumerate(modules):
        out.append(part)
        if part == "layers" and k + 1 < len(path) and not isinstance(path[k + 1], int):
            out.append(f"{{{axes}}}")  # layers stored stacked: model.layers.{i}
            axes += 1
    stacked = STACKED.get((modules[-1] if modules else "", leaf))
    if stacked is not None:
        tail, transposed = stacked.replace("{i}", f"{{{axes}}}"), True
        axes += 1
    elif leaf in LEAVES:
        tail, transposed = LEAVES[leaf]
    else:
        raise KeyError(f"{'.'.join(parts)}: no Hugging Face name for a {leaf!r} leaf")
    template = ".".join([*out, tail])
    names = [template.format(*index) for index in np.ndindex(*shape[:axes])]
    return names, transposed, axes


def hf_names(
    model: nnx.Module,
) -> Iterator[tuple[list[str], tuple[Any, ...], nnx.Variable, bool, int]]:
    """``(hf names, nnx path, variable, transposed, stacked axes)`` for each parameter, shared
    ones once; a stacked leaf has one name per slice of its stacked axes."""
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Param):
            names, transposed, axes = hf_name(path, variable.shape)
            yield names, path, variable, transposed, axes


def _tied_aliases(model: nnx.Module) -> dict[str, str]:
    """``lm_head.weight`` -> the embedding's name when the head is tied (transformers writes
    one or both; either reads into the one leaf)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


def load_state(
    model: nnx.Module,
    get_tensor: Callable[[str], np.ndarray],
    names: set[str],
    *,
    where: str = "checkpoint",
) -> None:
    """Sets each parameter of ``model`` from the tensor of its Hugging Face name.

    Args:
      model: a ``rudax.models`` model; its parameters' shapes and dtypes are the targets
        (a tensor is cast to the parameter's dtype once, rounding to nearest even).
      get_tensor: reads one tensor by name (tensor by tensor: the whole file never sits in
        memory twice).
      names: every tensor name the checkpoint holds.
      where: how errors name the checkpoint.

    Raises:
      ValueError: a parameter whose tensor is missing or has another shape (both named),
        or a tensor no parameter reads (a checkpoint of another architecture; rotary
        ``inv_freq`` buffers excepted).
    """
    # A tied head's leaf has two names (transformers writes one or both): either reads into it.
    tied = {n for pair in _tied_aliases(model).items() for n in pair}
    used: set[str] = set()
    seen: set[int] = set()
    for hf, path, variable, transposed, axes in list(hf_names(model)):
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        want = variable.shape[axes:]
        slices = []
        for name in hf:
            group = tied if name in tied else {name}
            present = sorted(group & names, key=lambda n: n != name)  # its own name first
            if not present:
                raise ValueError(f"{where}: no tensor {name!r} (for {'.'.join(map(str, path))})")
            source = present[0]
            tensor = np.asarray(get_tensor(source))
            for other in present[1:]:
                # Two tensors for one tied table: if they differ, transformers computes with
                # both (untied, with a warning), so one table here would give other logits.
                if not np.array_equal(np.asarray(get_tensor(other)), tensor, equal_nan=True):
                    raise ValueError(
                        f"{where}: the config ties the embeddings (tie_word_embeddings), but "
                        f"{other} differs from {source}: set tie_word_embeddings to false in "
                        "config.json to load both tables"
                    )
            value = tensor.T if transposed else tensor
            if value.shape != want:
                shape = tuple(reversed(want)) if transposed else want
                raise ValueError(f"{where}: {source} has shape {tensor.shape}, the model's {shape}")
            # cast slice by slice: the stacked copy is in the storage dtype only
            # copy=False: a tensor already in the storage dtype is not copied (the file's
            # buffer becomes the parameter), which keeps a streamed load's peak low
            slices.append(value.astype(variable.dtype, copy=False))
            used |= group & names
        value = np.stack(slices).reshape(variable.shape) if axes else slices[0]
        variable.set_value(jnp.asarray(value, variable.dtype))
    extra = sorted(n for n in names - used if not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(
            f"{where}: {len(extra)} tensor(s) no parameter of this model reads, e.g. "
            f"{extra[0]!r}: a checkpoint of another architecture or config"
        )


def state_dict(model: nnx.Module) -> dict[str, jax.Array]:
    """Every parameter under its Hugging Face name, in torch's layout (a tied head once, as
    ``model.embed_tokens.weight``)."""
    out: dict[str, jax.Array] = {}
    seen: set[int] = set()
    aliases = _tied_aliases(model)
    for hf, _, variable, transposed, axes in hf_names(model):
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        value = variable[...]
        slices = list(value.reshape(-1, *value.shape[axes:])) if axes else [value]
        for name, piece in zip(hf, slices, strict=True):
            out[aliases.get(name, name)] = piece.T if transposed else piece
    return out
