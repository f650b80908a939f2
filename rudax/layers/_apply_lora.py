"""apply_lora: LoRA or QLoRA on the Linear layers of any nnx model, by name (and the naming,
targeting and state helpers that merge_lora and the peft files share)."""

from __future__ import annotations

import re
import typing
import warnings
from collections.abc import Iterable, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from rudax._validation import check_bool
from rudax.layers._linear import Linear
from rudax.layers._lora import LoRALinear, LoRAParam
from rudax.layers._nf4_linear import NF4Linear
from rudax.layers._scan import STACKED, is_stacked

Path: TypeAlias = tuple[str | int, ...]

ModuleNames: TypeAlias = typing.Callable[[tuple[str | int, ...]], str | None]
ModuleNames.__doc__ = """The name a module is known by outside the model, from its nnx path.

A function ``names(path) -> str | None``: ``path`` is the module's path inside the model, the
keys attribute and item access use (``("blocks", 0, "attn", "q")``), and the result is the
module's name in another library's layout (peft's and torch's module names,
``"model.layers.0.self_attn.q_proj"``), or None for a module that has no such name (it is
then neither adaptable nor saved). The default, ``names=None``, is
``".".join(map(str, path))``: ``"blocks.0.attn.q"``. The library knows no model family; a
model's loader supplies its mapping.
"""

_LINEARS = (Linear, nnx.Linear, NF4Linear)  # what apply_lora adapts
_DENSE = (Linear, nnx.Linear)  # what quantize_base and quantize_untargeted quantize
_QUANTIZE_BASE = (None, "nf4")


def default_names(path: Path) -> str:
    """The default ModuleNames: keys joined by dots, ``("blocks", 0, "q")`` -> ``blocks.0.q``."""
    return ".".join(map(str, path))


@dataclass(frozen=True)
class _Module:
    """A module of a model with its name under a ModuleNames."""

    name: str
    path: Path  # the path this entry names it by (a shared module has one entry per path)
    module: nnx.Module


def _resolve_names(names: ModuleNames | None) -> ModuleNames:
    if names is None:
        return default_names
    if not callable(names):
        raise TypeError(f"names must be a callable path -> str | None, or None, got {names=}")
    return names


def _check_model(model: Any) -> None:
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}: {model=}")


def _check_unstacked(model: nnx.Module) -> None:
    """A ValueError naming the first layers stored stacked: their variables have a leading
    layer axis that LoRA, its merge and peft's per-layer names do not have."""
    for path, node in nnx.iter_graph(model):
        if is_stacked(node):
            where = ".".join(map(str, path)) or "model"
            raise ValueError(
                f"{where} holds {getattr(node, STACKED)} layers stored stacked "
                "(rudax.layers.stack_layers, a model's scan_layers): put LoRA on, merge or "
                "save adapters of the layers one module each (rudax.layers.unstack_layers, "
                "or scan_layers = False), then stack them"
            )


def named_modules(model: nnx.Module, names: ModuleNames | None = None) -> list[_Module]:
    """Every module below model's root that names gives a name, sorted by name.

    A module held at several paths is listed under each (so that targeting any of its names
    finds it, and apply_lora can refuse it by all of them). The insides of a ``LoRALinear``
    (its base, its dropout) are left out: the adapted layer is known by its own name, as
    peft's ``lora.Linear`` is. Two paths with one name are a ValueError.
    """
    _check_model(model)
    _check_unstacked(model)
    names = _resolve_names(names)
    modules = [
        (_as_path(path), node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module) and path != ()
    ]
    by_first_path = dict(modules)
    for paths in nnx.find_duplicates(model):
        node = by_first_path.get(_as_path(paths[0]))
        if node is not None:
            modules += [(_as_path(p), node) for p in paths[1:]]
    lora_paths = [path for path, node in modules if isinstance(node, LoRALinear)]
    found: dict[str, _Module] = {}
    for path, node in modules:
        if any(path[: len(p)] == p and path != p for p in lora_paths):
            continue
        name = names(path)
        if name is None:
            continue
        if not isinstance(name, str):
            raise TypeError(
                f"names must return a str or None, got {name!r} for the module at "
                f"{_keystr(path)} ({type(node).__name__})"
            )
        if name in found:
            raise ValueError(
                f"names gives two modules the same name {name!r}: {_keystr(found[name].path)} "
                f"and {_keystr(path)}"
            )
        found[name] = _Module(name, path, node)
    return [found[name] for name in sorted(found)]


