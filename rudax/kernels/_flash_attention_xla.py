"""``flash_attention``'s XLA path: the flash algorithm in ``lax`` loops, for any platform.

The forward walks the queries in chunks of ``bq`` rows (``lax.map``) and, for each, the keys
in chunks of ``bk`` (``lax.fori_loop``) with an online softmax: a running row maximum ``m``,
the running sum ``l`` of ``exp(score - m)`` and the unnormalized output, rescaled when ``m``
grows. Only the output and the log-sum-exp ``lse = m + log(l)`` are kept for the backward,
which recomputes each chunk's probabilities as ``exp(score - lse)``. So a chunk's scores,
``B x H x bq x bk`` floats, are the largest temporary: memory grows as O(T), not O(T^2).

The loops are ``lax`` loops whose bounds come from the mask (``Mask.kv_blocks`` and
``q_blocks``): chunks a causal or windowed mask hides entirely are never computed, and the
program's size does not grow with T. With segment or branch ids, a chunk whose query and key
ids cannot meet (``Mask.may_see``) is skipped under ``lax.cond``: a branch's queries never
compute another branch's keys.

The backward is one pass over key chunks. Each accumulates its dK and dV over the query
chunks that can see it, and adds each query chunk's share of dQ into one fp32 buffer: the
loops run in a fixed order, so the result is the same bits every run. A shared prefix's key
chunk sums its dK and dV over the query chunks of every branch, in row order.

Layouts inside: queries ``[B, T, G, R, K]`` (``R = H / G`` query heads per key/value head, a
free reshape), scores ``[B, G, R, bq, bk]``; the statistics ``lse`` leave as ``[B, H, T]``,
the layout the Pallas path keeps too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from rudax.kernels import _compat
from rudax.kernels._attention_mask import Ids, Mask

F32 = jnp.float32


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """``x`` with zeros appended along ``axis`` up to a multiple of ``multiple`` (or itself)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _precision(x: jax.Array) -> lax.Precision:
    """HIGHEST for fp32 (and wider) operands: a GPU's DEFAULT would multiply fp32 in TF32.

    Scores and their gradients are promised in fp32; bf16 and fp16 operands multiply in their
    own precision with fp32 accumulation either way.
    """
    return lax.Precision.HIGHEST if x.dtype.itemsize >= 4 else lax.Precision.DEFAULT


def _chunk(x: jax.Array, start: jax.Array, size: int, axis: int = 1) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _scores(q_BxGxRxQxK, k_BxGxSxK, scale: float, softcap: float | None):
    """``(scores, tanh)``: fp32 scores ``[B, G, R, Q, S]``, capped; tanh for the backward."""
    s = jnp.einsum(
        "bgrqk,bgsk->bgrqs",
        q_BxGxRxQxK,
        k_BxGxSxK,
        precision=_precision(k_BxGxSxK),
        preferred_element_type=F32,
    )
    s = s * F32(scale)
    if softcap is None:
        return s, None
    t = jnp.tanh(s / F32(softcap))
    return F32(softcap) * t, t


def _visible(mask: Mask, q_start, q_size, kv_start, kv_size, q_ids: Ids, kv_ids: Ids):
    """The chunk's mask, broadcastable to ``[B, G, R, Q, S]``."""
    q_index = q_start + lax.iota(jnp.int32, q_size)
    kv_index = kv_start + lax.iota(jnp.int32, kv_size)
    vis = mask.visible(q_index, kv_index, q_ids, kv_ids)  # [Q, S] or [B, Q, S]
    return vis[:, None, None] if vis.ndim == 3 else vis


