"""Cross entropy through a linear head, a chunk of tokens at a time: no ``[N, V]`` logits kept.

``linear_cross_entropy_sum(x, table, targets)`` is the summed next-token loss of the logits
``x @ table.T``, computed without materializing them all. The forward pass of the gradient
walks the tokens in chunks; each chunk's logits live only while its loss and its gradients
(``dx`` for the chunk, its share of ``dtable``) are formed, so peak memory holds one chunk's
logits instead of all of them, and each chunk's softmax is still in cache when its two
backward matmuls read it. The backward pass only scales the saved gradients by the incoming
cotangent. Liger-Kernel's fused linear cross entropy does the same on GPU.

The price of computing gradients in the forward pass: they are computed whenever the loss is
differentiated, even if only ``x``'s or only ``table``'s is wanted.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

import rudax.sharding as rs
from rudax._validation import check_positive_int, float_dtype


def linear_cross_entropy_sum(
    x_NxD: jax.Array,
    table_VxD: jax.Array,
    targets_N: jax.Array,
    *,
    dtype: Any = None,
    chunk: int = 1024,
) -> jax.Array:
    """``sum_n logsumexp(l_n) - l_n[targets_n]`` for the logits ``l = c(x) @ c(table).T``.

    ``c`` casts to the compute dtype ``dtype`` (None: ``x``'s), the dtype the logits are made
    in; the softmax and the sum are fp32 whatever it is, as in ``examples.lm.model.loss_sum``::

        logits_c = (c(x[i:i + chunk]) @ c(table).T).astype(float32)    for each chunk i
        loss     = sum_i sum(logsumexp(logits_c) - logits_c[targets])

    Its gradient equals plain autodiff of the full-logits formula up to float summation
    order: ``dtable`` is summed over chunks in fp32 and cast to the compute dtype once.

    Args:
      x_NxD: hidden states ``[N, D]``, floating.
      table_VxD: the output projection ``[V, D]`` (a tied embedding table), floating.
      targets_N: integer target ids ``[N]`` in ``[0, V)``.
      dtype: compute dtype of the logits and of the two gradient matmuls; None for ``x``'s.
      chunk: tokens per chunk, a positive int; the last chunk takes the remainder.

    Returns:
      The summed cross entropy, a fp32 scalar.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from examples.lm.loss import linear_cross_entropy_sum
      >>> x, table = jnp.ones((5, 4)), jnp.zeros((7, 4))  # equal logits: log(7) per token
      >>> loss = linear_cross_entropy_sum(x, table, jnp.arange(5), chunk=2)
      >>> bool(jnp.isclose(loss, 5 * jnp.log(7.0)))
      True

    References:
      Hsu et al., `Liger Kernel: Efficient Triton Kernels for LLM Training
      <https://arxiv.org/abs/2410.10989>`_, 2024 (fused linear cross entropy).
    """
    check_positive_int("chunk", chunk)
    x_NxD, table_VxD, targets_N = map(jnp.asarray, (x_NxD, table_VxD, targets_N))
    if x_NxD.ndim != 2 or table_VxD.ndim != 2 or x_NxD.shape[1] != table_VxD.shape[1]:
        raise ValueError(
            f"x_NxD must be [N, D] and table_VxD [V, D] with the same D, got "
            f"x_NxD.shape={x_NxD.shape}, table_VxD.shape={table_VxD.shape}"
        )
    if targets_N.shape != x_NxD.shape[:1] or not jnp.issubdtype(targets_N.dtype, jnp.integer):
        raise ValueError(
            f"targets_N must be integer ids of shape ({x_NxD.shape[0]},), got "
            f"targets_N.shape={targets_N.shape}, targets_N.dtype={targets_N.dtype}"
        )
    for name, value in (("x_NxD", x_NxD), ("table_VxD", table_VxD)):
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating, got {name}.dtype={value.dtype}")
    c = x_NxD.dtype if dtype is None else float_dtype("dtype", dtype)
    # The casts sit outside the custom VJP, so autodiff carries the gradients back to the
    # storage dtypes exactly as it would for the plain formula. So do the casts to varying:
    # inside shard_map a table replicated over `data` meets tokens that vary over it, and
    # the cast's transpose sums the table's gradient over `data` (rudax.sharding.vary_like).
    x_NxD, table_VxD = rs.vary_like(x_NxD, table_VxD), rs.vary_like(table_VxD, x_NxD)
    return _loss(x_NxD.astype(c), table_VxD.astype(c), targets_N, chunk)


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(i, min(i + chunk, n)) for i in range(0, n, chunk)]


def _chunk_loss(x, table, targets):
    """One chunk's logits (fp32), log-sum-exp and summed loss."""
    logits = jnp.einsum("nd,vd->nv", x, table).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return logits, lse, jnp.sum(lse - target)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _loss_vjp(x, table, targets, spans):
    return sum(_chunk_loss(x[a:b], table, targets[a:b])[2] for a, b in spans)


def _loss(x, table, targets, chunk):
    return _loss_vjp(x, table, targets, tuple(_spans(x.shape[0], chunk)))


def _loss_fwd(x, table, targets, spans):
    total = jnp.zeros((), jnp.float32)
    dx, dtable = [], jnp.zeros(table.shape, jnp.float32)
    for a, b in spans:
        logits, lse, loss = _chunk_loss(x[a:b], table, targets[a:b])
        total = total + loss
        # d loss / d logits = softmax - one_hot(target), cast to the compute dtype as the
        # transpose of the logits' fp32 cast would.
        one_hot = jax.nn.one_hot(targets[a:b], table.shape[0], dtype=jnp.float32)
        d = (jnp.exp(logits - lse[:, None]) - one_hot).astype(x.dtype)
        dx.append(jnp.einsum("nv,vd->nd", d, table))
        dtable = dtable + jnp.einsum("nv,nd->vd", d, x[a:b], preferred_element_type=jnp.float32)
    return total, (jnp.concatenate(dx), dtable.astype(table.dtype))


def _loss_bwd(spans, residuals, g):
    dx, dtable = residuals
    scale = lambda t: (g * t.astype(jnp.float32)).astype(t.dtype)
    return scale(dx), scale(dtable), None


_loss_vjp.defvjp(_loss_fwd, _loss_bwd)
