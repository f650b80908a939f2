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
was 3.4x faster than these kernels (``nf4_matmul``). The kernels are in
``_nf4_matmul_pallas.py``; this file holds the op: its checks, the choice of path, the XLA
path and the custom VJP.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rudax._validation import check_positive_int, check_power_of_two, float_dtype
from rudax.kernels import _auto, _compat, _nf4_matmul_pallas, _platform
from rudax.kernels._blocks import check_block
from rudax.kernels._nf4 import NF4Tensor, _check_layout, nf4_dequantize

# The kernel computes flat absmax indices (n * K + k) // block_size in int32 when a block may
# straddle rows; past this many weights that overflows, and such a weight runs the XLA path.
_MAX_STRADDLING_WEIGHTS = 2**31 - 1
# Compute dtypes the kernel takes (Triton's dot: fp16 and bf16 on tensor cores, fp32 at the
# precision jax_default_matmul_precision asks for, TF32 by default).
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


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
    # tuned on a GPU yet: with block=None on a GPU, the block benchmarks/tune_gpu.py measured
    # fastest there, once it has.
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


# --- forward and backward, each a Pallas or an XLA path ------------------------------------


def _forward(x_RxK: jax.Array, q: NF4Tensor, s: _Static) -> jax.Array:
    def xla(x_RxK, q):
        w_NxK = nf4_dequantize(q, s.dtype)
        return lax.dot_general(x_RxK, w_NxK, (((1,), (1,)), ((), ())))

    return _run(s, _nf4_matmul_pallas.forward, xla, x_RxK, q)


def _backward(dy_RxN: jax.Array, q: NF4Tensor, s: _Static) -> jax.Array:
    def xla(dy_RxN, q):
        # What autodiff of the forward's dot gives: dy contracted with W's N axis, in c.
        w_NxK = nf4_dequantize(q, s.dtype)
        return lax.dot_general(dy_RxN, w_NxK, (((1,), (0,)), ((), ())))

    return _run(s, _nf4_matmul_pallas.backward, xla, dy_RxN, q)


def _run(s: _Static, pallas: Any, xla: Any, x: jax.Array, q: NF4Tensor) -> jax.Array:
    """``_platform.run`` over the array and the weight's leaves."""
    leaves, treedef = jax.tree.flatten(q)

    def unflat(fn: Any, with_static: bool) -> Any:
        def call(x, *leaves):
            q = jax.tree.unflatten(treedef, leaves)
            if with_static:
                return (fn(x, q, dtype=s.dtype, block=s.block, interpret=s.interpret),)
            return (fn(x, q),)

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
    # Before the Pallas path reshapes the codes into blocks, where a wrong length would fail
    # with a reshape's error instead of naming the field.
    _check_layout(q)
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
    # "auto": the XLA path, measured faster on an H200 (rudax.kernels._auto: 0.50 ms against
    # these kernels' 1.67 ms, x (4096, 4096) bf16 and W (4096, 4096), forward and dx). XLA
    # dequantizes W once per call into a bf16 copy and runs cuBLAS; the kernels dequantize
    # each tile once per tile of rows, which costs more than the copy saves.
    path = _compat.resolve_impl(
        impl, interpret=interpret, kernel="nf4_matmul", size=q.shape[1], dtype=x.dtype
    )
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
      block: the kernels' ``NF4MatmulBlock``; None for the one measured fastest on the GPU
        lowered for (``rudax/kernels/auto_table.json``), else the default.
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
        block = _auto.tuned_block(NF4MatmulBlock, "nf4_matmul", size=q.shape[1], dtype=x.dtype)
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
