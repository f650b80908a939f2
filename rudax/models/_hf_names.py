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


def hf_name(path: tuple[Any, ...]) -> tuple[str, bool]:
    """``(name, transposed)`` of the parameter at nnx ``path``; a KeyError for a leaf the
    table does not name."""
    *modules, leaf = (str(p) for p in path)
    if leaf not in LEAVES:
        raise KeyError(f"{'.'.join(map(str, path))}: no Hugging Face name for a {leaf!r} leaf")
    name, transposed = LEAVES[leaf]
    return ".".join([*modules, name]), transposed


def hf_names(model: nnx.Module) -> Iterator[tuple[str, tuple[Any, ...], nnx.Variable, bool]]:
    """``(hf name, nnx path, variable, transposed)`` for each parameter, shared ones once."""
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Param):
            name, transposed = hf_name(path)
            yield name, path, variable, transposed


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
    for name, path, variable, transposed in list(hf_names(model)):
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        group = tied if name in tied else {name}
        present = sorted(group & names, key=lambda n: n != name)  # its own name first
        if not present:
            raise ValueError(f"{where}: no tensor {name!r} (for {'.'.join(map(str, path))})")
        source = present[0]
        tensor = np.asarray(get_tensor(source))
        value = tensor.T if transposed else tensor
        if value.shape != variable.shape:
            shape = tuple(reversed(variable.shape)) if transposed else variable.shape
            raise ValueError(f"{where}: {source} has shape {tensor.shape}, the model's {shape}")
        variable.set_value(jnp.asarray(value, variable.dtype))
        used |= group & names
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
    for name, _, variable, transposed in hf_names(model):
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        value = variable[...]
        out[aliases.get(name, name)] = value.T if transposed else value
    return out
