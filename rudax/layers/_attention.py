"""Attention: self-attention with RoPE over ``rudax.kernels.flash_attention``.

``out(flash_attention(rope(q), rope(k), v))`` with grouped-query heads, q/k/v biases, fused
or separate projections and Llama 3's RoPE: what Llama-family checkpoints (Llama, Qwen2,
Mistral) need. Packed rows (several examples of a batch in one row) pass ``segment_ids``,
which keep attention within each example, and ``positions``, which restart RoPE at 0 for
each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

import rudax.kernels as rk
from rudax._validation import check_bool, check_int, check_positive, check_positive_int
from rudax.layers._linear import Linear
from rudax.layers._rope import Llama3RopeScaling, apply_rope
from rudax.layers._validation import check_features

# GPT-2's initializer, N(0, 0.02), for both kernels unless the caller scales the output one.
DEFAULT_INIT = nnx.initializers.normal(0.02)

# The values of ``rudax.kernels.flash_attention``'s ``impl``: its Pallas and XLA paths, as
# every kernel has, and cuDNN's fused attention.
IMPLS = ("auto", "pallas", "xla", "cudnn")


class Attention(nnx.Module):
    """Self-attention with RoPE and H query heads: ``out(attention(rope(q), rope(k), v))``.

    ``G = num_kv_heads`` key/value heads (grouped-query attention; ``G = H`` is multi-head
    attention) of ``K = head_dim`` channels (``features // num_heads`` by default). The
    projections, in one of two layouts:

    * ``fused_qkv=True``: ``qkv_proj``, one ``Linear(d, (H + 2G) K)`` (one matmul instead of
      three) whose output is read as ``[q | k | v]``, each split into heads (Phi-3's layout);
    * ``fused_qkv=False``: ``q_proj``, ``k_proj``, ``v_proj``, a ``Linear(d, H K)`` and two
      ``Linear(d, G K)``: the layout of Hugging Face's Llama, in which a LoRA adapter on one
      of them alone is exact (``rudax.layers.apply_lora``).

    and ``o_proj``, a ``Linear(H K, d)``. The names are transformers', so LoRA targets and
    checkpoint names carry over; ``rudax.models``' Llama attention is this layer. q, k and v
    have biases only with ``qkv_bias`` (Qwen2's layout), ``o_proj`` only with ``out_bias``
    (Llama's ``attention_bias`` sets both). Every projection computes in ``dtype`` and the layer
    calls them (never reads their kernels), so ``rudax.sharding`` can swap them for their
    sharded forms and ``apply_lora`` for adapted ones.

    The attention itself is ``rudax.kernels.flash_attention`` of the rotated queries and
    keys (``apply_rope``), scaled by ``1 / sqrt(K)``: query head ``h`` attends with key/value
    head ``h // (H / G)`` (transformers' ``repeat_kv`` grouping), and query ``t`` sees key
    ``s`` iff ``s <= t`` (``causal``), ``segment_ids`` agree, and ``t - left <= s <= t + right``
    (``window=(left, right)``); ``softcap`` bounds the scores to ``softcap * tanh(s /
    softcap)`` (Gemma 2). Scores and softmax are in fp32 whatever the compute dtype.

    Args:
      features: d, the input and output size; a multiple of ``num_heads`` unless
        ``head_dim`` is given.
      num_heads: H, query heads.
      num_kv_heads: G, key/value heads, dividing H; None for H.
      head_dim: K, channels per head, even (RoPE rotates pairs); None for
        ``features // num_heads``.
      fused_qkv: the projections' layout, above.
      qkv_bias: whether q, k and v have biases (initialized to zeros).
      out_bias: whether ``o_proj`` has a bias (initialized to zeros).
      causal: whether query ``t`` sees only keys ``s <= t``.
      window: None, or ``(left, right)``, two ints >= 0: query ``t`` sees only keys
        ``t - left <= s <= t + right`` (Mistral's sliding window is ``(W - 1, 0)``).
      softcap: None, or a float > 0 capping the scores (``softcap * tanh(scores / softcap)``).
      rope_theta: RoPE's base wavelength, > 0.
      rope_scaling: None, or a ``Llama3RopeScaling`` rewriting RoPE's frequencies.
      dtype: compute dtype; None for the input's.
      param_dtype: storage dtype of the kernels and biases.
      kernel_init: initializer of the ``qkv_proj`` kernel (of ``q_proj``, ``k_proj`` and
        ``v_proj``'s); N(0, 0.02) by default, GPT-2's.
      out_init: initializer of the ``o_proj`` kernel; N(0, 0.02) by default.
      impl: ``"auto"``, ``"pallas"``, ``"xla"`` or ``"cudnn"``, passed to
        ``rudax.kernels.flash_attention``.
      interpret: with ``impl="pallas"``, run the Pallas kernels in interpret mode (tests on
        CPU); ignored by ``impl="auto"``.
      block: None, or a ``rudax.kernels.FlashAttentionBlock`` of the kernel's block sizes.
      rngs: the ``nnx.Rngs`` whose ``params`` stream draws the kernels.

    Returns:
      A module; calling it on ``x[B, T, d]`` returns an array of the same shape in the
      compute dtype. ``segment_ids`` and ``positions`` (integers ``[B, T]``, keyword-only)
      pack several examples into a row: attention stays within each segment and RoPE
      rotates by each token's own position (``apply_rope``). ``branch_ids`` (``[B, T]``,
      causal only) pack a shared prefix and its continuations: ``flash_attention``'s.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> attn = rl.Attention(8, 2, rngs=nnx.Rngs(0))
      >>> attn(jnp.ones((1, 5, 8))).shape
      (1, 5, 8)
      >>> gqa = rl.Attention(16, 4, num_kv_heads=2, fused_qkv=False, rngs=nnx.Rngs(0))
      >>> gqa.q_proj.kernel.shape, gqa.k_proj.kernel.shape, gqa(jnp.ones((1, 5, 16))).shape
      ((16, 16), (16, 8), (1, 5, 16))
      >>> seg, pos = jnp.array([[1, 1, 1, 2, 2]]), jnp.array([[0, 1, 2, 0, 1]])
      >>> attn(jnp.ones((1, 5, 8)), segment_ids=seg, positions=pos).shape
      (1, 5, 8)
      >>> wide = rl.Attention(8, 2, head_dim=6, window=(2, 0), rngs=nnx.Rngs(0))
      >>> wide.qkv_proj.kernel.shape, wide.o_proj.kernel.shape
      ((8, 36), (12, 8))

    References:
      Vaswani et al., `Attention Is All You Need <https://arxiv.org/abs/1706.03762>`_, 2017;
      Ainslie et al., `GQA <https://arxiv.org/abs/2305.13245>`_, 2023;
      Dao, `FlashAttention-2 <https://arxiv.org/abs/2307.08691>`_, 2023.
    """

    def __init__(
        self,
        features: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        fused_qkv: bool = True,
        qkv_bias: bool = False,
        out_bias: bool = False,
        causal: bool = True,
        window: tuple[int, int] | None = None,
        softcap: float | None = None,
        rope_theta: float = 10000.0,
        rope_scaling: Llama3RopeScaling | None = None,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        kernel_init: nnx.Initializer = DEFAULT_INIT,
        out_init: nnx.Initializer = DEFAULT_INIT,
        impl: str = "auto",
        interpret: bool = False,
        block: rk.FlashAttentionBlock | None = None,
        rngs: nnx.Rngs,
    ):
        check_positive_int("features", features)
        check_positive_int("num_heads", num_heads)
        if head_dim is None:
            if features % num_heads or (features // num_heads) % 2:
                raise ValueError(
                    f"features must be a multiple of num_heads={num_heads} with an even "
                    f"quotient (RoPE rotates pairs of channels), got {features=}; or give "
                    "head_dim"
                )
            head_dim = features // num_heads
        else:
            check_positive_int("head_dim", head_dim)
            if head_dim % 2:
                raise ValueError(
                    f"head_dim must be even (RoPE rotates pairs of channels), got {head_dim=}"
                )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads={num_heads}, got {num_kv_heads=}")
        check_bool("fused_qkv", fused_qkv)
        check_bool("qkv_bias", qkv_bias)
        check_bool("out_bias", out_bias)
        check_bool("causal", causal)
        check_bool("interpret", interpret)
        if rope_scaling is not None and not isinstance(rope_scaling, Llama3RopeScaling):
            raise TypeError(
                f"rope_scaling must be None or a Llama3RopeScaling, got {rope_scaling=}"
            )
        if not isinstance(impl, str) or impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl=}")
        if block is not None and not isinstance(block, rk.FlashAttentionBlock):
            raise TypeError(
                f"block must be None or a rudax.kernels.FlashAttentionBlock, got {block=}"
            )
        self.window = _check_window(window)
        self.softcap = (
            None if softcap is None else check_positive("softcap", softcap, accept="static")
        )
        self.rope_theta = check_positive("rope_theta", rope_theta, accept="static")
        self.rope_scaling = rope_scaling
        self.features, self.num_heads, self.num_kv_heads = features, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.fused_qkv = fused_qkv
        # Python bools: the kernel takes its flags as jit static arguments, NumPy bools refused.
        self.causal, self.interpret = bool(causal), bool(interpret)
        self.impl, self.block = impl, block
        linear = lambda n_in, n_out, init, bias: Linear(
            n_in,
            n_out,
            use_bias=bias,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=init,
            rngs=rngs,
        )
        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        if fused_qkv:
            self.qkv_proj = linear(features, q_out + 2 * kv_out, kernel_init, qkv_bias)
        else:
            self.q_proj = linear(features, q_out, kernel_init, qkv_bias)
            self.k_proj = linear(features, kv_out, kernel_init, qkv_bias)
            self.v_proj = linear(features, kv_out, kernel_init, qkv_bias)
        self.o_proj = linear(q_out, features, out_init, out_bias)

    @property
    def projections(self) -> tuple[str, ...]:
        """The attribute names of the layer's projections, in their layout."""
        if self.fused_qkv:
            return ("qkv_proj", "o_proj")
        return ("q_proj", "k_proj", "v_proj", "o_proj")

    def __call__(
        self,
        x_BxTxD: ArrayLike,
        *,
        segment_ids: jax.Array | None = None,
        branch_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        x_BxTxD = jnp.asarray(x_BxTxD)
        check_features("Attention", x_BxTxD, self.features)
        if x_BxTxD.ndim != 3:
            raise ValueError(f"Attention expects x[B, T, d], got x.shape={x_BxTxD.shape}")
        b, t, _ = x_BxTxD.shape
        q, k, v = self.project(x_BxTxD)
        q, k = self.rope(q, positions), self.rope(k, positions)
        out = self.attend(q, k, v, segment_ids=segment_ids, branch_ids=branch_ids)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))

    def project(self, x_BxTxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``q[B, T, H, K]``, ``k[B, T, G, K]``, ``v[B, T, G, K]`` of ``x``: the projections
        split into heads (for a caller that keeps keys and values, as a KV cache does)."""
        b, t, _ = x_BxTxD.shape
        h, g, kd = self.num_heads, self.num_kv_heads, self.head_dim
        if not self.fused_qkv:
            q = self.q_proj(x_BxTxD).reshape(b, t, h, kd)
            k = self.k_proj(x_BxTxD).reshape(b, t, g, kd)
            v = self.v_proj(x_BxTxD).reshape(b, t, g, kd)
        elif g == h:
            qkv = self.qkv_proj(x_BxTxD).reshape(b, t, 3, h, kd)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q, k, v = jnp.split(self.qkv_proj(x_BxTxD), [h * kd, (h + g) * kd], axis=-1)
            q, k, v = q.reshape(b, t, h, kd), k.reshape(b, t, g, kd), v.reshape(b, t, g, kd)
        return q, k, v

    def rope(
        self, y: jax.Array, positions: jax.Array | None, *, table_size: int | None = None
    ) -> jax.Array:
        """``apply_rope`` of queries or keys at ``positions`` with the layer's theta and
        scaling (``table_size``: the rows of its table, for positions a cache bounds)."""
        return apply_rope(
            y,
            positions=positions,
            theta=self.rope_theta,
            scaling=self.rope_scaling,
            table_size=table_size,
        )

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, **masks: Any) -> jax.Array:
        """``rudax.kernels.flash_attention`` with the layer's mask, window, soft-cap and
        kernel settings; ``masks``: ``segment_ids`` and ``branch_ids``."""
        return rk.flash_attention(
            q,
            k,
            v,
            causal=self.causal,
            window=self.window,
            softcap=self.softcap,
            impl=self.impl,
            interpret=self.interpret,
            block=self.block,
            **masks,
        )


def _check_window(window: Any) -> tuple[int, int] | None:
    """None, or ``(left, right)`` as a tuple of two ints >= 0 (a static jit argument)."""
    if window is None:
        return None
    message = f"window must be None or a pair (left, right) of ints >= 0, got {window=}"
    if isinstance(window, str) or not isinstance(window, Sequence) or len(window) != 2:
        raise TypeError(message)
    for side in window:
        try:
            check_int("window", side)
        except TypeError:
            raise TypeError(message) from None
        if side < 0:
            raise ValueError(message)
    return int(window[0]), int(window[1])
