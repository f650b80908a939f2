"""rudax.post_train.grpo_loss_sum: the GRPO loss of a LoRA policy on packed groups (each prompt
once, its G completions as branches), against TRL's layout written plainly (one completion per
row after a copy of its prompt, padded into one [N, L] batch, log-probs of the full tempered
logits, the reference a separate copy of the base model): loss_sum over its weight is TRL's
loss, and the adapters' gradients agree, for every loss type, with old log-probs and a KL term;
rows split over a mesh give the one-device update; bad batches refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rudax.models import pack_shared_prefix
from rudax.post_train import (
    GRPO_LOSS_TYPES,
    group_advantages,
    grpo_loss,
    grpo_loss_sum,
    token_logprobs,
)
from tests.post_train._lora import (
    V,
    adapter_grad,
    assert_trees_close,
    base_and_policy,
    one_update_each,
)

TEMPERATURE = 0.7


def _groups(n, g, seed=0):
    """n groups: (prompt, G completions, their rewards, each completion token's old log-prob).

    The old log-probs are random near the policy's scale, so some ratios fall outside the
    clip range on either side."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(1, V, rng.integers(1, 7)).tolist()
        completions = [rng.integers(1, V, rng.integers(1, 6)).tolist() for _ in range(g)]
        rewards = rng.integers(0, 3, g).astype(np.float32)
        old = [(-4.2 + 0.6 * rng.standard_normal(len(c))).astype(np.float32) for c in completions]
        out.append((prompt, completions, rewards, old))
    return out


def _trl_layout(policy, base, groups, *, beta, loss_type, **kw):
    """TRL's GRPO: [N, L] completions after copies of their prompts, padded; per-token
    log-probs of the full logits; the reference the base model. Returns TRL's loss."""
    rows = [(p, c, o) for p, cs, _, old in groups for c, o in zip(cs, old, strict=True)]
    n, width = len(rows), max(len(p) + len(c) for p, c, _ in rows)
    longest = max(len(c) for _, c, _ in rows)
    tokens = jnp.asarray([(p + c[:-1] + [0] * width)[: width - 1] for p, c, _ in rows])
    labels = jnp.asarray(
        [([-100] * (len(p) - 1) + c + [-100] * width)[: width - 1] for p, c, _ in rows]
    )

    def completion_logps(model):  # [N, longest]: each row's completion, left-aligned
        lp = token_logprobs(model(tokens), labels, temperature=TEMPERATURE)
        lp = jnp.pad(lp, ((0, 0), (0, longest)))
        return jnp.stack(
            [lp[i, len(p) - 1 : len(p) - 1 + longest] for i, (p, _, _) in enumerate(rows)]
        )

    logps, refs = completion_logps(policy), completion_logps(base)
    old = np.zeros((n, longest), np.float32)
    completion = np.full((n, longest), -1, np.int32)
    for i, (_, c, o) in enumerate(rows):
        old[i, : len(c)], completion[i, : len(c)] = o, i
    rewards = np.concatenate([r for _, _, r, _ in groups])
    g = len(groups[0][1])
    advantages = group_advantages(jnp.asarray(rewards), g)
    extra = {"max_completion_length": longest} if loss_type == "dr_grpo" else {}
    return grpo_loss(
        logps, jnp.asarray(old), refs, advantages, jnp.asarray(completion),
        num_completions=n, beta=beta, loss_type=loss_type, **extra, **kw,
    ).loss, longest  # fmt: skip


def _packed(groups, row_length=None):
    rows = pack_shared_prefix([(p, cs) for p, cs, _, _ in groups], row_length=row_length)
    rewards = np.concatenate([r for _, _, r, _ in groups])
    g = len(groups[0][1])
    advantages = np.asarray(group_advantages(jnp.asarray(rewards), g))
    old_flat = np.concatenate([o for _, _, _, old in groups for o in old])
    scored = rows.completion >= 0
    old = np.zeros(rows.completion.shape, np.float32)
    old[scored] = old_flat  # the scored positions, in row order, are the completions' tokens
    return {
        **rows.batch(),
        "completion": rows.completion,
        "advantages": np.where(scored, advantages[rows.completion], 0).astype(np.float32),
        "old_logps": old,
    }


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_over_its_weight_it_is_trls_loss_and_gradients(loss_type):
    base, policy = base_and_policy(("q_proj", "v_proj", "down_proj"), seed=3)
    groups = _groups(3, 4)
    kw = {"beta": 0.05, "loss_type": loss_type, "epsilon_high": 0.28}
    want_loss, want_grads = adapter_grad(policy, lambda m: _trl_layout(m, base, groups, **kw)[0])
    if loss_type == "dr_grpo":  # TRL's: the longest completion, its padded width
        kw["max_completion_length"] = max(len(c) for _, cs, _, _ in groups for c in cs)
    # a group per row, and the groups packed into fewer rows
    for row_length in (None, 48):
        batch = _packed(groups, row_length)

        def mean(model, batch=batch):
            total, metrics = grpo_loss_sum(model, batch, temperature=TEMPERATURE, **kw)
            return total / metrics["tokens"].astype(total.dtype)

        loss, grads = adapter_grad(policy, mean)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
        assert_trees_close(grads, want_grads)
        assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-4
    _, metrics = nnx.jit(lambda m, b: grpo_loss_sum(m, b, temperature=TEMPERATURE, **kw))(
        policy, batch
    )
    assert int(metrics["completions"]) == 12
    assert int(metrics["completion_tokens"]) == sum(len(c) for _, cs, _, _ in groups for c in cs)
    assert float(metrics["clipped_low"]) >= 1 and float(metrics["clipped_high"]) >= 1
    assert float(metrics["kl"]) > 0


def test_without_old_logps_the_ratio_is_one_and_equal_rewards_give_zero():
    """No old_logps: the current policy's (TRL's num_iterations=1); a group of equal rewards
    has zero advantages: loss 0, a zero gradient, no NaN."""
    _, policy = base_and_policy(("q_proj", "v_proj", "down_proj"), seed=3)
    groups = [(p, cs, np.ones_like(r), old) for p, cs, r, old in _groups(2, 3, seed=4)]
    batch = _packed(groups)
    del batch["old_logps"]
    loss, grads = adapter_grad(policy, lambda m: grpo_loss_sum(m, batch, loss_type="grpo")[0])
    assert float(loss) == 0.0
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_advantage_makes_the_loss_nan_not_zero(bad):
    """A NaN or infinite advantage (a reward bug upstream) is not trained on as 0: the loss is
    NaN, which a run's loss check stops at. The empty slots of a row still hold 0."""
    _, policy = base_and_policy(("q_proj", "v_proj"), seed=3)
    batch = _packed(_groups(2, 3, seed=4), row_length=64)  # room for empty slots
    good = float(grpo_loss_sum(policy, batch, loss_type="dapo")[0])
    assert np.isfinite(good)
    first = batch["completion"] == batch["completion"][batch["completion"] >= 0].min()
    batch["advantages"] = np.where(first, np.float32(bad), batch["advantages"])
    assert np.isnan(float(grpo_loss_sum(policy, batch, loss_type="dapo")[0]))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize(
    ("spec", "loss_type"), [({"data": 8}, "dapo"), ({"data": 4, "fsdp": 2}, "grpo")]
)
def test_rows_split_over_a_mesh_give_the_one_device_update(spec, loss_type):
    groups = _groups(8, 2, seed=5)  # 16 completions: one group a row, a row a device
    batch = _packed(groups)
    loss = lambda m, b: grpo_loss_sum(m, b, beta=0.1, loss_type=loss_type)
    results = one_update_each(
        lambda: base_and_policy(("q_proj", "v_proj", "down_proj"), seed=3)[1], loss, batch, spec
    )
    (one, m1, n1), (many, m2, n2) = results
    assert int(m1["completions"]) == int(m2["completions"]) == 16
    np.testing.assert_allclose(m2["loss_sum"], m1["loss_sum"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(n2, n1, rtol=1e-4)
    assert_trees_close(many, one, rtol=1e-4, atol=1e-6)


def test_bad_batches_are_refused():
    base, policy = base_and_policy(("q_proj", "v_proj", "down_proj"), seed=3)
    batch = _packed(_groups(1, 2))
    for key in ("completion", "advantages"):
        with pytest.raises(KeyError, match=key):
            grpo_loss_sum(policy, {k: v for k, v in batch.items() if k != key})
    with pytest.raises(ValueError, match=r"batch\['advantages'\] must be \[B, T\]"):
        grpo_loss_sum(policy, {**batch, "advantages": batch["advantages"][:, 0]})
    with pytest.raises(TypeError, match=r"batch\['old_logps'\] must be floating"):
        grpo_loss_sum(policy, {**batch, "old_logps": batch["completion"]})
    with pytest.raises(ValueError, match="LoRALinear"):
        grpo_loss_sum(base, batch, beta=0.1)
