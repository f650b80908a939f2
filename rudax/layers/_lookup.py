"""A table lookup whose backward can do without scatter-add: a sorted segment sum.

The gradient of ``table[ids]`` with respect to the table adds each output row's cotangent
into the row its id names. XLA writes that as a scatter-add, which a GPU runs with atomics:
rows that share an id are summed in whatever order the threads arrive, so two runs of the
same step differ in the last bits, and a bitwise resume cannot be checked on a GPU.

``backward="sorted"`` computes the same sums with no scatter at all:

1. a stable sort of the positions by id (out-of-range ids sort last and are dropped);
2. the cotangent rows gathered in that order, and an inclusive *segmented* scan over them
   (``lax.associative_scan``: a fixed tree of adds within each run of equal ids);
3. each table row gathers its segment's last prefix, or zero if no position names it.

Every step is a sort, a gather, slices and adds, so the order of each sum is fixed by the
program. It is not the scatter's order, so the two agree to fp32 rounding, not bitwise.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

Backward = Literal["scatter", "sorted"]
BACKWARDS: tuple[str, ...] = ("scatter", "sorted")


def lookup(table: jax.Array, ids: jax.Array, *, backward: Backward = "scatter") -> jax.Array:
    """``table[ids]``, ids outside ``[0, rows)`` giving NaN rows and no gradient.

    Args:
      table: ``[rows, features]``.
      ids: integer ids, any shape.
      backward: ``"scatter"`` (autodiff's scatter-add) or ``"sorted"`` (no scatter: see the
        module docstring).

    Returns:
      ``ids.shape + (features,)`` in the table's dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import rudax.layers as rl
      >>> table, ids = jnp.arange(6.0).reshape(3, 2), jnp.array([2, 0, 2])
      >>> jax.grad(lambda t: rl.lookup(t, ids, backward="sorted").sum())(table)
      Array([[1., 1.],
             [0., 0.],
             [2., 2.]], dtype=float32)
    """
    check_backward(backward)
    if backward == "scatter":
        return _gather(table, ids)
    return _sorted_lookup(table, ids)


def check_backward(backward: str) -> None:
    if backward not in BACKWARDS:
        raise ValueError(f'backward must be "scatter" or "sorted", got {backward=}')


def _gather(table: jax.Array, ids: jax.Array) -> jax.Array:
    # NumPy indexing (jnp.take's too) wraps -1..-V to the last rows; a negative id is as
    # wrong as one >= V, so both fill NaN, and their rows get no gradient.
    return table.at[ids].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)


@jax.custom_vjp
def _sorted_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    return _gather(table, ids)


def _sorted_lookup_fwd(table, ids):
    return _gather(table, ids), (ids, jax.ShapeDtypeStruct(table.shape, table.dtype))


def _sorted_lookup_bwd(residuals, g):
    ids, table_struct = residuals
    d_table = sorted_segment_sum(
        g.reshape(-1, g.shape[-1]), ids.reshape(-1), num_segments=table_struct.shape[0]
    )
    return d_table.astype(table_struct.dtype), None


_sorted_lookup.defvjp(_sorted_lookup_fwd, _sorted_lookup_bwd)


@functools.partial(jax.jit, static_argnames=("num_segments",))
def sorted_segment_sum(values: jax.Array, ids: jax.Array, *, num_segments: int) -> jax.Array:
    """``out[v] = sum of values[i] over ids[i] == v``, in fp32, without scatter.

    Args:
      values: ``[N, D]`` floating.
      ids: ``[N]`` integers; those outside ``[0, num_segments)`` are dropped.
      num_segments: the number of output rows.

    Returns:
      ``[num_segments, D]`` float32 (float64 for float64 values).

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.layers as rl
      >>> rl.sorted_segment_sum(jnp.ones((4, 1)), jnp.array([1, 3, 1, 9]), num_segments=3)
      Array([[0.],
             [2.],
             [0.]], dtype=float32)
    """
    acc = jnp.float64 if values.dtype == jnp.float64 else jnp.float32
    n = ids.shape[0]
    if n == 0:
        return jnp.zeros((num_segments, values.shape[1]), acc)
    valid = (ids >= 0) & (ids < num_segments)
    key = jnp.where(valid, ids, num_segments).astype(jnp.int32)
    order = jnp.argsort(key, stable=True)
    key_sorted = key[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), key_sorted[1:] != key_sorted[:-1]])

    def combine(a, b):
        start_a, sum_a = a
        start_b, sum_b = b
        return start_a | start_b, jnp.where(start_b[:, None], sum_b, sum_a + sum_b)

    _, prefix = jax.lax.associative_scan(combine, (starts, values[order].astype(acc)))
    # The last position of each id's run; an id no position names reads as absent.
    rows = jnp.arange(num_segments, dtype=jnp.int32)
    last = jnp.searchsorted(key_sorted, rows, side="right").astype(jnp.int32) - 1
    present = (last >= 0) & (key_sorted[jnp.maximum(last, 0)] == rows)
    return jnp.where(present[:, None], prefix[jnp.maximum(last, 0)], 0)
