"""SwiGLU's elementwise part, ``silu(gate) * up``, as a fused Pallas kernel with an XLA path.

The op reads two activations and writes one (three in, two out for the backward), so it is
bound by memory traffic: fusing it keeps the fp32 arithmetic in registers and stores nothing
but the results in the input dtype. The backward recomputes ``sigmoid(gate)`` from the saved
inputs, so the residuals are ``gate`` and ``up`` themselves, never an fp32 copy.

Any shape runs: both operands are flattened (a free reshape of a contiguous array) and cut
into 1-D blocks of ``SiluMulBlock.size`` elements. The last block may overhang the array;
its loads and stores are masked, so no padded copy is made (see ``_blocks.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from rudax._validation import check_power_of_two_fields
from rudax.kernels import _auto, _compat, _platform
from rudax.kernels._blocks import block_size_for, check_block, load_block, tail_mask

# The Triton lowering computes a block's start, program_id * block_size, in int32: with 1-D
# blocks that overflows past 2**31 - 1 elements, so larger arrays take the XLA path.
_MAX_PALLAS_ELEMENTS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class SiluMulBlock:
    """Block sizes of the ``silu_mul`` Pallas kernels.

    Attributes:
      size: elements per program, a power of two (Triton's blocks are powers of two). A
        smaller array uses one block of its size rounded up to a power of two.
      num_warps: warps per program on the GPU, a power of two.
    """

    # 1024 elements over 4 warps, 8 per thread: the usual shape of a Triton elementwise
    # kernel. Not tuned on a GPU yet: with block=None on a GPU, the block
    # benchmarks/tune_gpu.py measured fastest there, once it has.
    size: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        check_power_of_two_fields(self)


def _compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """fp32 for bf16, fp16 and fp32 inputs; a wider float (fp64 under x64) stays itself."""
    return jnp.dtype(jnp.float32) if dtype.itemsize <= 4 else dtype


def _forward_math(gate: jax.Array, up: jax.Array) -> jax.Array:
    return gate * jax.nn.sigmoid(gate) * up


def _backward_math(gate: jax.Array, up: jax.Array, d_out: jax.Array) -> tuple[jax.Array, ...]:
    # d silu(x)/dx = s + x * s * (1 - s) = s * (1 + x * (1 - s)), with s = sigmoid(x).
    s = jax.nn.sigmoid(gate)
    d_gate = d_out * up * s * (1 + gate * (1 - s))
    d_up = d_out * (gate * s)
    return d_gate, d_up


# --- Pallas kernels ------------------------------------------------------------------------


def _silu_mul_kernel(gate_ref, up_ref, out_ref, *, num_elements: int, block_size: int) -> None:
    mask = tail_mask(num_elements, block_size)
    dtype = _compute_dtype(out_ref.dtype)
    gate = load_block(gate_ref, mask).astype(dtype)
    up = load_block(up_ref, mask).astype(dtype)
    _compat.store(out_ref, _forward_math(gate, up).astype(out_ref.dtype), mask=mask)


def _silu_mul_backward_kernel(
    gate_ref, up_ref, d_out_ref, d_gate_ref, d_up_ref, *, num_elements: int, block_size: int
) -> None:
    mask = tail_mask(num_elements, block_size)
    dtype = _compute_dtype(gate_ref.dtype)
    gate = load_block(gate_ref, mask).astype(dtype)
    up = load_block(up_ref, mask).astype(dtype)
    d_out = load_block(d_out_ref, mask).astype(dtype)
    d_gate, d_up = _backward_math(gate, up, d_out)
    _compat.store(d_gate_ref, d_gate.astype(d_gate_ref.dtype), mask=mask)
    _compat.store(d_up_ref, d_up.astype(d_up_ref.dtype), mask=mask)


def _elementwise_call(
    kernel, name: str, num_outputs: int, block: SiluMulBlock, interpret: bool, *operands
) -> tuple[jax.Array, ...]:
    """Runs an elementwise kernel over the operands flattened to 1-D; outputs like operand 0."""
    shape, dtype, n = operands[0].shape, operands[0].dtype, operands[0].size
    block_size = block_size_for(n, block.size)
    spec = pl.BlockSpec((block_size,), lambda i: (i,))
    outs = _compat.pallas_call(
        functools.partial(kernel, num_elements=n, block_size=block_size),
        out_shape=[jax.ShapeDtypeStruct((n,), dtype)] * num_outputs,
        grid=(pl.cdiv(n, block_size),),
        in_specs=[spec] * len(operands),
        out_specs=[spec] * num_outputs,
        interpret=interpret,
        num_warps=block.num_warps,
        name=name,
    )(*(x.reshape(n) for x in operands))
    return tuple(out.reshape(shape) for out in outs)


# --- forward and backward, each a Pallas or an XLA path ------------------------------------


def _silu_mul_forward(
    gate: jax.Array, up: jax.Array, impl: str, interpret: bool, block: SiluMulBlock
) -> jax.Array:
    def pallas(gate, up):
        return _elementwise_call(_silu_mul_kernel, "silu_mul_fwd", 1, block, interpret, gate, up)

    def xla(gate, up):
        return (silu_mul_reference(gate, up),)

    (out,) = _platform.run(impl, pallas, xla, gate, up, name="silu_mul")
    return out


def _silu_mul_backward(
    gate: jax.Array,
    up: jax.Array,
    d_out: jax.Array,
    impl: str,
    interpret: bool,
    block: SiluMulBlock,
) -> tuple[jax.Array, jax.Array]:
    def pallas(gate, up, d_out):
        return _elementwise_call(
            _silu_mul_backward_kernel, "silu_mul_bwd", 2, block, interpret, gate, up, d_out
        )

    def xla(gate, up, d_out):
        dtype = _compute_dtype(gate.dtype)
        d_gate, d_up = _backward_math(gate.astype(dtype), up.astype(dtype), d_out.astype(dtype))
        return d_gate.astype(gate.dtype), d_up.astype(up.dtype)

    d_gate, d_up = _platform.run(impl, pallas, xla, gate, up, d_out, name="silu_mul")
    return d_gate, d_up


# --- the public op -------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _silu_mul(
    gate: jax.Array, up: jax.Array, impl: str, interpret: bool, block: SiluMulBlock
) -> jax.Array:
    return _silu_mul_forward(gate, up, impl, interpret, block)


def _silu_mul_fwd(gate, up, impl, interpret, block):
    # The inputs are the only residuals: the backward recomputes sigmoid(gate) in fp32
    # instead of keeping fp32 activations alive between the passes.
    return _silu_mul_forward(gate, up, impl, interpret, block), (gate, up)


def _silu_mul_bwd(impl, interpret, block, residuals, d_out):
    gate, up = residuals
    return _silu_mul_backward(gate, up, d_out, impl, interpret, block)


_silu_mul.defvjp(_silu_mul_fwd, _silu_mul_bwd)


def _check_operands(gate: jax.Array, up: jax.Array) -> None:
    for name, x in (("gate", gate), ("up", up)):
        if not isinstance(x, jax.Array | np.ndarray):
            raise TypeError(f"{name} must be a jax.Array or numpy array, got {name}={x!r}")
    if gate.shape != up.shape:
        raise ValueError(
            f"gate and up must have the same shape, got gate.shape={gate.shape}, "
            f"up.shape={up.shape}"
        )
    if gate.dtype != up.dtype:
        raise TypeError(
            f"gate and up must have the same dtype, got gate.dtype={gate.dtype}, "
            f"up.dtype={up.dtype}"
        )
    if not jnp.issubdtype(gate.dtype, jnp.floating):
        raise TypeError(
            f"gate and up must have a floating dtype, got gate.dtype={gate.dtype}, "
            f"up.dtype={up.dtype}"
        )


@functools.partial(jax.jit, static_argnames=("impl", "interpret", "block"))
def _silu_mul_jit(
    gate: jax.Array, up: jax.Array, *, impl: str, interpret: bool, block: SiluMulBlock
) -> jax.Array:
    gate, up = _compat.vary_like(gate, up), _compat.vary_like(up, gate)
    return _silu_mul(gate, up, impl, interpret, block)


def silu_mul(
    gate: jax.Array,
    up: jax.Array,
    *,
    impl: str = "auto",
    interpret: bool = False,
    block: SiluMulBlock | None = None,
) -> jax.Array:
    """SwiGLU's elementwise part ``silu(gate) * up``, fused, with a recomputing backward.

    Elementwise, in fp32 (bf16 and fp16 inputs are widened in registers), with ``s =
    sigmoid(gate)``::

        out    = gate * s * up
        d_gate = d_out * up * s * (1 + gate * (1 - s))
        d_up   = d_out * gate * s

    The output and both gradients are rounded once to the input dtype. The backward
    recomputes ``s`` from ``gate``, so ``jax.grad`` saves only ``gate`` and ``up``. NaN and
    infinity stay where they are: each output element depends on its own inputs only (as in
    ``jax.nn.silu``, ``gate = -inf`` gives NaN, ``-inf * 0``).

    Args:
      gate: the gate projection, any shape, a floating dtype.
      up: the up projection, the same shape and dtype as ``gate``.
      impl: ``"auto"`` (the XLA path: on an H200 it ran 1.16x the Pallas kernel's speed,
        ``docs/gpu_results.md``), ``"pallas"`` (the kernel, lowered for a GPU, for up to
        2**31 - 1 elements) or ``"xla"`` (``silu_mul_reference``'s math, with the same
        recomputing backward).
      interpret: run the Pallas kernel in interpret mode, on any backend (for tests).
      block: the kernels' ``SiluMulBlock``; None for the one measured fastest on the GPU
        lowered for (``rudax/kernels/auto_table.json``), else the default.

    Returns:
      ``silu(gate) * up`` with ``gate``'s shape and dtype, from a jitted body that compiles
      once per shape, dtype and option. A ValueError if the shapes differ (or for
      ``impl="pallas"`` past 2**31 - 1 elements), a TypeError if the dtypes differ or are not
      floating.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> gate = jnp.linspace(-3.0, 3.0, 12, dtype=jnp.bfloat16).reshape(2, 6)
      >>> up = jnp.ones((2, 6), jnp.bfloat16)
      >>> out = rk.silu_mul(gate, up)
      >>> out.shape, out.dtype
      ((2, 6), dtype(bfloat16))
      >>> d_gate = jax.grad(lambda g: rk.silu_mul(g, up).astype(jnp.float32).sum())(gate)
      >>> d_gate.dtype
      dtype(bfloat16)

    References:
      Shazeer, "GLU Variants Improve Transformer", 2020 (SwiGLU).
      Elfwing et al., "Sigmoid-Weighted Linear Units for Neural Network Function
      Approximation in Reinforcement Learning", 2017 (SiLU).
    """
    _check_operands(gate, up)
    check_block(block, SiluMulBlock)
    if block is None:
        size = gate.shape[-1] if gate.ndim else 1
        block = _auto.tuned_block(SiluMulBlock, "silu_mul", size=size, dtype=gate.dtype)
    resolved = _compat.resolve_impl(
        impl,
        interpret=interpret,
        kernel="silu_mul",
        size=gate.shape[-1] if gate.ndim else 1,
        dtype=gate.dtype,
    )
    if gate.size == 0:
        resolved = "xla"  # nothing for a kernel to do, and no grid to launch
    if resolved != "xla" and gate.size > _MAX_PALLAS_ELEMENTS:
        if impl == "pallas":
            raise ValueError(
                f"impl='pallas' runs arrays of at most {_MAX_PALLAS_ELEMENTS} elements, got "
                f"gate.shape={gate.shape} ({gate.size} elements): pass impl='auto' or 'xla'"
            )
        resolved = "xla"
    return _silu_mul_jit(gate, up, impl=resolved, interpret=interpret, block=block)


def silu_mul_reference(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``jax.nn.silu(gate) * up`` in fp32 (or wider), returned in the input dtype.

    Args:
      gate: any shape, a floating dtype.
      up: the same shape and dtype as ``gate``.

    Returns:
      ``gate * sigmoid(gate) * up`` with ``gate``'s dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> rk.silu_mul_reference(jnp.zeros(2), jnp.ones(2))
      Array([0., 0.], dtype=float32)
    """
    dtype = _compute_dtype(gate.dtype)
    return _forward_math(gate.astype(dtype), up.astype(dtype)).astype(gate.dtype)
