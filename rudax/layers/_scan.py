"""``scan_layers``: a stack of identical layers run as one ``lax.scan``, stored one per layer.

A Python loop over ``n`` blocks compiles ``n`` copies of the block; a scan compiles one,
and under remat its backward is a loop that recomputes one block at a time, which is where
activation checkpointing pays on every backend (``rudax/layers/_remat.py``). Here the
layers stay stored as separate modules (checkpoints, Hugging Face names, LoRA and FSDP see
no difference): their states are stacked on a new leading axis inside the call, one copy of
the parameters (and of their gradients) per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rudax.layers._remat import Policy, remat

__all__ = ["scan_layers"]


def scan_layers(
    layers: Sequence[nnx.Module], x: jax.Array, *, remat_policy: Policy = "none", **kwargs: Any
) -> tuple[jax.Array, Any]:
    """``x, y_i = layers[i](x, **kwargs)`` for each layer in turn, as one ``lax.scan``.

    Args:
      layers: modules of one structure (same types, shapes and adapters), each called as
        ``layer(x, **kwargs) -> (x, y)``.
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
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(state for _, state in splits))

    def body(carry: jax.Array, state: Any) -> tuple[jax.Array, Any]:
        layer = nnx.merge(graphdef, state)
        return remat(layer, policy=remat_policy, prevent_cse=False)(carry, **kwargs)

    return jax.lax.scan(body, x, stacked)
