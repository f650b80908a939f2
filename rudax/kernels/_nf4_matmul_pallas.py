"""``nf4_matmul``'s Pallas kernels: NF4 tiles dequantized in registers, fed to the dot.

The forward owns ``[block_m, block_n]`` tiles of y and loops over K; the backward owns
``[block_m, block_k]`` tiles of dx and loops over N. Both load weight tiles with
``_weight_tile``, which splits each byte into its two codes, looks them up with a tree of
selects (``_nf4_values``: a gather does not lower to Triton) and joins them back into k order.
The layout, the masking and the rounding are described in ``_nf4_matmul.py``, whose
``nf4_matmul`` chooses between these kernels and the XLA path.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from rudax.kernels import _compat
from rudax.kernels._nf4 import NF4_CODE, NF4Tensor, _absmax

# Triton's dot needs every tile dimension to be at least 16.
_MIN_TILE = 16


def _nf4_values(index: jax.Array) -> jax.Array:
    """``NF4_CODE[index]`` for int32 indices in [0, 16), as a tree of selects on the bits.

    Level ``b`` of the tree picks between neighbours by bit ``b``: 8 + 4 + 2 + 1 selects of
    the exact fp32 constants, so the value is the table's bit for bit.
    """
    level: list[Any] = [np.float32(v) for v in NF4_CODE]
    bit = 0
    while len(level) > 1:
        is_set = ((index >> bit) & 1) == 1
        level = [jnp.where(is_set, hi, lo) for lo, hi in zip(level[0::2], level[1::2], strict=True)]
        bit += 1
    return level[0]


def _weight_tile(codes_ref, absmax_ref, outs, out_mask, k_step, *, K, block_size, bk, dtype):
    """Rows ``outs`` of W, columns ``k_step * bk + [0, bk)``, dequantized: ``[bn, bk]``.

    Positions outside W read code 0 with absmax 0, hence the weight -0.0: finite, and
    multiplied there by x's or dy's masked zeros.
    """
    half = bk // 2
    pairs = k_step * half + jnp.arange(half)
    mask = out_mask[:, None] & (pairs < K // 2)[None, :]
    codes = _compat.load(
        codes_ref.at[outs[:, None], pairs[None, :]], mask=mask, other=jnp.zeros((), jnp.uint8)
    ).astype(jnp.int32)
    zero = jnp.zeros((), jnp.float32)
    if K % block_size == 0 and block_size % bk == 0:
        # The tile lies inside one block of each row: one absmax per row, a vector load.
        blocks_N = outs * (K // block_size) + (k_step * bk) // block_size
        absmax = _compat.load(absmax_ref.at[blocks_N], mask=out_mask, other=zero)[:, None]
    else:
        # Each weight's own block (both weights of a byte share one: block_size is even).
        if K % block_size == 0:
            blocks = outs[:, None] * (K // block_size) + (2 * pairs[None, :]) // block_size
        else:  # blocks straddle rows
            blocks = (outs[:, None] * K + 2 * pairs[None, :]) // block_size
        absmax = _compat.load(absmax_ref.at[blocks], mask=mask, other=zero)
    # fp32 NF4 * absmax, rounded once to c: nf4_dequantize's arithmetic.
    even = (_nf4_values(codes >> 4) * absmax).astype(dtype)
    odd = (_nf4_values(codes & 0xF) * absmax).astype(dtype)
    return jnp.stack([even, odd], axis=-1).reshape(outs.shape[0], bk)


def _forward_kernel(x_ref, codes_ref, absmax_ref, y_ref, *, K, block_size, bm, bn, bk):
    num_rows, num_outs = x_ref.shape[0], codes_ref.shape[0]
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    outs = pl.program_id(1) * bn + jnp.arange(bn)
    row_mask, out_mask = rows < num_rows, outs < num_outs
    tile = functools.partial(_weight_tile, K=K, block_size=block_size, bk=bk, dtype=x_ref.dtype)

    def body(step, acc):
        cols = step * bk + jnp.arange(bk)
        mask = row_mask[:, None] & (cols < K)[None, :]
        x = _compat.load(
            x_ref.at[rows[:, None], cols[None, :]], mask=mask, other=jnp.zeros((), x_ref.dtype)
        )
        w = tile(codes_ref, absmax_ref, outs, out_mask, step)
        # x [bm, bk] . w [bn, bk] over k, accumulated in fp32 whatever c is.
        return acc + lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    acc = lax.fori_loop(0, pl.cdiv(K, bk), body, jnp.zeros((bm, bn), jnp.float32))
    _compat.store(
        y_ref.at[rows[:, None], outs[None, :]],
        acc.astype(y_ref.dtype),
        mask=row_mask[:, None] & out_mask[None, :],
    )


def _backward_kernel(dy_ref, codes_ref, absmax_ref, dx_ref, *, K, block_size, bm, bn, bk):
    num_rows, num_outs = dy_ref.shape
    # Read outside the loop: interpret mode does not discharge program_id inside its body.
    k_step = pl.program_id(1)
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    cols = k_step * bk + jnp.arange(bk)
    row_mask = rows < num_rows

    def body(step, acc):
        outs = step * bn + jnp.arange(bn)
        out_mask = outs < num_outs
        dy = _compat.load(
            dy_ref.at[rows[:, None], outs[None, :]],
            mask=row_mask[:, None] & out_mask[None, :],
            other=jnp.zeros((), dy_ref.dtype),
        )
        w = _weight_tile(
            codes_ref,
            absmax_ref,
            outs,
            out_mask,
            k_step,
            K=K,
            block_size=block_size,
            bk=bk,
            dtype=dy_ref.dtype,
        )
        # dy [bm, bn] . w [bn, bk] over n, accumulated in fp32. The dot takes fp32 copies
        # of the c-rounded tiles: on an H200 (jax 0.11.2, Triton) the fp16/bf16 dot of these
        # tiles gave a wrong dx (2x the weight for one-hot rows), while the fp32 one passed
        # every check. A product of two bf16 or fp16 values is exact in fp32 (and in TF32,
        # which keeps their 10-bit mantissas), so the sums are the half-precision dot's.
        return acc + lax.dot_general(
            dy.astype(jnp.float32),
            w.astype(jnp.float32),
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )

    acc = lax.fori_loop(0, pl.cdiv(num_outs, bn), body, jnp.zeros((bm, bk), jnp.float32))
    _compat.store(
        dx_ref.at[rows[:, None], cols[None, :]],
        acc.astype(dx_ref.dtype),
        mask=row_mask[:, None] & (cols < K)[None, :],
    )


def _tile(size: int, dim: int) -> int:
    return min(size, max(_MIN_TILE, pl.next_power_of_2(dim)))


def _kernel_operands(q: NF4Tensor, like: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The codes as ``[N, K / 2]`` bytes and the absmax as flat fp32, varying like ``like``.

    A double-quantized absmax is dequantized here, in XLA, to one fp32 value per block:
    1/64 of the weights' count (at block_size 64), read once per tile like the codes, so
    doing its two-level lookup inside the kernel would save little and duplicate
    ``nf4_dequantize``'s careful rounding (``_nf4._absmax``).
    """
    n, k = q.shape
    codes = q.codes.reshape(n, k // 2)
    absmax = _absmax(q)
    return _compat.vary_like(codes, like), _compat.vary_like(absmax, like)


def forward(
    x_RxK: jax.Array, q: NF4Tensor, *, dtype: Any, block: Any, interpret: bool
) -> jax.Array:
    """``y = x @ W^T`` in ``dtype``, tiles of ``block`` (an ``NF4MatmulBlock``)."""
    (M, K), N = x_RxK.shape, q.shape[0]
    b = block
    bm, bn, bk = _tile(b.block_m, M), _tile(b.block_n, N), _tile(b.block_k, K)
    codes, absmax = _kernel_operands(q, x_RxK)
    kernel = functools.partial(_forward_kernel, K=K, block_size=q.block_size, bm=bm, bn=bn, bk=bk)
    return _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), dtype),
        grid=(pl.cdiv(M, bm), pl.cdiv(N, bn)),
        interpret=interpret,
        num_warps=b.num_warps,
        num_stages=b.num_stages,
        name="nf4_matmul_fwd",
    )(x_RxK, codes, absmax)


def backward(
    dy_RxN: jax.Array, q: NF4Tensor, *, dtype: Any, block: Any, interpret: bool
) -> jax.Array:
    """``dx = dy @ W`` in ``dtype``, tiles of ``block`` (an ``NF4MatmulBlock``)."""
    (M, N), K = dy_RxN.shape, q.shape[1]
    b = block
    bm, bn, bk = _tile(b.block_m, M), _tile(b.block_n, N), _tile(b.block_k, K)
    codes, absmax = _kernel_operands(q, dy_RxN)
    kernel = functools.partial(_backward_kernel, K=K, block_size=q.block_size, bm=bm, bn=bn, bk=bk)
    return _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, K), dtype),
        grid=(pl.cdiv(M, bm), pl.cdiv(K, bk)),
        interpret=interpret,
        num_warps=b.num_warps,
        num_stages=b.num_stages,
        name="nf4_matmul_bwd",
    )(dy_RxN, codes, absmax)
