"""rudax.layers' RoPE (apply_rope, rope_frequencies, Llama3RopeScaling) against NumPy.

The references rotate each channel pair in float64, at positions 0 .. T-1 or at given ones,
and rewrite the frequencies by Llama 3.1's published rule one at a time. transformers' own
RoPE is compared through whole models in tests/models/test_hf_logits.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.layers as rl
from tests.optim._bad_input import rejects

# head_dim 8 at theta 5e5: wavelengths 6.3, 167, 4.4e3, 1.2e5 against L / 4 = 64 and L = 256,
# so the rewrite keeps one frequency, blends one and divides two (as in
# tests/models/test_hf_logits.py).
LLAMA3 = rl.Llama3RopeScaling(8.0, 1.0, 4.0, 256)


def _normal(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _np_rope(x, theta, freqs=None):
    """Rotates each channel pair (i, i + K/2) at position t by t * theta**(-2i/K) (or freqs[i])."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    half = x.shape[-1] // 2
    for t in range(x.shape[1]):
        for i in range(half):
            a = t * (theta ** (-2.0 * i / x.shape[-1]) if freqs is None else freqs[i])
            rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
            pair = np.stack([x[:, t, :, i], x[:, t, :, i + half]], axis=-1)  # [B, H, 2]
            out[:, t, :, i], out[:, t, :, i + half] = np.moveaxis(pair @ rot.T, -1, 0)
    return out


