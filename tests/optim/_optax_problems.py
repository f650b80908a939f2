"""The objectives optax's generic optimizer tests use, for tests/optim/test_optax_suite.py.

Two targets for every optimizer (``parabola``, ``rosenbrock``), real or complex, and the five
standard functions optax's L-BFGS is checked on against scipy (``STANDARD_FUNCTIONS``), each in
a jnp version (what the optimizer minimizes) and a numpy version (what scipy minimizes, in
float64). The definitions are the textbook ones, with optax's starting points and minimizers,
so a result can be set beside optax's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Target:
    """An objective with its starting point and its minimizer, in one dtype."""

    init: Any  # jax array: where the optimizer starts
    minimizer: Any  # jax array like init: where it should end
    objective: Callable[[Any], Any]  # params -> real scalar


def _abs_sq(z: Any) -> Any:
    """|z|**2, real for real or complex z; the complex objectives' modulus."""
    return jnp.real(jnp.conj(z) * z)


def parabola(dtype: Any) -> Target:
    """sum |p - p*|**2 from (-1, 10, 1) to p* = (1, -1, 1), times (1 + 1j) for complex dtypes."""
    init = jnp.array([-1.0, 10.0, 1.0], dtype)
    minimizer = jnp.array([1.0, -1.0, 1.0], dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        minimizer = minimizer * (1 + 1j)
    return Target(init, minimizer, lambda p: jnp.sum(_abs_sq(p - minimizer)))


def rosenbrock(dtype: Any) -> Target:
    """|a - x|**2 + 100 |y - x**2|**2 from (0, 0) to (a, a**2); a = 1, or 1 + 1j if complex.

    The minimum lies at the end of a long, curved, nearly flat valley: optimizers reach the
    valley floor fast and then crawl along it, so any bias in the fixed point (a weight decay
    pulling toward 0, say) shows at the end.
    """
    a = (1 + 1j) if jnp.issubdtype(dtype, jnp.complexfloating) else 1.0
    init = jnp.zeros(2, dtype)
    minimizer = jnp.array([a, a * a], dtype)
    return Target(init, minimizer, lambda p: _abs_sq(a - p[0]) + 100.0 * _abs_sq(p[1] - p[0] ** 2))


def as_row_matrix(target: Target) -> Target:
    """The same problem on a (1, n) matrix: what Muon orthogonalizes must be 2-D."""
    objective = target.objective
    return Target(target.init[None], target.minimizer[None], lambda p: objective(p[0]))


# ----------------------------------------------------------------------------------------------
# The standard functions of optax's L-BFGS tests. Each takes ``xnp`` (jnp or np) so that one
# definition serves the optimizer (jnp, float32) and scipy (numpy, float64).


def _rosenbrock_n(x, xnp):
    return xnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def _himmelblau(p, xnp):
    x, y = p[0], p[1]
    return (x**2 + y - 11.0) ** 2 + (x + y**2 - 7.0) ** 2


def _matyas(p, xnp):
    x, y = p[0], p[1]
    return 0.26 * (x**2 + y**2) - 0.48 * x * y


def _eggholder(p, xnp):
    x, y = p[0], p[1]
    return -(y + 47.0) * xnp.sin(xnp.sqrt(xnp.abs(x / 2.0 + y + 47.0))) - x * xnp.sin(
        xnp.sqrt(xnp.abs(x - (y + 47.0)))
    )


def _zakharov(x, xnp):
    weights = 0.5 * xnp.arange(1, x.shape[0] + 1, dtype=x.dtype)
    linear = xnp.sum(weights * x)
    return xnp.sum(x**2) + linear**2 + linear**4


@dataclasses.dataclass(frozen=True)
class StandardFunction:
    """A test function of optimization, where optax starts it, and its known optimum."""

    fn: Callable[[Any, Any], Any]  # (x, xnp) -> scalar
    init: np.ndarray  # float64
    minimum: float
    minimizer: np.ndarray  # one of the minimizers (Himmelblau has four)

    def jnp_fn(self, x):
        return self.fn(x, jnp)

    def np_fn(self, x):
        return self.fn(np.asarray(x, np.float64), np)


STANDARD_FUNCTIONS = {
    "rosenbrock": StandardFunction(_rosenbrock_n, np.zeros(2), 0.0, np.ones(2)),
    "himmelblau": StandardFunction(_himmelblau, np.ones(2), 0.0, np.array([3.0, 2.0])),
    "matyas": StandardFunction(_matyas, np.full(2, 6.0), 0.0, np.zeros(2)),
    # Started at (6, 6), every local method ends in the nearest of its many local minima (near
    # (8.46, 15.65)), not at the global one (512, 404.23): the comparison is with scipy's.
    "eggholder": StandardFunction(
        _eggholder, np.full(2, 6.0), -959.6407, np.array([512.0, 404.2319])
    ),
    "zakharov": StandardFunction(
        _zakharov, np.array([600.0, 700.0, 200.0, 100.0, 90.0, 1e3]), 0.0, np.zeros(6)
    ),
}
