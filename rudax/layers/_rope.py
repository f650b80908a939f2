"""Rotary position embedding: ``apply_rope``, its frequencies and Llama 3's rewrite of them.

``apply_rope`` rotates queries and keys by their positions (GPT-NeoX's "rotate half" layout,
Hugging Face Llama's); ``positions`` restart it at 0 for each example of a packed row.
``rope_frequencies`` are its angular frequencies, float64 constants of the program, rewritten
for a longer context by ``Llama3RopeScaling`` (Llama 3.1's ``rope_type="llama3"``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rudax._validation import check_positive, check_positive_int


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's rewrite of RoPE's frequencies for a longer context (``rope_type="llama3"``).

    With ``L = original_max_position_embeddings`` and each frequency's wavelength
    ``w = 2 pi / f``, a frequency is kept, divided by ``factor``, or blended between the two::

        f' = f                          if w < L / high_freq_factor      (short wavelengths)
        f' = f / factor                 if w > L / low_freq_factor       (long wavelengths)
        f' = (1 - a) f / factor + a f   otherwise, a = (L / w - low_freq_factor)
                                                       / (high_freq_factor - low_freq_factor)

    Frozen and hashable, so a model config holding one stays a static jit argument.

    Attributes:
      factor: the divisor of the long wavelengths' frequencies, > 0 (8 in Llama 3.1).
      low_freq_factor: > 0 (1 in Llama 3.1).
      high_freq_factor: > low_freq_factor (4 in Llama 3.1).
      original_max_position_embeddings: L, the pretraining context, a positive int (8192).

    Example:
      >>> import rudax.layers as rl
      >>> rl.Llama3RopeScaling(8.0, 1.0, 4.0, 8192).factor
      8.0
      >>> rl.Llama3RopeScaling(8.0, 4.0, 1.0, 8192)
      Traceback (most recent call last):
      ...
      ValueError: high_freq_factor must be > low_freq_factor=4.0, got high_freq_factor=1.0

    References:
      Meta, `The Llama 3 Herd of Models <https://arxiv.org/abs/2407.21783>`_, 2024.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(
                self, name, check_positive(name, getattr(self, name), accept="static")
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor must be > low_freq_factor={self.low_freq_factor}, got "
                f"high_freq_factor={self.high_freq_factor}"
            )
        check_positive_int(
            "original_max_position_embeddings", self.original_max_position_embeddings
        )


def rope_frequencies(
    head_dim: int, *, theta: float = 10000.0, scaling: Llama3RopeScaling | None = None
) -> np.ndarray:
    """RoPE's ``head_dim / 2`` angular frequencies ``f_i = theta ** (-2i / head_dim)``, float64.

    With ``scaling`` they are rewritten as ``Llama3RopeScaling`` says. NumPy at trace time:
    the frequencies are constants of the program.

    Args:
      head_dim: K, even and > 0.
      theta: the base wavelength, > 0.
      scaling: None, or a ``Llama3RopeScaling``.

    Returns:
      A float64 array of shape ``[head_dim // 2]``.

    Example:
      >>> import rudax.layers as rl
      >>> rl.rope_frequencies(4, theta=100.0).tolist()
      [1.0, 0.1]
      >>> # Wavelengths 6.3 < 32 / 4 (kept) and 62.8 > 32 / 1 (divided by 8).
      >>> scaling = rl.Llama3RopeScaling(8.0, 1.0, 4.0, 32)
      >>> rl.rope_frequencies(4, theta=100.0, scaling=scaling).tolist()
      [1.0, 0.0125]
    """
    inv_freq = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    if not isinstance(scaling, Llama3RopeScaling):
        raise TypeError(f"scaling must be None or a Llama3RopeScaling, got {scaling=}")
    s, old = scaling, scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    blend = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    medium = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    out = np.where(wavelen > old / s.low_freq_factor, inv_freq / s.factor, medium)
    return np.where(wavelen < old / s.high_freq_factor, inv_freq, out)


def apply_rope(
    x_BxTxHxK: jax.Array,
    *,
    positions: jax.Array | None = None,
    theta: float = 10000.0,
    scaling: Llama3RopeScaling | None = None,
    table_size: int | None = None,
) -> jax.Array:
    """Rotary position embedding of queries or keys at positions ``0 .. T-1`` or given ones.

    Channel ``i`` is paired with channel ``i + K/2`` (GPT-NeoX's "rotate half" layout, the
    same rotation as RoFormer's interleaved pairs up to a fixed permutation of channels), and
    the pair at position ``t`` is rotated by the angle ``t * f_i``, ``f_i = theta ** (-2i / K)``
    (``rope_frequencies``)::

        y[i]       = x[i] * cos - x[i + K/2] * sin
        y[i + K/2] = x[i + K/2] * cos + x[i] * sin

    This is Hugging Face Llama's ``x * cos + rotate_half(x) * sin`` with ``cos``/``sin`` of the
    angles repeated over both halves. The angles are computed in float64 with NumPy at trace
    time (constants of the program; transformers computes them in fp32), the rotation in
    fp32, and the result is returned in ``x``'s dtype.

    ``positions`` gives each token its own ``t`` (packed sequences: each example's tokens
    restart at 0). The table of ``cos``/``sin`` for ``t = 0 .. T-1`` is the same float64
    NumPy constant as without ``positions``, and each token reads its row of it, so a token
    at position ``t`` is rotated bit for bit as the ``t``-th token of an unpacked row is.
    ``table_size`` makes the table longer than T: a KV cache's new tokens sit at positions
    past their own count. A position outside ``[0, table_size)`` cannot be checked at trace
    time: its token's rotation is NaN, visibly wrong, never clamped to another position.

    Args:
      x_BxTxHxK: queries or keys, ``[batch, time, heads, head_dim]``, head_dim even.
      positions: None for ``0 .. T-1`` in every row; or integer positions ``[batch, time]``,
        each in ``[0, table_size)``.
      theta: the base wavelength, > 0.
      scaling: None, or a ``Llama3RopeScaling`` rewriting the frequencies.
      table_size: rows of the cos/sin table, positive; None for T. Only with ``positions``.

    Returns:
      An array of ``x``'s shape and dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.layers as rl
      >>> x = jnp.ones((1, 2, 1, 2))  # the pair (1, 1) at positions 0 and 1
      >>> y = rl.apply_rope(x)  # position 1 is rotated by 1 radian (K = 2: one pair, i = 0)
      >>> c, s = jnp.cos(1.0), jnp.sin(1.0)
      >>> bool(jnp.allclose(y[0, 0, 0], 1.0))
      True
      >>> bool(jnp.allclose(y[0, 1, 0], jnp.array([c - s, c + s])))
      True
      >>> # Given positions: the second token at position 0 is not rotated at all.
      >>> y = rl.apply_rope(x, positions=jnp.array([[1, 0]]))
      >>> bool(jnp.allclose(y[0, 0, 0], jnp.array([c - s, c + s]))), bool(jnp.all(y[0, 1] == 1))
      (True, True)

    References:
      Su et al., `RoFormer <https://arxiv.org/abs/2104.09864>`_, 2021.
    """
    if x_BxTxHxK.ndim != 4 or x_BxTxHxK.shape[-1] % 2:
        raise ValueError(
            f"apply_rope expects [batch, time, heads, head_dim] with an even head_dim, got "
            f"x.shape={x_BxTxHxK.shape}"
        )
    t, k = x_BxTxHxK.shape[1], x_BxTxHxK.shape[-1]
    if table_size is not None:
        check_positive_int("table_size", table_size)
        if positions is None:
            raise ValueError(f"table_size={table_size} needs positions (None reads rows 0 .. T-1)")
    rows = t if table_size is None else int(table_size)
    inv_freq = rope_frequencies(k, theta=theta, scaling=scaling)
    angles_TxK2 = np.arange(rows, dtype=np.float64)[:, None] * inv_freq[None, :]
    if positions is None:
        cos = jnp.asarray(np.cos(angles_TxK2)[None, :, None, :], jnp.float32)
        sin = jnp.asarray(np.sin(angles_TxK2)[None, :, None, :], jnp.float32)
    else:
        positions_BxT = _check_per_token("positions", positions, x_BxTxHxK.shape[:2])
        # Rows of the same constant table as above (not fp32 angles computed from the
        # positions), so packing changes no token's rotation by even one ulp.
        valid_BxT = (positions_BxT >= 0) & (positions_BxT < rows)
        index_BxT = jnp.where(valid_BxT, positions_BxT, 0)
        cos, sin = (
            jnp.where(
                valid_BxT[..., None],
                jnp.asarray(table_TxK2, jnp.float32)[index_BxT],
                jnp.float32(jnp.nan),
            )[:, :, None, :]
            for table_TxK2 in (np.cos(angles_TxK2), np.sin(angles_TxK2))
        )
    x1, x2 = jnp.split(x_BxTxHxK.astype(jnp.float32), 2, axis=-1)
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return y.astype(x_BxTxHxK.dtype)


def _check_per_token(name: str, value: Any, shape_BxT: tuple[int, ...]) -> jax.Array:
    """``value`` as an integer ``[batch, time]`` array of ``shape_BxT``, or a clear error."""
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must be integers, got {name}.dtype={value.dtype}")
    if value.shape != tuple(shape_BxT):
        raise ValueError(
            f"{name} must be [batch, time] = {tuple(shape_BxT)}, one per token, got "
            f"{name}.shape={value.shape}"
        )
    return value
