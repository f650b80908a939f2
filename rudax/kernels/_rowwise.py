"""What rms_norm and layer_norm share: argument checks, block sizes and the two row launchers.

Both norms are a reduction over the last axis followed by an elementwise pass, forward and
backward. The array is viewed as ``[rows, features]``; one Pallas program handles a block of
``RowBlock.rows`` rows and all features, padded to the next power of two (Triton blocks must
be powers of two). Padding is never materialised: reads and writes are masked, so a feature
size of 100 reads 100 values per row and the statistics divide by 100.

The backward also reduces over rows (the scale's and bias's gradients). Each backward program
loops over a strided set of row blocks and keeps its partial sums in registers, writing one
fp32 row of partials at the end: a buffer of ``min(row blocks, RowBlock.programs)`` x features,
summed by XLA, instead of a row of partials per row block (as large as the activations).

The per-block math (a ``*_kernel`` in each norm's file) sees fp32 blocks whose padded
positions are zero and the column mask, and returns fp32 results.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from rudax._validation import check_positive, check_positive_int, check_power_of_two
from rudax.kernels import _auto, _compat
from rudax.kernels._blocks import check_block

# Features per row the Pallas path takes: one row must fit one block in registers. Wider
# rows run the XLA path under impl="auto"; impl="pallas" refuses them.
MAX_FEATURES = 16384
# Target elements per forward/backward block: 16 fp32 values per thread at 8 warps.
_BLOCK_ELEMENTS = 4096


@dataclasses.dataclass(frozen=True)
class RowBlock:
    """Block sizes for the Pallas row kernels (rms_norm, layer_norm).

    Attributes:
      rows: rows per block; a power of two. Features always span one block, padded to the
        next power of two.
      num_warps: warps per program on the GPU; a power of two.
      programs: most programs in the backward, hence rows of fp32 partial sums of the
        scale's (and bias's) gradient; each program loops over its share of row blocks.
    """

    rows: int = 1
    num_warps: int = 8
    programs: int = 256

    def __post_init__(self) -> None:
        check_power_of_two("rows", self.rows)
        check_power_of_two("num_warps", self.num_warps)
        check_positive_int("programs", self.programs)


def _default_block(num_rows: int, features: int) -> RowBlock:
    """About ``_BLOCK_ELEMENTS`` elements per block, no more rows than there are."""
    cols = pl.next_power_of_2(features)
    rows = max(1, min(_BLOCK_ELEMENTS // cols, pl.next_power_of_2(max(num_rows, 1))))
    warps = min(max(rows * cols // 512, 1), 16)
    return RowBlock(rows=rows, num_warps=warps)


def _check_input(x: Any) -> None:
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"x must be a floating array, got dtype={dtype} for x")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (feature) axis, got x.shape={x.shape}")


def _check_vector(name: str, v: Any, x: Any) -> None:
    """A per-feature parameter: shape (features,), dtype x's or float32."""
    dtype = getattr(v, "dtype", None)
    if dtype is None or jnp.dtype(dtype) not in (jnp.dtype(x.dtype), jnp.dtype(jnp.float32)):
        raise TypeError(
            f"{name} must have x's dtype ({jnp.dtype(x.dtype)}) or float32, got "
            f"{name}.dtype={dtype}"
        )
    if tuple(v.shape) != (x.shape[-1],):
        raise ValueError(
            f"{name} must have shape (features,) = ({x.shape[-1]},) for x.shape={x.shape}, got "
            f"{name}.shape={tuple(v.shape)}"
        )


def _choose_path(impl: str, interpret: bool, x: jax.Array, kernel: str) -> str:
    """resolve_impl, then XLA for rows too wide for one block (or an error if forced)."""
    path = _compat.resolve_impl(
        impl, interpret=interpret, kernel=kernel, size=x.shape[-1], dtype=x.dtype
    )
    if path != "xla" and x.shape[-1] > MAX_FEATURES:
        if impl == "auto":
            return "xla"
        raise ValueError(
            f"impl='pallas' takes at most {MAX_FEATURES} features per row, got "
            f"x.shape={x.shape}: use impl='xla' (or 'auto')"
        )
    if path != "xla" and x.size == 0:
        return "xla"  # no rows: nothing for a kernel to do, and no grid to launch
    return path


def check_arguments(
    x: Any,
    vectors: dict[str, Any],
    epsilon: Any,
    impl: str,
    interpret: bool,
    block: RowBlock | None,
    *,
    kernel: str,
) -> tuple[float, str, RowBlock]:
    """A norm's argument checks; returns (epsilon as a float, the path, the block to use).

    ``vectors`` maps the name of each per-feature parameter given to it; ``kernel`` is the
    norm's name in the measured table (``rudax.kernels._auto``).
    """
    _check_input(x)
    for name, v in vectors.items():
        _check_vector(name, v, x)
    epsilon = check_positive("epsilon", epsilon, accept="static")
    check_block(block, RowBlock)
    path = _choose_path(impl, interpret, x, kernel)
    if block is None:
        block = _auto.tuned_block(
            RowBlock,
            kernel,
            size=x.shape[-1],
            dtype=x.dtype,
            default=lambda: _default_block(x.size // x.shape[-1], x.shape[-1]),
        )
    return epsilon, path, block


def _masks(program: Any, block_rows: int, block_cols: int, num_rows: int, features: int):
    rows = program * block_rows + jnp.arange(block_rows)
    cols = jnp.arange(block_cols)
    row_mask = rows < num_rows
    col_mask = cols < features
    return rows, cols, row_mask, col_mask, row_mask[:, None] & col_mask[None, :]


def _forward_kernel(x_ref, *refs, math_fn, n_vec, block_rows, features):
    vec_refs, y_ref, stat_refs = refs[:n_vec], refs[n_vec], refs[n_vec + 1 :]
    num_rows, block_cols = x_ref.shape[0], pl.next_power_of_2(features)
    rows, cols, row_mask, col_mask, mask = _masks(
        pl.program_id(0), block_rows, block_cols, num_rows, features
    )
    x = _compat.load(x_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0.0)
    vecs = [
        _compat.load(r.at[cols], mask=col_mask, other=0.0).astype(jnp.float32) for r in vec_refs
    ]
    y, stats = math_fn(x.astype(jnp.float32), *vecs, col_mask=col_mask)
    _compat.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=mask)
    for ref, s in zip(stat_refs, stats, strict=True):
        _compat.store(ref.at[rows], s, mask=row_mask)


