"""``x @ W^T`` with W stored as NF4: a Pallas kernel that dequantizes tiles in registers.

QLoRA's frozen base is read once per matmul as 4-bit codes (half a byte per weight, plus the
absmax), never as a dequantized copy: each program loads a tile of codes, turns it into the
compute dtype in registers and feeds it to the tensor-core dot, accumulating in fp32. The
same tile loader serves the forward (``y = x @ W^T``, tiles of ``[M, N]`` looping over K) and
the backward with respect to the input (``dx = dy @ W``, tiles of ``[M, K]`` looping over N).
The weight gets no gradient: it is frozen.

The layout is bitsandbytes' (``_nf4.py``): W is ``[N, K]`` (torch's ``[out, in]``) flattened
row-major, two codes per byte with the even k in the high nibble, one absmax per
``block_size`` consecutive weights. A tile of ``block_k`` weights of a row is ``block_k / 2``
bytes; the kernel splits each byte into its two nibbles, dequantizes both and joins them
back into k order in registers (Triton's ``join`` and a reshape), so x is read contiguously and
nothing de-interleaved is ever written. The NF4 lookup is a tree of 15 selects on the code's
bits (a gather from a table does not lower to Triton); the value is the fp32 product
``NF4[code] * absmax`` rounded once to the compute dtype, bit for bit ``nf4_dequantize``'s.

Any shape runs: M, N and K need not divide the tiles (loads and stores are masked), and a
64-block may even straddle two rows of W (K not a multiple of ``block_size``): each weight's
absmax is loaded from its own flat index. ``impl="auto"`` runs the XLA path: on an H200 it
was 3.4x faster than these kernels (``nf4_matmul``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from rudax._validation import check_positive_int, check_power_of_two, float_dtype
from rudax.kernels import _compat, _platform
from rudax.kernels._blocks import check_block
from rudax.kernels._nf4 import NF4_CODE, NF4Tensor, _absmax, nf4_dequantize

# The kernel computes flat absmax indices (n * K + k) // block_size in int32 when a block may
# straddle rows; past this many weights that overflows, and such a weight runs the XLA path.
_MAX_STRADDLING_WEIGHTS = 2**31 - 1
# Compute dtypes the kernel takes (Triton's dot: fp16 and bf16 on tensor cores, fp32 at the
# precision jax_default_matmul_precision asks for, TF32 by default).
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Triton's dot needs every tile dimension to be at least 16.
_MIN_TILE = 16


@dataclasses.dataclass(frozen=True)
class NF4MatmulBlock:
    """Tile sizes of the ``nf4_matmul`` Pallas kernels.

    The forward's programs each own a ``[block_m, block_n]`` tile of y and loop over K in steps
    of ``block_k``; the backward's own a ``[block_m, block_k]`` tile of dx and loop over N in
    steps of ``block_n``. A dimension smaller than its tile uses a tile of its size rounded
    up to a power of two, at least 16 (Triton's smallest dot).

    Attributes:
      block_m: rows of x per program, a power of two.
      block_n: output features (rows of W) per tile, a power of two.
      block_k: input features (columns of W) per tile, a power of two (an even number of
        codes: whole bytes).
      num_warps: warps per program on the GPU, a power of two.
      num_stages: Triton's software-pipelining stages of the loop over the contraction.
    """

    # A usual Triton fp16 matmul tile, with the taller M side: each program dequantizes its
    # weight tiles itself (some 25 shifts, compares and selects a weight), so W is dequantized
    # M / block_m times a pass, and a taller block_m amortises that over more rows of x. Not
    # tuned on a GPU yet; benchmarks/kernels.py is where to tune it.
    block_m: int = 128
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            check_power_of_two(name, getattr(self, name))
        check_positive_int("num_stages", self.num_stages)


@dataclasses.dataclass(frozen=True)
class _Static:
    dtype: jnp.dtype  # the compute dtype c
    path: str  # resolve_impl's answer: "auto", "pallas", "interpret" or "xla"
    interpret: bool
    block: NF4MatmulBlock


# --- Pallas kernels ------------------------------------------------------------------------


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


def _pallas_forward(x_RxK: jax.Array, q: NF4Tensor, s: _Static) -> jax.Array:
    (M, K), N = x_RxK.shape, q.shape[0]
    b = s.block
    bm, bn, bk = _tile(b.block_m, M), _tile(b.block_n, N), _tile(b.block_k, K)
    codes, absmax = _kernel_operands(q, x_RxK)
    kernel = functools.partial(_forward_kernel, K=K, block_size=q.block_size, bm=bm, bn=bn, bk=bk)
    return _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), s.dtype),
        grid=(pl.cdiv(M, bm), pl.cdiv(N, bn)),
        interpret=s.interpret,
        num_warps=b.num_warps,
        num_stages=b.num_stages,
        name="nf4_matmul_fwd",
    )(x_RxK, codes, absmax)


def _pallas_backward(dy_RxN: jax.Array, q: NF4Tensor, s: _Static) -> jax.Array:
    (M, N), K = dy_RxN.shape, q.shape[1]
    b = s.block
    bm, bn, bk = _tile(b.block_m, M), _tile(b.block_n, N), _tile(b.block_k, K)
    codes, absmax = _kernel_operands(q, dy_RxN)
    kernel = functools.partial(_backward_kernel, K=K, block_size=q.block_size, bm=bm, bn=bn, bk=bk)
    return _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, K), s.dtype),
        grid=(pl.cdiv(M, bm), pl.cdiv(K, bk)),
        interpret=s.interpret,
        num_warps=b.num_warps,
        num_stages=b.num_stages,
        name="nf4_matmul_bwd",
    )(dy_RxN, codes, absmax)


# --- forward and backward, each a Pallas or an XLA path ------------------------------------


def _forward(x_RxK: jax.Array, q: NF4Tensor, s: _Static) -> jax.Array:
    def xla(x_RxK, q):
        w_NxK = nf4_dequantize(q, s.dtype)
        return lax.dot_general(x_RxK, w_NxK, (((1,), (1,)), ((), ())))

    return _run(s, _pallas_forward, xla, x_RxK, q)


def _backward(dy_RxN: jax.Array, q: NF4Tensor, s: _Static) -> jax.Array:
    def xla(dy_RxN, q):
        # What autodiff of the forward's dot gives: dy contracted with W's N axis, in c.
        w_NxK = nf4_dequantize(q, s.dtype)
        return lax.dot_general(dy_RxN, w_NxK, (((1,), (0,)), ((), ())))

    return _run(s, _pallas_backward, xla, dy_RxN, q)


def _run(s: _Static, pallas: Any, xla: Any, x: jax.Array, q: NF4Tensor) -> jax.Array:
    """``_platform.run`` over the array and the weight's leaves."""
    leaves, treedef = jax.tree.flatten(q)

    def unflat(fn: Any, with_static: bool) -> Any:
        def call(x, *leaves):
            q = jax.tree.unflatten(treedef, leaves)
            return (fn(x, q, s) if with_static else fn(x, q),)

        return call

    (y,) = _platform.run(
        s.path, unflat(pallas, True), unflat(xla, False), x, *leaves, name="nf4_matmul"
    )
    return y


# --- the public op -------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _nf4_matmul(x_RxK: jax.Array, q: NF4Tensor, s: _Static) -> jax.Array:
    return _forward(x_RxK, q, s)


def _nf4_matmul_fwd(x_RxK, q, s):
    # dx = dy @ W needs only the weight, which the caller holds anyway: no activation is kept.
    return _forward(x_RxK, q, s), q


def _nf4_matmul_bwd(s, q, dy_RxN):
    # The weight is frozen: None is a zero cotangent for every leaf of q (float0 for codes).
    return _backward(dy_RxN, q, s), None


_nf4_matmul.defvjp(_nf4_matmul_fwd, _nf4_matmul_bwd)


@functools.partial(jax.jit, static_argnames=("s",))
def _nf4_matmul_jit(x: jax.Array, q: NF4Tensor, s: _Static) -> jax.Array:
    lead, (n, k) = x.shape[:-1], q.shape
    y_RxN = _nf4_matmul(x.astype(s.dtype).reshape(-1, k), q, s)
    # See _rms_norm_jit: pyright types a custom_vjp call as `object`; it is an Array.
    return y_RxN.reshape(*lead, n)  # pyright: ignore[reportAttributeAccessIssue]


def _check_arguments(x: Any, q: Any, dtype: Any) -> jnp.dtype:
    """The checks of nf4_matmul's operands; returns the compute dtype c."""
    if not isinstance(q, NF4Tensor):
        raise TypeError(
            f"q must be an NF4Tensor (from rudax.kernels.nf4_quantize), got {type(q).__name__}"
        )
    if len(q.shape) != 2:
        raise ValueError(
            f"q must hold a 2-D weight [N, K] (torch's [out, in]), got q.shape={q.shape}"
        )
    if not isinstance(x, jax.Array | np.ndarray) or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"x must be a floating jax.Array or numpy array, got {type(x).__name__} with "
            f"x.dtype={getattr(x, 'dtype', None)}"
        )
    x_dtype = x.dtype
    if x.ndim < 1 or x.shape[-1] != q.shape[1]:
        raise ValueError(
            f"x.shape[-1] must equal q.shape[1] (K = {q.shape[1]}, the weight's input "
            f"features), got x.shape={tuple(x.shape)} for q.shape={q.shape}"
        )
    c = float_dtype("dtype", dtype)
    # As jnp does: float64 is float32 unless x64 is enabled.
    return jax.dtypes.canonicalize_dtype(x_dtype if c is None else c)


