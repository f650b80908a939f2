"""Test inputs drawn with numpy: jax.random compiles its generator once per shape, which on a
busy 2-core CI machine costs more than the layers under test."""

import jax
import jax.numpy as jnp
import numpy as np


def normal(shape: tuple[int, ...], seed: int = 0, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32)).astype(dtype)


def uniform(shape: tuple[int, ...], low: float, high: float, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32))
