"""``from_pretrained(..., mesh=mesh)``: a checkpoint read straight into its FSDP form.

The model is first built abstractly (``nnx.eval_shape``: shapes, no arrays), quantized,
adapted (``prepare``), stacked and sharded exactly as the caller would do it with arrays, which
gives each sharded variable's storage layout: ``rudax.sharding.ShardedParameter``, the row-major
flattened value cut into N contiguous slices. Then every variable is filled with
``ShardedParameter.from_local``, which asks only for the slices of this process's devices:

* a parameter read from the files: its slice's bytes alone (``SafetensorsFile.get_elements``;
  a ``Linear`` kernel is the file's tensor transposed, so its rows are the file's columns,
  ``get_columns``), cast to the storage dtype;
* an NF4 projection: this process quantizes its own 64-blocks (the codes and block scales of
  its slices), the processes gather the block scales (4 bytes per 64 weights), and each finishes
  the double quantization from all of them: the bits of quantizing the whole tensor, whose only
  global step is the mean of the scales;
* anything no file holds (``prepare``'s LoRA adapters, a dropout's RNG state): the model's own
  initial values, computed by one jitted call whose other outputs XLA never computes.

So a process holds its shards and one slice being read, never a whole tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import rudax.layers as rl
import rudax.sharding as rs
from rudax.models._hf_mesh_nf4 import NF4Pieces, Rounding
from rudax.models._hf_names import hf_name
from rudax.models._llama import LlamaForCausalLM
from rudax.models._safetensors import SafetensorsFile
from rudax.models._shard import shard

__all__ = ["Rounding", "load_onto_mesh"]


AXIS = "fsdp"
_NF4_FIELDS = ("codes", "absmax_codes", "absmax_scales", "absmax_offset")
_TIED = ("lm_head.weight", "model.embed_tokens.weight")


class _File(NamedTuple):
    """A variable read from the files: one tensor per index of its leading stacked axes."""

    names: list[str]  # row-major over the stacked axes (the layers', then the experts')
    transposed: bool  # a Linear kernel: the file's tensor transposed
    inner: int  # stacked axes inside the logical value (Mixtral's experts: 1)


class _NF4(NamedTuple):
    """A field of an NF4 projection, made from its weight (one tensor per stacked layer)."""

    names: list[str]
    field: str
    shape: tuple[int, int]  # the weight's [out, in]


def load_onto_mesh(
    folder: Path,
    where: dict[str, SafetensorsFile],
    build: Callable[[], LlamaForCausalLM],
    mesh: Mesh,
    *,
    absmax_rounding: Rounding,
    gather_dtype: Any = None,
) -> LlamaForCausalLM:
    """The model ``build()`` makes, sharded over ``mesh``'s ``fsdp`` axis, filled from files.

    ``build`` makes the unsharded model (random weights, quantized, adapted, stacked: as the
    caller wants it) and is only traced: abstractly once, and under ``jit`` for the variables
    no file holds. ``gather_dtype`` is ``shard``'s ``compute_dtype``.
    """
    ctx = rs.ShardingContext(mesh, AXIS)
    sources: dict[tuple[Any, ...], Any] = {}

    def sharded() -> LlamaForCausalLM:
        model = build()
        sources.update(_sources(model))
        return shard(model, ctx, compute_dtype=gather_dtype)

    model = nnx.eval_shape(sharded)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    names, used = set(where), set()
    computed: list[tuple[tuple[Any, ...], nnx.Variable]] = []
    nf4 = NF4Pieces(where, folder, mesh, model.config.param_dtype, absmax_rounding)
    # One order on every process: an NF4 projection's gather is a collective.
    for path, (variable, source) in sorted(_targets(model, sources).items(), key=_path_key):
        held = variable.get_value()
        if source is None or not isinstance(held, rs.ShardedParameter):
            computed.append((path, variable))
            continue
        lead = held.local.shape[:-1]  # (L,) for a stack of layers, else ()
        if isinstance(source, _File):
            files = [_resolve(name, names, tied, folder) for name in source.names]
            used.update(n for group in files for n in group)
            piece = held.logical_shape[source.inner :]
            _check_shapes(
                where, files, tuple(reversed(piece)) if source.transposed else piece, folder
            )
            read: Callable[..., np.ndarray] = functools.partial(
                _read_file, where, files, source.transposed, lead[0] if lead else None, piece
            )
        else:
            used.update(source.names)
            read = functools.partial(nf4.read, source)
        value = rs.ShardedParameter.from_local(
            lambda r, read=read, held=held: read(*held.shard_range(r), held.local.dtype),
            held.logical_shape,
            mesh,
            AXIS,
            dtype=held.local.dtype,
            layers=lead[0] if lead else None,
        )
        variable.set_value(value)
    extra = sorted(n for n in names - used if not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(
            f"{folder}: {len(extra)} tensor(s) no parameter of this model reads, e.g. "
            f"{extra[0]!r}: a checkpoint of another architecture or config"
        )
    if computed:
        _fill_computed(computed, sharded)
    return model


def _path_key(item: tuple[tuple[Any, ...], Any]) -> tuple[str, ...]:
    return tuple(str(p) for p in item[0])


def _stacked_layers(path: tuple[Any, ...]) -> bool:
    """Whether ``path`` runs through layers stored stacked (``layers`` with no index)."""
    return any(
        p == "layers" and i + 1 < len(path) and not isinstance(path[i + 1], int)
        for i, p in enumerate(path)
    )


def _sources(model: nnx.Module) -> dict[tuple[Any, ...], Any]:
    """{nnx path: _File | _NF4 | None} of each variable of the unsharded ``model``.

    A LoRA wrapper's ``base`` is the layer the checkpoint names (``q_proj.base.kernel`` is
    ``q_proj.weight``); an ``NF4Linear``'s quantized fields come from its projection's weight;
    anything else (adapters, RNG state) has no source.
    """
    out: dict[tuple[Any, ...], Any] = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Variable):
            continue
        parent: Any = model
        named: list[Any] = []
        for part in path[:-1]:
            if not (isinstance(parent, rl.LoRALinear) and part == "base"):
                named.append(part)
            parent = _child(parent, part)
        leaf, source = path[-1], None
        if isinstance(parent, rl.NF4Linear) and leaf in _NF4_FIELDS:
            names, _, _ = hf_name((*named, "kernel"), node.shape)
            source = _NF4(names, leaf, (parent.out_features, parent.in_features))
        elif isinstance(node, nnx.Param | rl.Frozen):
            try:
                names, transposed, axes = hf_name((*named, leaf), node.shape)
                source = _File(names, transposed, axes - _stacked_layers(path))
            except KeyError:  # a leaf no checkpoint names (an adapter's): no source
                pass
        out[path] = source
    return out


def _child(node: Any, part: Any) -> Any:
    """``node``'s child at one step of an nnx path (an index into a list, else an attribute)."""
    return node[part] if isinstance(part, int) else getattr(node, str(part))


