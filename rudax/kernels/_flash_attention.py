"""Flash attention: ``softmax(scale * q k^T + mask) v`` without the T x S score matrix.

The op's contract, its arguments' checks and its derivative live here; the two paths live
beside it: ``_flash_attention_pallas.py`` (Triton kernels for the GPU, an ordered backward
with no atomics) and ``_flash_attention_xla.py`` (the same algorithm in ``lax`` loops for
every other platform). Both keep only the output and the fp32 log-sum-exp for the backward,
so attention's memory grows as O(T), and both skip the blocks a causal mask, a window,
disjoint segment ids or other branches of a shared prefix (``branch_ids``) hide.
``impl="cudnn"`` calls ``jax.nn.dot_product_attention``'s cuDNN kernel where it computes the
same function, and refuses where it would not.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.core
import jax.numpy as jnp

from rudax._validation import check_bool
from rudax.kernels import _auto, _compat, _platform
from rudax.kernels import _flash_attention_checks as _checks
from rudax.kernels import _flash_attention_pallas as _pallas
from rudax.kernels import _flash_attention_xla as _xla
from rudax.kernels._attention_mask import Ids, Mask, unshared_positions
from rudax.kernels._blocks import check_block

IMPLS = ("auto", "pallas", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class FlashAttentionBlock:
    """Block sizes of ``flash_attention``'s two paths.

    Attributes:
      q: query rows per program of the Pallas forward, a power of two >= 16.
      kv: key rows per step of the Pallas forward, a power of two >= 16.
      q_backward: query rows per block of the Pallas backward kernels, likewise.
      kv_backward: key rows per block of the Pallas backward kernels, likewise.
      num_warps: warps per Pallas program, a power of two.
      num_stages: Triton's software-pipelining stages of the Pallas kernels' loops, >= 1.
      xla_q: query rows per chunk of the XLA path, >= 1 (any size: the last chunk is padded).
      xla_kv: key rows per chunk of the XLA path, >= 1.
    """

    # Pallas: FlashAttention-2's usual tiles for head_dim <= 128 on an A100/H100-class GPU
    # (64 x 64 forward over 4 warps): the defaults. With block=None on a GPU, the block
    # benchmarks/tune_gpu.py measured fastest there for the head dimension, where it has.
    q: int = 64
    kv: int = 64
    q_backward: int = 64
    kv_backward: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # XLA: measured on a 2-core CPU (benchmarks/attention.py): larger chunks amortize each
    # loop step, smaller ones skip more of a causal mask's hidden half.
    xla_q: int = 128
    xla_kv: int = 128

    def __post_init__(self) -> None:
        for name in ("q", "kv", "q_backward", "kv_backward"):
            value = getattr(self, name)
            if _not_int(value) or value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {name}={value!r}")
        if _not_int(self.num_warps) or self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got num_warps={self.num_warps!r}")
        for name in ("num_stages", "xla_q", "xla_kv"):
            value = getattr(self, name)
            if _not_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {name}={value!r}")


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything about a call that shapes the compiled program (hashable)."""

    mask: Mask
    scale: float
    softcap: float | None
    path: str  # "auto", "pallas", "interpret" or "xla" (_compat.resolve_impl)
    block: FlashAttentionBlock


# --- the derivative ------------------------------------------------------------------------
# ``ids`` is a flat tuple: the queries' id arrays, then the keys', each side in ``Mask.kinds``
# order (segment, branch, position; those present). Integers: no cotangent.


def _sides(st: _Static, ids: tuple[jax.Array, ...]) -> tuple[Ids, Ids]:
    n = len(st.mask.kinds)
    return st.mask.ids(ids[:n]), st.mask.ids(ids[n:])


def _forward(st: _Static, q, k, v, ids) -> tuple[jax.Array, jax.Array]:
    n = len(ids)

    def pallas(q, k, v, *ids):
        return _pallas.forward(
            q, k, v, *_sides(st, ids), block=st.block, interpret=st.path == "interpret",
            mask=st.mask, scale=st.scale, softcap=st.softcap,
        )  # fmt: skip

    def xla(q, k, v, *ids):
        b = st.block
        return _xla.forward(
            q, k, v, *_sides(st, ids), q_chunk=b.xla_q, kv_chunk=b.xla_kv, mask=st.mask,
            scale=st.scale, softcap=st.softcap,
        )  # fmt: skip

    assert n == 2 * len(st.mask.kinds)
    out, lse = _platform.run(st.path, pallas, xla, q, k, v, *ids, name="flash_attention")
    return out, lse