def target_matcher(targets: str | Sequence[str]) -> typing.Callable[[str], bool]:
    """peft's ``target_modules`` test: a regex str must fullmatch the name; a list of names
    matches a name equal to one of them or ending with "." + one of them."""
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            raise ValueError(
                "targets='all-linear' is peft's shorthand for every linear layer but the output "
                "head, which rudax cannot tell apart; pass the module names (a list) or a regex"
            )
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise ValueError(f"targets is not a valid regular expression ({e}): {targets=}") from e
        return lambda name: pattern.fullmatch(name) is not None
    if not isinstance(targets, Iterable) or isinstance(targets, bytes):
        raise TypeError(
            f"targets must be a list of module names or a regular expression str, got {targets=}"
        )
    items = list(targets)
    if not items:
        raise ValueError(f"targets must name at least one module, got {targets=}")
    for t in items:
        if not isinstance(t, str):
            raise TypeError(f"targets must hold str module names, got {t!r} in {targets=}")
        if not t:
            raise ValueError(f"targets must hold non-empty module names, got '' in {targets=}")
    exact = frozenset(items)
    suffixes = tuple("." + t for t in items)
    return lambda name: name in exact or name.endswith(suffixes)


def _candidates_text(modules: list[_Module]) -> str:
    linear = [m.name for m in modules if isinstance(m.module, _LINEARS)]
    return f"the Linear layers are {linear}" if linear else "the model has no Linear layer"


def _check_not_shared(model: nnx.Module, chosen: list[_Module]) -> None:
    """A target layer or one of its variables held elsewhere too is refused.

    LoRALinear re-tags its base's parameters as Frozen by replacing the variables inside the
    base, so a kernel tied to another module would silently stop being one variable, and a
    layer used at two places would be adapted at one of them only.
    """
    duplicates = [[_as_path(p) for p in paths] for paths in nnx.find_duplicates(model)]
    for m in chosen:
        for paths in duplicates:
            if m.path in paths:
                raise ValueError(
                    f"{m.name!r} is one layer reached by several paths "
                    f"{[_keystr(p) for p in paths]}; LoRA would adapt it at one of them only. "
                    "Adapt a model whose shared layers are not targets"
                )
            inside = [p for p in paths if p[: len(m.path)] == m.path and len(p) > len(m.path)]
            if inside:
                others = [_keystr(p) for p in paths if p not in inside]
                raise ValueError(
                    f"{m.name!r}: its variable {_keystr(inside[0])} is tied to {others}; LoRA "
                    "freezes the base by re-tagging its variables, which would untie them. "
                    "Untie it first, or leave this layer out of targets"
                )


def plan_lora(
    model: nnx.Module, targets: str | Sequence[str], names: ModuleNames | None
) -> list[_Module]:
    """The Linear layers apply_lora would adapt, sorted by name, after every check; no change."""
    match = target_matcher(targets)
    modules = named_modules(model, names)
    chosen = [m for m in modules if match(m.name)]
    if not chosen:
        raise ValueError(
            f"targets={targets!r} matches no module of the model; {_candidates_text(modules)}"
        )
    if not isinstance(targets, str):
        # peft says nothing of a listed name that matches nothing (a typo, another model's
        # name): the run would train fewer layers than asked for.
        unmatched = [t for t in targets if not any(target_matcher([t])(m.name) for m in chosen)]
        if unmatched:
            warnings.warn(
                f"targets {unmatched} match no module of the model (the other targets do); "
                f"{_candidates_text(modules)}",
                stacklevel=3,
            )
    adapted = [m.name for m in chosen if isinstance(m.module, LoRALinear)]
    if adapted:
        raise ValueError(f"targets={targets!r} matches layers that already have LoRA: {adapted}")
    wrong = [
        f"{m.name} ({type(m.module).__name__})"
        for m in chosen
        if not isinstance(m.module, _LINEARS)
    ]
    if wrong:
        raise TypeError(
            f"targets={targets!r} matches modules that are not a rudax.layers.Linear or "
            f"flax.nnx.Linear: {wrong} (nor a rudax.layers.NF4Linear); "
            f"{_candidates_text(modules)}"
        )
    _check_not_shared(model, chosen)
    for m in chosen:
        _check_replaceable(model, m.path)
    return chosen


