"""Embedding lookup and the output projection tied to it (one variable, gradients summed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from rudax._validation import check_positive_int, float_dtype
from rudax.layers._lookup import Backward, check_backward, lookup
from rudax.layers._matmul import rows_matmul
from rudax.layers._validation import check_features

# flax's nnx.Embed default: N(0, 1/features), the fan-in taken over the feature axis.
_DEFAULT_EMBEDDING_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


class Embedding(nnx.Module):
    """A lookup table: ``y = c(embedding[ids])``, table stored ``[num_embeddings, features]``.

    ``c`` casts to the compute dtype ``dtype`` (None: the table's storage dtype, as flax's
    ``nnx.Embed``); only the gathered rows are cast, not the whole table. ids outside
    ``[0, num_embeddings)``, negative ones included, cannot be checked under ``jit``: they give
    NaN rows (a gather in ``fill`` mode that does not wrap negative indices) and no gradient,
    rather than torch's error, a silently clamped row or NumPy's wrap of -1 to the last row.

    Args:
      num_embeddings: number of rows (the vocabulary size), > 0.
      features: size of each row, > 0.
      dtype: compute and output dtype; None for the storage dtype.
      param_dtype: storage dtype of the table.
      embedding_init: initializer of the ``[num_embeddings, features]`` table; flax's default,
        N(0, 1 / features) (torch's ``nn.Embedding`` draws N(0, 1)).
      backward: how the table's gradient is summed: ``"scatter"`` (autodiff's scatter-add,
        which a GPU runs with atomics, in an order that changes from run to run) or
        ``"sorted"`` (a sorted segment sum with no scatter, in a fixed order: for
        bit-identical GPU runs; see ``rudax.layers.lookup``). An attribute: it may be set
        after construction.
      rngs: the ``nnx.Rngs`` whose ``params`` stream draws the table.

    Returns:
      A module; calling it on integer ``ids`` of any shape returns ``ids.shape + (features,)``.
      Non-integer ids are a TypeError.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> embed = rl.Embedding(10, 4, rngs=nnx.Rngs(0))
      >>> embed(jnp.array([[1, 2, 3]])).shape
      (1, 3, 4)

    References:
      Bengio et al., `A Neural Probabilistic Language Model
      <https://www.jmlr.org/papers/v3/bengio03a.html>`_, 2003.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        embedding_init: nnx.Initializer = _DEFAULT_EMBEDDING_INIT,
        backward: Backward = "scatter",
        rngs: nnx.Rngs,
    ):
        check_positive_int("num_embeddings", num_embeddings)
        check_backward(backward)
        self.backward: Backward = backward
        check_positive_int("features", features)
        self.dtype = float_dtype("dtype", dtype)
        param_dtype = float_dtype("param_dtype", param_dtype, allow_none=False)
        self.num_embeddings = num_embeddings
        self.features = features
        self.embedding = nnx.Param(
            embedding_init(rngs.params(), (num_embeddings, features), param_dtype)
        )

    def __call__(self, ids: ArrayLike) -> jax.Array:
        ids = jnp.asarray(ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"Embedding expects integer ids, got ids.dtype={ids.dtype}")
        rows = lookup(self.embedding[...], ids, backward=self.backward)
        return rows if self.dtype is None else rows.astype(self.dtype)


class TiedProjection(nnx.Module):
    """Logits from an ``Embedding``'s own table: ``y = c(x) @ c(embedding).T + c(bias)``.

    The projection holds the embedding's ``nnx.Param`` itself, not a copy: ``nnx.state`` of a
    model with both has one leaf for the table, and its gradient is the sum of the lookup's
    and the projection's. ``c`` casts to the compute dtype (``dtype``, or ``x.dtype`` when it
    is None; flax's ``Embed.attend`` promotes instead). Sharing survives ``nnx.split`` /
    ``nnx.merge``, ``nnx.jit`` and ``rudax.layers.to_dtype``.

    Args:
      embedding: the ``Embedding`` whose table is the output projection.
      bias: None for no bias; an array of shape ``(num_embeddings,)``, the initial value of a
        new trainable ``nnx.Param``; or an existing ``nnx.Variable`` of that shape, used (and
        shared) as it is.
      dtype: compute and output dtype; None for the input's dtype.

    Returns:
      A module; calling it on ``x[..., features]`` returns ``logits[..., num_embeddings]``.
      A non-floating ``x`` is a TypeError, a wrong last axis a ValueError.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> embed = rl.Embedding(10, 4, rngs=nnx.Rngs(0))
      >>> head = rl.TiedProjection(embed, bias=jnp.zeros(10))
      >>> head.embedding is embed.embedding
      True
      >>> head(embed(jnp.array([1, 2]))).shape
      (2, 10)

    References:
      Press & Wolf, `Using the Output Embedding to Improve Language Models
      <https://arxiv.org/abs/1608.05859>`_, 2017.
    """

    def __init__(
        self,
        embedding: Embedding,
        *,
        bias: ArrayLike | nnx.Variable | None = None,
        dtype: DTypeLike | None = None,
    ):
        if not isinstance(embedding, Embedding):
            raise TypeError(f"embedding must be a rudax.layers.Embedding, got {embedding=}")
        self.dtype = float_dtype("dtype", dtype)
        self.num_embeddings = embedding.num_embeddings
        self.features = embedding.features
        self.embedding = embedding.embedding
        if bias is not None:
            value = bias[...] if isinstance(bias, nnx.Variable) else jnp.asarray(bias)
            if value.shape != (self.num_embeddings,):
                raise ValueError(
                    f"bias must have shape ({self.num_embeddings},), got bias.shape={value.shape}"
                )
            if not jnp.issubdtype(value.dtype, jnp.floating):
                raise TypeError(f"bias must have a floating dtype, got bias.dtype={value.dtype}")
            if not isinstance(bias, nnx.Variable):
                bias = nnx.Param(value)
        self.bias = bias

    def __call__(self, x: ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        check_features("TiedProjection", x, self.features)
        dtype = x.dtype if self.dtype is None else self.dtype
        # Contract the feature axes directly: no transposed copy of the table is made.
        logits = rows_matmul(x.astype(dtype), self.embedding[...].astype(dtype), w_axis=1)
        if self.bias is not None:
            logits = logits + self.bias[...].astype(dtype)
        return logits