def _choose_path(impl: str, interpret: bool, x: Any, q: NF4Tensor, c: jnp.dtype) -> str:
    """resolve_impl, then XLA for what the kernel does not take (an error if forced)."""
    path = _compat.resolve_impl(impl, interpret=interpret)  # checks impl and interpret
    if impl == "auto":
        # Measured on an H200 (jax 0.11.2, benchmarks/kernels.py, x (4096, 4096) bf16 and W
        # (4096, 4096), forward and dx): the XLA path 0.50 ms, these kernels 1.67 ms. XLA
        # dequantizes W once per call into a bf16 copy and runs cuBLAS; the kernels
        # dequantize each tile once per tile of rows, which costs more than the copy saves.
        # Until they are tuned to win, "auto" is the XLA path on every platform.
        return "xla"
    if path == "xla":
        return path
    n, k = q.shape
    reason = None
    if c not in _KERNEL_DTYPES:
        reason = f"computes in float32, bfloat16 or float16, got dtype={c}"
    elif k % q.block_size and n * k > _MAX_STRADDLING_WEIGHTS:
        reason = (
            f"indexes a weight whose blocks straddle rows (K={k} not a multiple of "
            f"block_size={q.block_size}) in int32, up to {_MAX_STRADDLING_WEIGHTS} weights; "
            f"got q.shape={q.shape}"
        )
    if reason is not None:
        if impl == "pallas":
            raise ValueError(f"impl='pallas' {reason}: pass impl='xla' (or 'auto')")
        return "xla"
    if x.size == 0:
        return "xla"  # no rows: nothing for a kernel to do, and no grid to launch
    return path


