"""merge_lora: every LoRALinear of a model folded back into a plain Linear, in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rudax.kernels import nf4_dequantize
from rudax.layers._apply_lora import (
    ModuleNames,
    _as_path,
    _check_model,
    _check_replaceable,
    _check_unstacked,
    _Module,
    _replace,
    _resolve_names,
    default_names,
    named_modules,
)
from rudax.layers._frozen import Frozen
from rudax.layers._linear import Linear
from rudax.layers._lora import LoRALinear
from rudax.layers._nf4_linear import NF4Linear

__all__ = ["lora_modules", "merge_lora"]


def lora_modules(model: nnx.Module, names: ModuleNames | None = None) -> list[_Module]:
    """The model's LoRALinear layers with their names, sorted by name."""
    return [m for m in named_modules(model, names) if isinstance(m.module, LoRALinear)]


def merge_lora(model: nnx.Module, *, names: ModuleNames | None = None) -> list[str]:
    """Folds every LoRALinear into its base, in place: the model has plain Linear layers again.

    Each ``LoRALinear`` (scale ``s``, adapters ``A [in, r]``, ``B [r, out]``) is replaced, at
    every path that holds it, by its base with::

        kernel = round(f32(kernel) + s * f32(A) @ f32(B))     (round: once, to kernel's dtype)

    computed in fp32 at full matmul precision, the bias unchanged, and the base's ``Frozen``
    variables re-tagged ``nnx.Param`` (trainable again, as peft's ``merge_and_unload`` leaves
    them). Dropout plays no part: the merged model computes the adapter's eval-mode output.
    Called outside ``jit``: it replaces modules. A layer whose adapter is switched off
    (``adapter_enabled`` False, inside ``adapters_disabled``) is a ValueError naming it, the
    model unchanged: merging it would change what the model computes.

    An ``NF4Linear`` base (QLoRA) becomes a dense ``rudax.layers.Linear`` with ``kernel =
    round(nf4_dequantize(W, f32).T + s * f32(A) @ f32(B))`` in the weight's original dtype
    (``weight_dtype``), its bias and compute dtype. Merging back into 4 bits would round most
    of the small update away; this is what peft's ``merge_and_unload`` on a bitsandbytes
    4-bit layer computes too, before it quantizes again. Untargeted ``NF4Linear`` layers stay.

    Args:
      model: an ``nnx.Module`` holding LoRALinear layers; modified in place.
      names: a ``ModuleNames`` function, for the returned names; None for the dotted path.

    Returns:
      The merged layers' names, sorted (the dotted path for a layer ``names`` maps to None).
      A model without a LoRALinear is a ValueError.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> model = nnx.Dict(proj=rl.Linear(4, 3, rngs=nnx.Rngs(0)))
      >>> rl.apply_lora(model, ["proj"], rank=2, alpha=2.0, rngs=nnx.Rngs(1))
      ['proj']
      >>> model["proj"].lora_b[...] = jnp.ones((2, 3))
      >>> x = jnp.ones((1, 4))
      >>> y = model["proj"](x)
      >>> rl.merge_lora(model)
      ['proj']
      >>> type(model["proj"]).__name__, type(model["proj"].kernel).__name__
      ('Linear', 'Param')
      >>> bool(jnp.allclose(model["proj"](x), y, atol=1e-5))
      True
    """
    _check_model(model)
    _check_unstacked(model)
    names = _resolve_names(names)
    found = [
        (_as_path(path), node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, LoRALinear) and path != ()
    ]
    if not found:
        raise ValueError(f"merge_lora: the model has no LoRALinear layer: {type(model).__name__}")
    # A switched-off layer computes its base alone: folding its adapter in would change the
    # function the model computes, and a merge inside adapters_disabled is a mistake.
    off = [".".join(map(str, path)) for path, lora in found if not lora.adapter_enabled]
    if off:
        raise ValueError(
            f"merge_lora: the adapters of {', '.join(off)} are switched off (adapter_enabled="
            "False, as inside rudax.layers.adapters_disabled): merging would fold in adapters "
            "the model does not apply; merge outside the block"
        )
    duplicates = [[_as_path(p) for p in paths] for paths in nnx.find_duplicates(model)]
    # A LoRALinear held at several paths (built by hand) is replaced at all of them.
    holders = [next((ps for ps in duplicates if path in ps), [path]) for path, _ in found]
    for paths in holders:
        for p in paths:
            _check_replaceable(model, p)
    merged = []
    for (path, lora), paths in zip(found, holders, strict=True):
        base = lora.base
        delta = jnp.matmul(
            lora.lora_a.get_value().astype(jnp.float32),
            lora.lora_b.get_value().astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        if isinstance(base, NF4Linear):
            base = _merged_nf4(base, lora.scale * delta)
        else:
            kernel = base.kernel.get_value()
            new_kernel = (kernel.astype(jnp.float32) + lora.scale * delta).astype(kernel.dtype)
            for attr, var in list(vars(base).items()):
                if isinstance(var, Frozen):
                    value = new_kernel if attr == "kernel" else var.get_raw_value()
                    setattr(base, attr, nnx.Param.from_metadata(value, var.get_metadata()))
        for p in paths:
            _replace(model, p, base)
        name = names(path)
        merged.append(name if isinstance(name, str) else default_names(path))
    return sorted(merged)


def _merged_nf4(base: NF4Linear, delta: jax.Array) -> Linear:
    """A dense Linear holding ``dequant(W).T + delta`` (fp32, rounded once), bias and dtype kept."""
    kernel = nf4_dequantize(base.weight, jnp.float32).T + delta
    # eval_shape builds the layer without drawing a kernel that is replaced at once.
    layer = nnx.eval_shape(
        lambda: Linear(
            base.in_features,
            base.out_features,
            use_bias=base.bias is not None,
            dtype=base.dtype,
            param_dtype=base.weight_dtype,
            rngs=nnx.Rngs(0),
        )
    )
    layer.kernel = nnx.Param(kernel.astype(base.weight_dtype))
    if base.bias is not None:
        layer.bias = nnx.Param(base.bias.get_value())
    return layer
