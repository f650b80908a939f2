"""``scan_layers``: a stack of identical layers run as one ``lax.scan``; ``stack_layers`` and
``unstack_layers`` convert their storage.

A Python loop over ``n`` blocks compiles ``n`` copies of the block; a scan compiles one,
and under remat its backward is a loop that recomputes one block at a time, which is where
activation checkpointing pays on every backend (``rudax/layers/_remat.py``).

A scan runs over arrays with a leading layer axis. Layers stored one module each are stacked
inside every call: one more copy of the parameters (and of their gradients) per step, which
for a quantized base is a second base. ``stack_layers`` stores them stacked once, as one
module whose every variable has the leading axis; ``scan_layers`` then scans its state as it
is, and ``unstack_layers`` gives the modules back. Build the layers' structure first (LoRA,
quantization), then stack: the transforms of ``rudax.layers`` refuse a stacked module.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rudax.layers._remat import Policy, remat

__all__ = ["STACKED", "is_stacked", "scan_layers", "stack_layers", "unstack_layers"]

# The attribute stack_layers sets on the module it returns: the number of layers stacked.
STACKED = "stacked_layers"


def is_stacked(module: Any) -> bool:
    """Whether ``module`` is layers stored stacked by ``stack_layers``."""
    return isinstance(module, nnx.Module) and isinstance(getattr(module, STACKED, None), int)


def _check_layers(layers: Sequence[nnx.Module]) -> tuple[Any, list[Any]]:
    """The layers' common graphdef and their states; a ValueError naming the first layer that
    differs in structure or holds RNG state."""
    splits = [nnx.split(layer) for layer in layers]
    if not splits:
        raise ValueError("scan_layers: layers is empty")
    graphdef = splits[0][0]
    for i, (other, _) in enumerate(splits):
        if other != graphdef:
            raise ValueError(
                f"scan_layers: layers[{i}] differs in structure from layers[0] (another "
                "layer type, shape or adapter); a scan runs one layer's program for all"
            )
        if jax.tree.leaves(nnx.state(layers[i], nnx.RngState)):
            raise ValueError(
                f"scan_layers: layers[{i}] holds RNG state (dropout): a scan would draw the "
                "same numbers in every layer; run without dropout, or without a scan"
            )
    return graphdef, [state for _, state in splits]


def stack_layers(layers: Sequence[nnx.Module]) -> nnx.Module:
    """One module holding ``layers`` stacked: each variable's values on a new leading axis.

    The result has the layers' type and structure (its ``stacked_layers`` attribute is their
    number) and is what ``scan_layers`` runs without copying. The layers' own arrays are
    released as each variable is stacked (each is left holding an empty array), so the
    conversion holds at most one more variable's worth: do not use the layers afterwards.

    Args:
      layers: modules of one structure (same types, shapes and adapters) without RNG state.

    Returns:
      The stacked module.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> stacked = rl.stack_layers([rl.Linear(2, 3, rngs=nnx.Rngs(i)) for i in range(4)])
      >>> stacked.kernel.shape, stacked.stacked_layers
      ((4, 2, 3), 4)
      >>> [layer.kernel.shape for layer in rl.unstack_layers(stacked)]
      [(2, 3), (2, 3), (2, 3), (2, 3)]
    """
    layers = list(layers)
    for i, layer in enumerate(layers):
        if is_stacked(layer):
            raise ValueError(f"stack_layers: layers[{i}] is already stacked")
    graphdef, states = _check_layers(layers)
    flat = [nnx.to_flat_state(state) for state in states]
    stacked = []
    for j, (path, first) in enumerate(flat[0]):
        variables = [f[j][1] for f in flat]
        value = jnp.stack([v.get_value() for v in variables])
        for v in variables:  # released now, not when the caller drops the layers
            v.set_value(jnp.zeros((0,), value.dtype))
        stacked.append((path, first.replace(value)))
    module = nnx.merge(graphdef, nnx.from_flat_state(stacked))
    setattr(module, STACKED, len(layers))
    return module


def unstack_layers(stacked: nnx.Module) -> list[nnx.Module]:
    """The layers of a module ``stack_layers`` made, one module each.

    The stacked arrays are released as each variable is split (each is left holding an empty
    array), so the conversion holds at most one more variable's worth: do not use the
    stacked module afterwards.

    Args:
      stacked: a stacked module.

    Returns:
      Its ``stacked_layers`` layers, in order.
    """
    if not is_stacked(stacked):
        raise ValueError(f"unstack_layers: {type(stacked).__name__} is not stacked layers")
    n = getattr(stacked, STACKED)
    graphdef, state = nnx.split(stacked)
    per_layer: list[list[Any]] = [[] for _ in range(n)]
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        for i in range(n):
            per_layer[i].append((path, variable.replace(value[i])))
        variable.set_value(jnp.zeros((0,), value.dtype))  # released now
    layers = []
    for flat in per_layer:
        layer = nnx.merge(graphdef, nnx.from_flat_state(flat))
        delattr(layer, STACKED)
        layers.append(layer)
    return layers


def scan_layers(
    layers: Sequence[nnx.Module] | nnx.Module,
    x: jax.Array,
    *,
    remat_policy: Policy = "none",
    **kwargs: Any,
) -> tuple[jax.Array, Any]:
    """``x, y_i = layers[i](x, **kwargs)`` for each layer in turn, as one ``lax.scan``.

    Args:
      layers: modules of one structure (same types, shapes and adapters), each called as
        ``layer(x, **kwargs) -> (x, y)``, stacked inside the call; or one module from
        ``stack_layers``, scanned as it is stored.
      x: the first layer's input (the scan's carry).
      remat_policy: each layer's activation checkpointing, one of
        ``rudax.layers.REMAT_POLICIES`` (without ``prevent_cse``, which a scan makes
        unnecessary).
      **kwargs: passed to every layer (arrays or None; the same for each layer).

    Returns:
      The last layer's output and every layer's ``y`` stacked on a leading axis (None where
      the layers return None).

    Raises:
      ValueError: a layer differs in structure from the first, or holds RNG state (a scan
        would give every layer the same dropout draws); the error names it.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> class Add(nnx.Module):
      ...     def __init__(self, c): self.c = nnx.Param(jnp.full((2,), c))
      ...     def __call__(self, x): return x + self.c[...], self.c[...].sum()
      >>> x, y = rl.scan_layers([Add(1.0), Add(2.0)], jnp.zeros(2))
      >>> x.tolist(), y.tolist()
      ([3.0, 3.0], [2.0, 4.0])
    """
    if is_stacked(layers):
        assert isinstance(layers, nnx.Module)
        if jax.tree.leaves(nnx.state(layers, nnx.RngState)):
            raise ValueError(
                "scan_layers: the stacked layers hold RNG state (dropout): a scan would draw "
                "the same numbers in every layer"
            )
        graphdef, stacked = nnx.split(layers)
    else:
        # a sequence of modules (an nnx.List is one)
        graphdef, states = _check_layers(list(typing.cast(Sequence[nnx.Module], layers)))
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)

    def body(carry: jax.Array, state: Any) -> tuple[jax.Array, Any]:
        layer = nnx.merge(graphdef, state)
        return remat(layer, policy=remat_policy, prevent_cse=False)(carry, **kwargs)

    return jax.lax.scan(body, x, stacked)
