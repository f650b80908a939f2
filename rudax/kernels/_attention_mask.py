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
    and kv_branch[s] in (0, q_branch[t])            (with branch ids)

Branch ids pack a shared prefix and its continuations into one row, ``[prefix, branch 1,
..., branch G]``: branch 0 is the prefix, which every branch sees; a branch sees no other
branch. Each branch then attends exactly as it would after its own copy of the prefix, with
one exception the row's indices cannot express: a window. A branch's distance to a prefix
key is shorter in its own copy than in the packed row (the other branches are not in
between), so with branches the window is measured on ``position``, each token's index in
the unshared layout (``unshared_positions``), and the index bounds a window gives (the key
blocks left of it) are not used to skip blocks; ``may_see`` skips them from the positions.

The bounds below are the blocks a query block's keys can come from (and the reverse). They
only use the positional rules; the ids skip a block at run time (``may_see``), since they
are data.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# The kinds of per-token ids a mask may read, in the order the paths pass them.
KINDS = ("segment", "branch", "position")


class Ids(NamedTuple):
    """One side's (the queries' or the keys') per-token ids, each ``[..., n]`` int32 or None.

    Attributes:
      segment: segment ids: tokens of different segments never see each other.
      branch: branch ids: 0 the segment's shared prefix, b > 0 one of its continuations.
      position: the tokens' indices in the unshared layout (only with branches and a window).
    """

    segment: jax.Array | None = None
    branch: jax.Array | None = None
    position: jax.Array | None = None

    def arrays(self) -> list[jax.Array]:
        """The ids present, in ``KINDS`` order (what the paths pass as flat arguments)."""
        return [x for x in self if x is not None]

    def map(self, fn) -> Ids:
        """``fn`` applied to each id array present."""
        return Ids(*(None if x is None else fn(x) for x in self))

    def slice(self, start: jax.Array, size: int) -> Ids:
        """Tokens ``[start, start + size)`` of ``[B, n]`` ids, along axis 1."""
        return self.map(lambda x: lax.dynamic_slice_in_dim(x, start, size, axis=1))


NO_IDS = Ids()


@dataclasses.dataclass(frozen=True)
class Mask:
    """The static part of the mask (hashable, part of the compiled program).

    Attributes:
      q_len: T, the number of real (unpadded) queries.
      kv_len: S, the number of real (unpadded) keys.
      causal: whether a query sees only keys at its position or before.
      window: None, or ``(left, right)``: a query at ``p`` sees keys in ``[p - left, p + right]``.
      segments: whether segment ids are passed.
      branches: whether branch ids are passed (then a window reads ``Ids.position``).
    """

    q_len: int
    kv_len: int
    causal: bool
    window: tuple[int, int] | None
    segments: bool = False
    branches: bool = False

    @property
    def offset(self) -> int:
        """``p(t) - t``: how far the queries' positions are shifted from their indices."""
        return self.kv_len - self.q_len

    @property
    def kinds(self) -> tuple[str, ...]:
        """The ids each side passes, in ``KINDS`` order."""
        positions = self.branches and self.window is not None
        present = (self.segments, self.branches, positions)
        return tuple(kind for kind, on in zip(KINDS, present, strict=True) if on)

    def ids(self, arrays) -> Ids:
        """The ``Ids`` of one side from its arrays in ``kinds`` order (``Ids.arrays``' inverse)."""
        found = dict(zip(self.kinds, arrays, strict=True))
        return Ids(*(found.get(kind) for kind in KINDS))

    def visible(
        self, q_index: jax.Array, kv_index: jax.Array, q: Ids = NO_IDS, kv: Ids = NO_IDS
    ) -> jax.Array:
        """The boolean mask ``[..., Q, K]`` of query indices ``[Q]`` against key indices ``[K]``.

        With ids (``[..., Q]`` and ``[..., K]``, the same leading shape) the result has their
        leading shape; without, it is ``[Q, K]``.
        """
        pos = (q_index + self.offset)[:, None]
        s = kv_index[None, :]
        ok = (s < self.kv_len) & (q_index[:, None] < self.q_len)
        if self.causal:
            ok = ok & (s <= pos)
        if self.window is not None:
            left, right = self.window
            if self.branches:
                assert q.position is not None and kv.position is not None
                pos, s = q.position[..., :, None], kv.position[..., None, :]
            ok = ok & (s >= pos - left) & (s <= pos + right)
        if self.segments:
            assert q.segment is not None and kv.segment is not None
            ok = ok & (q.segment[..., :, None] == kv.segment[..., None, :])
        if self.branches:
            assert q.branch is not None and kv.branch is not None
            kb = kv.branch[..., None, :]
            ok = ok & ((kb == 0) | (kb == q.branch[..., :, None]))
        return ok

    def may_see(self, q: Ids, kv: Ids) -> jax.Array | None:
        """False only if no query of a block can see a key of another, from their ids.

        A cheap, conservative test (ids need not be sorted): when it says False, the block's
        mask is all False and the block is skipped; when True, the mask decides. None
        without ids: nothing to test, the block runs. Segments must overlap as ranges; a
        key block of branches holds the prefix (0) or overlaps the queries' branches (a
        branch-3 query block skips the key blocks of branches 1, 2 and 4); with a window on
        positions, the keys' last position reaches the queries' first minus ``left``.
        """
        tests = []
        if self.segments:
            tests.append(_ranges_overlap(q.segment, kv.segment))
        if self.branches:
            assert kv.branch is not None
            tests.append((jnp.min(kv.branch) == 0) | _ranges_overlap(q.branch, kv.branch))
            if self.window is not None:
                assert q.position is not None and kv.position is not None
                tests.append(jnp.max(kv.position) >= jnp.min(q.position) - self.window[0])
        if not tests:
            return None
        pred = tests[0]
        for test in tests[1:]:
            pred = pred & test
        return pred

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
            if not self.branches:  # with branches the window is on positions, not indices
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
            if not self.branches:  # p - left <= s, on indices only without branches
                end_q = jnp.minimum(end_q, last_key + left - self.offset + 1)
        first = _floor_div(jnp.clip(start_q, 0, self.q_len), q_block)
        end = _ceil_div(jnp.clip(end_q, 0, self.q_len), q_block)
        return first, jnp.maximum(first, end)