def forward(
    math_fn: Callable[..., tuple[jax.Array, Sequence[jax.Array]]],
    x_RxN: jax.Array,
    vectors: Sequence[jax.Array],
    *,
    num_stats: int,
    block: RowBlock,
    interpret: bool,
    name: str,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Runs ``math_fn(x, *vectors, col_mask=) -> (y, stats)`` over row blocks with Pallas.

    Returns ``y`` in x's dtype and ``num_stats`` fp32 per-row statistics of shape (rows,).
    """
    num_rows, features = x_RxN.shape
    kernel = functools.partial(
        _forward_kernel,
        math_fn=math_fn,
        n_vec=len(vectors),
        block_rows=block.rows,
        features=features,
    )
    out_shape = (
        jax.ShapeDtypeStruct(x_RxN.shape, x_RxN.dtype),
        *(jax.ShapeDtypeStruct((num_rows,), jnp.float32) for _ in range(num_stats)),
    )
    y, *stats = _compat.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(num_rows, block.rows),),
        interpret=interpret,
        num_warps=block.num_warps,
        name=name,
    )(x_RxN, *vectors)
    return y, tuple(stats)


def _backward_kernel(
    x_ref, g_ref, *refs, math_fn, n_vec, n_stat, n_part, block_rows, features, steps, programs
):
    vec_refs = refs[:n_vec]
    stat_refs = refs[n_vec : n_vec + n_stat]
    dx_ref, part_refs = refs[n_vec + n_stat], refs[n_vec + n_stat + 1 :]
    num_rows, block_cols = x_ref.shape[0], pl.next_power_of_2(features)
    program = pl.program_id(0)
    cols = jnp.arange(block_cols)
    col_mask = cols < features
    vecs = [
        _compat.load(r.at[cols], mask=col_mask, other=0.0).astype(jnp.float32) for r in vec_refs
    ]

    def body(step, partials):
        # Strided over row blocks, so the last, partly empty step is spread over programs.
        rows, _, row_mask, _, mask = _masks(
            program + step * programs, block_rows, block_cols, num_rows, features
        )
        at = (rows[:, None], cols[None, :])
        x = _compat.load(x_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
        g = _compat.load(g_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
        stats = [_compat.load(r.at[rows], mask=row_mask, other=0.0) for r in stat_refs]
        dx, row_partials = math_fn(x, g, *vecs, *stats, col_mask=col_mask)
        _compat.store(dx_ref.at[at], dx.astype(dx_ref.dtype), mask=mask)
        return tuple(
            acc + jnp.sum(jnp.where(mask, p, 0.0), axis=0)
            for acc, p in zip(partials, row_partials, strict=True)
        )

    init = tuple(jnp.zeros((block_cols,), jnp.float32) for _ in range(n_part))
    partials = jax.lax.fori_loop(0, steps, body, init)
    for ref, p in zip(part_refs, partials, strict=True):
        _compat.store(ref.at[program, cols], p)


def backward(
    math_fn: Callable[..., tuple[jax.Array, Sequence[jax.Array]]],
    x_RxN: jax.Array,
    g_RxN: jax.Array,
    vectors: Sequence[jax.Array],
    stats: Sequence[jax.Array],
    *,
    num_partials: int,
    block: RowBlock,
    interpret: bool,
    name: str,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Runs ``math_fn(x, g, *vectors, *stats, col_mask=) -> (dx, per_row_partials)``.

    Returns ``dx`` in x's dtype and, for each of the ``num_partials`` per-row partials, its
    fp32 sum over rows, shape (features,).
    """
    num_rows, features = x_RxN.shape
    row_blocks = pl.cdiv(num_rows, block.rows)
    programs = min(row_blocks, block.programs)
    block_cols = pl.next_power_of_2(features)
    kernel = functools.partial(
        _backward_kernel,
        math_fn=math_fn,
        n_vec=len(vectors),
        n_stat=len(stats),
        n_part=num_partials,
        block_rows=block.rows,
        features=features,
        steps=pl.cdiv(row_blocks, programs),
        programs=programs,
    )
    out_shape = (
        jax.ShapeDtypeStruct(x_RxN.shape, x_RxN.dtype),
        *(jax.ShapeDtypeStruct((programs, block_cols), jnp.float32) for _ in range(num_partials)),
    )
    dx, *partials = _compat.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(programs,),
        interpret=interpret,
        num_warps=block.num_warps,
        name=name,
    )(x_RxN, g_RxN, *vectors, *stats)
    return dx, tuple(jnp.sum(p, axis=0)[:features] for p in partials)


def to_rows(x: jax.Array) -> jax.Array:
    """``[..., features]`` as ``[rows, features]``."""
    return x.reshape(int(np.prod(x.shape[:-1], dtype=np.int64)), x.shape[-1])
