"""``flash_attention``'s Pallas (Triton) kernels for the GPU: one forward, two backward.

* ``flash_attention_fwd``: one program per (query block, batch row, query head). It keeps
  its queries in registers and walks the key blocks its mask allows (``Mask.kv_blocks``)
  with an online softmax, writing the output and the log-sum-exp, nothing else.
* ``flash_attention_dkdv``: one program per (key block, batch row, key/value head). It walks
  the ``R = H / G`` query heads of its group and, for each, the query blocks that can see its
  keys, summing dK and dV in registers; each program writes only its own block.
* ``flash_attention_dq``: one program per (query block, batch row, query head), walking the
  key blocks as the forward does and summing dQ.

No program writes where another does, and every sum runs in a fixed loop order, so there
are no atomics and the gradients are the same bits every run, by construction: FlashAttention
2's backward adds dQ from each key block's program with atomics, whose order varies. The
price is that the backward computes the scores twice (once per kernel). A shared prefix
(``branch_ids``) is the dK/dV program of a prefix key block walking the query blocks of every
branch in row order; a branch's programs skip the other branches' blocks (``Mask.may_see``).
The ids (segment, branch, position; those a call has) are one int32 ref each per side.

The scores are computed in base 2 (``exp2`` of scores times log2(e)), the GPU's native
exponential; the saved log-sum-exp is natural, the same as the XLA path's. Blocks are powers
of two of at least 16 rows (Triton's ``dot``); the sequences are padded with zeros to whole
blocks and the head dimension to a power of two of at least 16 (80 -> 128, 8 -> 16), each
only when it is not already one: a padded copy, unlike the row kernels' masked loads, which
attention's O(T^2) work makes cheap. Padding is masked (``Mask``): padded keys are never
seen, padded queries see nothing.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from rudax.kernels import _compat
from rudax.kernels._attention_mask import Ids, Mask
from rudax.kernels._flash_attention_xla import _pad_to, _precision

F32 = jnp.float32
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def _block(size: int, length: int) -> int:
    """The block for ``length`` rows: ``size``, or fewer for a short sequence (>= 16)."""
    return min(size, max(16, pl.next_power_of_2(length)))


def _padded_head_dim(head_dim: int) -> int:
    return max(16, pl.next_power_of_2(head_dim))


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """``a @ b`` of 2-D blocks, either transposed in the contraction, accumulated in fp32.

    ``lax.dot_general`` rather than ``pl.dot`` (deprecated in jax 0.10, moved to the Triton
    module): Pallas's Triton lowering turns it into one ``tt.dot``, with the tensor cores'
    fp32 accumulation for bf16/fp16 operands. fp32 operands ask for HIGHEST precision, which
    that lowering makes IEEE fp32: its DEFAULT would be TF32 (10 mantissa bits).
    """
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=_precision(a), preferred_element_type=F32)


def _scores(q, k, scale: float, softcap: float | None):
    """``(scores, tanh)`` of a block, fp32, capped; tanh (or None) for the backward."""
    s = _dot(q, k, trans_b=True) * F32(scale)
    if softcap is None:
        return s, None
    t = jnp.tanh(s / F32(softcap))
    return F32(softcap) * t, t


def _read_ids(mask: Mask, refs: Any, index: Any) -> Ids:
    """A block of one side's ids read from its refs (in ``mask.kinds`` order)."""
    return mask.ids([ref[index] for ref in refs])


def _split_refs(mask: Mask, refs: Any) -> tuple[Any, Any, Any]:
    """``(query id refs, key id refs, output refs)`` of a kernel's trailing refs."""
    n = len(mask.kinds)
    return refs[:n], refs[n : 2 * n], refs[2 * n :]


def _maybe(pred, fn, carry):
    if pred is None:
        return fn(carry)
    return lax.cond(pred, fn, lambda c: c, carry)


# --- forward -------------------------------------------------------------------------------


