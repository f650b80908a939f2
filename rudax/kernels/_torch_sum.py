"""torch's CPU sum and mean of an fp32 vector, in torch's order, so that the bits agree.

bitsandbytes' double quantization centres the absmax values on ``absmax.mean()``, a torch
reduction; to store the same 8-bit codes rudax must start from the same fp32 offset, bit for
bit. A float sum's last bits depend on the order of its additions, and XLA's reduce has an
order of its own, so ``torch_cpu_mean`` writes torch's order out as explicit additions:

* ``Tensor.mean`` on the CPU is ``sum(x).div_(n)``, a true (correctly rounded) division;
* the sum is ``cascade_sum`` (``aten/src/ATen/native/cpu/SumKernel.cpp``):
  ``vectorized_inner_sum`` reads the vector as ``n // lanes`` SIMD vectors, sums those with
  ``row_sum`` (four interleaved accumulators, ``ilp_factor``), each accumulator a
  ``multi_row_sum`` cascade (runs of ``2**level_power`` rows summed in order, the run sums
  summed in runs again, four levels), then adds the ``n % lanes`` leftover scalars and the
  vector's lanes one at a time;
* ``lanes`` is ``Vectorized<float>::size()`` of the kernel torch dispatches: 8 on x86, with
  AVX2 and equally with AVX-512 (``REGISTER_DISPATCH`` registers no AVX-512 kernel, so
  ``sum_stub`` falls back to the AVX2 one) and without either; 4 with aarch64's NEON;
* from ``GRAIN_SIZE = 32768`` elements on, with ``T > 1`` threads, ``parallel_reduce`` splits
  the vector into ``min(T, ceil(n / 32768))`` equal chunks (``at::parallel_for``), sums each
  as above into a buffer of ``T`` entries and sums that buffer the same way. The result then
  depends on ``torch.get_num_threads()``; ``threads`` names it.

The same code runs in NumPy on a NumPy vector (on the host, nothing to compile) and in jnp on
a ``jax.Array`` (static shapes: jittable). In jnp it is only additions and one division, no
multiply that XLA could fuse into an FMA, and the divisor is behind an
``optimization_barrier``, so that XLA's simplifier cannot turn ``s / n`` into ``s * (1 / n)``,
which rounds differently. ``tests/kernels/test_nf4_bnb_shapes.py`` checks both against torch
bit for bit, with 1 to 16 threads (lanes: 8 only; the test machines are x86).
"""

from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# at::internal::GRAIN_SIZE: below it parallel_reduce runs on one thread.
GRAIN_SIZE = 32768
# Vectorized<float>::size() of the sum kernel torch runs on x86 (see the module docstring).
X86_LANES = 8

# Longer left folds run as a lax.scan, to keep the traced program small.
_UNROLL = 32