def _backward(st: _Static, q, k, v, ids, out, lse, d_out):
    n = len(ids)

    def pallas(q, k, v, *rest):
        ids, (out, lse, d_out) = rest[:n], rest[n:]
        return _pallas.backward(
            q, k, v, *_sides(st, ids), out, lse, d_out, block=st.block,
            interpret=st.path == "interpret", mask=st.mask, scale=st.scale, softcap=st.softcap,
        )  # fmt: skip

    def xla(q, k, v, *rest):
        ids, (out, lse, d_out) = rest[:n], rest[n:]
        b = st.block
        return _xla.backward(
            q, k, v, *_sides(st, ids), out, lse, d_out, q_chunk=b.xla_q, kv_chunk=b.xla_kv,
            mask=st.mask, scale=st.scale, softcap=st.softcap,
        )  # fmt: skip

    dq, dk, dv = _platform.run(
        st.path, pallas, xla, q, k, v, *ids, out, lse, d_out, name="flash_attention"
    )
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, q, k, v, ids):
    return _forward(st, q, k, v, ids)[0]


def _attention_fwd(st, q, k, v, ids):
    out, lse = _forward(st, q, k, v, ids)
    # The inputs, the output and B x H x T fp32 statistics: O(T) residuals, no scores.
    return out, (q, k, v, ids, out, lse)


def _attention_bwd(st, residuals, d_out):
    q, k, v, ids, out, lse = residuals
    dq, dk, dv = _backward(st, q, k, v, ids, out, lse, d_out)
    return dq, dk, dv, tuple(None for _ in ids)  # ids are integers: no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.jit, static_argnames=("st",))
def _attention_jit(q, k, v, q_seg, kv_seg, branch, *, st: _Static) -> jax.Array:
    if st.path != "xla":
        q, k, v = (_compat.vary_like(x, q, k, v) for x in (q, k, v))
    position = None
    if branch is not None and st.mask.window is not None:
        position = unshared_positions(q_seg, branch)
    q_ids = Ids(q_seg, branch, position)
    kv_ids = Ids(kv_seg, branch, position)
    return _attention(st, q, k, v, (*q_ids.arrays(), *kv_ids.arrays()))


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window"))
def _cudnn(q, k, v, *, scale, causal, window) -> jax.Array:
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, local_window_size=window, implementation="cudnn"
    )


