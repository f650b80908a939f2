"""Causal self-attention with rotary positions: ``apply_rope``, ``causal_attention`` and the layer.

The GPT in ``examples/lm/model.py`` uses ``CausalSelfAttention``; the two functions are
its arithmetic, written out so each can be checked against a plain reference. The layer
covers what Llama-family checkpoints need (``examples/lm/hf.py``): grouped-query attention,
q/k/v biases (Qwen2), separate q/k/v projections beside the fused one, and Llama 3's
frequency rewrite of RoPE (``Llama3RopeScaling``). It also runs packed rows, several
examples of a fine-tuning batch in one row: ``segment_ids`` keep attention within each
example and ``positions`` restart RoPE at 0 for each.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rudax.layers as rl
from rudax._validation import check_bool, check_positive, check_positive_int

# GPT-2's initializer, N(0, 0.02), for both kernels unless the caller scales the output one.
DEFAULT_INIT = nnx.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's rewrite of RoPE's frequencies for a longer context (``rope_type="llama3"``).

    With ``L = original_max_position_embeddings`` and each frequency's wavelength
    ``w = 2 pi / f``, a frequency is kept, divided by ``factor``, or blended between the two::

        f' = f                          if w < L / high_freq_factor      (short wavelengths)
        f' = f / factor                 if w > L / low_freq_factor       (long wavelengths)
        f' = (1 - a) f / factor + a f   otherwise, a = (L / w - low_freq_factor)
                                                       / (high_freq_factor - low_freq_factor)

    Frozen and hashable, so a ``GPTConfig`` holding one stays a static jit argument.

    Attributes:
      factor: the divisor of the long wavelengths' frequencies, > 0 (8 in Llama 3.1).
      low_freq_factor: > 0 (1 in Llama 3.1).
      high_freq_factor: > low_freq_factor (4 in Llama 3.1).
      original_max_position_embeddings: L, the pretraining context, a positive int (8192).

    Example:
      >>> from examples.lm.attention import Llama3RopeScaling
      >>> Llama3RopeScaling(8.0, 1.0, 4.0, 8192).factor
      8.0
      >>> Llama3RopeScaling(8.0, 4.0, 1.0, 8192)
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
      >>> from examples.lm.attention import Llama3RopeScaling, rope_frequencies
      >>> rope_frequencies(4, theta=100.0).tolist()
      [1.0, 0.1]
      >>> # Wavelengths 6.3 < 32 / 4 (kept) and 62.8 > 32 / 1 (divided by 8).
      >>> rope_frequencies(4, theta=100.0, scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 32)).tolist()
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
    A position outside ``[0, T)`` cannot be checked at trace time: its token's rotation is
    NaN, visibly wrong, never clamped to another position.

    Args:
      x_BxTxHxK: queries or keys, ``[batch, time, heads, head_dim]``, head_dim even.
      positions: None for ``0 .. T-1`` in every row; or integer positions ``[batch, time]``,
        each in ``[0, T)``.
      theta: the base wavelength, > 0.
      scaling: None, or a ``Llama3RopeScaling`` rewriting the frequencies.

    Returns:
      An array of ``x``'s shape and dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from examples.lm.attention import apply_rope
      >>> x = jnp.ones((1, 2, 1, 2))  # the pair (1, 1) at positions 0 and 1
      >>> y = apply_rope(x)  # position 1 is rotated by 1 radian (K = 2: one pair, i = 0)
      >>> c, s = jnp.cos(1.0), jnp.sin(1.0)
      >>> bool(jnp.allclose(y[0, 0, 0], 1.0))
      True
      >>> bool(jnp.allclose(y[0, 1, 0], jnp.array([c - s, c + s])))
      True
      >>> # Given positions: the second token at position 0 is not rotated at all.
      >>> y = apply_rope(x, positions=jnp.array([[1, 0]]))
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
    inv_freq = rope_frequencies(k, theta=theta, scaling=scaling)
    angles_TxK2 = np.arange(t, dtype=np.float64)[:, None] * inv_freq[None, :]
    if positions is None:
        cos = jnp.asarray(np.cos(angles_TxK2)[None, :, None, :], jnp.float32)
        sin = jnp.asarray(np.sin(angles_TxK2)[None, :, None, :], jnp.float32)
    else:
        positions_BxT = _check_per_token("positions", positions, x_BxTxHxK.shape[:2])
        # Rows of the same constant table as above (not fp32 angles computed from the
        # positions), so packing changes no token's rotation by even one ulp.
        valid_BxT = (positions_BxT >= 0) & (positions_BxT < t)
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


# Query rows per block of ``causal_attention``: small enough that the masked half it skips
# matters (T = 256 in 4 blocks computes 10/16 of the scores), large enough that each block's
# matmuls stay efficient.
QUERY_BLOCK = 64


def causal_attention(
    q_BxTxHxK: jax.Array,
    k_BxTxGxK: jax.Array,
    v_BxTxGxK: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    query_block: int = QUERY_BLOCK,
) -> jax.Array:
    """``softmax(q k^T / sqrt(K) + mask) v``, scores and softmax in fp32; GQA and packing too.

    Grouped-query attention: ``k`` and ``v`` may have ``G`` heads for ``q``'s ``H``, ``G``
    dividing ``H``; query head ``h`` then attends with key/value head ``h // (H / G)``, the
    grouping of transformers' ``repeat_kv``. The groups are a reshape of the queries, so the
    keys and values are never repeated in memory.

    The queries are split into blocks of ``query_block`` rows; block ``[s, e)`` attends only
    to keys ``[0, e)``, the causal mask applied inside the block. The keys past ``e`` would
    only get probability 0 (``exp(-inf)``), so each row's softmax is the same function as
    over the full masked row, and the ``~T^2/2`` scores above the diagonal's blocks are never
    computed. On a 2-core CPU (T = 256, fp32, the default ``GPTConfig``'s 4 heads of 64,
    batch 16) blocks of 64 rows made attention's forward and backward 1.4x faster than the
    full ``T x T`` form (62 -> 43 ms; blocks of 32: 1.25x, of 128: 1.3x) and a whole training
    step 3% cheaper (2.6-6% over four paired runs). The full form had cost the same as
    ``jax.nn.dot_product_attention(..., is_causal=True)``.

    The mask is causal: query ``t`` sees keys ``s <= t``. With ``segment_ids`` (several
    examples packed into one row) it is also within the segment: query ``t`` sees key ``s``
    iff ``s <= t`` and ``segment_ids[b, s] == segment_ids[b, t]``, so each example attends
    only to itself, exactly as if it were alone (its keys from other segments get
    probability 0). Padding (segment 0, or any id) attends only to its own segment's earlier
    tokens; every row still keeps its diagonal, so no row is all masked and no output is
    NaN. Blocks are as above: the mask is applied inside each block.

    Args:
      q_BxTxHxK: queries ``[batch, time, H, head_dim]``.
      k_BxTxGxK, v_BxTxGxK: keys and values ``[batch, time, G, head_dim]``, ``H % G == 0``,
        of q's dtype.
      segment_ids: None (one sequence per row), or integer ids ``[batch, time]``: tokens
        attend only to earlier tokens of the same id.
      query_block: query rows per block, >= 1; ``T`` or more: one block, the full form.

    Returns:
      ``[batch, time, H, head_dim]`` in ``v``'s dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from examples.lm.attention import causal_attention
      >>> v = jnp.arange(3.0).reshape(1, 3, 1, 1)
      >>> causal_attention(jnp.zeros((1, 3, 1, 1)), jnp.zeros((1, 3, 1, 1)), v)[0, :, 0, 0]
      Array([0. , 0.5, 1. ], dtype=float32)
      >>> q = jnp.zeros((1, 3, 1, 1))  # blocks of 2 query rows: the same result
      >>> causal_attention(q, q, v, query_block=2)[0, :, 0, 0]
      Array([0. , 0.5, 1. ], dtype=float32)
      >>> q2 = jnp.zeros((1, 3, 2, 1))  # two query heads share the one key/value head
      >>> causal_attention(q2, q, v)[0, :, :, 0]
      Array([[0. , 0. ],
             [0.5, 0.5],
             [1. , 1. ]], dtype=float32)
      >>> # Two examples packed in one row: the third token starts its own segment.
      >>> seg = jnp.array([[1, 1, 2]])
      >>> causal_attention(q, q, v, segment_ids=seg)[0, :, 0, 0]
      Array([0. , 0.5, 2. ], dtype=float32)
    """
    q, k, v = q_BxTxHxK, k_BxTxGxK, v_BxTxGxK
    if (
        q.ndim != 4
        or k.shape != v.shape
        or k.ndim != 4
        or q.shape[:2] + q.shape[3:] != k.shape[:2] + k.shape[3:]
        or q.shape[2] % k.shape[2]
    ):
        raise ValueError(
            f"causal_attention expects q [batch, time, heads, head_dim] and k, v of one "
            f"[batch, time, kv_heads, head_dim] shape, kv_heads dividing heads, got "
            f"q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}"
        )
    check_positive_int("query_block", query_block)
    b, t, h, kd = q.shape
    if segment_ids is not None:
        segment_ids = _check_per_token("segment_ids", segment_ids, (b, t))
    g = k.shape[2]
    scale = 1.0 / math.sqrt(kd)
    if g == h:  # one key/value head per query head: no group axis in the einsums
        q_score, s_spec, o_spec = q, "bthk,bshk->bhts", "bhts,bshk->bthk"
    else:
        q_score, s_spec, o_spec = (
            q.reshape(b, t, g, h // g, kd),
            "btgrk,bsgk->bgrts",
            "bgrts,bsgk->btgrk",
        )
    outs = []
    for s in range(0, t, query_block):
        e = min(s + query_block, t)
        scores = (
            jnp.einsum(s_spec, q_score[:, s:e], k[:, :e], preferred_element_type=jnp.float32)
            * scale
        )
        # Query row s + i sees keys 0 .. s + i. -inf is safe: every row keeps its diagonal.
        causal = np.tril(np.ones((e - s, e), bool), k=s)
        mask: Any = causal
        if segment_ids is not None:  # ... of its own segment: [B, e - s, e], per row
            same_BxQxS = segment_ids[:, s:e, None] == segment_ids[:, None, :e]
            mask_BxQxS = same_BxQxS & causal
            mask = mask_BxQxS[:, None] if g == h else mask_BxQxS[:, None, None]
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        out = jnp.einsum(o_spec, probs.astype(v.dtype), v[:, :e])
        outs.append(out if g == h else out.reshape(b, e - s, h, kd))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


class CausalSelfAttention(nnx.Module):
    """Causal self-attention with RoPE and H query heads: ``out(attention(rope(q), rope(k), v))``.

    ``G = num_kv_heads`` key/value heads (grouped-query attention; ``G = H`` is multi-head
    attention) of ``K = features // num_heads`` channels. The projections, in one of two
    layouts:

    * ``fused_qkv=True``: ``qkv``, one ``Linear(d, (H + 2G) K)`` (one matmul instead of
      three) whose output is read as ``[q | k | v]``, each split into heads;
    * ``fused_qkv=False``: ``q``, ``k``, ``v``, a ``Linear(d, H K)`` and two
      ``Linear(d, G K)``: the layout of Hugging Face's ``q_proj``/``k_proj``/``v_proj``, in
      which a LoRA adapter on one of them alone is exact (``rudax.layers.apply_lora``).

    and ``out``, a ``Linear(H K, d)`` without bias (``o_proj``). q, k and v have biases only
    with ``qkv_bias`` (Qwen2's layout). Every projection computes in ``dtype`` and the layer
    calls them (never reads their kernels), so ``rudax.sharding`` can swap them for their
    sharded forms and ``apply_lora`` for adapted ones.

    Args:
      features: d, the input and output size, a multiple of ``num_heads``.
      num_heads: H, query heads; ``features // num_heads`` must be even (RoPE rotates pairs).
      num_kv_heads: G, key/value heads, dividing H; None for H.
      fused_qkv: the projections' layout, above.
      qkv_bias: whether q, k and v have biases (initialized to zeros).
      rope_theta: RoPE's base wavelength, > 0.
      rope_scaling: None, or a ``Llama3RopeScaling`` rewriting RoPE's frequencies.
      dtype: compute dtype; None for the input's.
      param_dtype: storage dtype of the kernels and biases.
      kernel_init: initializer of the ``qkv`` kernel (of ``q``, ``k`` and ``v``'s).
      out_init: initializer of the ``out`` kernel.
      rngs: the ``nnx.Rngs`` whose ``params`` stream draws the kernels.

    Returns:
      A module; calling it on ``x[B, T, d]`` returns an array of the same shape in the
      compute dtype. ``segment_ids`` and ``positions`` (integers ``[B, T]``, keyword-only)
      pack several examples into a row: attention stays within each segment
      (``causal_attention``) and RoPE rotates by each token's own position (``apply_rope``).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from examples.lm.attention import CausalSelfAttention
      >>> attn = CausalSelfAttention(8, 2, rngs=nnx.Rngs(0))
      >>> attn(jnp.ones((1, 5, 8))).shape
      (1, 5, 8)
      >>> gqa = CausalSelfAttention(16, 4, num_kv_heads=2, fused_qkv=False, rngs=nnx.Rngs(0))
      >>> gqa.q.kernel.shape, gqa.k.kernel.shape, gqa(jnp.ones((1, 5, 16))).shape
      ((16, 16), (16, 8), (1, 5, 16))
      >>> seg, pos = jnp.array([[1, 1, 1, 2, 2]]), jnp.array([[0, 1, 2, 0, 1]])
      >>> attn(jnp.ones((1, 5, 8)), segment_ids=seg, positions=pos).shape
      (1, 5, 8)

    References:
      Vaswani et al., `Attention Is All You Need <https://arxiv.org/abs/1706.03762>`_, 2017;
      Ainslie et al., `GQA <https://arxiv.org/abs/2305.13245>`_, 2023.
    """

    def __init__(
        self,
        features: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        fused_qkv: bool = True,
        qkv_bias: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: Llama3RopeScaling | None = None,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: nnx.Initializer = DEFAULT_INIT,
        out_init: nnx.Initializer = DEFAULT_INIT,
        rngs: nnx.Rngs,
    ):
        check_positive_int("features", features)
        check_positive_int("num_heads", num_heads)
        if features % num_heads or (features // num_heads) % 2:
            raise ValueError(
                f"features must be a multiple of num_heads={num_heads} with an even quotient "
                f"(RoPE rotates pairs of channels), got {features=}"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads={num_heads}, got {num_kv_heads=}")
        check_bool("fused_qkv", fused_qkv)
        check_bool("qkv_bias", qkv_bias)
        if rope_scaling is not None and not isinstance(rope_scaling, Llama3RopeScaling):
            raise TypeError(
                f"rope_scaling must be None or a Llama3RopeScaling, got {rope_scaling=}"
            )
        self.rope_theta = check_positive("rope_theta", rope_theta, accept="static")
        self.rope_scaling = rope_scaling
        self.features, self.num_heads, self.num_kv_heads = features, num_heads, num_kv_heads
        self.fused_qkv = fused_qkv
        head_dim = features // num_heads
        linear = lambda n_out, init, bias: rl.Linear(
            features,
            n_out,
            use_bias=bias,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=init,
            rngs=rngs,
        )
        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        if fused_qkv:
            self.qkv = linear(q_out + 2 * kv_out, kernel_init, qkv_bias)
        else:
            self.q = linear(q_out, kernel_init, qkv_bias)
            self.k = linear(kv_out, kernel_init, qkv_bias)
            self.v = linear(kv_out, kernel_init, qkv_bias)
        self.out = linear(features, out_init, False)

    @property
    def projections(self) -> tuple[str, ...]:
        """The attribute names of the layer's projections, in their layout."""
        return ("qkv", "out") if self.fused_qkv else ("q", "k", "v", "out")

    def __call__(
        self,
        x_BxTxD: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        x_BxTxD = jnp.asarray(x_BxTxD)
        if x_BxTxD.ndim != 3:
            raise ValueError(f"CausalSelfAttention expects x[B, T, d], got x.shape={x_BxTxD.shape}")
        b, t, d = x_BxTxD.shape
        h, g, kd = self.num_heads, self.num_kv_heads, d // self.num_heads
        if not self.fused_qkv:
            q = self.q(x_BxTxD).reshape(b, t, h, kd)
            k = self.k(x_BxTxD).reshape(b, t, g, kd)
            v = self.v(x_BxTxD).reshape(b, t, g, kd)
        elif g == h:
            qkv = self.qkv(x_BxTxD).reshape(b, t, 3, h, kd)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q, k, v = jnp.split(self.qkv(x_BxTxD), [h * kd, (h + g) * kd], axis=-1)
            q, k, v = q.reshape(b, t, h, kd), k.reshape(b, t, g, kd), v.reshape(b, t, g, kd)
        rope = lambda y: apply_rope(
            y, positions=positions, theta=self.rope_theta, scaling=self.rope_scaling
        )
        out = causal_attention(rope(q), rope(k), v, segment_ids=segment_ids)
        return self.out(out.reshape(b, t, d))