def _ranges_overlap(a: jax.Array | None, b: jax.Array | None) -> jax.Array:
    """Whether ``[min(a), max(a)]`` and ``[min(b), max(b)]`` intersect."""
    assert a is not None and b is not None
    return (jnp.min(b) <= jnp.max(a)) & (jnp.max(b) >= jnp.min(a))


def unshared_positions(segment: jax.Array | None, branch: jax.Array) -> jax.Array:
    """Each token's index in the unshared layout of its segment, ``[B, T]`` int32.

    A prefix token (branch 0) keeps its rank among its segment's prefix tokens; a token of
    branch ``b`` is at ``P + r``, ``P`` its segment's prefix length and ``r`` its rank in
    branch ``b``: where it would be after its own copy of the prefix. Within a segment,
    differences of these positions are the unshared layout's distances, which is all a window
    compares. Computed by one stable sort of each row by (segment, branch): O(T log T).

    Assumes each segment's prefix tokens come before its branches' (``flash_attention``
    checks it when the ids are concrete).
    """
    seg = jnp.zeros_like(branch) if segment is None else segment

    def row(seg_T: jax.Array, br_T: jax.Array) -> jax.Array:
        t = br_T.shape[0]
        order = jnp.lexsort((br_T, seg_T))  # by segment, then branch; stable: index order
        s, b = seg_T[order], br_T[order]
        index = jnp.arange(t, dtype=jnp.int32)
        first = jnp.ones((1,), bool)
        new_seg = jnp.concatenate([first, s[1:] != s[:-1]])
        new_group = new_seg | jnp.concatenate([first, b[1:] != b[:-1]])
        rank = index - lax.cummax(jnp.where(new_group, index, 0))
        seg_start = lax.cummax(jnp.where(new_seg, index, 0))
        # Prefix tokens of the segment up to here, inclusive; for a branch token, all of them.
        prefix = jnp.cumsum(b == 0, dtype=jnp.int32)
        prefix = prefix - prefix[seg_start] + (b[seg_start] == 0).astype(jnp.int32)
        sorted_pos = jnp.where(b == 0, rank, prefix + rank)
        return jnp.zeros((t,), jnp.int32).at[order].set(sorted_pos)

    return jax.vmap(row)(seg.astype(jnp.int32), branch.astype(jnp.int32))


def _floor_div(x: jax.Array, d: int) -> jax.Array:
    # x >= 0 here, where truncation is floor; lax.div lowers inside Triton kernels, where
    # jnp's floor_divide (its sign fix-up) does not.
    return lax.div(x, jnp.int32(d))


def _ceil_div(x: jax.Array, d: int) -> jax.Array:
    return lax.div(x + jnp.int32(d - 1), jnp.int32(d))
