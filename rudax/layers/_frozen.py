"""Frozen: the variable type of a parameter that is not trained (a LoRA base's weights)."""

from __future__ import annotations

from flax import nnx

__all__ = ["Frozen", "freeze"]


class Frozen(nnx.Variable):
    """A parameter that is not trained: a ``Variable`` but not an ``nnx.Param``.

    Filters that select ``nnx.Param`` (``nnx.state(model, nnx.Param)``, ``nnx.grad``'s and
    ``nnx.Optimizer``'s default ``wrt``) skip it; ``rudax.layers.to_dtype`` converts it.
    ``LoRALinear`` re-tags its base's parameters with it.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> model = nnx.Dict(w=nnx.Param(jnp.ones(2)), base=rl.Frozen(jnp.ones(2)))
      >>> list(nnx.state(model, nnx.Param).keys())
      ['w']
    """


def freeze(module: nnx.Module) -> None:
    """Re-tags every ``nnx.Param`` attribute of module as ``Frozen``, in place, without copies.

    A variable the base shares with another module is replaced in the base only, so such a
    tie is broken; freeze tied weights by hand if both uses should stay one variable.
    """
    for name, value in list(vars(module).items()):
        if isinstance(value, nnx.Param):
            setattr(module, name, Frozen.from_metadata(value.get_raw_value(), value.get_metadata()))
