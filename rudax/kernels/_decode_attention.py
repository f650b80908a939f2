"""Decode attention: one new query per row over a KV cache, read in the layout it is stored.

A decoding step has one query token per row and a cache of S keys: the work is reading the
cache once, so the op is two batched matmuls (scores, then probabilities times values) and
an fp32 softmax between them, nothing blocked or padded. ``flash_attention`` with T = 1 pads
the query to a 16-row tile on its Pallas path and transposes the whole cache on its XLA path
at every step; this op does neither.

The cache is kv-head-major, ``[B, G, S, K]``: XLA's dot wants its batch axes (row, kv head)
leading, and with ``[B, S, G, K]`` it copies the cache into that order at every call (seen in
the compiled HLO on the CPU). Here the dots read it as stored; the one transpose is the
prefill's, once per prompt.

A row may also attend a shared block: ``n`` consecutive rows (a prompt's samples) read one
block of keys and values (the prompt's, written once by the prefill). Their ``n x H``
queries meet that block in one batched matmul, so the block is read once for all ``n``, never
gathered or copied per row. The two blocks' scores share one fp32 softmax: a page table of
depth two, each row's pages being its group's shared block and its own.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def _precision(x: jax.Array) -> lax.Precision:
    # fp32 operands multiply in fp32: a GPU's DEFAULT would round them to TF32.
    return lax.Precision.HIGHEST if x.dtype.itemsize >= 4 else lax.Precision.DEFAULT


@functools.partial(jax.jit, static_argnames=("scale",))
def _decode(q, k, v, visible, shared_k, shared_v, shared_visible, *, scale: float) -> jax.Array:
    b, h, kd = q.shape
    g = k.shape[1]
    r = h // g
    f32 = jnp.float32
    # Own block: row b's R query heads of kv head g against its keys [b, g, :, :].
    q4 = q.reshape(b, g, r, kd)
    own = jnp.einsum("bgrk,bgsk->bgrs", q4, k, precision=_precision(k), preferred_element_type=f32)
    own = jnp.where(visible[:, None, None, :], own * f32(scale), -jnp.inf)
    m = jnp.max(own, axis=-1, keepdims=True, initial=-jnp.inf)
    if shared_k is not None:
        # Shared block: the n rows of group c as one [n * R, K] query matrix per kv head, a
        # plain batched matmul over (c, g) that reads each shared key once for all n rows.
        c, p = shared_k.shape[0], shared_k.shape[2]
        n = b // c
        q_shared = q.reshape(c, n, g, r, kd).transpose(0, 2, 1, 3, 4).reshape(c, g, n * r, kd)
        shared = jnp.einsum(
            "cgmk,cgpk->cgmp",
            q_shared,
            shared_k,
            precision=_precision(shared_k),
            preferred_element_type=f32,
        )
        shared_visible = shared_visible.reshape(c, 1, n, 1, p)
        shared = jnp.where(
            shared_visible, shared.reshape(c, g, n, r, p) * f32(scale), -jnp.inf
        ).reshape(c, g, n * r, p)
        m_shared = jnp.max(shared, axis=-1, initial=-jnp.inf).reshape(c, g, n, r)
        m = jnp.maximum(m, m_shared.transpose(0, 2, 1, 3).reshape(b, g, r, 1))
    # A row that sees nothing has m = -inf: shift by 0 there, so its weights are exp(-inf) = 0.
    m = jnp.where(m == -jnp.inf, 0.0, m)
    e_own = jnp.exp(own - m)
    total = jnp.sum(e_own, axis=-1, keepdims=True)
    if shared_k is not None:
        to_shared = lambda x: x.reshape(c, n, g, r, 1).transpose(0, 2, 1, 3, 4).reshape(c, g, -1, 1)
        e_shared = jnp.exp(shared - to_shared(m))
        sum_shared = jnp.sum(e_shared, axis=-1).reshape(c, g, n, r)
        total = total + sum_shared.transpose(0, 2, 1, 3).reshape(b, g, r, 1)
    total = jnp.where(total == 0, 1.0, total)
    # Probabilities normalized in fp32, then cast to v's dtype for the product (as
    # flash_attention_reference and transformers' eager attention do).
    p_own = (e_own / total).astype(v.dtype)
    out = jnp.einsum(
        "bgrs,bgsk->bgrk", p_own, v, precision=_precision(v), preferred_element_type=f32
    )
    if shared_k is not None:
        p_shared = (e_shared / to_shared(total)).astype(v.dtype)
        out_shared = jnp.einsum(
            "cgmp,cgpk->cgmk",
            p_shared,
            shared_v,
            precision=_precision(shared_v),
            preferred_element_type=f32,
        )
        out = out + out_shared.reshape(c, g, n, r, kd).transpose(0, 2, 1, 3, 4).reshape(b, g, r, kd)
    return out.reshape(b, h, kd).astype(v.dtype)


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array,
    *,
    shared_k: jax.Array | None = None,
    shared_v: jax.Array | None = None,
    shared_visible: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Attention of one new query per row over its cached keys and values (a decoding step).

    With ``R = H / G`` query heads per key/value head (grouped-query attention; keys and
    values are never repeated), row ``b``'s head ``h`` attends with kv head ``g = h // R``::

        own[s]    = scale * q[b, h] . k[b, g, s]                      (fp32)
        shared[p] = scale * q[b, h] . shared_k[b // n, g, p]          (n = B / B_shared)
        out[b, h] = sum_s w_own[s] v[b, g, s] + sum_p w_shared[p] shared_v[b // n, g, p]

    where ``(w_own, w_shared) = softmax(own where visible, shared where shared_visible)``:
    one softmax over both blocks, in fp32. Rows ``i * n .. i * n + n - 1`` share block ``i``
    (a prompt's ``n`` samples share its keys): a page table of depth two, every row's pages
    being its group's shared block and its own. The shared block is read once for its ``n``
    rows, in one batched matmul. A row that sees no key gets zeros.

    Precision: scores, softmax and sums in fp32; the probabilities are cast to ``v``'s dtype
    for their product with ``v`` (as ``flash_attention`` does), the output rounded once.

    Args:
      q: the new queries ``[B, H, K]``, a floating dtype.
      k: each row's own keys ``[B, G, S, K]`` (kv-head-major, the layout the product reads
        without a copy), q's dtype, ``G`` dividing ``H``.
      v: each row's own values ``[B, G, S, K]``, q's dtype.
      visible: bool ``[B, S]``: the own slots each row sees (written, and within any window).
      shared_k: None, or the shared keys ``[B_shared, G, P, K]``, ``B_shared`` dividing ``B``.
      shared_v: the shared values, ``shared_k``'s shape; with ``shared_k`` only.
      shared_visible: bool ``[B, P]``: the shared slots each row sees; with ``shared_k`` only.
      scale: the scores' scale, a float > 0; None for ``1 / sqrt(K)``.

    Returns:
      ``[B, H, K]`` in ``v``'s dtype. Shapes and dtypes are checked at trace time: a
      ValueError or TypeError names the argument and the shapes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> q = jax.random.normal(jax.random.key(0), (4, 6, 8))  # 4 rows, 6 query heads
      >>> prompt = jax.random.normal(jax.random.key(1), (2, 3, 5, 8))  # 2 prompts, 3 kv heads
      >>> own = jax.random.normal(jax.random.key(2), (4, 3, 2, 8))  # each row's 2 slots
      >>> seen, seen_prompt = jnp.ones((4, 2), bool), jnp.ones((4, 5), bool)
      >>> out = rk.decode_attention(q, own, own, seen, shared_k=prompt, shared_v=prompt,
      ...                           shared_visible=seen_prompt)
      >>> out.shape
      (4, 6, 8)
      >>> # the same as each row reading its prompt's copy and its own slots, concatenated
      >>> full = jnp.concatenate([jnp.repeat(prompt, 2, axis=0), own], axis=2)
      >>> alone = rk.decode_attention(q, full, full, jnp.ones((4, 7), bool))
      >>> bool(jnp.allclose(out, alone, atol=1e-6))
      True

    References:
      Kwon et al., `PagedAttention <https://arxiv.org/abs/2309.06180>`_, 2023 (block tables);
      Ainslie et al., `GQA <https://arxiv.org/abs/2305.13245>`_, 2023.
    """
    q, k, v, visible = _check(q, k, v, visible)
    shared = (shared_k, shared_v, shared_visible)
    if any(x is not None for x in shared):
        shared_k, shared_v, shared_visible = _check_shared(q, k, *shared)
    scale = _check_scale(scale, q.shape[-1])
    return _decode(q, k, v, visible, shared_k, shared_v, shared_visible, scale=scale)