def _targets(
    model: nnx.Module, sources: dict[tuple[Any, ...], Any]
) -> dict[tuple[Any, ...], tuple[nnx.Variable, Any]]:
    """{path in the sharded model: (variable, source)}: each variable once (a tied table by
    a path that has a source), those outside any ``ShardedModule`` without one."""
    found: dict[int, tuple[tuple[Any, ...], nnx.Variable, Any]] = {}
    for place, module in nnx.iter_graph(model):
        if isinstance(module, rs.ShardedModule):
            for i, (sub, variable) in enumerate(zip(module.paths, module.variables, strict=True)):
                source = sources.get((*place, *sub))
                seen = found.get(id(variable))
                if seen is None or (seen[2] is None and source is not None):
                    found[id(variable)] = ((*place, "variables", i), variable, source)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and id(node) not in found:
            found[id(node)] = (path, node, None)
    return {path: (variable, source) for path, variable, source in found.values()}


def _resolve(name: str, names: set[str], tied: bool, folder: Path) -> list[str]:
    """The file tensors holding ``name``: itself, or for a tied head either table (both, to
    be compared, when the checkpoint has both, as transformers writes one or both)."""
    group = set(_TIED) if tied and name in _TIED else {name}
    present = sorted(group & names, key=lambda n: n != name)
    if not present:
        raise ValueError(f"{folder}: no tensor {name!r}")
    return present