def torch_cpu_sum(
    x_N: jax.Array | np.ndarray, *, lanes: int = X86_LANES, threads: int = 1
) -> jax.Array | np.ndarray:
    """``torch.sum`` of a contiguous fp32 vector on the CPU, bit for bit.

    The same additions run on a NumPy ``x_N`` (in NumPy, on the host), or on a ``jax.Array``
    (traceable: under ``jit`` the order is fixed by the program, not by XLA's reduce).

    Args:
      x_N: float32, shape ``(n,)``, ``n >= 1``; a ``jax.Array`` or a NumPy array.
      lanes: torch's ``Vectorized<float>::size()``: 8 on x86, 4 on aarch64.
      threads: ``torch.get_num_threads()``; it matters only from ``GRAIN_SIZE`` elements on.

    Returns:
      A float32 scalar, of ``x_N``'s kind. Never ``-0.0``: torch adds the sum to a zeroed
      output.
    """
    if x_N.ndim != 1 or x_N.shape[0] == 0 or x_N.dtype != np.float32:
        raise ValueError(
            f"x_N must be a non-empty float32 vector, got shape {x_N.shape} and {x_N.dtype}"
        )
    for name, value in (("lanes", lanes), ("threads", threads)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
    xp = np if isinstance(x_N, np.ndarray) else jnp
    n = x_N.shape[0]
    if n < GRAIN_SIZE or threads == 1:
        total = _inner_sum(x_N, lanes, xp)
    else:
        # two_pass_reduction: one chunk per task, each summed into its thread's buffer entry;
        # the entries of idle threads stay 0, and the buffer is summed like any vector.
        tasks = min(threads, -(-n // GRAIN_SIZE))
        chunk = -(-n // tasks)
        partials = [_inner_sum(x_N[lo : lo + chunk], lanes, xp) for lo in range(0, n, chunk)]
        idle = xp.zeros((threads - len(partials),), np.float32)
        total = _inner_sum(xp.concatenate([xp.stack(partials), idle]), lanes, xp)
    # The kernel adds its sum to an output filled with 0: a -0.0 sum comes back as +0.0. No
    # other signed zero can reach the result, so the folds below may start from x[0], not 0.
    return xp.where(total == 0, np.float32(0), total)


def torch_cpu_mean(
    x_N: jax.Array | np.ndarray, *, lanes: int = X86_LANES, threads: int = 1
) -> jax.Array | np.ndarray:
    """``torch.mean`` of a contiguous fp32 vector on the CPU, bit for bit: the sum over ``n``.

    Args and Returns as ``torch_cpu_sum``.
    """
    total = torch_cpu_sum(x_N, lanes=lanes, threads=threads)
    n = np.float32(x_N.shape[0])
    if isinstance(total, np.ndarray):
        return np.asarray(total / n, np.float32)
    # A true division, as torch's div_ does: the barrier keeps XLA from replacing the
    # division by a constant with a multiplication by its (rounded) reciprocal.
    return total / lax.optimization_barrier(jnp.float32(n))


def _fold(x, xp: ModuleType):
    """``x[0] + x[1] + ... + x[m - 1]`` left to right over axis 0; zeros when ``m == 0``."""
    m = x.shape[0]
    if m == 0:
        return xp.zeros(x.shape[1:], x.dtype)
    if m <= _UNROLL or xp is np:
        acc = x[0]
        for i in range(1, m):
            acc = acc + x[i]
        return acc
    acc, _ = lax.scan(lambda acc, row: (acc + row, None), x[0], x[1:])
    return acc


def _fold_runs(x, run: int, xp: ModuleType):
    """Each whole run of ``run`` rows of ``x`` folded, and the fold of the rows left over."""
    whole = x.shape[0] // run * run
    runs = x[:whole].reshape(-1, run, *x.shape[1:])
    return _fold(xp.swapaxes(runs, 0, 1), xp), _fold(x[whole:], xp)


def _ceil_log2(x: int) -> int:
    """c10's ``CeilLog2``: 1 for ``x <= 2``."""
    return 1 if x <= 2 else (x - 1).bit_length()


def _multi_row_sum(rows_SxK, xp: ModuleType):
    """SumKernel.cpp's ``multi_row_sum``: the K column sums of S rows, as a 4-level cascade.

    Level 0 sums runs of ``step = 2**level_power`` rows in order; whenever a run ends, its
    sum is added to level 1; when ``step`` runs have, level 1 goes to level 2, and so on;
    level 3 keeps all it gets. The rows after the last whole run are summed in order, then
    levels 1, 2 and 3 are added to them.
    """
    level_power = max(4, _ceil_log2(rows_SxK.shape[0]) // 4)
    step = 1 << level_power
    level0, tail = _fold_runs(rows_SxK, step, xp)
    level1, acc1 = _fold_runs(level0, step, xp)
    level2, acc2 = _fold_runs(level1, step, xp)
    acc3 = _fold(level2, xp)
    return ((tail + acc1) + acc2) + acc3


def _row_sum(items_SxL, xp: ModuleType):
    """SumKernel.cpp's ``row_sum``: the sum of S items of L lanes, 4 interleaved partials."""
    size, lanes = items_SxL.shape
    ilp = 4
    rows = size // ilp
    partials = _multi_row_sum(items_SxL[: rows * ilp].reshape(rows, ilp * lanes), xp)
    partials = partials.reshape(ilp, lanes)
    acc = partials[0]
    for i in range(rows * ilp, size):
        acc = acc + items_SxL[i]
    for k in range(1, ilp):
        acc = acc + partials[k]
    return acc


def _inner_sum(x_N, lanes: int, xp: ModuleType):
    """SumKernel.cpp's contiguous inner sum of one vector (one thread's share)."""
    n = x_N.shape[0]
    if n < lanes:  # too short for one SIMD vector: row_sum over scalars
        return _row_sum(x_N.reshape(n, 1), xp)[0]
    vectors = n // lanes
    vec_acc = _row_sum(x_N[: vectors * lanes].reshape(vectors, lanes), xp)
    # The leftover scalars first, then the vector accumulator's lanes, in order.
    return _fold(xp.concatenate([x_N[vectors * lanes :], vec_acc]), xp)
