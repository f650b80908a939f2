"""Which keys a query sees, and which blocks of keys (or queries) can be skipped.

One ``Mask`` describes attention's visibility for every path of ``flash_attention``: the XLA
chunks and the Pallas kernels call the same functions, so they cannot disagree on a mask.

Positions: key ``s`` is at position ``s``; query ``t`` at ``p(t) = t + kv_len - q_len``, the
T queries being the last T of the S positions (bottom-right alignment, flash-attn's since
2.1): with a KV cache, the new tokens' queries follow the cached keys. Query ``t`` sees key
``s`` iff::

    t < q_len and s < kv_len                        (padding neither sees nor is seen)
    and (not causal or s <= p(t))
    and (window is None or p(t) - left <= s <= p(t) + right)
    and q_segment[t] == kv_segment[s]               (with segment ids)

The bounds below are the blocks a query block's keys can come from (and the reverse). They
only use the positional rules; segment ids skip a block at run time (``segments_overlap``),
since they are data.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Mask:
    """The positional part of the mask; static (hashable), part of the compiled program.

    Attributes:
      q_len: T, the number of real (unpadded) queries.
      kv_len: S, the number of real (unpadded) keys.
      causal: whether a query sees only keys at its position or before.
      window: None, or ``(left, right)``: a query at ``p`` sees keys in ``[p - left, p + right]``.
    """

    q_len: int
    kv_len: int
    causal: bool
    window: tuple[int, int] | None

    @property
    def offset(self) -> int:
        """``p(t) - t``: how far the queries' positions are shifted from their indices."""
        return self.kv_len - self.q_len

    def visible(
        self,
        q_index: jax.Array,
        kv_index: jax.Array,
        q_segment: jax.Array | None = None,
        kv_segment: jax.Array | None = None,
    ) -> jax.Array:
        """The boolean mask ``[..., Q, K]`` of query indices ``[Q]`` against key indices ``[K]``.

        With segments (``[..., Q]`` and ``[..., K]``, the same leading shape) the result has
        their leading shape; without, it is ``[Q, K]``.
        """
        pos = (q_index + self.offset)[:, None]
        s = kv_index[None, :]
        ok = (s < self.kv_len) & (q_index[:, None] < self.q_len)
        if self.causal:
            ok = ok & (s <= pos)
        if self.window is not None:
            left, right = self.window
            ok = ok & (s >= pos - left) & (s <= pos + right)
        if q_segment is None:
            return ok
        assert kv_segment is not None
        return ok & (q_segment[..., :, None] == kv_segment[..., None, :])

    def kv_blocks(self, q_start: jax.Array, q_block: int, kv_block: int) -> tuple[jax.Array, ...]:
        """``(first, end)``: the key blocks queries ``[q_start, q_start + q_block)`` may see.

        Every key outside blocks ``[first, end)`` is invisible to all of these queries; the
        range may be empty (``end <= first``), e.g. for queries left of every key.
        """
        q_start = jnp.asarray(q_start, jnp.int32)
        first_pos = q_start + self.offset
        last_pos = first_pos + (q_block - 1)
        end_key = jnp.int32(self.kv_len)  # one past the last key that may be seen
        if self.causal:
            end_key = jnp.minimum(end_key, last_pos + 1)
        start_key = jnp.int32(0)
        if self.window is not None:
            left, right = self.window
            end_key = jnp.minimum(end_key, last_pos + right + 1)
            start_key = jnp.maximum(start_key, first_pos - left)
        first = _floor_div(jnp.clip(start_key, 0, self.kv_len), kv_block)
        end = _ceil_div(jnp.clip(end_key, 0, self.kv_len), kv_block)
        return first, jnp.maximum(first, end)

    def q_blocks(self, kv_start: jax.Array, kv_block: int, q_block: int) -> tuple[jax.Array, ...]:
        """``(first, end)``: the query blocks that may see keys ``[kv_start, kv_start + kv_block)``.

        Only real queries (``t < q_len``) are counted: padded query rows are left out.
        """
        kv_start = jnp.asarray(kv_start, jnp.int32)
        last_key = kv_start + (kv_block - 1)
        start_q = jnp.int32(0)  # the first query index that may see one of these keys
        end_q = jnp.int32(self.q_len)
        if self.causal:  # p(t) >= kv_start
            start_q = jnp.maximum(start_q, kv_start - self.offset)
        if self.window is not None:
            left, right = self.window
            start_q = jnp.maximum(start_q, kv_start - right - self.offset)  # p + right >= s
            end_q = jnp.minimum(end_q, last_key + left - self.offset + 1)  # p - left <= s
        first = _floor_div(jnp.clip(start_q, 0, self.q_len), q_block)
        end = _ceil_div(jnp.clip(end_q, 0, self.q_len), q_block)
        return first, jnp.maximum(first, end)


def segments_overlap(q_segment: jax.Array | None, kv_segment: jax.Array | None) -> jax.Array | None:
    """False only if no query id of the block can equal a key id: disjoint ``[min, max]``.

    A cheap, conservative test (ids need not be sorted): when it says False, the block's mask
    is all False and the block is skipped; when True, the mask decides. None without segment
    ids: nothing to test, the block runs.
    """
    if q_segment is None or kv_segment is None:
        return None
    return (jnp.min(kv_segment) <= jnp.max(q_segment)) & (jnp.max(kv_segment) >= jnp.min(q_segment))


def _floor_div(x: jax.Array, d: int) -> jax.Array:
    # x >= 0 here, where truncation is floor; lax.div lowers inside Triton kernels, where
    # jnp's floor_divide (its sign fix-up) does not.
    return lax.div(x, jnp.int32(d))


def _ceil_div(x: jax.Array, d: int) -> jax.Array:
    return lax.div(x + jnp.int32(d - 1), jnp.int32(d))