def _forward_kernel(q_ref, k_ref, v_ref, *refs, mask, scale, softcap, bq, bk):
    qs_refs, ks_refs, (o_ref, lse_ref) = _split_refs(mask, refs)
    q_start = pl.program_id(0) * bq
    q = q_ref[...]
    q_index = q_start + lax.iota(jnp.int32, bq)
    qs = _read_ids(mask, qs_refs, slice(None))

    def key_block(j, carry):
        kv_start = j * bk
        ks = _read_ids(mask, ks_refs, pl.ds(kv_start, bk))

        def update(carry):
            o, m, row_sum = carry
            kc = k_ref[pl.ds(kv_start, bk), :]
            vc = v_ref[pl.ds(kv_start, bk), :]
            s, _ = _scores(q, kc, scale, softcap)
            vis = mask.visible(q_index, kv_start + lax.iota(jnp.int32, bk), qs, ks)
            s = jnp.where(vis, s * F32(LOG2E), -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, F32(0), m_new)  # rows still empty
            p = jnp.exp2(s - m_safe[:, None])
            rescale = jnp.exp2(m - m_safe)
            row_sum = rescale * row_sum + jnp.sum(p, axis=1)
            o = rescale[:, None] * o + _dot(p.astype(vc.dtype), vc)
            return o, m_new, row_sum

        return _maybe(mask.may_see(qs, ks), update, carry)

    init = (
        jnp.zeros((bq, q_ref.shape[-1]), F32),
        jnp.full((bq,), -jnp.inf, F32),
        jnp.zeros((bq,), F32),
    )
    first, end = mask.kv_blocks(q_start, bq, bk)
    o, m, row_sum = lax.fori_loop(first, end, key_block, init)
    empty = row_sum == 0
    row_sum = jnp.where(empty, F32(1), row_sum)
    o_ref[...] = (o / row_sum[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(row_sum)) * F32(LN2))


def forward(q, k, v, q_ids: Ids, kv_ids: Ids, *, mask: Mask, scale, softcap, block, interpret):
    """``(out [B, T, H, K], lse [B, H, T] fp32)``, the same contract as the XLA path's."""
    b, t, h, kd = q.shape
    s, g = k.shape[1], k.shape[2]
    r = h // g
    kp = _padded_head_dim(kd)
    bq, bk = _block(block.q, t), _block(block.kv, s)
    q = _pad_to(_pad_to(q, 1, bq), 3, kp)
    k, v = (_pad_to(_pad_to(x, 1, bk), 3, kp) for x in (k, v))
    tp, sp = q.shape[1], k.shape[1]
    kv_head = lambda i, bb, hh: (bb, 0, lax.div(hh, jnp.int32(r)), 0)
    in_specs = [
        pl.BlockSpec((None, bq, None, kp), lambda i, bb, hh: (bb, i, hh, 0)),
        pl.BlockSpec((None, sp, None, kp), kv_head),
        pl.BlockSpec((None, sp, None, kp), kv_head),
    ]
    args = [q, k, v]
    n = len(mask.kinds)
    in_specs += [pl.BlockSpec((None, bq), lambda i, bb, hh: (bb, i))] * n
    in_specs += [pl.BlockSpec((None, sp), lambda i, bb, hh: (bb, 0))] * n
    args += [_pad_to(x, 1, bq) for x in q_ids.arrays()]
    args += [_pad_to(x, 1, bk) for x in kv_ids.arrays()]
    kernel = functools.partial(
        _forward_kernel, mask=mask, scale=scale, softcap=softcap, bq=bq, bk=bk
    )
    out, lse = _compat.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((b, tp, h, kp), v.dtype),
            jax.ShapeDtypeStruct((b, h, tp), F32),
        ],
        grid=(tp // bq, b, h),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, kp), lambda i, bb, hh: (bb, i, hh, 0)),
            pl.BlockSpec((None, None, bq), lambda i, bb, hh: (bb, hh, i)),
        ],
        interpret=interpret,
        num_warps=block.num_warps,
        num_stages=block.num_stages,
        name="flash_attention_fwd",
    )(*args)
    return out[:, :t, :, :kd], lse[:, :, :t]


