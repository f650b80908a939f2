"""Cross entropy through a linear head, a chunk of tokens at a time: no ``[N, V]`` logits kept.

``linear_cross_entropy(features, table, labels)`` is the summed cross entropy of the logits
``features @ table.T`` over the tokens whose label is not ``ignore_index``, and the number of
those tokens, computed without materializing the logits. Under ``jax.grad`` the forward pass
walks the tokens in chunks (a ``lax.scan``, so the chunks run one after the other: unrolled
in Python, as ``examples/lm/loss.py`` had them, XLA's CPU schedule kept every chunk's logits
alive at once); each chunk's logits live only while its loss and its gradients
(``dfeatures`` for the chunk, its share of ``dtable``) are formed, so peak memory holds one
chunk's logits instead of all of them, and each chunk's softmax is still in cache when its
two backward matmuls read it. The backward pass only scales the saved gradients by the
incoming cotangent. Liger-Kernel's fused linear cross entropy does the same on GPU.

The price of computing gradients in the forward pass: they are computed whenever the loss is
differentiated, even if only ``features``' or only ``table``'s is wanted.

There is no Pallas kernel: each chunk is XLA's matmuls around a softmax it fuses; what the
chunking saves is memory, not time.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from rudax._validation import check_int, check_positive_int, float_dtype
from rudax.kernels import _compat


def _label_masks(
    labels: jax.Array, vocab: int, ignore_index: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(counted, in_range, safe)``: which labels count, which of those index ``[0, V)``,
    and the labels with every other one replaced by 0, so that no gather reads out of bounds
    (and no negative label wraps around to the end of the vocabulary, as jnp indexing would).
    """
    counted = labels != ignore_index
    in_range = (labels >= 0) & (labels < vocab)
    return counted, in_range, jnp.where(counted & in_range, labels, 0)


def _fp32_logits(logits: jax.Array) -> jax.Array:
    """The logits in fp32, rounded to their compute dtype first, whatever XLA fuses.

    XLA may drop a cast to a narrower float and back (``xla_allow_excess_precision``, on by
    default), and whether it does depends on the program around it: jax 0.11.2 on the CPU
    rounded a chunk's bf16 logits and not the whole batch's. ``reduce_precision`` to the
    compute dtype's exponent and mantissa is an op of its own, which that rewrite keeps, so
    the op and its reference compute the same function in every program.
    """
    info = jnp.finfo(logits.dtype)
    if logits.dtype == jnp.float32 or info.bits > 32:
        return logits.astype(jnp.float32)
    return jax.lax.reduce_precision(
        logits.astype(jnp.float32), exponent_bits=info.nexp, mantissa_bits=info.nmant
    )


def _chunk(
    x: jax.Array, table: jax.Array, labels: jax.Array, ignore_index: int, grads: bool
) -> tuple[jax.Array, jax.Array | None]:
    """One chunk's summed loss (fp32) and, with ``grads``, d loss / d logits in x's dtype."""
    logits = _fp32_logits(jnp.einsum("nd,vd->nv", x, table))
    lse = jax.nn.logsumexp(logits, axis=-1)
    counted, in_range, safe = _label_masks(labels, table.shape[0], ignore_index)
    target = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
    # An out-of-range label cannot be caught at trace time: it makes the loss NaN, visibly,
    # instead of training on the wrong token. `where`, not a product with the mask, so an
    # ignored token contributes an exact 0 whatever its logits are.
    loss = jnp.sum(jnp.where(counted, jnp.where(in_range, lse - target, jnp.nan), 0.0))
    if not grads:
        return loss, None
    # d loss / d logits = softmax - one_hot(label) for a counted token, 0 for an ignored one,
    # cast to the compute dtype as the transpose of the logits' fp32 cast would.
    one_hot = jax.nn.one_hot(safe, table.shape[0], dtype=jnp.float32)
    d = jnp.exp(logits - lse[:, None]) - one_hot
    d = jnp.where(counted[:, None], jnp.where(in_range[:, None], d, jnp.nan), 0.0)
    return loss, d.astype(x.dtype)


