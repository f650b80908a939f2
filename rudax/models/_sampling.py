"""How ``generate`` picks each next token: greedy, or sampled at a temperature after
transformers' top-k and top-p filters, with the token's log-probability.

The temperature, k and p are traced values (a new one reuses the compiled program); what
shapes the program is static (``Mode``): greedy or not, and which filters are on.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Mode", "check_temperature", "filter_logits", "sample"]

# The smallest temperature sampling takes: float32's smallest normal number. The logits are
# divided by the temperature in float32, and XLA flushes a subnormal divisor to zero on the
# CPU and the GPU (0 / 1e-45 is NaN there), so a smaller one would sample garbage.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)
MAX_TEMPERATURE = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Mode:
    """What shapes the sampling program (static); the temperature, k and p are traced."""

    greedy: bool
    top_k: bool  # filter by a top_k
    top_p: bool  # filter by a top_p


def filter_logits(z_BxV: jax.Array, top_k: jax.Array, top_p: jax.Array, mode: Mode) -> jax.Array:
    """``z`` with the tokens top-k, then top-p drop set to -inf (transformers' warpers)."""
    if not (mode.top_k or mode.top_p):
        return z_BxV
    rows, v = z_BxV.shape
    # One stable sort serves both filters (k and p are traced: no lax.top_k of a static k).
    # Ties keep their index order, as argsort(-z) does.
    index = jax.lax.broadcasted_iota(jnp.int32, z_BxV.shape, 1)
    neg_sorted, order = jax.lax.sort((-z_BxV, index), dimension=1, is_stable=True, num_keys=1)
    sorted_z = -neg_sorted
    z = z_BxV
    if mode.top_k:
        # TopKLogitsWarper: drop what is below the k-th largest (ties with it stay).
        kth = jax.lax.dynamic_slice_in_dim(sorted_z, jnp.clip(top_k, 1, v) - 1, 1, axis=1)
        z = jnp.where(z < kth, -jnp.inf, z)
        sorted_z = jnp.where(sorted_z < kth, -jnp.inf, sorted_z)
    if mode.top_p:
        # TopPLogitsWarper: keep the smallest set of most likely tokens whose probability
        # reaches top_p, the most likely always; top_p = 1 keeps all.
        probs = jax.nn.softmax(sorted_z, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
        drop_sorted = (before >= top_p) & (top_p < 1.0)
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(rows)[:, None], order].set(drop_sorted)
        z = jnp.where(drop, -jnp.inf, z)
    return z


def sample(
    logits_BxV: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    mode: Mode,
) -> tuple[jax.Array, jax.Array]:
    """Each row's next token, and its log-probability ``log_softmax(logits / T)`` before the
    filters (T = 1 when greedy): what a trainer's own forward recomputes."""
    logits = logits_BxV.astype(jnp.float32)
    if mode.greedy:
        token = jnp.argmax(logits, axis=-1)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        # Shifted before the division, (logits - max) / T is <= 0: it cannot overflow for any
        # normal T (a token far below the max goes to -inf, probability 0, as it should).
        z = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
        logp = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)
        token = jax.random.categorical(key, filter_logits(z, top_k, top_p, mode), axis=-1)
    token = token.astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def check_temperature(temperature: Any) -> float:
    """``temperature`` as a float: 0 (greedy), or a float32 normal number; else an error."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a number >= 0, got {temperature!r}")
    t = float(temperature)
    if not t >= 0:  # negative or NaN
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not (math.isfinite(t) and t <= MAX_TEMPERATURE):
        raise ValueError(
            f"temperature must be finite in float32 (at most {MAX_TEMPERATURE:.8g}), got "
            f"{temperature=!r}"
        )
    if 0 < t < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:.8g}, float32's "
            f"smallest normal number (the logits are divided by it in float32, where a smaller "
            f"divisor is flushed to zero), got {temperature=!r}"
        )
    return t