def _np_rope_at(x, positions, freqs):
    """Rotates channel pair (i, i + K/2) of token (b, t) by positions[b, t] * freqs[i]."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    a = np.asarray(positions, np.float64)[:, :, None, None] * np.asarray(freqs)  # [B, T, 1, K/2]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], -1)


def test_rope_is_a_rotation_by_position_and_scores_depend_on_offsets_only():
    rope = jax.jit(rl.apply_rope, static_argnames="theta")
    x = _normal(3, 6, 3, 8)
    got = np.asarray(rope(x, theta=100.0))
    np.testing.assert_allclose(got, _np_rope(x, 100.0), rtol=1e-5, atol=1e-6)
    # One query and one key repeated at every position: q_t . k_s depends on t - s alone.
    same = np.concatenate([np.repeat(x[:1, :1], 6, axis=1), np.repeat(x[1:2, :1], 6, axis=1)])
    qk = np.asarray(rope(np.concatenate([same, x[2:]]), theta=10000.0))
    scores = np.einsum("thk,shk->hts", qk[0], qk[1])
    for offset in range(-5, 6):
        diag = np.diagonal(scores, offset=offset, axis1=1, axis2=2)
        np.testing.assert_allclose(diag, diag[:, :1].repeat(diag.shape[1], 1), rtol=1e-4)
    assert rope(x.astype(jnp.bfloat16), theta=100.0).dtype == jnp.bfloat16


def test_llama3_rope_rewrites_the_frequencies_by_wavelength():
    # Llama 3.1's published rule, one frequency at a time (its paper's code, in words).
    scaling = rl.Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    want = []
    for i in range(8):
        f = 500.0 ** (-2.0 * i / 16)
        wavelength = 2 * np.pi / f
        if wavelength < 64 / 4.0:
            want.append(f)
        elif wavelength > 64 / 1.0:
            want.append(f / 8.0)
        else:
            smooth = (64 / wavelength - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * f / 8.0 + smooth * f)
    got = rl.rope_frequencies(16, theta=500.0, scaling=scaling)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    plain = rl.rope_frequencies(16, theta=500.0)
    kept, divided = got == plain, np.isclose(got, plain / 8.0)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three branches
    x = _normal(2, 6, 3, 16)
    y = jax.jit(lambda x: rl.apply_rope(x, theta=500.0, scaling=scaling))(x)
    np.testing.assert_allclose(np.asarray(y), _np_rope(x, 500.0, want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_rope_at_given_positions_matches_numpy(scaling):
    x = np.random.default_rng(0).standard_normal((2, 6, 3, 8)).astype(np.float32)
    positions = np.array([[0, 1, 2, 0, 1, 5], [3, 0, 4, 4, 2, 1]], np.int32)
    rope = jax.jit(lambda x, p: rl.apply_rope(x, positions=p, theta=5e5, scaling=scaling))
    got = np.asarray(rope(x, positions))
    want = _np_rope_at(x, positions, rl.rope_frequencies(8, theta=5e5, scaling=scaling))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Outside [0, T): that token's rotation is NaN, never another position's; the rest stands.
    bad = positions.copy()
    bad[0, 1], bad[1, 4] = 6, -1
    out = np.asarray(rope(x, bad))
    assert np.isnan(out[0, 1]).all() and np.isnan(out[1, 4]).all()
    ok = np.ones((2, 6), bool)
    ok[0, 1] = ok[1, 4] = False
    np.testing.assert_array_equal(out[ok], got[ok])
    # Positions 0 .. T-1 given explicitly rotate bit for bit as no positions do: both read
    # rows of one float64 table, never fp32 angles computed from the positions.
    arange = np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6))
    plain = jax.jit(lambda x: rl.apply_rope(x, theta=5e5, scaling=scaling))(x)
    np.testing.assert_array_equal(np.asarray(rope(x, arange)), np.asarray(plain))


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="scaling must be None or a Llama3RopeScaling"):
        rl.rope_frequencies(8, scaling=(8.0, 1.0, 4.0, 8192))
    with pytest.raises(ValueError, match=r"even head_dim, got x.shape=\(1, 2, 1, 3\)"):
        rl.apply_rope(jnp.ones((1, 2, 1, 3)))
    with pytest.raises(ValueError, match=r"even head_dim, got x.shape=\(2, 4\)"):
        rl.apply_rope(jnp.ones((2, 4)))
    x = jnp.ones((1, 5, 1, 4))
    with pytest.raises(ValueError, match=r"positions must be \[batch, time\] = \(1, 5\)"):
        rl.apply_rope(x, positions=np.zeros((5,), np.int32))
    with pytest.raises(TypeError, match=r"positions must be integers, got positions.dtype=float"):
        rl.apply_rope(x, positions=np.zeros((1, 5), np.float32))


test_bad_llama3_scaling = rejects(
    rl.Llama3RopeScaling,
    [
        ({"factor": 0.0}, ValueError, "factor must be a finite number > 0"),
        ({"low_freq_factor": -1.0}, ValueError, "low_freq_factor must be a finite number > 0"),
        ({"high_freq_factor": 1.0}, ValueError, "high_freq_factor must be > low_freq_factor"),
        ({"factor": "8"}, TypeError, "factor must be a real number"),
        (
            {"original_max_position_embeddings": 0},
            ValueError,
            "original_max_position_embeddings must be a positive int",
        ),
        (
            {"original_max_position_embeddings": 8192.0},
            TypeError,
            "original_max_position_embeddings must be an int",
        ),
    ],
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def test_table_size_rotates_positions_past_t_as_a_longer_row_does():
    # A KV cache's new token sits at a position past its own count (T = 1).
    x = jax.random.normal(jax.random.key(0), (2, 12, 3, 8))
    full = rl.apply_rope(x)
    pos = jnp.array([[11], [7]])
    one = rl.apply_rope(x[jnp.arange(2), pos[:, 0]][:, None], positions=pos, table_size=12)
    np.testing.assert_array_equal(one[:, 0], full[jnp.arange(2), pos[:, 0]])
    # past the table: NaN, never another position's rotation
    far = rl.apply_rope(x[:, :1], positions=jnp.array([[12], [0]]), table_size=12)
    assert bool(jnp.all(jnp.isnan(far[0]))) and not bool(jnp.any(jnp.isnan(far[1])))
    with pytest.raises(ValueError, match="table_size=4 needs positions"):
        rl.apply_rope(x, table_size=4)
    with pytest.raises(ValueError, match="table_size"):
        rl.apply_rope(x, positions=jnp.zeros((2, 12), jnp.int32), table_size=0)