def _walk(
    x: jax.Array, table: jax.Array, labels: jax.Array, chunk: int, ignore_index: int, grads: bool
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """``(loss, dx, dtable)`` over all chunks: the full chunks in a scan, then the remainder.

    ``dtable`` is accumulated in fp32 over the chunks and cast to the table's dtype once.
    """
    n, d_model = x.shape
    full = n - n % chunk
    # The scan's carry must have the type its body returns: inside shard_map that is varying
    # over every axis the chunk's operands vary over (they were made alike by the caller).
    zero = _compat.vary_like(jnp.zeros((), jnp.float32), x, table, labels)
    dtable = zero + jnp.zeros(table.shape, jnp.float32) if grads else zero
    carry = (zero, dtable)

    def body(carry, xs) -> tuple[tuple[jax.Array, jax.Array], Any]:  # Any: dx, or None
        total, dtable = carry
        x_c, labels_c = xs
        loss, d = _chunk(x_c, table, labels_c, ignore_index, grads)
        if d is None:
            return (total + loss, dtable), None
        dtable = dtable + jnp.einsum("nv,nd->vd", d, x_c, preferred_element_type=jnp.float32)
        return (total + loss, dtable), jnp.einsum("nv,vd->nd", d, table)

    dx = []
    if full:
        xs = (x[:full].reshape(full // chunk, chunk, d_model), labels[:full].reshape(-1, chunk))
        carry, dx_full = jax.lax.scan(body, carry, xs)
        if grads:
            dx.append(dx_full.reshape(full, d_model))
    if full < n:
        carry, dx_rest = body(carry, (x[full:], labels[full:]))
        if grads:
            dx.append(dx_rest)
    total, dtable = carry
    if not grads:
        return total, None, None
    dx_all = jnp.concatenate(dx) if dx else jnp.zeros(x.shape, x.dtype)
    return total, dx_all, dtable.astype(table.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _loss(x, table, labels, chunk, ignore_index):
    return _walk(x, table, labels, chunk, ignore_index, grads=False)[0]


def _loss_fwd(x, table, labels, chunk, ignore_index):
    total, dx, dtable = _walk(x, table, labels, chunk, ignore_index, grads=True)
    return total, (dx, dtable)


def _loss_bwd(chunk, ignore_index, residuals, g):
    dx, dtable = residuals
    scale = lambda t: (g * t.astype(jnp.float32)).astype(t.dtype)
    return scale(dx), scale(dtable), None


_loss.defvjp(_loss_fwd, _loss_bwd)


def _check_operands(
    features_NxD: Any, table_VxD: Any, labels_N: Any, ignore_index: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    features_NxD, table_VxD, labels_N = map(jnp.asarray, (features_NxD, table_VxD, labels_N))
    if features_NxD.ndim != 2 or table_VxD.ndim != 2 or features_NxD.shape[1] != table_VxD.shape[1]:
        raise ValueError(
            f"features_NxD must be [N, D] and table_VxD [V, D] with the same D (reshape "
            f"leading batch axes into N first), got features_NxD.shape={features_NxD.shape}, "
            f"table_VxD.shape={table_VxD.shape}"
        )
    if table_VxD.shape[0] == 0:
        raise ValueError(f"table_VxD must have V >= 1 rows, got {table_VxD.shape=}")
    if labels_N.shape != features_NxD.shape[:1] or not jnp.issubdtype(labels_N.dtype, jnp.integer):
        raise ValueError(
            f"labels_N must be integer ids of shape ({features_NxD.shape[0]},), got "
            f"labels_N.shape={labels_N.shape}, labels_N.dtype={labels_N.dtype}"
        )
    for name, value in (("features_NxD", features_NxD), ("table_VxD", table_VxD)):
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating, got {name}.dtype={value.dtype}")
    for name, value in (
        ("features_NxD", features_NxD),
        ("table_VxD", table_VxD),
        ("labels_N", labels_N),
    ):
        # Over an Explicit mesh axis the sharding is part of the type, and each chunk's
        # slice, reshape and gather would need an output sharding chosen for it; the tokens
        # are meant to be chunked per device, inside shard_map (Auto axes need nothing).
        spec = getattr(getattr(jax.typeof(value), "sharding", None), "spec", None)
        if spec is not None and any(axis is not None for axis in spec):
            raise ValueError(
                f"{name} is sharded over an Explicit mesh axis ({name} has spec {spec}): "
                f"call linear_cross_entropy per device inside jax.shard_map, on each "
                f"device's tokens, or reshard {name} replicated"
            )
    check_int("ignore_index", ignore_index)
    # Narrow labels are widened (losslessly) so that V and ignore_index compare with them.
    if labels_N.dtype.itemsize < 4:
        labels_N = labels_N.astype(jnp.int32)
    info = np.iinfo(labels_N.dtype)
    if not info.min <= ignore_index <= info.max:
        raise ValueError(
            f"ignore_index={ignore_index} is not a value of labels_N.dtype={labels_N.dtype}: "
            f"pass signed labels, or an ignore_index in [{info.min}, {info.max}]"
        )
    return features_NxD, table_VxD, labels_N


@functools.partial(jax.jit, static_argnames=("chunk", "ignore_index", "dtype"))
def _linear_cross_entropy_jit(
    features: jax.Array,
    table: jax.Array,
    labels: jax.Array,
    *,
    chunk: int,
    ignore_index: int,
    dtype: np.dtype,
) -> tuple[jax.Array, jax.Array]:
    # The casts sit outside the custom VJP, so autodiff carries the gradients back to the
    # storage dtypes exactly as it would for the plain formula. So do the casts to varying:
    # inside shard_map a table replicated over `data` meets tokens that vary over it, and
    # the cast's transpose sums the table's gradient over `data` (rudax.sharding.vary_like).
    features = _compat.vary_like(features, table, labels)
    table = _compat.vary_like(table, features)
    count = jnp.sum(labels != ignore_index, dtype=jnp.int32)
    loss = _loss(features.astype(dtype), table.astype(dtype), labels, chunk, ignore_index)
    # jax.custom_vjp.__new__ is unannotated, so the checkers cannot see that _loss returns
    # an Array (see rudax/kernels/_rms_norm.py).
    return loss, count  # pyright: ignore[reportReturnType]  # see above


def linear_cross_entropy(
    features_NxD: ArrayLike,
    table_VxD: ArrayLike,
    labels_N: ArrayLike,
    *,
    chunk: int = 1024,
    ignore_index: int = -100,
    dtype: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Summed cross entropy of ``features @ table.T`` over the counted tokens, chunked.

    ``c`` casts to the compute dtype ``dtype`` (None: ``features``'s), the dtype the logits
    are made in and rounded to (explicitly, so XLA's ``xla_allow_excess_precision`` cannot
    keep their matmul's fp32 result in one program and not in another); the softmax and the
    sum are fp32 whatever it is. With ``counted_n = labels_n != ignore_index``::

        logits_c = (c(features[i:i + chunk]) @ c(table).T).astype(float32)   for each chunk i
        loss_sum = sum_i sum_n [counted_n] (logsumexp(logits_c[n]) - logits_c[n, labels_n])
        count    = sum_n [counted_n]

    The ``[N, V]`` logits are never held whole: one chunk's at a time (see the module
    docstring). An ignored token adds exactly nothing to the loss or to either gradient, so a
    chunk whose labels are all ignored, or a batch with no counted token, gives a zero loss,
    zero gradients and ``count == 0`` (no NaN: the caller divides by the count, if at all).
    ``(loss_sum, count)`` is the contract of token-weighted gradient accumulation:
    ``acc.add(grad(loss_sum), weight=count)``.

    Gradients equal plain autodiff of ``linear_cross_entropy_reference`` up to float
    summation order, in the storage dtypes of ``features`` and ``table``: ``dtable`` is summed
    over the chunks in fp32 and cast to the compute dtype once. They are computed, chunk by
    chunk, in the forward pass of the gradient.

    Labels that are neither ``ignore_index`` nor in ``[0, V)`` cannot be checked at trace
    time: each makes ``loss_sum`` NaN (and the gradients NaN), so the step is visibly wrong
    and a finite check (``rudax.optim.skip_nonfinite``) skips it. It is never read out of
    bounds, nor wrapped around as a negative index would be. It is still counted.

    Inside ``jax.shard_map``, on each device's tokens, a table replicated over an axis the
    tokens vary over gets its gradient summed over that axis, as a replicated parameter's
    must be. Under ``jax.jit`` over Auto mesh axes any input shardings work; an operand
    sharded over an Explicit mesh axis outside ``shard_map`` is a ValueError saying so.

    Args:
      features_NxD: the hidden states ``[N, D]``, floating. Only ``[N, D]``: reshape leading
        batch axes into ``N`` first (``x.reshape(-1, D)``, with ``labels.reshape(-1)``).
      table_VxD: the output projection ``[V, D]``, floating: a tied embedding table, or an
        untied head stored ``[out, in]`` as Hugging Face's ``lm_head.weight`` is.
      labels_N: integer token ids ``[N]``, in ``[0, V)`` or equal to ``ignore_index``.
      chunk: tokens per chunk, a positive int; the last chunk takes the remainder. Static:
        each value compiles its own program.
      ignore_index: the label of a token that is not counted (prompt and padding tokens);
        -100, Hugging Face's and torch's convention, by default. A Python int.
      dtype: compute dtype of the logits and of the two gradient matmuls; None for
        ``features``'s.

    Returns:
      ``(loss_sum, count)``: the summed cross entropy over the counted tokens, a fp32
      scalar, and their number, an int32 scalar, from a jitted body that compiles once per
      shape, dtype and option. A ValueError or TypeError naming the argument, its shape and
      dtype, for operands of the wrong kind.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> x, table = jnp.ones((5, 4)), jnp.zeros((7, 4))  # equal logits: log(7) per token
      >>> labels = jnp.array([0, 1, -100, 3, -100])  # two tokens not counted
      >>> loss, count = rk.linear_cross_entropy(x, table, labels, chunk=2)
      >>> int(count), bool(jnp.isclose(loss, 3 * jnp.log(7.0)))
      (3, True)
      >>> dx = jax.grad(lambda x: rk.linear_cross_entropy(x, table, labels, chunk=2)[0])(x)
      >>> dx.shape, dx.dtype
      ((5, 4), dtype('float32'))

    References:
      Hsu et al., `Liger Kernel: Efficient Triton Kernels for LLM Training
      <https://arxiv.org/abs/2410.10989>`_, 2024 (fused linear cross entropy).
    """
    check_positive_int("chunk", chunk)
    features_NxD, table_VxD, labels_N = _check_operands(
        features_NxD, table_VxD, labels_N, ignore_index
    )
    c = features_NxD.dtype if dtype is None else float_dtype("dtype", dtype, allow_none=False)
    return _linear_cross_entropy_jit(
        features_NxD,
        table_VxD,
        labels_N,
        chunk=int(chunk),
        ignore_index=int(ignore_index),
        dtype=c,
    )


def linear_cross_entropy_reference(
    features_NxD: ArrayLike,
    table_VxD: ArrayLike,
    labels_N: ArrayLike,
    *,
    ignore_index: int = -100,
    dtype: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """``linear_cross_entropy``'s definition in plain jnp: the full logits, plain autodiff.

    The same formula with one chunk of all ``N`` tokens, written without a custom VJP, so
    ``jax.grad`` of it is autodiff through the full ``[N, V]`` logits (the memory the
    chunked op saves). Labels outside ``[0, V)`` that are not ignored make the loss NaN, as
    in ``linear_cross_entropy`` (autodiff then gives such a token a zero gradient, not NaN).

    Args:
      features_NxD: the hidden states ``[N, D]``, floating.
      table_VxD: the output projection ``[V, D]``, floating.
      labels_N: integer token ids ``[N]``.
      ignore_index: the label of a token that is not counted.
      dtype: compute dtype of the logits; None for ``features``'s.

    Returns:
      ``(loss_sum, count)``, a fp32 and an int32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> loss, count = rk.linear_cross_entropy_reference(
      ...     jnp.ones((2, 3)), jnp.zeros((4, 3)), jnp.array([1, -100]))
      >>> int(count), bool(jnp.isclose(loss, jnp.log(4.0)))
      (1, True)
    """
    features_NxD, table_VxD, labels_N = map(jnp.asarray, (features_NxD, table_VxD, labels_N))
    c = features_NxD.dtype if dtype is None else dtype
    logits = _fp32_logits(jnp.einsum("nd,vd->nv", features_NxD.astype(c), table_VxD.astype(c)))
    lse = jax.nn.logsumexp(logits, axis=-1)
    counted, in_range, safe = _label_masks(labels_N, table_VxD.shape[0], ignore_index)
    target = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
    loss = jnp.sum(jnp.where(counted, jnp.where(in_range, lse - target, jnp.nan), 0.0))
    return loss, jnp.sum(counted, dtype=jnp.int32)
