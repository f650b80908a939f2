"""rudax.layers.MoE and load_balancing_loss against a per-token float64 loop and hand-made
routings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rudax.layers import MoE, load_balancing_loss


def _normal(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _np_softmax(s, axis=-1):
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


_forward = nnx.jit(lambda model, *args: model(*args))


def _moe_reference(moe, x_NxD, k):
    """Per token: its top-k experts by router probability, gates renormalized (float64)."""
    w_r, w_g, w_u, w_d = (
        np.asarray(v.get_value(), np.float64)
        for v in (moe.gate.kernel, moe.experts.w1, moe.experts.w3, moe.experts.w2)
    )
    silu = lambda z: z / (1.0 + np.exp(-z))
    out = []
    for x in np.asarray(x_NxD, np.float64):
        p = _np_softmax(x @ w_r)
        chosen = np.argsort(-p, kind="stable")[:k]
        gates = p[chosen] / p[chosen].sum()
        out.append(
            sum(
                g * (silu(x @ w_g[e]) * (x @ w_u[e])) @ w_d[e]
                for g, e in zip(gates, chosen, strict=True)
            )
        )
    return np.stack(out)


def test_moe_matches_a_per_token_loop():
    x, cot = _normal(2, 3, 6, seed=1), _normal(6, 6, seed=2)
    moe = MoE(6, 10, 4, top_k=2, rngs=nnx.Rngs(0))
    # A router with larger weights, so the top-2 choice is well separated from ties.
    moe.gate.kernel.set_value(jnp.asarray(_normal(6, 4, seed=3)))
    want_y = _moe_reference(moe, x.reshape(6, 6), 2).reshape(2, 3, 6)
    # Gradients wrt the input and every weight, against a jnp loop over the same choices.
    chosen = [np.argsort(-p, kind="stable")[:2] for p in np.asarray(_router_probs(moe, x))]
    graph, params = nnx.split(moe)

    def loop_loss(params, x):
        m = nnx.merge(graph, params)
        p = jax.nn.softmax(x.reshape(6, 6) @ m.gate.kernel[...], axis=-1)
        total = jnp.zeros(())
        for n, (token, experts) in enumerate(zip(x.reshape(6, 6), chosen, strict=True)):
            gates = p[n, experts] / jnp.sum(p[n, experts])
            for g, e in zip(gates, experts, strict=True):
                h = jax.nn.silu(token @ m.experts.w1[e]) * (token @ m.experts.w3[e])
                total = total + g * jnp.sum((h @ m.experts.w2[e]) * cot[n])
        return total

    want = jax.jit(jax.grad(loop_loss, argnums=(0, 1)))(params, x)
    for impl in ("ragged", "dense"):
        moe.impl = impl
        graph, params = nnx.split(moe)

        def loss(params, x, graph=graph):
            y, aux = nnx.merge(graph, params)(x)
            return jnp.sum(y.reshape(6, 6) * cot), (y, aux)

        got, (y, aux) = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        assert y.dtype == jnp.float32 and aux.shape == () and aux.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-5, atol=1e-6, err_msg=impl)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _router_probs(moe, x):
    return jax.nn.softmax(x.reshape(-1, moe.features) @ moe.gate.kernel[...], axis=-1)


def test_load_balancing_loss_on_hand_made_routings():
    lbl = jax.jit(load_balancing_loss)
    # f = (1, 0) (both tokens to expert 0), P = (0.65, 0.35): 2 * (1 * 0.65 + 0 * 0.35).
    probs = jnp.array([[0.7, 0.3], [0.6, 0.4]])
    np.testing.assert_allclose(float(lbl(probs, jnp.array([[0], [0]]))), 1.3)
    # Two slots per token over four experts: f = (2, 1, 1, 0) / 4, P = (0.4, 0.3, 0.2, 0.1).
    probs = jnp.array([[0.5, 0.3, 0.1, 0.1], [0.3, 0.3, 0.3, 0.1]])
    got = float(lbl(probs, jnp.array([[0, 1], [0, 2]])))
    np.testing.assert_allclose(got, 4 * (0.5 * 0.4 + 0.25 * 0.3 + 0.25 * 0.2), rtol=1e-6)

    e = 4
    moe = MoE(e, 8, e, top_k=1, rngs=nnx.Rngs(0))
    # Token i is the unit vector e_i and the router the identity times 3: token i goes to
    # expert i (f uniform) and P is uniform by symmetry, so the loss is exactly balanced: 1.
    moe.gate.kernel.set_value(3.0 * jnp.eye(e))
    _, aux = _forward(moe, jnp.eye(e))
    np.testing.assert_allclose(float(aux), 1.0, rtol=1e-6)
    # Every logit of expert 0 raised: every token goes to it, aux = E * 1 * P_0.
    moe.gate.kernel.set_value(jnp.zeros((e, e)).at[:, 0].set(2.0))
    x = np.abs(_normal(e, e)) + 0.1  # the shape above: no recompilation
    _, aux = _forward(moe, x)
    p0 = _np_softmax(np.asarray(x, np.float64) @ np.asarray(moe.gate.kernel[...]))[:, 0].mean()
    np.testing.assert_allclose(float(aux), e * p0, rtol=1e-6)
    assert p0 > 0.5  # all on one expert: far from the balanced 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(top_k=5), ValueError, "top_k must be <= num_experts=4, got top_k=5"),
        (dict(top_k=2, impl="fast"), ValueError, "impl must be one of"),
        (dict(top_k=0), ValueError, "top_k"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        MoE(6, 10, 4, **kwargs, rngs=nnx.Rngs(0))


def test_bad_input_is_named():
    moe = MoE(6, 10, 4, top_k=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x.shape\[-1\] == 6"):
        moe(jnp.ones((2, 5)))
    with pytest.raises(TypeError, match="floating input"):
        moe(jnp.ones((2, 6), jnp.int32))


def test_route_gives_the_statistics_of_the_loss_over_the_real_tokens():
    moe = MoE(6, 10, 4, top_k=2, rngs=nnx.Rngs(0))
    x = _normal(2, 5, 6, seed=4)
    y, aux = _forward(moe, x)
    y2, (fraction, probability) = nnx.jit(lambda m, x: m.route(x))(moe, x)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_allclose(np.sum(fraction), 2.0, rtol=1e-6)  # k choices per token
    # load_balancing_loss's f is the assignments' fraction: route's fraction over k
    np.testing.assert_allclose(4 * np.sum(fraction / 2 * probability), aux, rtol=1e-6)
    # Padding (segment id 0) counts for nothing: the statistics of the real tokens alone.
    segment_ids = np.array([[1, 1, 1, 0, 0], [2, 2, 0, 0, 0]], np.int32)
    _, masked = moe.route(x, segment_ids=segment_ids)
    _, real = moe.route(np.concatenate([x[0, :3], x[1, :2]])[None])
    for a, b in zip(masked, real, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_router_dtype_is_where_the_logits_are_computed():
    x = _normal(4, 6, seed=5)
    fp32 = MoE(6, 10, 4, top_k=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    bf16 = MoE(6, 10, 4, top_k=2, dtype=jnp.bfloat16, router_dtype=jnp.bfloat16,
               rngs=nnx.Rngs(0))  # fmt: skip
    want = np.asarray(x, np.float32).astype(jnp.bfloat16) @ np.asarray(fp32.gate.kernel[...])
    assert fp32.gate(x.astype(jnp.bfloat16)).dtype == jnp.float32
    assert bf16.gate(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    np.testing.assert_allclose(fp32.gate(x.astype(jnp.bfloat16)), want, rtol=1e-6, atol=1e-6)