def _node_at(model: nnx.Module, path: Path) -> Any:
    node: Any = model
    key: Any  # an int indexes a list, a str names an attribute or a dict's item
    for key in path:
        node = node[key] if isinstance(node, Sequence | MutableMapping) else getattr(node, key)
    return node


def _check_replaceable(model: nnx.Module, path: Path) -> None:
    parent = _node_at(model, path[:-1])
    if not (
        isinstance(parent, MutableSequence | MutableMapping)
        or (isinstance(parent, nnx.Module) and isinstance(path[-1], str))
    ):
        raise TypeError(
            f"cannot replace the module at {_keystr(path)}: it sits in a "
            f"{type(parent).__name__}, which cannot be changed in place (use nnx.List or nnx.Dict)"
        )


def _replace(model: nnx.Module, path: Path, new: Any) -> None:
    parent = _node_at(model, path[:-1])
    key: Any = path[-1]
    if isinstance(parent, MutableSequence | MutableMapping):
        parent[key] = new
    else:
        setattr(parent, key, new)


def _plan_untargeted(model: nnx.Module, chosen: list[_Module]) -> list[Path]:
    """The paths of the dense layers quantize_untargeted replaces, after every check.

    Every ``Linear`` / ``nnx.Linear`` of the graph that is not a target and not inside a
    ``LoRALinear`` (an adapted layer keeps its base), whether or not ``names`` names it. One
    that is shared is refused, as a target would be: replacing it at one path would untie it.
    """
    nodes = [(_as_path(p), n) for p, n in nnx.iter_graph(model) if p != ()]
    lora_paths = [p for p, n in nodes if isinstance(n, LoRALinear)]
    targets = {m.path for m in chosen}
    duplicates = [[_as_path(p) for p in paths] for paths in nnx.find_duplicates(model)]
    found = []
    for path, node in nodes:
        if not isinstance(node, _DENSE) or path in targets:
            continue
        if any(path[: len(p)] == p for p in lora_paths):
            continue
        for paths in duplicates:
            tied = [p for p in paths if p[: len(path)] == path and len(p) > len(path)]
            if path in paths or tied:
                shared = paths if path in paths else [p for p in paths if p not in tied]
                raise ValueError(
                    f"quantize_untargeted: the Linear at {_keystr(path)} "
                    f"{'is reached by' if path in paths else 'has a variable tied to'} "
                    f"{[_keystr(p) for p in shared]}; replacing it by an NF4Linear would untie "
                    "them. Untie it first, or pass quantize_untargeted=False"
                )
        _check_replaceable(model, path)
        found.append(path)
    return found


