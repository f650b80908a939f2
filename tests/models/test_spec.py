"""rudax.models.ModelSpec and next_token_loss_sum: the trainer's model and its loss's contract.

The model itself (``rudax.models.LlamaForCausalLM``) is checked against transformers in
test_hf_logits.py; here: the ``[B, T + 1]`` loss is NumPy's cross entropy summed (plus a
Mixtral's balancing term), token-weighted accumulation of it gives the mean loss's gradient,
and a bf16 model learns a repeated batch.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import rudax.optim as ro
from rudax.models import LlamaConfig, ModelSpec
from rudax.models import next_token_loss_sum as loss_sum

F32 = LlamaConfig.tiny(
    32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
    max_position_embeddings=8, param_dtype=jnp.float32,
)  # fmt: skip
MIXTRAL = dataclasses.replace(
    F32, model_type="mixtral", num_local_experts=4, router_aux_loss_coef=0.5,
    output_router_logits=True,
)  # fmt: skip


def _batch(b, t, *, seed=0):
    return np.random.default_rng(seed).integers(0, 32, size=(b, t), dtype=np.int32)


def test_next_token_loss_sum_is_numpy_cross_entropy_summed_plus_the_balancing_term():
    model = ModelSpec(MIXTRAL, 8, loss_chunk=5).create(0)
    batch = _batch(3, 7)
    run = nnx.jit(lambda m, b: (m(b[:, :-1]), m.hidden_states(b[:, :-1])[2], loss_sum(m, b)))
    logits, aux, (loss, metrics) = run(model, batch)
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, batch[:, 1:, None], -1).sum()
    assert int(metrics["tokens"]) == 18 and metrics["tokens"].dtype == jnp.int32
    np.testing.assert_allclose(float(metrics["ce_sum"]), ce, rtol=1e-5)
    assert float(metrics["aux_loss"]) == float(aux) > 0
    # transformers' ce_mean + coef * aux, as a sum over the 18 targets
    np.testing.assert_allclose(float(loss), ce + 0.5 * 18 * float(aux), rtol=1e-5)


@pytest.mark.parametrize("config", [F32, MIXTRAL], ids=["dense", "mixtral"])
def test_token_weighted_accumulation_gives_the_mean_loss_gradient(config):
    graph, params = nnx.split(ModelSpec(config, 8).create(0))
    grad = jax.grad(lambda p, b: loss_sum(nnx.merge(graph, p), b), has_aux=True)

    @jax.jit
    def accumulated_and_direct(params, parts, whole):
        acc = ro.GradientAccumulator.init(params, dtype=jnp.float32)
        for part in parts:
            g, metrics = grad(params, part)
            acc = acc.add(g, weight=metrics["tokens"])
        n = sum(p.shape[0] * (p.shape[1] - 1) for p in parts)
        mean_loss = lambda p: sum(loss_sum(nnx.merge(graph, p), b)[0] for b in parts) / n
        return acc.pop(normalize=True)[0], jax.grad(mean_loss)(params)

    whole = _batch(5, 9)
    got, want = accumulated_and_direct(params, (whole[:2], whole[2:]), whole)  # 16, 24 tokens
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_loss_falls_over_twenty_adamw_steps_on_a_repeated_batch():
    bf16 = dataclasses.replace(F32, param_dtype=jnp.bfloat16)
    graph, params = nnx.split(ModelSpec(bf16, 8, dtype=jnp.bfloat16).create(0))
    tx = ro.fp32_master(ro.adamw(1e-2))

    @jax.jit
    def step(params, opt_state, batch):
        (loss, metrics), grads = jax.value_and_grad(
            lambda p: loss_sum(nnx.merge(graph, p), batch), has_aux=True
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        mean = loss / metrics["tokens"].astype(jnp.float32)
        return optax.apply_updates(params, updates), opt_state, mean

    opt_state, batch, losses = tx.init(params), _batch(4, 9), []
    for _ in range(20):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert step._cache_size() == 1
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_bad_batch_is_named():
    model = ModelSpec(F32, 8).create(0)
    with pytest.raises(ValueError, match=r"batch_BxT1 must be \[batch, time \+ 1\].*\(3,\)"):
        loss_sum(model, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"time >= 1.*\(2, 1\)"):
        loss_sum(model, jnp.zeros((2, 1), jnp.int32))


def test_equal_specs_are_equal_and_hash_alike():
    """The spec is the jitted builder's static argument: one spelling of a dtype, one cache key."""
    spec = ModelSpec(F32, 8, dtype="float32")
    assert spec == ModelSpec(F32, 8, dtype=jnp.float32) and hash(spec) == hash(ModelSpec(F32, 8))
    assert spec != ModelSpec(F32, 8, dtype=jnp.bfloat16)