def _check_shapes(
    where: dict[str, SafetensorsFile],
    files: list[list[str]],
    want: tuple[int, ...],
    folder: Path,
) -> None:
    for group in files:
        for name in group:
            got = where[name].shape(name)
            if got != tuple(want):
                raise ValueError(f"{folder}: {name} has shape {got}, the model's {tuple(want)}")


def _read_file(
    where: dict[str, SafetensorsFile],
    files: list[list[str]],
    transposed: bool,
    layers: int | None,
    piece: tuple[int, ...],
    start: int,
    stop: int,
    dtype: Any,
) -> np.ndarray:
    """Elements [start, stop) of the logical value (of each layer's, for a stack of
    ``layers``), read alone and cast to ``dtype``. ``piece``: one file tensor's shape in the
    model's layout."""
    if layers is None:
        return _read_pieces(where, files, transposed, piece, start, stop, dtype)
    per = len(files) // layers
    return np.stack(
        [
            _read_pieces(
                where, files[i * per : (i + 1) * per], transposed, piece, start, stop, dtype
            )
            for i in range(layers)
        ]
    )


def _read_pieces(
    where: dict[str, SafetensorsFile],
    files: list[list[str]],
    transposed: bool,
    piece_shape: tuple[int, ...],
    start: int,
    stop: int,
    dtype: Any,
) -> np.ndarray:
    """Elements [start, stop) of the concatenation of ``files``' tensors (in the model's
    layout, flattened): one tensor, or a leaf stacking several (Mixtral's experts)."""
    piece = math.prod(piece_shape)
    parts = [np.zeros((0,), dtype)]
    for j in range(start // piece, -(-stop // piece)):
        s, e = max(start, j * piece) - j * piece, min(stop, (j + 1) * piece) - j * piece
        group = files[j]
        first, *others = [_read_piece(where, n, transposed, piece_shape, s, e) for n in group]
        for other, name in zip(others, group[1:], strict=True):
            if not np.array_equal(other, first, equal_nan=True):
                raise ValueError(
                    f"the config ties the embeddings (tie_word_embeddings), but {name} differs "
                    f"from {group[0]}: set tie_word_embeddings to false in config.json to load "
                    "both tables"
                )
        parts.append(first.astype(dtype, copy=False))
    return parts[1] if len(parts) == 2 else np.concatenate(parts)


def _read_piece(
    where: dict[str, SafetensorsFile],
    name: str,
    transposed: bool,
    shape: tuple[int, ...],
    s: int,
    e: int,
) -> np.ndarray:
    """Elements [s, e) of one tensor in the model's layout (a kernel: the file's transposed)."""
    if not transposed:
        return where[name].get_elements(name, s, e)
    width = shape[-1]  # a kernel [in, out]: its rows are the file's [out, in] columns
    i0, i1 = s // width, -(-e // width)
    rows = where[name].get_columns(name, i0, i1).T
    return rows.reshape(-1)[s - i0 * width : e - i0 * width]


def _fill_computed(
    computed: list[tuple[tuple[Any, ...], nnx.Variable]], sharded: Callable[[], nnx.Module]
) -> None:
    """The variables no file holds, at their initial values: the model built and sharded in
    one ``jit`` that returns only them (XLA drops the random base weights, never used)."""
    paths = [path for path, _ in computed]

    def initial() -> list[Any]:
        flat = dict(nnx.to_flat_state(nnx.state(sharded())))
        return [flat[path].get_value() for path in paths]

    for (_, variable), value in zip(computed, jax.jit(initial)(), strict=True):
        variable.set_value(value)