def apply_lora(
    model: nnx.Module,
    targets: str | Sequence[str],
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    scale_rule: str = "alpha/rank",
    dtype: DTypeLike | None = None,
    param_dtype: DTypeLike = jnp.float32,
    names: ModuleNames | None = None,
    quantize_base: str | None = None,
    quantize_untargeted: bool = False,
    rngs: nnx.Rngs,
) -> list[str]:
    """Replaces, in place, each Linear layer whose name matches targets by a LoRALinear over it.

    For every ``rudax.layers.Linear``, ``flax.nnx.Linear`` or ``rudax.layers.NF4Linear`` ``W``
    whose name matches::

        W  ->  LoRALinear(W, rank, alpha=alpha, ...):   y = W(x) + s * d(x) @ A @ B

    with ``W``'s parameters re-tagged ``rudax.layers.Frozen`` (not trained), ``A``, ``B``
    ``rudax.layers.LoRAParam`` and ``B = 0``, so the model's outputs are unchanged until it
    trains. Names are ``names(path)`` (default: the nnx path joined by dots), and they match
    as peft's ``target_modules``:

    - a list of names matches a module whose name equals one of them or ends with
      ``"." + name``: ``["q_proj", "v_proj"]`` adapts ``model.layers.3.self_attn.q_proj``;
    - a str is a regular expression that must match the whole name:
      ``r".*\\.(q|v)_proj"``.

    Modules anywhere in the graph are found: attributes, ``nnx.List``, ``nnx.Dict``,
    ``nnx.Sequential``. A target layer that is shared (one layer at two paths, or a kernel
    tied to another module) is refused rather than untied. A fresh A is drawn for each layer
    from ``rngs``'s ``params`` stream, in the order of the sorted names.

    QLoRA: with ``quantize_base="nf4"`` each dense target is first quantized,
    ``W -> NF4Linear.from_linear(W)`` (4-bit NormalFloat in 64-blocks of the ``[out, in]``
    weight, double quantization, W's bias and compute dtype kept), and the adapter wraps
    that; a target that is an ``NF4Linear`` already is wrapped as it is. With
    ``quantize_untargeted=True`` every other dense layer of the graph (named or not, outside
    the adapted layers) is replaced by its ``NF4Linear`` too. The dense layers' full-precision
    kernels are then no longer referenced by the model.

    ``rudax.layers.to_dtype`` converts A and B with the rest (``LoRAParam`` is an
    ``nnx.Param``), and leaves NF4 storage (``rudax.layers.Quantized``) alone; for a bf16
    base under fp32 adapters, convert them back: ``to_dtype(model, jnp.bfloat16)`` then
    ``to_dtype(model, jnp.float32, only=rl.LoRAParam)``.

    Args:
      model: an ``nnx.Module``; modified in place.
      targets: module names (a list or tuple of str) or one regex str, as above.
      rank, alpha, dropout, scale_rule, dtype, param_dtype: ``rudax.layers.LoRALinear``'s,
        the same for every adapted layer.
      names: a ``ModuleNames`` function; None for the dotted nnx path.
      quantize_base: None (bases as they are) or ``"nf4"``.
      quantize_untargeted: also quantize the dense layers that are not targets (needs
        ``quantize_base``).
      rngs: an ``nnx.Rngs`` (``params`` draws A, ``dropout`` the masks).

    Returns:
      The adapted names, sorted. Targets that match nothing, match a module that is not a
      Linear or one that already has LoRA, a bad ``quantize_base`` and a layer that cannot be
      quantized (a size not a multiple of 64) are errors naming them, raised before the model
      is changed.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> rngs = nnx.Rngs(0)
      >>> block = lambda: nnx.Dict(q_proj=rl.Linear(4, 4, rngs=rngs), up=rl.Linear(4, 8, rngs=rngs))
      >>> model = nnx.Dict(layers=nnx.List([block(), block()]))
      >>> rl.apply_lora(model, ["q_proj"], rank=2, alpha=4.0, rngs=rngs)
      ['layers.0.q_proj', 'layers.1.q_proj']
      >>> type(model["layers"][1]["q_proj"]).__name__, list(rl.lora_state(model)["layers"][0])
      ('LoRALinear', ['q_proj'])
      >>> rl.apply_lora(model, r"layers\\.1\\.up", rank=2, alpha=4.0, rngs=rngs)
      ['layers.1.up']

      QLoRA, the untargeted layer quantized too:

      >>> model = nnx.Dict(q_proj=rl.Linear(64, 64, rngs=rngs), up=rl.Linear(64, 128, rngs=rngs))
      >>> rl.apply_lora(model, ["q_proj"], rank=2, alpha=4.0, quantize_base="nf4",
      ...               quantize_untargeted=True, rngs=rngs)
      ['q_proj']
      >>> type(model["q_proj"].base).__name__, type(model["up"]).__name__
      ('NF4Linear', 'NF4Linear')

    References:
      peft's ``LoraConfig.target_modules``,
      https://huggingface.co/docs/peft/package_reference/lora. Dettmers et al., `QLoRA:
      Efficient Finetuning of Quantized LLMs <https://arxiv.org/abs/2305.14314>`_, 2023.
    """
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}: {rngs=}")
    if not (quantize_base is None or isinstance(quantize_base, str)) or (
        quantize_base not in _QUANTIZE_BASE
    ):
        raise ValueError(f"quantize_base must be None or 'nf4', got {quantize_base=}")
    check_bool("quantize_untargeted", quantize_untargeted, allow_numpy=False)
    if quantize_untargeted and quantize_base is None:
        raise ValueError(
            "quantize_untargeted=True needs a format: pass quantize_base='nf4' too, got "
            f"{quantize_base=}"
        )
    chosen = plan_lora(model, targets, names)
    untargeted = _plan_untargeted(model, chosen) if quantize_untargeted else []
    # Everything is built before anything is put in place: quantization first (a layer whose
    # size does not divide into blocks fails here), then every LoRALinear (a bad rank fails on
    # the first layer, before its base is re-tagged), so an error changes nothing.
    bases: list[Linear | nnx.Linear | NF4Linear] = []
    for m in chosen:
        base = m.module
        assert isinstance(base, _LINEARS)  # plan_lora checked it
        if quantize_base == "nf4" and isinstance(base, _DENSE):
            base = _quantized(base, m.name)
        bases.append(base)
    quantized = []
    for path in untargeted:
        dense = _node_at(model, path)
        quantized.append(_quantized(dense, default_names(path)))
    built = [
        LoRALinear(
            base,
            rank,
            alpha=alpha,
            dropout=dropout,
            scale_rule=scale_rule,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        for base in bases
    ]
    for m, lora in zip(chosen, built, strict=True):
        _replace(model, m.path, lora)
    for path, layer in zip(untargeted, quantized, strict=True):
        _replace(model, path, layer)
    return [m.name for m in chosen]


def _quantized(dense: Linear | nnx.Linear, name: str) -> NF4Linear:
    try:
        return NF4Linear.from_linear(dense)
    except (TypeError, ValueError) as e:
        raise type(e)(f"quantize_base='nf4': {name!r}: {e}") from e


def lora_state(model: nnx.Module) -> nnx.State:
    """The model's LoRA adapters, every ``lora_a`` and ``lora_b``: ``nnx.state(model, LoRAParam)``.

    The state to give the optimizer and the checkpoint when only the adapters train; the same
    filter splits the model (``nnx.split(model, rl.LoRAParam, ...)``) for a functional step.

    Args:
      model: an ``nnx.Module``.

    Returns:
      An ``nnx.State`` with the ``LoRAParam`` variables only, at their paths in the model.

    Example:
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> rngs = nnx.Rngs(0)
      >>> model = nnx.Dict(q=rl.Linear(4, 4, rngs=rngs), norm=rl.RMSNorm(4, rngs=rngs))
      >>> _ = rl.apply_lora(model, ["q"], rank=2, alpha=2.0, rngs=rngs)
      >>> [(path, v.shape) for path, v in nnx.to_flat_state(rl.lora_state(model))]
      [(('q', 'lora_a'), (4, 2)), (('q', 'lora_b'), (2, 4))]
    """
    _check_model(model)
    return nnx.state(model, LoRAParam)


def _as_path(parts: tuple[Any, ...]) -> Path:
    """An nnx path (typed ``tuple[Hashable, ...]``) as what it holds: attribute names, indices."""
    return typing.cast(Path, parts)


def _keystr(path: Path) -> str:
    """An nnx path as the attribute access it stands for: ``.blocks[0].q``."""
    keys = [
        jax.tree_util.SequenceKey(k) if isinstance(k, int) else jax.tree_util.GetAttrKey(k)
        for k in path
    ]
    return jax.tree_util.keystr(tuple(keys))