# --- backward ------------------------------------------------------------------------------


def _probabilities_and_ds(qc, kc, vc, doc, lse, delta, vis, *, scale, softcap):
    """A block's ``P`` and ``dS`` (see ``_flash_attention_xla.backward``), fp32."""
    s, tanh = _scores(qc, kc, scale, softcap)
    p = jnp.where(vis, jnp.exp2((s - lse[:, None]) * F32(LOG2E)), F32(0))
    dp = _dot(doc, vc, trans_b=True)
    ds = p * (dp - delta[:, None])
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    return p, ds * F32(scale)


def _dkdv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, mask, scale, softcap, bq, bk, r
):  # fmt: skip
    qs_refs, ks_refs, (dk_ref, dv_ref) = _split_refs(mask, refs)
    kv_start = pl.program_id(0) * bk
    kc, vc = k_ref[...], v_ref[...]
    kv_index = kv_start + lax.iota(jnp.int32, bk)
    ks = _read_ids(mask, ks_refs, slice(None))
    first, end = mask.q_blocks(kv_start, bk, bq)

    def head(rr, carry):
        def query_block(i, carry):
            q_start = i * bq
            qs = _read_ids(mask, qs_refs, pl.ds(q_start, bq))

            def update(carry):
                dk, dv = carry
                qc = q_ref[pl.ds(q_start, bq), rr, :]
                doc = do_ref[pl.ds(q_start, bq), rr, :]
                vis = mask.visible(q_start + lax.iota(jnp.int32, bq), kv_index, qs, ks)
                p, ds = _probabilities_and_ds(
                    qc,
                    kc,
                    vc,
                    doc,
                    lse_ref[rr, pl.ds(q_start, bq)],
                    delta_ref[rr, pl.ds(q_start, bq)],
                    vis,
                    scale=scale,
                    softcap=softcap,
                )
                dv = dv + _dot(p.astype(doc.dtype), doc, trans_a=True)
                dk = dk + _dot(ds.astype(qc.dtype), qc, trans_a=True)
                return dk, dv

            return _maybe(mask.may_see(qs, ks), update, carry)

        return lax.fori_loop(first, end, query_block, carry)

    zeros = jnp.zeros((bk, k_ref.shape[-1]), F32)
    dk, dv = lax.fori_loop(0, r, head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, mask, scale, softcap, bq, bk
):  # fmt: skip
    qs_refs, ks_refs, (dq_ref,) = _split_refs(mask, refs)
    q_start = pl.program_id(0) * bq
    qc, doc = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_index = q_start + lax.iota(jnp.int32, bq)
    qs = _read_ids(mask, qs_refs, slice(None))

    def key_block(j, dq):
        kv_start = j * bk
        ks = _read_ids(mask, ks_refs, pl.ds(kv_start, bk))

        def update(dq):
            kc = k_ref[pl.ds(kv_start, bk), :]
            vc = v_ref[pl.ds(kv_start, bk), :]
            vis = mask.visible(q_index, kv_start + lax.iota(jnp.int32, bk), qs, ks)
            _, ds = _probabilities_and_ds(
                qc, kc, vc, doc, lse, delta, vis, scale=scale, softcap=softcap
            )
            return dq + _dot(ds.astype(kc.dtype), kc)

        return _maybe(mask.may_see(qs, ks), update, dq)

    first, end = mask.kv_blocks(q_start, bq, bk)
    dq = lax.fori_loop(first, end, key_block, jnp.zeros((bq, q_ref.shape[-1]), F32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def backward(
    q, k, v, q_ids: Ids, kv_ids: Ids, out, lse, d_out, *, mask: Mask, scale, softcap, block,
    interpret,
):  # fmt: skip
    """``(dq, dk, dv)``: the two kernels above; the same contract as the XLA path's."""
    b, t, h, kd = q.shape
    s, g = k.shape[1], k.shape[2]
    r = h // g
    kp = _padded_head_dim(kd)
    bq, bk = _block(block.q_backward, t), _block(block.kv_backward, s)
    # D = rowsum(dO * O) in fp32, [B, H, T]: a cheap fused XLA reduction.
    delta = jnp.sum(d_out.astype(F32) * out.astype(F32), axis=-1).transpose(0, 2, 1)
    q, d_out = (_pad_to(_pad_to(x, 1, bq), 3, kp) for x in (q, d_out))
    k, v = (_pad_to(_pad_to(x, 1, bk), 3, kp) for x in (k, v))
    lse, delta = _pad_to(lse, 2, bq), _pad_to(delta, 2, bq)
    tp, sp = q.shape[1], k.shape[1]
    n = len(mask.kinds)
    ids = [_pad_to(x, 1, bq) for x in q_ids.arrays()] + [_pad_to(x, 1, bk) for x in kv_ids.arrays()]
    static = dict(mask=mask, scale=scale, softcap=softcap, bq=bq, bk=bk)
    common = dict(interpret=interpret, num_warps=block.num_warps, num_stages=block.num_stages)

    # dK, dV: a program per (key block, row, kv head); the group's R query heads as one
    # [T, R, K] block (a free reshape of [B, T, H, K]), indexed by head inside the kernel.
    q5, do5 = (x.reshape(b, tp, g, r, kp) for x in (q, d_out))
    lse4, delta4 = (x.reshape(b, g, r, tp) for x in (lse, delta))
    group = pl.BlockSpec((None, tp, None, r, kp), lambda j, bb, gg: (bb, 0, gg, 0, 0))
    stats = pl.BlockSpec((None, None, r, tp), lambda j, bb, gg: (bb, gg, 0, 0))
    kv_block = pl.BlockSpec((None, bk, None, kp), lambda j, bb, gg: (bb, j, gg, 0))
    id_specs = [pl.BlockSpec((None, tp), lambda j, bb, gg: (bb, 0))] * n
    id_specs += [pl.BlockSpec((None, bk), lambda j, bb, gg: (bb, j))] * n
    dk, dv = _compat.pallas_call(
        functools.partial(_dkdv_kernel, r=r, **static),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(sp // bk, b, g),
        in_specs=[group, kv_block, kv_block, group, stats, stats, *id_specs],
        out_specs=[kv_block, kv_block],
        name="flash_attention_dkdv",
        **common,
    )(q5, k, v, do5, lse4, delta4, *ids)

    # dQ: a program per (query block, row, query head).
    q_block = pl.BlockSpec((None, bq, None, kp), lambda i, bb, hh: (bb, i, hh, 0))
    kv_head = pl.BlockSpec(
        (None, sp, None, kp), lambda i, bb, hh: (bb, 0, lax.div(hh, jnp.int32(r)), 0)
    )
    row = pl.BlockSpec((None, None, bq), lambda i, bb, hh: (bb, hh, i))
    id_specs = [pl.BlockSpec((None, bq), lambda i, bb, hh: (bb, i))] * n
    id_specs += [pl.BlockSpec((None, sp), lambda i, bb, hh: (bb, 0))] * n
    (dq,) = _compat.pallas_call(
        functools.partial(_dq_kernel, **static),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        grid=(tp // bq, b, h),
        in_specs=[q_block, kv_head, kv_head, q_block, row, row, *id_specs],
        out_specs=[q_block],
        name="flash_attention_dq",
        **common,
    )(q, k, v, d_out, lse, delta, *ids)
    return dq[:, :t, :, :kd], dk[:, :s, :, :kd], dv[:, :s, :, :kd]
