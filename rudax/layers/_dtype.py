"""to_dtype: change the storage dtype of a model's floating parameters, keeping its graph."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.core
import jax.numpy as jnp
from flax import nnx
from flax.nnx import filterlib
from jax.typing import DTypeLike

from rudax._validation import STORAGE_DTYPES
from rudax.layers._frozen import Frozen

M = TypeVar("M", bound=nnx.Module)


def to_dtype(model: M, dtype: DTypeLike, *, only: filterlib.Filter = (nnx.Param, Frozen)) -> M:
    """Converts the storage of a model's floating parameters to ``dtype``, in place.

    For every variable the filter ``only`` selects (by default ``nnx.Param`` and
    ``rudax.layers.Frozen``)::

        value = value.astype(dtype)     if value has a floating dtype
        value = value                   otherwise (integer or bool buffers, RNG keys and counts)

    The variables themselves are kept and only their values replaced, as ``nnx.update`` does,
    so the graph is unchanged: a variable shared by two modules (``TiedProjection`` and its
    ``Embedding``) is converted once and stays one object, a ``Frozen`` variable stays
    ``Frozen``, and references the caller holds to the model or its submodules see the new
    dtype. Variables outside ``only`` keep theirs: an fp32 ``nnx.BatchStat``, and the
    ``rudax.layers.Quantized`` storage of an ``NF4Linear`` (its uint8 codes and fp32 absmax
    define the weight; cast, they would change it), which the default leaves out. The layers'
    compute ``dtype`` settings are not touched: storage and arithmetic stay separate.

    This is for setting up and restoring models (cast a fp32-initialized model to bf16,
    load bf16 weights into fp32 for evaluation), not for use inside ``jit``, ``grad`` or
    other transforms: arrays being traced are refused with a ValueError. To train in low
    precision, keep fp32 masters in the optimizer (``rudax.optim.fp32_master``).

    Args:
      model: an ``nnx.Module``; modified in place.
      dtype: ``jnp.bfloat16``, ``jnp.float16`` or ``jnp.float32``.
      only: an nnx filter selecting the variables to convert.

    Returns:
      The same ``model`` object, for chaining.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> embed = rl.Embedding(10, 4, rngs=nnx.Rngs(0))
      >>> head = rl.TiedProjection(embed)
      >>> model = nnx.List([embed, head])
      >>> model = rl.to_dtype(model, jnp.bfloat16)
      >>> head.embedding.dtype, head.embedding is embed.embedding
      (dtype(bfloat16), True)

    References:
      Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
      2018.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}: {model=}")
    try:
        target = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype=}") from e
    if target not in STORAGE_DTYPES:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype=}")

    def convert(path: tuple, value: Any) -> Any:
        if isinstance(value, jax.core.Tracer):
            raise ValueError(
                f"to_dtype: variable {jax.tree_util.keystr(path)} is being traced; call "
                "to_dtype outside jit, grad and other transforms (setup and restore only)"
            )
        if jnp.issubdtype(value.dtype, jnp.floating):
            return value.astype(target)
        return value

    state = nnx.state(model, only)
    nnx.update(model, jax.tree_util.tree_map_with_path(convert, state))
    return model
