"""4-bit NormalFloat (NF4) quantization of weights, with QLoRA's double quantization.

The format is bitsandbytes' (``quantize_4bit(..., quant_type="nf4")``): the same 16 code
values, the same nearest-code rule and tie, the same packing of two codes per byte, and the
same fp32 arithmetic on the way back. The codes, the absmax and the dequantized weights equal
bitsandbytes' bit for bit. With double quantization so do the offset, the 8-bit absmax codes
and their scales: the offset is torch's ``absmax.mean()`` on the CPU, summed in torch's order
(``_torch_sum.py``; from 32,768 blocks on torch splits that sum between its threads, and rudax
follows one thread); bitsandbytes' CUDA and CPU kernels round some of the 8-bit codes
differently, and ``absmax_rounding`` picks which to reproduce. The 8-bit part is
``_dynamic8.py``. ``tests/kernels/test_nf4.py`` and ``test_nf4_bnb_shapes.py`` check all of it
against bitsandbytes and against a numpy reference.

Pure jnp (but for the offset of a concrete weight, which NumPy sums on the host in the same
order): quantization runs once per weight, and dequantization is an elementwise gather and
multiply that XLA fuses into its consumer. The dequantize-matmul kernel builds on this module.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from rudax.kernels._dynamic8 import (
    ABSMAX_BLOCK_SIZE,
    DYNAMIC_CODE,
    _double_quantize,
    _midpoints,
)
from rudax.kernels._torch_sum import torch_cpu_mean

# The 16 NF4 values: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero (QLoRA,
# appendix E). Stored as these fp32 numbers by bitsandbytes; taken as the definition here.
NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)

# bitsandbytes clamps the absmax at 1e-38 before taking its reciprocal, so an all-zero block
# maps to code 7 (0.0). 1e-38 is subnormal, which XLA flushes to zero; here a block whose
# absmax is below the smallest normal fp32 scales by 0 instead (for an all-zero block, the
# same codes; a block of only subnormal weights, which bitsandbytes scales by 1e38, is the
# one case that differs).
_TINY = np.float32(np.finfo(np.float32).tiny)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "absmax", "absmax_codes", "absmax_scales", "absmax_offset"],
    meta_fields=["shape", "dtype", "block_size"],
)
@dataclasses.dataclass(frozen=True)
class NF4Tensor:
    """A weight stored as NF4: packed 4-bit codes and one scale (absmax) per block.

    A pytree: the arrays are its leaves, ``shape``, ``dtype`` and ``block_size`` are static.
    Exactly one of ``absmax`` and the three ``absmax_*`` fields is set.

    Attributes:
      codes: uint8, shape ``(size // 2,)``. Element ``2 j`` of the flattened weight in the high
        nibble of byte ``j``, element ``2 j + 1`` in the low nibble.
      absmax: fp32, shape ``(size // block_size,)``; ``None`` under double quantization.
      absmax_codes: uint8, shape ``(size // block_size,)``: ``absmax - absmax_offset`` in the
        8-bit dynamic map, in blocks of 256; ``None`` without double quantization.
      absmax_scales: fp32, shape ``(ceil(size / block_size / 256),)``, each 256-block's absmax.
      absmax_offset: fp32, shape ``()``: the mean of the absmax values.
      shape: the original weight's shape.
      dtype: the original weight's dtype.
      block_size: weights per absmax.
    """

    codes: jax.Array
    absmax: jax.Array | None
    absmax_codes: jax.Array | None
    absmax_scales: jax.Array | None
    absmax_offset: jax.Array | None
    shape: tuple[int, ...]
    dtype: jnp.dtype
    block_size: int

    @property
    def double_quant(self) -> bool:
        return self.absmax is None


def _check_weight(w: jax.Array | np.ndarray, block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive even integer, got {block_size=}")
    if block_size % 2:
        # Two codes share a byte; an odd block would split a byte between two scales.
        raise ValueError(f"block_size must be a positive even integer, got {block_size=}")
    dtype = jnp.dtype(w.dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(f"w must be float32, bfloat16 or float16, got w.dtype={dtype}")
    if w.size == 0 or w.size % block_size:
        raise ValueError(
            f"w.size must be a positive multiple of block_size; got w.shape={tuple(w.shape)} "
            f"(size {w.size}) and {block_size=}. Pick a block_size that divides the size."
        )


def _nan_max(x: jax.Array, *, axis: int) -> jax.Array:
    """``max`` along ``axis`` that is NaN wherever a NaN is, on every backend and shape.

    XLA's reduce does not promise to propagate NaN: XLA:CPU vectorizes ``max`` into
    instructions that return the other operand when one is NaN, so a row's NaN is kept or
    dropped by where it lies (in a (4, 64) weight it was kept, in a (64, 64) one every position
    was dropped). ``isnan`` and a logical ``or`` have no such freedom.
    """
    return jnp.where(jnp.any(jnp.isnan(x), axis=axis), jnp.nan, jnp.max(x, axis=axis))


def _quantize_nf4(x_NxB: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's absmax, and each value's nearest NF4 index after scaling by it."""
    absmax_N = _nan_max(jnp.abs(x_NxB), axis=1)
    # bitsandbytes multiplies by the reciprocal (not a division: the bits differ).
    # A NaN absmax keeps its NaN reciprocal (every value then takes the last code, as in
    # bitsandbytes); only a zero or subnormal one scales by 0.
    small_N = absmax_N < _TINY
    inv_N = jnp.where(small_N, 0.0, jnp.float32(1.0) / jnp.where(small_N, 1.0, absmax_N))
    scaled = jnp.clip(x_NxB * inv_N[:, None], -1.0, 1.0)
    # Nearest code, a tie (exactly on a midpoint) going to the lower one: the count of
    # fp32 midpoints strictly below the value (torch.bucketize's rule).
    mids = jnp.asarray(_midpoints(NF4_CODE))
    index = jnp.sum(scaled[..., None] > mids, axis=-1, dtype=jnp.int32)
    # A NaN (an inf's own position, inf * 0) takes the last code, +1.0, as bitsandbytes'
    # search falls through to it: an inf weight comes back as +inf, the rest of its block NaN.
    index = jnp.where(jnp.isnan(scaled), len(NF4_CODE) - 1, index)
    return absmax_N, index.astype(jnp.uint8)


def nf4_quantize(
    w: jax.Array | np.ndarray,
    *,
    block_size: int = 64,
    double_quant: bool = True,
    chunk_size: int | None = None,
    absmax_rounding: Literal["cuda", "cpu"] = "cuda",
) -> NF4Tensor:
    """Quantizes a weight to 4-bit NormalFloat in blocks, as QLoRA and bitsandbytes do.

    The flattened weight is cut into blocks of ``block_size``; for each block ``b``::

        absmax_b = max_i |w_i|                                  (fp32)
        code_i   = argmin_k |NF4[k] - clip(w_i * (1 / absmax_b), -1, 1)|

    the tie going to the lower ``k``. Non-finite weights follow bitsandbytes: a block holding
    a NaN or an inf is NaN when dequantized, but for an inf's own position, which is +inf
    (whatever its sign, as bitsandbytes gives); with ``double_quant`` the offset, a mean over
    every block, is then NaN, and so is every weight. A finite weight of magnitude >= 2**126 is
    refused (its block's reciprocal would be subnormal, which XLA flushes to zero; under
    ``jit`` such a block is stored as zeros). With ``double_quant`` the absmax values are quantized
    again (QLoRA section 3): ``offset = mean(absmax)``, and ``absmax - offset`` is stored as
    8-bit codes of the signed dynamic map in blocks of 256, each with its fp32 absmax. That is
    ``8 / block_size + 32 / (256 block_size)`` bits per weight of overhead (0.127 at 64)
    instead of ``32 / block_size`` (0.5).

    bitsandbytes' two kernels choose some 8-bit absmax codes differently, and
    ``absmax_rounding`` says whose bytes to reproduce: "cuda" (the default: the kernel that
    quantizes the checkpoints people share) takes the nearest code; "cpu" takes the code of the
    value's bin in a 65,536-bin table, which is the farther neighbour for about 1 in 1000
    values next to a midpoint. The 4-bit codes and the scales are the same under both.

    The offset is bitsandbytes' own, ``absmax.mean()`` as torch computes it on an x86 CPU, bit
    for bit: its summation order is reproduced (``_torch_sum.py``). From 32,768 blocks on
    (2**21 weights at ``block_size=64``: every matrix of an 8B model, none of a 135M one), torch
    sums in one chunk per thread, so its last bit depends on ``torch.get_num_threads()``;
    rudax's is torch's with one thread. (On a GPU torch reduces in yet another order, which is
    not reproduced.) Where the offsets differ, a few 8-bit codes may too.

    The weight's size must be a multiple of ``block_size`` (bitsandbytes also takes a short
    last block; rudax refuses it instead, as every matrix of a real model divides by 64).

    ``chunk_size`` bounds the memory it takes: the flattened weight is quantized that many
    values at a time (the blocks are independent), and a NumPy ``w`` (a tensor just read from
    a checkpoint) is moved to the device one chunk at a time, so beside ``w`` and the result
    only one chunk's fp32 copy exists. The result is the same, bit for bit, for any
    ``chunk_size``: each block's codes and absmax do not depend on the others, and the offset is
    the mean of the same absmax vector, summed in the same order.

    Args:
      w: the weight, float32, bfloat16 or float16, any shape; a ``jax.Array`` or a NumPy array.
      block_size: weights per absmax, a positive even integer dividing ``w.size``.
      double_quant: quantize the absmax values too.
      chunk_size: values quantized per step, a positive multiple of ``block_size``; None
        quantizes the whole weight in one step.
      absmax_rounding: "cuda" or "cpu": whose 8-bit absmax codes to match under
        ``double_quant``.

    Returns:
      An ``NF4Tensor``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from rudax.kernels import nf4_quantize, nf4_dequantize
      >>> w = jax.random.normal(jax.random.key(0), (128, 64), jnp.bfloat16)
      >>> q = nf4_quantize(w)
      >>> q.codes.shape, q.absmax_codes.shape, q.absmax_scales.shape
      ((4096,), (128,), (1,))
      >>> w2 = nf4_dequantize(q)
      >>> w2.dtype, bool(jnp.max(jnp.abs(w2 - w)) < 0.2 * jnp.max(jnp.abs(w)))
      (dtype(bfloat16), True)

    References:
      Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", 2023,
      https://arxiv.org/abs/2305.14314
    """
    if not isinstance(w, jax.Array | np.ndarray):
        w = jnp.asarray(w)
    _check_weight(w, block_size)
    if absmax_rounding not in ("cuda", "cpu"):
        raise ValueError(f'absmax_rounding must be "cuda" or "cpu", got {absmax_rounding=}')
    if chunk_size is None:
        chunk_size = w.size
    elif (
        not isinstance(chunk_size, int)
        or isinstance(chunk_size, bool)
        or chunk_size <= 0
        or chunk_size % block_size
    ):
        raise ValueError(
            f"chunk_size must be a positive multiple of block_size={block_size}, got {chunk_size=}"
        )
    flat = w.reshape(-1)
    pieces = [
        _quantize_blocks(flat[start : start + chunk_size], block_size)
        for start in range(0, w.size, chunk_size)
    ]
    codes = _concatenate([codes for codes, _ in pieces])
    absmax_N = _concatenate([absmax for _, absmax in pieces])
    del pieces
    _check_magnitude(absmax_N, block_size)
    shape, dtype = tuple(w.shape), jnp.dtype(w.dtype)
    if not double_quant:
        return NF4Tensor(codes, absmax_N, None, None, None, shape, dtype, block_size)
    absmax_codes, scales_M, offset = _double_quantize_all(absmax_N, absmax_rounding)
    return NF4Tensor(codes, None, absmax_codes, scales_M, offset, shape, dtype, block_size)


# The largest magnitude whose fp32 reciprocal is a normal number: above it the reciprocal is
# subnormal, which XLA flushes to zero, and the block would be stored as zeros.
_HUGE = float(2.0**126)


def _check_magnitude(absmax_N: jax.Array, block_size: int) -> None:
    """A ValueError for a concrete block whose absmax is finite and >= 2**126."""
    if isinstance(absmax_N, jax.core.Tracer):
        return  # traced: such a block is stored as zeros (see the docstring)
    huge = jnp.isfinite(absmax_N) & (absmax_N >= _HUGE)
    if bool(jnp.any(huge)):
        b = int(jnp.argmax(huge))
        magnitude = str(np.float32(absmax_N[b]))  # as fp32 prints it: 1e+38
        raise ValueError(
            f"w's block {b} (flat indices {b * block_size} to {(b + 1) * block_size - 1}) holds "
            f"a magnitude of {magnitude}: NF4 cannot store a finite magnitude >= "
            "2**126 (~8.5e37), whose reciprocal is subnormal (flushed to zero here); the weight "
            "is damaged, or scale it first"
        )


def _concatenate(arrays: list[jax.Array]) -> jax.Array:
    return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays)


@functools.partial(jax.jit, static_argnames=("block_size",))
def _quantize_blocks(x: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """The packed codes and the absmax of a flat run of whole blocks."""
    absmax_N, index_NxB = _quantize_nf4(x.astype(jnp.float32).reshape(-1, block_size))
    pairs = index_NxB.reshape(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1], absmax_N


def _double_quantize_all(
    absmax_N: jax.Array, rounding: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    # bitsandbytes' offset is torch's absmax.mean(): summed in torch's order, then a true
    # division. (jnp.mean's sum * (1 / n) differed, and XLA fused that multiply into the
    # subtraction of the offset, an FMA rounding once, which moved 256-blocks' absmax by an
    # ulp.) A concrete absmax is summed by NumPy on the host, the same additions without a
    # compilation per shape; a traced one by the same additions in jnp.
    if isinstance(absmax_N, jax.core.Tracer):
        offset = _traced_mean(absmax_N)
    else:
        offset = jnp.asarray(torch_cpu_mean(np.asarray(absmax_N)))
    absmax_codes, scales_M = _double_quantize_jit(absmax_N, offset, rounding)
    return absmax_codes, scales_M, offset


_double_quantize_jit = jax.jit(_double_quantize, static_argnames=("rounding",))
# Under an outer trace (nnx.eval_shape or jit of a QLoRA model's build) the cascade's hundreds
# of additions become one call in the caller's program, not hundreds of its equations: jax
# 0.10's tracers walk every equation of the program each time flax probes a Variable's
# sharding (each nnx.Rngs draw), so a long program made building a 30-layer QLoRA model
# abstractly take 3 minutes.
_traced_mean = jax.jit(torch_cpu_mean)


def _check_layout(q: NF4Tensor) -> None:
    """A ValueError naming the first field whose shape (or dtype) its ``shape`` and
    ``block_size`` do not imply: a hand-built NF4Tensor with short scales otherwise fails
    deep in dequantization with a broadcasting error. Static shapes: checked at trace time."""
    size = int(np.prod(q.shape))
    if not isinstance(q.block_size, int) or q.block_size <= 0 or q.block_size % 2:
        raise ValueError(f"NF4Tensor.block_size must be a positive even int, got {q.block_size!r}")
    if size == 0 or size % q.block_size:
        raise ValueError(
            f"NF4Tensor.shape {q.shape} (size {size}) is not a positive multiple of its "
            f"block_size={q.block_size}"
        )
    n_blocks = size // q.block_size
    double = q.absmax is None
    fields = {
        "codes": (size // 2,),
        "absmax": None if double else (n_blocks,),
        "absmax_codes": (n_blocks,) if double else None,
        "absmax_scales": (-(-n_blocks // ABSMAX_BLOCK_SIZE),) if double else None,
        "absmax_offset": () if double else None,
    }
    for name, expected in fields.items():
        value = getattr(q, name)
        if expected is None and value is not None:
            raise ValueError(
                f"NF4Tensor.{name} must be None when absmax is "
                f"{'None (double quantization)' if double else 'set'}; exactly one of absmax "
                "and absmax_codes/absmax_scales/absmax_offset is set"
            )
        if expected is None:
            continue
        shape = tuple(getattr(value, "shape", ()) if value is not None else ())
        if value is None or shape != expected:
            got = "None" if value is None else f"shape {shape}"
            raise ValueError(
                f"NF4Tensor.{name} must have shape {expected} for shape={q.shape} and "
                f"block_size={q.block_size} ({n_blocks} blocks), got {got}"
            )
        if name in ("codes", "absmax_codes") and jnp.dtype(value.dtype) != jnp.uint8:
            raise ValueError(f"NF4Tensor.{name} must be uint8, got dtype {value.dtype}")


def _absmax(q: NF4Tensor) -> jax.Array:
    _check_layout(q)
    if q.absmax is not None:
        return q.absmax
    assert q.absmax_codes is not None and q.absmax_scales is not None
    assert q.absmax_offset is not None
    n = q.absmax_codes.shape[0]
    values = jnp.asarray(DYNAMIC_CODE)[q.absmax_codes.astype(jnp.int32)]
    scales = jnp.repeat(q.absmax_scales, ABSMAX_BLOCK_SIZE)[:n]
    product = values * scales
    # Two roundings, as bitsandbytes does. XLA contracts a multiply and an add in one fusion
    # into a fused multiply-add, which rounds once and changes the bits; an
    # optimization_barrier is removed before fusion, but no fusion crosses a conditional.
    # The other branch is taken only for a NaN offset, where the sum is NaN either way.
    offset = q.absmax_offset
    product = jax.lax.cond(offset == offset, lambda p: p, jnp.zeros_like, product)
    return product + offset


def nf4_dequantize(q: NF4Tensor, dtype: jnp.dtype | None = None) -> jax.Array:
    """The weight an ``NF4Tensor`` stores: ``NF4[code_i] * absmax_b``, in fp32, then rounded.

    Under double quantization ``absmax_b = DYNAMIC[c_b] * scale_{b // 256} + offset`` first,
    in fp32. The product is rounded once, to nearest even, into ``dtype``.

    Args:
      q: from ``nf4_quantize``.
      dtype: the result's dtype, a floating dtype; ``None`` gives the original weight's dtype.

    Returns:
      An array of ``q.shape``.

    Example:
      >>> import jax.numpy as jnp
      >>> from rudax.kernels import nf4_quantize, nf4_dequantize
      >>> q = nf4_quantize(jnp.linspace(-1.0, 1.0, 64), double_quant=False)
      >>> w = nf4_dequantize(q)
      >>> w[0], w[-1], w.dtype
      (Array(-1., dtype=float32), Array(1., dtype=float32), dtype('float32'))
    """
    if not isinstance(q, NF4Tensor):
        raise TypeError(f"q must be an NF4Tensor, got {type(q).__name__}")
    out_dtype = jnp.dtype(q.dtype if dtype is None else dtype)
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype=}")
    _check_layout(q)  # here too, so the error's traceback is not jit's
    return _dequantize(q, out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def _dequantize(q: NF4Tensor, out_dtype: jnp.dtype) -> jax.Array:
    high = (q.codes >> 4).astype(jnp.int32)
    low = (q.codes & 0xF).astype(jnp.int32)
    index = jnp.stack([high, low], axis=1).reshape(-1, q.block_size)
    values_NxB = jnp.asarray(NF4_CODE)[index] * _absmax(q)[:, None]
    return values_NxB.astype(out_dtype).reshape(q.shape)
