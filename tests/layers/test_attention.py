"""rudax.layers.Attention against a plain computation written here.

The reference is the layer's definition spelled out in float64 NumPy: the projections (with
their biases), RoPE at each token's position, then softmax attention over the visible keys
(causal, the same segment, inside the window), scores soft-capped when asked. It covers
multi-head and grouped-query attention in both projection layouts, packed rows and a
``head_dim`` of its own. The kernel itself (blocks, gradients, every impl) is tested in
tests/kernels/test_flash_attention.py; the whole GPT against transformers in tests/lm.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.kernels as rk
import rudax.layers as rl
from tests.optim._bad_input import rejects

F = jnp.float32
D, H, T = 16, 4, 9
# Two examples packed in one row, the second at positions with a gap, then padding (its own
# segment, 0); the second row is one sequence at positions 0 .. T-1.
SEG = np.array([[1, 1, 1, 1, 2, 2, 2, 0, 0], [5] * T], np.int32)
POS = np.array([[0, 1, 2, 3, 0, 1, 3, 0, 1], list(range(T))], np.int32)


def _layer(*, seed=0, **kwargs):
    """An Attention with every kernel and bias N(0, 0.5): scores of a few units, so that
    positions and masks show (GPT-2's N(0, 0.02) gives near-uniform attention)."""
    layer = rl.Attention(D, H, rope_theta=50.0, rngs=nnx.Rngs(0), **kwargs)
    rng = np.random.default_rng(seed)
    for name in layer.projections:
        proj = getattr(layer, name)
        proj.kernel.set_value(jnp.asarray(0.5 * rng.standard_normal(proj.kernel.shape), F))
        if proj.bias is not None:
            proj.bias.set_value(jnp.asarray(0.5 * rng.standard_normal(proj.bias.shape), F))
    return layer


def _x(b=2, seed=1):
    return np.random.default_rng(seed).standard_normal((b, T, D)).astype(np.float32)


def _np_rope(x, positions, theta):
    """Rotates channel pair (i, i + K/2) of token (b, t) by positions[b, t] * theta**(-2i/K)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-np.arange(half, dtype=np.float64) * 2 / x.shape[-1])
    a = np.asarray(positions, np.float64)[:, :, None, None] * freqs  # [B, T, 1, K/2]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], -1)


def _np_layer(layer, x, seg=None, pos=None):
    """The layer's output, float64: projections, RoPE, masked softmax attention, ``out``."""
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    h, g, kd = layer.num_heads, layer.num_kv_heads, layer.head_dim
    w = lambda p: np.asarray(p.kernel.get_value(), np.float64)
    bias = lambda p: 0.0 if p.bias is None else np.asarray(p.bias.get_value(), np.float64)
    if layer.fused_qkv:
        qkv = x @ w(layer.qkv_proj) + bias(layer.qkv_proj)
        q, k, v = np.split(qkv, [h * kd, (h + g) * kd], axis=-1)
    else:
        q, k, v = (x @ w(p) + bias(p) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    q, k, v = q.reshape(b, t, h, kd), k.reshape(b, t, g, kd), v.reshape(b, t, g, kd)
    pos = np.broadcast_to(np.arange(t), (b, t)) if pos is None else pos
    q, k = _np_rope(q, pos, layer.rope_theta), _np_rope(k, pos, layer.rope_theta)
    # Query head i reads key/value head i // (H / G), transformers' repeat_kv.
    k, v = np.repeat(k, h // g, axis=2), np.repeat(v, h // g, axis=2)
    scores = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(kd)
    if layer.softcap is not None:
        scores = layer.softcap * np.tanh(scores / layer.softcap)
    ts, ss = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = np.ones((b, t, t), bool)
    if layer.causal:
        visible &= ss <= ts
    if layer.window is not None:
        left, right = layer.window
        visible &= (ss >= ts - left) & (ss <= ts + right)
    if seg is not None:
        visible &= seg[:, :, None] == seg[:, None, :]
    scores = np.where(visible[:, None], scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    p = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = p.sum(-1, keepdims=True)
    p = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)  # no key seen: zeros
    heads = np.einsum("bhts,bshk->bthk", p, v).reshape(b, t, h * kd)
    return heads @ w(layer.o_proj) + bias(layer.o_proj)


_run = nnx.jit(lambda layer, x, s, p: layer(x, segment_ids=s, positions=p))
_plain = nnx.jit(lambda layer, x: layer(x))


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


LAYOUTS = {
    "mha-fused": dict(),
    "mha-separate": dict(fused_qkv=False),
    "gqa-fused": dict(num_kv_heads=2, qkv_bias=True),
    "gqa-separate": dict(num_kv_heads=2, fused_qkv=False, qkv_bias=True, out_bias=True),
    "mqa-head-dim-6": dict(num_kv_heads=1, head_dim=6),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matches_the_plain_computation_packed_and_not(name):
    layer = _layer(**LAYOUTS[name])
    x = _x()
    got = _run(layer, x, SEG, POS)
    assert got.shape == (2, T, D) and got.dtype == F
    _close(got, _np_layer(layer, x, SEG, POS))
    _close(_plain(layer, x), _np_layer(layer, x))


def test_compiles_once_per_shape():
    graph, state = nnx.split(_layer(num_kv_heads=2))
    run = jax.jit(lambda s, x, seg, pos: nnx.merge(graph, s)(x, segment_ids=seg, positions=pos))
    first = run(state, _x(), SEG, POS)
    second = run(state, _x(seed=2), SEG, POS[::-1])
    assert run._cache_size() == 1 and not np.array_equal(first, second)


def test_projection_shapes_and_names_follow_the_layout():
    fused = rl.Attention(D, H, num_kv_heads=2, qkv_bias=True, rngs=nnx.Rngs(0))
    assert fused.projections == ("qkv_proj", "o_proj") and fused.head_dim == 4
    assert fused.qkv_proj.kernel.shape == (D, (H + 2 * 2) * 4)
    assert fused.qkv_proj.bias.shape == (32,)
    assert fused.o_proj.kernel.shape == (H * 4, D) and fused.o_proj.bias is None
    wide = rl.Attention(D, H, num_kv_heads=2, head_dim=8, fused_qkv=False, rngs=nnx.Rngs(0))
    assert wide.projections == ("q_proj", "k_proj", "v_proj", "o_proj") and wide.q_proj.bias is None
    assert wide.q_proj.kernel.shape == (D, 32) and wide.k_proj.kernel.shape == (D, 16)
    assert wide.v_proj.kernel.shape == (D, 16) and wide.o_proj.kernel.shape == (32, D)
    assert not hasattr(wide, "qkv_proj") and not hasattr(fused, "q_proj")
    bf16 = rl.Attention(D, H, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert bf16.qkv_proj.kernel.dtype == F and bf16(jnp.ones((1, 3, D), F)).dtype == jnp.bfloat16


def _bites(layer, t=T):
    """[T, T]: the keys the option hides that the plain causal layer would show."""
    ts, ss = np.arange(t)[:, None], np.arange(t)[None, :]
    shown = np.ones((t, t), bool) if not layer.causal else ss <= ts
    if layer.window is not None:
        shown &= (ss >= ts - layer.window[0]) & (ss <= ts + layer.window[1])
    return (ss <= ts) & ~shown, shown & ~(ss <= ts)


@pytest.mark.parametrize(
    "options",
    [
        dict(window=(2, 0)),
        dict(window=(3, 1)),
        dict(causal=False),
        dict(causal=False, window=(1, 2)),
    ],
    ids=["window-2-0", "window-3-1", "not-causal", "not-causal-window-1-2"],
)
def test_a_mask_option_changes_exactly_the_rows_it_bites(options):
    plain, layer = _layer(num_kv_heads=2), _layer(num_kv_heads=2, **options)
    x = _x()
    want = _np_layer(layer, x)
    got = np.asarray(_plain(layer, x))
    _close(got, want)
    hidden, added = _bites(layer)
    bitten = (hidden | added).any(axis=1)  # query rows whose visible keys change
    assert bitten.any()
    base = np.asarray(_plain(plain, x))
    scale = np.abs(base).max()
    # Rows the option leaves alone: the same keys, the same softmax (masked keys add exact
    # zeros), so the same output up to the order of a few fp32 sums.
    np.testing.assert_allclose(got[:, ~bitten], base[:, ~bitten], rtol=0, atol=1e-6 * scale)
    # Every bitten row moves, in every batch row.
    moved = np.abs(got - base).max(axis=-1)  # [B, T]
    assert (moved[:, bitten] > 1e-3 * scale).all(), moved


def test_softcap_reaches_the_kernel():
    plain, capped = _layer(num_kv_heads=2), _layer(num_kv_heads=2, softcap=1.5)
    x = _x()
    got = np.asarray(_run(capped, x, SEG, POS))
    _close(got, _np_layer(capped, x, SEG, POS))
    base = np.asarray(_run(plain, x, SEG, POS))
    scale = np.abs(base).max()
    # A query that sees one key gives that key's value whatever the scores: the first token
    # of each segment. Every other row moves.
    first = np.zeros(SEG.shape, bool)
    first[:, 0] = True
    first[:, 1:] = SEG[:, 1:] != SEG[:, :-1]
    np.testing.assert_allclose(got[first], base[first], rtol=0, atol=1e-6 * scale)
    assert (np.abs(got - base).max(axis=-1)[~first] > 1e-3 * scale).all()


def test_the_options_are_passed_to_the_kernel(monkeypatch):
    calls = []
    kernel = rk.flash_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(rk, "flash_attention", spy)
    block = rk.FlashAttentionBlock(q=16, kv=16, q_backward=16, kv_backward=16, xla_q=4, xla_kv=4)
    layer = rl.Attention(
        D, H, causal=False, window=(3, 1), softcap=2.0, impl="xla", block=block, rngs=nnx.Rngs(0)
    )
    seg = jnp.asarray(SEG)
    layer(jnp.ones((2, T, D), F), segment_ids=seg, positions=jnp.asarray(POS))
    (kwargs,) = calls
    assert kwargs.pop("segment_ids") is seg
    assert kwargs.pop("branch_ids") is None
    assert kwargs == dict(
        causal=False, window=(3, 1), softcap=2.0, impl="xla", interpret=False, block=block
    )


def test_bad_call_is_named():
    layer = rl.Attention(8, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"positions must be \[batch, time\] = \(1, 5\)"):
        layer(jnp.ones((1, 5, 8)), positions=np.zeros((5,), np.int32))
    with pytest.raises(ValueError, match=r"Attention expects x.shape\[-1\] == 8.*\(1, 5, 6\)"):
        layer(jnp.ones((1, 5, 6)))
    with pytest.raises(ValueError, match=r"Attention expects x\[B, T, d\], got x.shape=\(5, 8\)"):
        layer(jnp.ones((5, 8)))
    with pytest.raises(TypeError, match=r"Attention expects a floating input"):
        layer(jnp.ones((1, 5, 8), jnp.int32))
    with pytest.raises(TypeError, match="segment_ids"):
        layer(jnp.ones((1, 5, 8)), segment_ids=jnp.ones((1, 5)))


test_bad_arguments = rejects(
    rl.Attention,
    [
        ({"features": 0}, ValueError, "features must be a positive int, got features=0"),
        ({"num_heads": 2.0}, TypeError, "num_heads must be an int, got num_heads=2.0"),
        ({"features": 12}, ValueError, "features must be a multiple of num_heads=4.*features=12"),
        ({"features": 20}, ValueError, "even quotient .*features=20"),
        ({"head_dim": 3}, ValueError, "head_dim must be even .*head_dim=3"),
        ({"head_dim": 0}, ValueError, "head_dim must be a positive int, got head_dim=0"),
        (
            {"num_kv_heads": 3},
            ValueError,
            "num_kv_heads must divide num_heads=4, got num_kv_heads=3",
        ),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be a positive int"),
        ({"fused_qkv": 1}, TypeError, "fused_qkv must be a bool, got fused_qkv=1"),
        ({"qkv_bias": None}, TypeError, "qkv_bias must be a bool"),
        ({"out_bias": 1}, TypeError, "out_bias must be a bool"),
        ({"causal": "yes"}, TypeError, "causal must be a bool, got causal='yes'"),
        ({"window": 4}, TypeError, r"window must be None or a pair \(left, right\).*window=4"),
        ({"window": (1, 2, 3)}, TypeError, r"window must be .*window=\(1, 2, 3\)"),
        ({"window": (-1, 0)}, ValueError, r"ints >= 0, got window=\(-1, 0\)"),
        ({"window": (1.0, 0)}, TypeError, r"ints >= 0, got window=\(1.0, 0\)"),
        ({"softcap": 0.0}, ValueError, "softcap must be a finite number > 0, got softcap=0.0"),
        ({"softcap": "1"}, TypeError, "softcap must be a real number"),
        ({"rope_theta": -1.0}, ValueError, "rope_theta must be a finite number > 0"),
        ({"rope_scaling": (8.0, 1.0)}, TypeError, "rope_scaling must be None or a Llama3"),
        ({"impl": "triton"}, ValueError, "impl must be one of .*got impl='triton'"),
        ({"block": {"q": 16}}, TypeError, "block must be None or a rudax.kernels.FlashAtt"),
        ({"interpret": 1}, TypeError, "interpret must be a bool, got interpret=1"),
        ({"dtype": jnp.int32}, TypeError, "dtype must be a floating dtype"),
    ],
    features=D,
    num_heads=H,
    rngs=nnx.Rngs(0),
)


def test_shared_prefix_row_equals_each_continuation_alone():
    """[prompt, a, b] with branch ids 0/1/2 and b's positions restarting after the prompt:
    b's outputs are those of [prompt, b] computed alone (RoPE and the window included)."""
    attn = rl.Attention(16, 4, num_kv_heads=2, window=(3, 0), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 11, 16))
    branch = jnp.array([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]])
    positions = jnp.array([[0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7]])
    shared = attn(x, branch_ids=branch, positions=positions)
    alone = jnp.array([0, 1, 2, 3, 7, 8, 9, 10])
    want = attn(x[:, alone])
    np.testing.assert_allclose(shared[:, alone], want, rtol=1e-5, atol=1e-6)
