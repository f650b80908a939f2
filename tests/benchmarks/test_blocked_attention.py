"""benchmarks/_blocked_attention.py, the flash-attention benchmark's baseline, against NumPy.

The baseline is the GPT's attention before ``rudax.kernels.flash_attention``: it must still
compute attention for the comparison to mean anything. Tiny shapes, a plain float64 masked
softmax as the reference; every block size (a ragged last block too), GQA and packed rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks._blocked_attention import causal_attention

_attend = jax.jit(causal_attention, static_argnames="query_block")


def _normal(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _np_attention(q, k, v, seg=None):
    """Plain masked softmax attention; key s visible to query t iff s <= t (same segment)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    scores = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    t = q.shape[1]
    mask = np.broadcast_to(np.tril(np.ones((t, t), bool)), (q.shape[0], t, t))
    if seg is not None:
        mask = mask & (seg[:, :, None] == seg[:, None, :])
    scores = np.where(mask[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bshk->bthk", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("query_block", [1, 2, 3, 5])
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
def test_matches_numpy_for_every_query_block(query_block, kv_heads):
    # Query blocks attend only to the keys up to their last row: the same arithmetic as the
    # full masked softmax, whatever the block size (3 leaves a ragged last block).
    q, k, v = (
        _normal(2, 5, 2, 4, seed=0),
        _normal(2, 5, kv_heads, 4, seed=1),
        _normal(2, 5, kv_heads, 4, seed=2),
    )
    got = _attend(q, k, v, query_block=query_block)
    np.testing.assert_allclose(np.asarray(got), _np_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_is_jaxs_own_causal_attention():
    q, k, v = (_normal(2, 5, 2, 4, seed=i) for i in range(3))
    ours, jax_own = jax.jit(
        lambda *a: (causal_attention(*a), jax.nn.dot_product_attention(*a, is_causal=True))
    )(q, k, v)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(jax_own), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("query_block", "kv_heads"), [(4, 2), (3, 4), (16, 2)], ids=["4-gqa", "3-mha", "one-block-gqa"]
)
def test_segments_match_numpy_in_every_block_size(query_block, kv_heads):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 11, 4, 4)).astype(np.float32) * 2
    k, v = (rng.standard_normal((3, 11, kv_heads, 4)).astype(np.float32) * 2 for _ in range(2))
    seg = np.array(
        [
            [1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0],  # segments crossing the blocks' edges
            [1] * 11,
            [0] * 11,  # all padding: attends to itself, finite
        ],
        np.int32,
    )
    got = np.asarray(_attend(q, k, v, segment_ids=seg, query_block=query_block))
    np.testing.assert_allclose(got, _np_attention(q, k, v, seg), rtol=1e-5, atol=1e-6)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_query_block_is_named(bad):
    x = jnp.ones((1, 4, 1, 4))
    with pytest.raises((TypeError, ValueError), match="query_block"):
        causal_attention(x, x, x, query_block=bad)


def test_bad_shapes_and_segments_are_named():
    with pytest.raises(ValueError, match=r"kv_heads dividing heads.*k.shape=\(1, 2, 3, 4\)"):
        causal_attention(jnp.ones((1, 2, 4, 4)), jnp.ones((1, 2, 3, 4)), jnp.ones((1, 2, 3, 4)))
    with pytest.raises(ValueError, match=r"kv_heads dividing heads, got q.shape.*k.shape"):
        causal_attention(jnp.ones((1, 2, 1, 4)), jnp.ones((1, 3, 1, 4)), jnp.ones((1, 3, 1, 4)))
    x = jnp.ones((1, 4, 1, 4))
    with pytest.raises(TypeError, match=r"segment_ids must be integers, got segment_ids\.dtype=f"):
        causal_attention(x, x, x, segment_ids=jnp.ones((1, 4)))