# --- argument checks -----------------------------------------------------------------------


def _check(q: Any, k: Any, v: Any, visible: Any) -> tuple[jax.Array, ...]:
    for name, x in (("q", q), ("k", k), ("v", v), ("visible", visible)):
        if not isinstance(x, jax.Array | np.ndarray):
            raise TypeError(f"{name} must be a jax.Array or numpy array, got {name}={x!r}")
    shapes = f"q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}"
    if q.ndim != 3 or k.ndim != 4:
        raise ValueError(
            f"decode_attention expects q [batch, heads, head_dim] and k, v [batch, kv_heads, "
            f"slots, head_dim], got {shapes}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {shapes}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[3]:
        raise ValueError(f"q and k must have the same batch size and head_dim, got {shapes}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"k's kv_heads must divide q's heads (grouped-query attention), got {shapes}"
        )
    _check_dtypes({"q": q, "k": k, "v": v})
    if visible.dtype != jnp.bool_ or visible.shape != (k.shape[0], k.shape[2]):
        raise ValueError(
            f"visible must be bool [batch, slots] = {(k.shape[0], k.shape[2])}, got "
            f"visible.shape={visible.shape}, visible.dtype={visible.dtype}"
        )
    return q, k, v, visible


def _check_shared(
    q: jax.Array, k: jax.Array, shared_k: Any, shared_v: Any, shared_visible: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    given = {"shared_k": shared_k, "shared_v": shared_v, "shared_visible": shared_visible}
    missing = [name for name, x in given.items() if x is None]
    if missing:
        raise ValueError(f"shared_k, shared_v and shared_visible go together; missing {missing}")
    for name, x in given.items():
        if not isinstance(x, jax.Array | np.ndarray):
            raise TypeError(f"{name} must be a jax.Array or numpy array, got {name}={x!r}")
    shapes = f"shared_k.shape={shared_k.shape}, shared_v.shape={shared_v.shape}, k.shape={k.shape}"
    if shared_k.ndim != 4 or shared_k.shape != shared_v.shape:
        raise ValueError(
            f"shared_k and shared_v must both be [groups, kv_heads, slots, head_dim], got {shapes}"
        )
    c = shared_k.shape[0]
    if shared_k.shape[1] != k.shape[1] or shared_k.shape[3] != k.shape[3]:
        raise ValueError(f"shared_k must have k's kv_heads and head_dim, got {shapes}")
    if c == 0 or q.shape[0] % c:
        raise ValueError(
            f"shared_k's groups must divide the batch (each group's rows are consecutive), got "
            f"{c} groups for batch {q.shape[0]}: {shapes}"
        )
    _check_dtypes({"q": q, "shared_k": shared_k, "shared_v": shared_v})
    want = (q.shape[0], shared_k.shape[2])
    if shared_visible.dtype != jnp.bool_ or shared_visible.shape != want:
        raise ValueError(
            f"shared_visible must be bool [batch, shared slots] = {want}, got "
            f"shared_visible.shape={shared_visible.shape}, "
            f"shared_visible.dtype={shared_visible.dtype}"
        )
    return shared_k, shared_v, shared_visible


def _check_dtypes(arrays: dict[str, Any]) -> None:
    dtypes = ", ".join(f"{name}.dtype={x.dtype}" for name, x in arrays.items())
    if len({x.dtype for x in arrays.values()}) != 1:
        raise TypeError(f"{', '.join(arrays)} must have the same dtype, got {dtypes}")
    if next(iter(arrays.values())).dtype not in _DTYPES:
        raise TypeError(f"the operands must be float16, bfloat16, float32 or float64, got {dtypes}")


def _check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be None or a Python float, got scale={scale!r}")
    if not (math.isfinite(float(scale)) and float(scale) > 0):
        raise ValueError(f"scale must be None or a finite float > 0, got scale={scale!r}")
    return float(scale)


# --- the reference -------------------------------------------------------------------------


def decode_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array,
    *,
    shared_k: jax.Array | None = None,
    shared_v: jax.Array | None = None,
    shared_visible: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """``decode_attention`` written plainly: each row's own copy of its shared block and of
    every kv head, concatenated, and one softmax over the whole row.

    O(B H (P + S)) memory with the copies: for tests. Same arguments and result.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> v = jnp.arange(3.0).reshape(1, 1, 3, 1)
      >>> seen = jnp.array([[True, True, False]])
      >>> rk.decode_attention_reference(jnp.zeros((1, 1, 1)), v, v, seen)[0, 0, 0]
      Array(0.5, dtype=float32)
    """
    q, k, v, visible = _check(q, k, v, visible)
    b, h, kd = q.shape
    g = k.shape[1]
    if any(x is not None for x in (shared_k, shared_v, shared_visible)):
        shared_k, shared_v, shared_visible = _check_shared(q, k, shared_k, shared_v, shared_visible)
        n = b // shared_k.shape[0]
        k = jnp.concatenate([jnp.repeat(shared_k, n, axis=0), k], axis=2)
        v = jnp.concatenate([jnp.repeat(shared_v, n, axis=0), v], axis=2)
        visible = jnp.concatenate([shared_visible, visible], axis=1)
    scale = _check_scale(scale, kd)
    k_h = jnp.repeat(k, h // g, axis=1)  # [B, H, S, K]: every query head its own kv copy
    v_h = jnp.repeat(v, h // g, axis=1)
    highest = lax.Precision.HIGHEST if q.dtype.itemsize >= 4 else None
    scores = jnp.einsum(
        "bhk,bhsk->bhs", q, k_h, precision=highest, preferred_element_type=jnp.float32
    )
    scores = jnp.where(visible[:, None, :], scores * jnp.float32(scale), -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf)
    p = jnp.exp(scores - jnp.where(m == -jnp.inf, 0.0, m))
    row_sum = jnp.sum(p, axis=-1, keepdims=True)
    probs = p / jnp.where(row_sum == 0, 1.0, row_sum)
    out = jnp.einsum(
        "bhs,bhsk->bhk",
        probs.astype(v.dtype),
        v_h,
        precision=highest,
        preferred_element_type=jnp.float32,
    )
    return out.astype(v.dtype)
