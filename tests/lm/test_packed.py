"""Packed rows (segment ids, per-token RoPE positions) in the GPT (issue 14); the labelled loss
of packed rows is ``rudax.models.causal_lm_loss_sum``'s (tests/models/test_loss.py).

The references are independent of the packing code: each example run alone, unpacked, by
the plain model (the same arithmetic per example, so the bound is a few fp32 ulps of the
logits); transformers' ``LlamaForCausalLM`` with torch's cross entropy and
``ignore_index=-100``; and one device for the FSDP form. Every model is tiny and fp32. The
layer's packed arithmetic (RoPE at given positions, segment-masked attention) is checked
against NumPy in tests/layers/test_attention.py and test_rope.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
from examples.lm.model import GPT, GPTConfig

V, T = 32, 16
F = jnp.float32
F32 = dict(param_dtype=F, dtype=F)
# One block (compiling dominates these tests) but for "dense", where a second block checks
# that every block gets the segments and positions.
TINY = dict(vocab_size=V, seq_len=T, d_model=16, n_layers=1, n_heads=2, mlp_hidden=32, **F32)
# head_dim 8 at theta 5e5: wavelengths 6.3, 167, 4.4e3, 1.2e5 against L / 4 = 64 and L = 256,
# so the rewrite keeps one frequency, blends one and divides two (as in tests/lm/test_hf.py).
LLAMA3 = rl.Llama3RopeScaling(8.0, 1.0, 4.0, 256)
CONFIGS = {
    "dense": dict(n_layers=2),
    "gqa": dict(n_heads=4, n_kv_heads=2, fused_qkv=False, tie_embeddings=False),
    "llama3": dict(n_kv_heads=1, rope_theta=5e5, rope_scaling=LLAMA3),
}
# A packed row: example a, example b (6 tokens each), 4 tokens of padding; the second row
# packs them the other way round, so each example sits at offsets 0 and 6. One length for
# both, so the two examples alone are one unpacked batch [2, 6] (one compilation).
A = B = 6


def _config(**overrides):
    return GPTConfig(**{**TINY, **overrides})


def _model(config, seed=0):
    """A GPT with every parameter N(0, 0.3): scores of a few units (GPT-2's N(0, 0.02) gives
    near-uniform attention, in which positions and masks hardly show). Built abstractly:
    an eager init compiles each of its ops, which costs more than the tests."""
    graph, state = nnx.split(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))
    leaves, tree = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype) for x in leaves]
    return nnx.merge(graph, jax.tree.unflatten(tree, leaves))


def _ids(n, seed):
    return np.random.default_rng(seed).integers(0, V, size=n, dtype=np.int32)


def _packed(a, b):
    """tokens, segment_ids, positions [2, T] of the rows [a b pad] and [b a pad]."""
    pad = T - len(a) - len(b)
    rows = [
        (np.concatenate([a, b, np.zeros(pad, np.int32)]), [len(a), len(b)]),
        (np.concatenate([b, a, np.zeros(pad, np.int32)]), [len(b), len(a)]),
    ]
    tokens = np.stack([r for r, _ in rows])
    seg = np.stack([np.repeat([1, 2, 0], [*n, pad]) for _, n in rows]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(k) for k in (*n, pad)]) for _, n in rows])
    return tokens, seg, pos.astype(np.int32) * (seg > 0)


_plain = nnx.jit(lambda model, tokens: model(tokens)[0])
_packed_logits = nnx.jit(lambda m, t, s, p: m(t, segment_ids=s, positions=p)[0])


# --------------------------------------------------------------------- the packed model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_packed_example_has_the_logits_it_has_alone(name):
    model = _model(_config(**CONFIGS[name]))
    a, b = _ids(A, 1), _ids(B, 2)
    tokens, seg, pos = _packed(a, b)
    got = np.asarray(_packed_logits(model, tokens, seg, pos))
    alone_a, alone_b = np.asarray(_plain(model, np.stack([a, b])))  # rows never interact
    scale = max(np.abs(alone_a).max(), np.abs(alone_b).max())
    # The same arithmetic per example up to summation order (other matmul and softmax
    # lengths; the masked keys add exact zeros): 1e-6 of the largest logit is ~8 fp32 ulps
    # of it (measured on CPU: <= 2.2e-7, under 2 ulps).
    for row, (first, second) in enumerate([(alone_a, alone_b), (alone_b, alone_a)]):
        n = len(first)
        np.testing.assert_allclose(got[row, :n], first, rtol=0, atol=1e-6 * scale)
        np.testing.assert_allclose(got[row, n : n + len(second)], second, rtol=0, atol=1e-6 * scale)
    assert np.isfinite(got).all()  # padding (segment 0) included
    # Without the segments (one sequence per row), b reads a: the mask is what separates them.
    unmasked = np.asarray(_packed_logits(model, tokens, np.ones_like(seg), pos))
    assert np.abs(unmasked[0, A : A + B] - alone_b).max() > 1e-2 * scale
    # RoPE sees only offsets within a segment, so restarting the positions shows in rounding
    # alone. Positions with gaps show that they reach RoPE in every block: b given positions
    # 0, 2, 4, ... equals b placed at 0, 2, 4, ... of a row (positions 0 .. T-1) with a
    # token of another segment in each gap, and differs from b at 0, 1, 2, ...
    spread = np.zeros((2, T), np.int32)
    spread[0, : 2 * B : 2], spread[0, 1 : 2 * B : 2] = b, _ids(B, 5)
    spread[1, :B] = b
    spread_seg = np.zeros((2, T), np.int32)
    spread_seg[0, : 2 * B] = np.where(np.arange(2 * B) % 2, np.arange(2 * B) + 2, 1)
    spread_seg[1, :B] = 1
    spread_pos = np.zeros((2, T), np.int32)
    spread_pos[0] = np.arange(T)
    spread_pos[1, :B] = 2 * np.arange(B)
    got = np.asarray(_packed_logits(model, spread, spread_seg, spread_pos))
    np.testing.assert_allclose(got[1, :B], got[0, : 2 * B : 2], rtol=0, atol=1e-6 * scale)
    assert np.abs(got[1, :B] - alone_b).max() > 1e-2 * scale


@pytest.mark.parametrize("name", ["dense", "llama3"])
def test_one_segment_at_positions_0_to_T_is_the_plain_call_bit_for_bit(name):
    # The packed path's RoPE reads rows of the plain path's constant table and its mask is
    # the causal mask: nothing differs, not even rounding (fp32 angles computed from the
    # positions would differ by ulps).
    model = _model(_config(**CONFIGS[name]))
    tokens = np.random.default_rng(3).integers(0, V, size=(2, T), dtype=np.int32)
    seg = np.ones((2, T), np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T))
    np.testing.assert_array_equal(
        np.asarray(_packed_logits(model, tokens, seg, pos)), np.asarray(_plain(model, tokens))
    )


def test_bad_segment_ids_or_positions_are_named():
    model = _model(_config())
    tokens = np.zeros((2, 8), np.int32)
    with pytest.raises(ValueError, match=r"segment_ids must have the tokens' shape.*\(2, 7\)"):
        model(tokens, segment_ids=np.zeros((2, 7), np.int32))
    with pytest.raises(
        TypeError, match=r"positions must hold integers, got positions\.dtype=float32"
    ):
        model.features(tokens, positions=np.zeros((2, 8), np.float32))
