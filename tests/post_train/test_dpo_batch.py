"""rudax.post_train.dpo_loss_sum: the DPO loss of a LoRA policy on packed shared-prefix pairs,
against TRL's layout written plainly (each answer in a row of its own after a copy of its
prompt, the full logits' log-softmax, the reference a separate copy of the base model): the
same loss, rewards and adapter gradients for every loss type; several pairs per row and
empty slots; rows split over a mesh of simulated devices give the one-device update; bad
batches and a model without adapters refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import rudax.layers as rl
from rudax.models import LlamaConfig, LlamaForCausalLM, pack_shared_prefix
from rudax.post_train import DPO_LOSS_TYPES, dpo_loss, dpo_loss_sum, token_logprobs
from tests.post_train._lora import (
    V,
    adapter_grad,
    assert_trees_close,
    base_and_policy,
    one_update_each,
)


def _pairs(n, seed=0):
    """n (prompt, chosen, rejected) of 1 to 7 prompt tokens and 1 to 5 tokens per answer."""
    rng = np.random.default_rng(seed)
    ids = lambda lo, hi: rng.integers(1, V, rng.integers(lo, hi)).tolist()
    return [(ids(1, 8), ids(1, 6), ids(1, 6)) for _ in range(n)]


def _trl_layout_loss(policy, base, pairs, **kw):
    """TRL's DPO written plainly: each answer in its own row after its prompt, the rows
    right-padded into one batch (chosen, then rejected), log-probs from the full logits, the
    reference the base model itself. Returns (mean loss, DPOOutput)."""
    answers = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    width = max(len(p) + len(a) for p, a in answers) - 1
    tokens = jnp.asarray([(p + a[:-1] + [0] * width)[:width] for p, a in answers])
    labels = jnp.asarray([([-100] * (len(p) - 1) + a + [-100] * width)[:width] for p, a in answers])

    def two(model):  # [chosen; rejected] summed log-probs, one row per answer
        return jnp.split(jnp.sum(token_logprobs(model(tokens), labels), axis=-1), 2)

    chosen, rejected = two(policy)
    ref_chosen, ref_rejected = two(base)
    lengths = {}
    if kw.get("loss_type") == "ipo":
        lengths = {
            "chosen_lengths": jnp.asarray([len(c) for _, c, _ in pairs]),
            "rejected_lengths": jnp.asarray([len(r) for _, _, r in pairs]),
        }
    out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, **kw, **lengths)
    return out.loss, out


def _packed(pairs, row_length=None):
    rows = pack_shared_prefix([(p, [c, r]) for p, c, r in pairs], row_length=row_length)
    return {**rows.batch(), "completion": rows.completion}


@pytest.mark.parametrize(
    "loss_type",  # each loss type's formula is TRL's in test_dpo.py: two here, in CI
    [
        t if t in ("sigmoid", "ipo") else pytest.param(t, marks=pytest.mark.slow)
        for t in DPO_LOSS_TYPES
    ],
)
def test_equals_trls_layout_with_a_separate_reference_loss_rewards_and_gradients(loss_type):
    base, policy = base_and_policy()
    pairs = _pairs(5)
    kw = {"beta": 0.3, "loss_type": loss_type}
    if loss_type == "robust":
        kw["label_smoothing"] = 0.2
    want_loss, want_grads = adapter_grad(
        policy, lambda m: _trl_layout_loss(m, base, pairs, **kw)[0]
    )
    # several pairs to a row (and a slot left empty at the end of a row), and pairs alone
    for row_length in (None, 40):
        batch = _packed(pairs, row_length)
        assert row_length is None or batch["tokens"].shape[0] < len(pairs)

        def shared(model, batch=batch):
            total, metrics = dpo_loss_sum(model, batch, **kw)
            return total / metrics["pairs"].astype(total.dtype)

        loss, grads = adapter_grad(policy, shared)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        assert_trees_close(grads, want_grads)
        assert any(float(jnp.abs(g).max()) > 1e-3 for g in jax.tree.leaves(grads))

    _, metrics = nnx.jit(lambda m, b: dpo_loss_sum(m, b, **kw))(policy, batch)
    out = nnx.jit(lambda m, b: _trl_layout_loss(m, b, pairs, **kw)[1])(policy, base)
    assert int(metrics["pairs"]) == int(metrics["tokens"]) == len(pairs)
    np.testing.assert_allclose(metrics["chosen_rewards"], out.chosen_rewards.sum(), atol=1e-5)
    np.testing.assert_allclose(metrics["rejected_rewards"], out.rejected_rewards.sum(), atol=1e-5)
    np.testing.assert_allclose(
        metrics["margins"], (out.chosen_rewards - out.rejected_rewards).sum(), atol=1e-5
    )
    assert float(metrics["accuracies"]) == float(jnp.sum(out.chosen_rewards > out.rejected_rewards))


def test_untrained_adapters_give_log_2_per_pair_and_a_gradient():
    """B = 0 (apply_lora's start): the policy is the reference, each pair's sigmoid loss is
    log 2, and the gradient reaches the adapters' B through the policy only."""
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    rl.apply_lora(model, ["q_proj", "v_proj"], rank=2, alpha=4, rngs=nnx.Rngs(1))
    batch = _packed(_pairs(3, seed=1), row_length=64)
    loss, grads = adapter_grad(model, lambda m: dpo_loss_sum(m, batch)[0])
    np.testing.assert_allclose(loss, 3 * np.log(2.0), rtol=1e-6)
    assert float(optax.tree.norm(grads)) > 0


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize(
    "spec", [pytest.param({"data": 8}, marks=pytest.mark.slow), {"data": 4, "fsdp": 2}]
)
def test_rows_split_over_a_mesh_give_the_one_device_update(spec):
    """make_train_steps sums each device's pairs: the update over a mesh is the one-device
    update, the pairs counted once."""
    pairs = _pairs(12, seed=2)
    batch = _packed(pairs, row_length=32)
    rows = batch["tokens"].shape[0]
    pad = -rows % 8  # whole rows per device: rows of padding (no pair) at the end
    batch = {
        k: np.concatenate([v, np.full((pad, v.shape[1]), -1 if k == "completion" else 0)])
        for k, v in batch.items()
    }
    batch["labels"][rows:] = -100
    loss = lambda m, b: dpo_loss_sum(m, b, beta=0.5)
    results = one_update_each(lambda: base_and_policy()[1], loss, batch, spec)
    (one, m1, n1), (many, m2, n2) = results
    assert int(m1["pairs"]) == int(m2["pairs"]) == len(pairs)
    np.testing.assert_allclose(m2["loss_sum"], m1["loss_sum"], rtol=1e-5)
    np.testing.assert_allclose(n2, n1, rtol=1e-4)
    assert_trees_close(many, one, rtol=1e-4, atol=1e-6)


def test_bad_batches_and_a_model_without_adapters_are_refused():
    base, policy = base_and_policy()
    batch = _packed(_pairs(2))
    with pytest.raises(KeyError, match="completion"):
        dpo_loss_sum(policy, {k: v for k, v in batch.items() if k != "completion"})
    with pytest.raises(ValueError, match=r"batch\['completion'\] must be \[B, T\]"):
        dpo_loss_sum(policy, {**batch, "completion": batch["completion"][:, :-1]})
    with pytest.raises(TypeError, match="integers"):
        dpo_loss_sum(policy, {**batch, "completion": batch["completion"].astype(np.float32)})
    with pytest.raises(ValueError, match="LoRALinear"):
        dpo_loss_sum(base, batch)