# --- the public op -------------------------------------------------------------------------


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    branch_ids: jax.Array | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    impl: str = "auto",
    interpret: bool = False,
    block: FlashAttentionBlock | None = None,
) -> jax.Array:
    """Attention ``softmax(scale * q k^T + mask) v`` in O(T) memory, with an ordered backward.

    With ``R = H / G`` query heads per key/value head (grouped-query attention; the keys and
    values are never repeated in memory), query ``t``'s head ``h`` attends with key/value head
    ``h // R``::

        scores[t, s] = scale * q[t, h] . k[s, h // R]         (fp32; then, with softcap,
                                                                softcap * tanh(scores / softcap))
        out[t, h]    = sum_s softmax_s(scores[t, s] where visible, else -inf) v[s, h // R]

    Key ``s`` is at position ``s`` and query ``t`` at ``p = t + S - T``: the T queries are the
    last T positions of S (flash-attn's bottom-right alignment; ``p = t`` when T = S, and with
    a KV cache the new tokens' queries follow the cached keys). Query ``t`` sees key ``s`` iff
    ``s <= p`` (``causal``), ``p - left <= s <= p + right`` (``window=(left, right)``) and the
    two have the same segment id (``segment_ids``: examples packed into one row never see
    each other). A query that sees no key at all gets an output of zeros and no gradient.

    Shared prefixes (``branch_ids``, causal self-attention only): within a segment (a row
    without ``segment_ids``), tokens of branch 0 are the segment's shared prefix and a token
    of branch ``b > 0`` sees the prefix and the earlier tokens of its own branch, never
    another branch's. A row ``[prompt, completion 1, ..., completion G]`` then computes each
    completion exactly as ``[prompt, completion g]`` would (give the completions' RoPE
    positions restarting at the prompt's length), the prompt once instead of G times: a
    row's work is ``P^2/2 + G (R P + R^2/2)`` instead of ``G (P + R)^2 / 2``. A window is
    measured as in that unshared layout. Blocks of keys that no query of a block can see
    are skipped (a branch's queries never compute another branch's keys), and the prompt's
    dK and dV sum over every branch's queries in row order: the same bits every run.

    Precision: scores, softmax statistics and every sum in fp32; the probabilities are cast to
    ``v``'s dtype for their product with ``v`` (as every flash attention does), and the output
    is rounded once to ``v``'s dtype. The backward recomputes the scores block by block from
    the saved output and fp32 log-sum-exp (``B x H x T``): nothing ``T x S`` is ever stored. Its
    sums run in a fixed order on every path, so gradients are bitwise reproducible run to run.

    Args:
      q: queries ``[B, T, H, K]``, a floating dtype.
      k: keys ``[B, S, G, K]``, q's dtype, ``G`` dividing ``H``.
      v: values ``[B, S, G, K]``, q's dtype.
      causal: whether query ``t`` sees only keys at its position or before.
      segment_ids: None, or integer ids ``[B, T]`` of the queries' segments.
      kv_segment_ids: None (the same as ``segment_ids``; needs ``S == T``), or integer ids
        ``[B, S]`` of the keys' segments.
      branch_ids: None, or integer ids ``[B, T]`` >= 0 (needs ``causal=True`` and ``S ==
        T``): 0 for a segment's shared prefix, ``b > 0`` for its continuation ``b``. Each
        segment's prefix tokens must come before its branches' (checked when the ids are
        concrete, not traced).
      window: None, or ``(left, right)``, two ints >= 0: query at ``p`` sees keys in
        ``[p - left, p + right]`` (a sliding window: ``(w - 1, 0)`` with ``causal``).
      softcap: None, or a float > 0 that caps the scores smoothly (Gemma 2's logit soft-cap).
      scale: the scores' scale, a float > 0; None for ``1 / sqrt(K)``.
      impl: ``"auto"`` (the Pallas kernels where lowered for a GPU, XLA elsewhere),
        ``"pallas"``, ``"xla"`` (chunks of ``block.xla_q`` x ``block.xla_kv`` in ``lax``
        loops), or ``"cudnn"`` (``jax.nn.dot_product_attention(implementation="cudnn")``: a
        GPU with cuDNN, fp16/bf16; refused with segment ids, a softcap, a window other than
        ``(left, 0)`` with ``causal``, or T != S with a causal mask or window, which it would
        compute differently).
      interpret: with ``impl="pallas"``, run the Pallas kernels in interpret mode, on any
        backend (for tests); ``impl="auto"`` ignores it, as every rudax kernel does.
      block: the ``FlashAttentionBlock``; None for the one measured fastest on the GPU
        lowered for at this head dimension (``rudax/kernels/auto_table.json``), else the
        default.

    Returns:
      ``[B, T, H, K]`` in ``v``'s dtype, from a jitted body that compiles once per shape,
      dtype and option. Shapes, dtypes and options are checked at trace time: a ValueError or
      TypeError names the argument and the shapes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> q = jax.random.normal(jax.random.key(0), (1, 6, 4, 8))  # 4 query heads
      >>> kv = jax.random.normal(jax.random.key(1), (1, 6, 2, 8))  # 2 key/value heads
      >>> out = rk.flash_attention(q, kv, kv, causal=True)
      >>> out.shape, out.dtype
      ((1, 6, 4, 8), dtype('float32'))
      >>> # Two examples packed in one row: the first three tokens never see the last three.
      >>> seg = jnp.array([[1, 1, 1, 2, 2, 2]])
      >>> packed = rk.flash_attention(q, kv, kv, causal=True, segment_ids=seg)
      >>> alone = rk.flash_attention(q[:, 3:], kv[:, 3:], kv[:, 3:], causal=True)
      >>> bool(jnp.allclose(packed[:, 3:], alone, atol=1e-6))
      True
      >>> dq = jax.grad(lambda q: rk.flash_attention(q, kv, kv, causal=True).sum())(q)
      >>> dq.shape
      (1, 6, 4, 8)
      >>> # A 2-token prompt shared by two 2-token continuations: [p p a a b b].
      >>> br = jnp.array([[0, 0, 1, 1, 2, 2]])
      >>> shared = rk.flash_attention(q, kv, kv, causal=True, branch_ids=br)
      >>> pick = jnp.array([0, 1, 4, 5])  # the prompt and continuation 2, unshared
      >>> own = rk.flash_attention(q[:, pick], kv[:, pick], kv[:, pick], causal=True)
      >>> bool(jnp.allclose(shared[:, 4:], own[:, 2:], atol=1e-6))
      True

    References:
      Dao et al., `FlashAttention <https://arxiv.org/abs/2205.14135>`_, 2022;
      Dao, `FlashAttention-2 <https://arxiv.org/abs/2307.08691>`_, 2023;
      Ainslie et al., `GQA <https://arxiv.org/abs/2305.13245>`_, 2023.
    """
    q, k, v = _checks.check_qkv(q, k, v)
    b, t, _, kd = q.shape
    s = k.shape[1]
    check_bool("causal", causal, allow_numpy=False)
    q_seg, kv_seg = _checks.check_segments(segment_ids, kv_segment_ids, b, t, s)
    branch = _checks.check_branches(branch_ids, segment_ids, kv_segment_ids, causal, b, t, s)
    window = _checks.check_window(window, t, s)
    softcap = _checks.check_positive_static("softcap", softcap)
    scale = _checks.check_positive_static("scale", scale)
    scale = 1.0 / math.sqrt(kd) if scale is None else scale
    check_block(block, FlashAttentionBlock)
    if block is None:
        # The block its sweep measured fastest for this head dimension on the GPU lowered
        # for, only for that very head dimension (a larger one may not fit its tiles).
        block = _auto.tuned_block(
            FlashAttentionBlock, "flash_attention", size=kd, dtype=q.dtype, exact=True
        )
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl=}")
    if impl == "cudnn":
        _checks.check_cudnn(q, k, causal, q_seg, branch, softcap, window)
        return _cudnn(q, k, v, scale=scale, causal=causal, window=window)
    path = _compat.resolve_impl(impl, interpret=interpret)
    if q.size == 0 or k.size == 0:  # no query, or nothing to see: zeros (no kernel launch)
        return jnp.zeros(q.shape, v.dtype)
    mask = Mask(t, s, causal, window, segments=q_seg is not None, branches=branch is not None)
    st = _Static(mask, scale, softcap, path, block)
    return _attention_jit(q, k, v, q_seg, kv_seg, branch, st=st)