def _maybe(pred: jax.Array | None, fn, carry):
    """``fn(carry)`` if ``pred`` (a scalar) is true or None, else ``carry`` unchanged."""
    if pred is None:
        return fn(carry)
    return lax.cond(pred, fn, lambda c: c, carry)


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_ids: Ids,
    kv_ids: Ids,
    *,
    mask: Mask,
    scale: float,
    softcap: float | None,
    q_chunk: int,
    kv_chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """``(out [B, T, H, K] in v's dtype, lse [B, H, T] fp32)``; see the module docstring.

    A query that sees no key has ``out = 0`` and ``lse = -inf``.
    """
    b, t, h, kd = q.shape
    s, g = k.shape[1], k.shape[2]
    r = h // g
    bq, bk = min(q_chunk, t), min(kv_chunk, s)
    # Heads-major copies ([B, G, R, T, K], [B, G, S, K]): each chunk is then a contiguous
    # slab, and every product a plain batched matmul. O(T) copies, cheap beside O(T^2) work.
    q5 = _pad_to(q, 1, bq).reshape(b, -1, g, r, kd).transpose(0, 2, 3, 1, 4)
    k, v = (_pad_to(x, 1, bk).transpose(0, 2, 1, 3) for x in (k, v))
    q_ids = q_ids.map(lambda x: _pad_to(x, 1, bq))
    kv_ids = kv_ids.map(lambda x: _pad_to(x, 1, bk))
    n_q = q5.shape[3] // bq

    def query_chunk(i):
        q_start = i * bq
        qc, qs = _chunk(q5, q_start, bq, axis=3), q_ids.slice(q_start, bq)

        def key_chunk(j, carry):
            kv_start = j * bk
            kc, vc = _chunk(k, kv_start, bk, axis=2), _chunk(v, kv_start, bk, axis=2)
            ks = kv_ids.slice(kv_start, bk)

            def update(carry):
                o, m, row_sum = carry
                scores, _ = _scores(qc, kc, scale, softcap)
                vis = _visible(mask, q_start, bq, kv_start, bk, qs, ks)
                scores = jnp.where(vis, scores, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
                # A row that has seen no key yet keeps m = -inf; exp(-inf - 0) = 0 keeps it
                # empty instead of exp(-inf - -inf) = NaN.
                m_safe = jnp.where(m_new == -jnp.inf, F32(0), m_new)
                p = jnp.exp(scores - m_safe[..., None])
                rescale = jnp.exp(m - m_safe)
                row_sum = rescale * row_sum + jnp.sum(p, axis=-1)
                pv = jnp.einsum(
                    "bgrqs,bgsk->bgrqk",
                    p.astype(v.dtype),
                    vc,
                    precision=_precision(vc),
                    preferred_element_type=F32,
                )
                return rescale[..., None] * o + pv, m_new, row_sum

            return _maybe(mask.may_see(qs, ks), update, carry)

        init = (
            jnp.zeros((b, g, r, bq, kd), F32),
            jnp.full((b, g, r, bq), -jnp.inf, F32),
            jnp.zeros((b, g, r, bq), F32),
        )
        # Inside shard_map the carry must vary over the mesh axes its updates do.
        init = tuple(_compat.vary_like(x, q, k, v) for x in init)
        first, end = mask.kv_blocks(q_start, bq, bk)
        o, m, row_sum = lax.fori_loop(first, end, key_chunk, init)
        empty = row_sum == 0
        out = o / jnp.where(empty, F32(1), row_sum)[..., None]
        lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, F32(1), row_sum)))
        return out.astype(v.dtype), lse

    outs, lses = lax.map(query_chunk, jnp.arange(n_q, dtype=jnp.int32))
    # [n_q, B, G, R, bq, K] -> [B, n_q, bq, G, R, K] -> [B, T, H, K]
    out = outs.transpose(1, 0, 4, 2, 3, 5).reshape(b, n_q * bq, h, kd)[:, :t]
    lse = lses.transpose(1, 2, 3, 0, 4).reshape(b, h, n_q * bq)[:, :, :t]
    return out, lse


def backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_ids: Ids,
    kv_ids: Ids,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    mask: Mask,
    scale: float,
    softcap: float | None,
    q_chunk: int,
    kv_chunk: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` in q's, k's and v's dtypes, from the forward's ``out`` and ``lse``.

    With ``P = exp(S - lse)`` (S the capped scores, masked keys 0), ``D = rowsum(dO * O)``::

        dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D) * (1 - tanh^2 if capped) * scale
        dQ = dS K,     dK = dS^T Q

    dK and dV sum over the ``R`` query heads that share a key/value head.
    """
    b, t, h, kd = q.shape
    s, g = k.shape[1], k.shape[2]
    r = h // g
    bq, bk = min(q_chunk, t), min(kv_chunk, s)
    # D in fp32 from the stored (rounded) output, as flash attention computes it.
    delta = jnp.sum(d_out.astype(F32) * out.astype(F32), axis=-1)  # [B, T, H]
    q5, do5 = (
        _pad_to(x, 1, bq).reshape(b, -1, g, r, kd).transpose(0, 2, 3, 1, 4) for x in (q, d_out)
    )
    tp = q5.shape[3]
    # Statistics as [B, G, R, T]; padded query rows see no key (Mask), so their P is 0.
    lse4 = _pad_to(lse.reshape(b, g, r, t), 3, bq)
    delta4 = _pad_to(delta.reshape(b, t, g, r).transpose(0, 2, 3, 1), 3, bq)
    k, v = (_pad_to(x, 1, bk).transpose(0, 2, 1, 3) for x in (k, v))
    q_ids = q_ids.map(lambda x: _pad_to(x, 1, bq))
    kv_ids = kv_ids.map(lambda x: _pad_to(x, 1, bk))
    n_k = k.shape[2] // bk

    def key_chunk(dq_acc, j):
        kv_start = j * bk
        kc, vc = _chunk(k, kv_start, bk, axis=2), _chunk(v, kv_start, bk, axis=2)
        ks = kv_ids.slice(kv_start, bk)

        def query_chunk(i, carry):
            q_start = i * bq
            qc, qs = _chunk(q5, q_start, bq, axis=3), q_ids.slice(q_start, bq)

            def update(carry):
                dk, dv, dq_acc = carry
                doc = _chunk(do5, q_start, bq, axis=3)
                lse_c = _chunk(lse4, q_start, bq, axis=3)
                delta_c = _chunk(delta4, q_start, bq, axis=3)
                scores, tanh = _scores(qc, kc, scale, softcap)
                vis = _visible(mask, q_start, bq, kv_start, bk, qs, ks)
                p = jnp.where(vis, jnp.exp(scores - lse_c[..., None]), F32(0))
                dv = dv + jnp.einsum(
                    "bgrqs,bgrqk->bgsk",
                    p.astype(d_out.dtype),
                    doc,
                    precision=_precision(doc),
                    preferred_element_type=F32,
                )
                dp = jnp.einsum(
                    "bgrqk,bgsk->bgrqs",
                    doc,
                    vc,
                    precision=_precision(vc),
                    preferred_element_type=F32,
                )
                ds = p * (dp - delta_c[..., None])
                if tanh is not None:
                    ds = ds * (1 - tanh * tanh)
                ds = ds * F32(scale)
                dk = dk + jnp.einsum(
                    "bgrqs,bgrqk->bgsk",
                    ds.astype(q.dtype),
                    qc,
                    precision=_precision(qc),
                    preferred_element_type=F32,
                )
                dq_c = jnp.einsum(
                    "bgrqs,bgsk->bgrqk",
                    ds.astype(k.dtype),
                    kc,
                    precision=_precision(kc),
                    preferred_element_type=F32,
                )
                dq_acc = lax.dynamic_update_slice_in_dim(
                    dq_acc, _chunk(dq_acc, q_start, bq, axis=3) + dq_c, q_start, axis=3
                )
                return dk, dv, dq_acc

            return _maybe(mask.may_see(qs, ks), update, carry)

        zeros = _compat.vary_like(jnp.zeros((b, g, bk, kd), F32), q, k, v, d_out)
        init = (zeros, zeros, dq_acc)
        first, end = mask.q_blocks(kv_start, bk, bq)
        dk, dv, dq_acc = lax.fori_loop(first, end, query_chunk, init)
        return dq_acc, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq_acc = _compat.vary_like(jnp.zeros((b, g, r, tp, kd), F32), q, k, v, d_out)
    dq_acc, (dks, dvs) = lax.scan(key_chunk, dq_acc, jnp.arange(n_k, dtype=jnp.int32))
    dq = dq_acc.transpose(0, 3, 1, 2, 4).reshape(b, tp, h, kd)[:, :t].astype(q.dtype)
    # [n_k, B, G, bk, K] -> [B, S, G, K]
    dk = dks.transpose(1, 0, 3, 2, 4).reshape(b, n_k * bk, g, kd)[:, :s]
    dv = dvs.transpose(1, 0, 3, 2, 4).reshape(b, n_k * bk, g, kd)[:, :s]
    return dq, dk, dv