def nf4_matmul(
    x: jax.Array,
    q: NF4Tensor,
    *,
    dtype: Any = None,
    impl: str = "auto",
    block: NF4MatmulBlock | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x @ W^T`` for an NF4 weight W ``[N, K]``, dequantized tile by tile in registers.

    With ``c = dtype or x.dtype`` and ``W = nf4_dequantize(q, c)`` (``NF4[code] * absmax`` in
    fp32, rounded once to c)::

        y  = c(x) @ W^T          [..., N]
        dx = dy @ W              [..., K], then cast to x's dtype

    both accumulated in fp32 and rounded once to c. The weight is frozen: its cotangent is
    zero (float0 for the codes). The backward keeps no activation: ``dx`` needs only ``q``.
    For a float32 c, both paths' dots follow ``jax_default_matmul_precision`` as any jnp dot
    does (TF32 on recent GPUs by default; ``jax.default_matmul_precision("highest")`` for fp32).

    ``impl="xla"`` is the definition: ``nf4_dequantize`` then ``lax.dot_general`` in c
    (``nf4_matmul_reference``, under the same ``custom_vjp``). The Pallas kernels never write
    W to memory; they read its codes once per tile of x's rows. They take compute dtypes
    float32, bfloat16 and float16 and any M, N, K; ``impl="pallas"`` refuses anything else (a
    float64 c, or a weight of 2**31 weights or more whose blocks straddle rows).

    Args:
      x: activations ``[..., K]``, a floating dtype.
      q: an ``NF4Tensor`` of a 2-D weight ``[N, K]`` (torch's ``[out, in]`` layout).
      dtype: the compute dtype c; None for x's.
      impl: ``"auto"`` (the XLA path on every platform: on an H200 it ran 3.4x faster than
        the kernels, which are not yet tuned), ``"pallas"`` (the kernels on a GPU) or
        ``"xla"``.
      block: the kernels' ``NF4MatmulBlock``; None for the default.
      interpret: run the Pallas kernels in interpret mode, on any backend (for tests).

    Returns:
      ``y`` ``[..., N]`` in c, from a jitted body that compiles once per shape, dtype and
      option. A TypeError for a ``q`` that is not an ``NF4Tensor`` or a non-floating ``x`` or
      ``dtype``, a ValueError for a ``q`` that is not 2-D or an ``x`` whose last axis is not K.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> w = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32)  # [out, in]
      >>> q = rk.nf4_quantize(w)
      >>> x = jnp.ones((2, 3, 64), jnp.bfloat16)
      >>> y = rk.nf4_matmul(x, q)
      >>> y.shape, y.dtype
      ((2, 3, 32), dtype(bfloat16))
      >>> bool(jnp.all(y == rk.nf4_matmul_reference(x, q)))
      True
      >>> dx = jax.grad(lambda x: rk.nf4_matmul(x, q).astype(jnp.float32).sum())(x)
      >>> dx.shape, dx.dtype
      ((2, 3, 64), dtype(bfloat16))

    References:
      Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", 2023,
      https://arxiv.org/abs/2305.14314
    """
    c = _check_arguments(x, q, dtype)
    check_block(block, NF4MatmulBlock)
    if block is None:
        block = NF4MatmulBlock()
    path = _choose_path(impl, interpret, x, q, c)
    return _nf4_matmul_jit(x, q, _Static(dtype=c, path=path, interpret=interpret, block=block))


def nf4_matmul_reference(x: jax.Array, q: NF4Tensor, *, dtype: Any = None) -> jax.Array:
    """``c(x) @ nf4_dequantize(q, c)^T`` in pure jnp, ``c = dtype or x.dtype``.

    The definition ``nf4_matmul`` is tested against: ``rudax.layers``' ``rows_matmul`` with a
    ``[N, K]`` weight (leading axes of x merged into rows, one ``lax.dot_general`` in c).

    Args:
      x: ``[..., K]``, a floating dtype.
      q: an ``NF4Tensor`` of a 2-D weight ``[N, K]``.
      dtype: the compute dtype; None for x's.

    Returns:
      ``[..., N]`` in c.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> q = rk.nf4_quantize(jnp.ones((2, 64)), double_quant=False)
      >>> rk.nf4_matmul_reference(jnp.ones((1, 64)), q)
      Array([[64., 64.]], dtype=float32)
    """
    c = _check_arguments(x, q, dtype)
    w_NxK = nf4_dequantize(q, c)
    lead, k = x.shape[:-1], q.shape[1]
    # rows_matmul's arithmetic, written here: rudax.layers imports rudax.kernels.
    y = lax.dot_general(x.astype(c).reshape(-1, k), w_NxK, (((1,), (1,)), ((), ())))
    return y.reshape(*lead, q.shape[0])