# --- the reference -------------------------------------------------------------------------


def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    branch_ids: jax.Array | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
    """``flash_attention``'s function written plainly: the whole ``T x S`` scores in fp32.

    O(T S) memory: for tests and short sequences. Same arguments and result as
    ``flash_attention`` (probabilities cast to ``v``'s dtype before the product with ``v``).

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> v = jnp.arange(3.0).reshape(1, 3, 1, 1)
      >>> rk.flash_attention_reference(jnp.zeros((1, 3, 1, 1)), v, v, causal=True)[0, :, 0, 0]
      Array([0. , 0.5, 1. ], dtype=float32)
    """
    q, k, v = _checks.check_qkv(q, k, v)
    b, t, h, kd = q.shape
    s, g = k.shape[1], k.shape[2]
    q_seg, kv_seg = _checks.check_segments(segment_ids, kv_segment_ids, b, t, s)
    branch = _checks.check_branches(branch_ids, segment_ids, kv_segment_ids, causal, b, t, s)
    window = _checks.check_window(window, t, s)
    softcap = _checks.check_positive_static("softcap", softcap)
    scale = _checks.check_positive_static("scale", scale)
    scale = 1.0 / math.sqrt(kd) if scale is None else scale
    q5 = q.reshape(b, t, g, h // g, kd)
    highest = jax.lax.Precision.HIGHEST if q.dtype.itemsize >= 4 else None
    scores = jnp.einsum(
        "btgrk,bsgk->bgrts", q5, k, precision=highest, preferred_element_type=jnp.float32
    )
    scores = scores * jnp.float32(scale)
    if softcap is not None:
        scores = jnp.float32(softcap) * jnp.tanh(scores / jnp.float32(softcap))
    pos = jnp.broadcast_to(jnp.arange(t)[:, None] + (s - t), (b, t, 1))
    key = jnp.broadcast_to(jnp.arange(s)[None, :], (b, 1, s))
    visible = jnp.ones((b, t, s), bool)
    if causal:
        visible &= key <= pos
    if window is not None:
        if branch is not None:  # measured in each branch's unshared layout
            pos = key = unshared_positions(q_seg, branch)
            pos, key = pos[:, :, None], key[:, None, :]
        visible &= (key >= pos - window[0]) & (key <= pos + window[1])
    if q_seg is not None and kv_seg is not None:
        visible &= q_seg[:, :, None] == kv_seg[:, None, :]
    if branch is not None:
        kb = branch[:, None, :]
        visible &= (kb == 0) | (kb == branch[:, :, None])
    visible = visible[:, None, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(m == -jnp.inf, 0.0, m))
    row_sum = jnp.sum(p, axis=-1, keepdims=True)
    probs = p / jnp.where(row_sum == 0, 1.0, row_sum)
    out = jnp.einsum(
        "bgrts,bsgk->btgrk",
        probs.astype(v.dtype),
        v,
        precision=highest,
        preferred_element_type=jnp.float32,
    )
    return out.reshape(b, t, h, kd).astype(v.dtype)
