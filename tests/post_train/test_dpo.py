"""``dpo_loss`` against TRL 1.16's own ``DPOTrainer._compute_loss``, run on the same numbers.

TRL's method is called on a bare trainer (``object.__new__(DPOTrainer)``) holding only the
attributes it reads, with a stand-in model whose output carries the given per-token
log-probabilities (TRL's fused LM head returns them as ``outputs.log_probs``) and precomputed
reference log-probs. Everything is float64 on both sides; the loss, each pair's loss (TRL run
on that pair alone), the logged reward statistics and the gradient with respect to the
policy's log-probs (torch autograd through TRL's lines) must agree to 1e-12.
"""

from __future__ import annotations

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rudax.post_train import DPO_LOSS_TYPES, dpo_loss

torch = pytest.importorskip(
    "torch", reason="torch runs TRL, the reference (the test extra pins it)"
)
dpo_trainer = pytest.importorskip(
    "trl.trainer.dpo_trainer", reason="TRL is the post-training reference (the test extra pins it)"
)

N, L = 6, 7
TOL = 1e-12


def _pairs(seed=0):
    """N pairs: per-token policy log-probs [N, L] (0 past each completion), masks, references.

    Log-ratios spread over about +-8 so that sigmoid, hinge and ipo see both signs and both
    sides of their kinks; pair 0's chosen and rejected rewards are equal (a tie: not an
    accuracy).
    """
    rng = np.random.default_rng(seed)
    lengths_c = np.array([3, 1, 7, 4, 5, 2])
    lengths_r = np.array([3, 6, 2, 7, 1, 4])
    mask_c = np.arange(L) < lengths_c[:, None]
    mask_r = np.arange(L) < lengths_r[:, None]
    tok_c = np.where(mask_c, -rng.uniform(0.05, 3.0, (N, L)), 0.0)
    tok_r = np.where(mask_r, -rng.uniform(0.05, 3.0, (N, L)), 0.0)
    ref_c = tok_c.sum(1) + rng.uniform(-4, 4, N)
    ref_r = tok_r.sum(1) + rng.uniform(-4, 4, N)
    tok_r[0], ref_r[0] = tok_c[0], ref_c[0]  # pair 0: equal log-ratios, bit for bit
    return tok_c, tok_r, mask_c, mask_r, ref_c, ref_r


class _Accelerator:
    """The single-process accelerator's part that TRL's loss uses."""

    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def _trl(tok_c, tok_r, mask_c, mask_r, ref_c, ref_r, *, beta, label_smoothing, loss_type):
    """TRL's loss, its logged metrics, and d loss / d per-token log-probs ([2N, L])."""
    trainer = object.__new__(dpo_trainer.DPOTrainer)
    trainer.model = types.SimpleNamespace(training=True)
    trainer.accelerator = _Accelerator()
    trainer.aux_loss_enabled = False
    trainer.precompute_ref_logps = True
    trainer.ld_alpha = None
    trainer.f_divergence_type = "reverse_kl"
    trainer.loss_types = [loss_type]
    trainer.loss_weights = [1.0]
    trainer.beta = beta
    trainer.label_smoothing = label_smoothing
    trainer.use_weighting = False
    trainer._metrics = {
        "train": collections.defaultdict(list),
        "eval": collections.defaultdict(list),
    }
    trainer._total_train_tokens = 0
    trainer._tp_size = 1

    n = len(tok_c)
    log_probs = torch.tensor(np.concatenate([tok_c, tok_r]), dtype=torch.float64)
    log_probs.requires_grad_(True)
    zeros = torch.zeros_like(log_probs)

    def model(**kwargs):  # the fused LM head's output: the labels' log-probs, 0 elsewhere
        return types.SimpleNamespace(
            log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
        )

    # TRL's completion_mask covers input_ids: one prompt token, then the completion; the
    # log-probs are at the shifted positions, completion_mask[:, 1:].
    completion_mask = np.concatenate([mask_c, mask_r]).astype(np.int64)
    completion_mask = np.pad(completion_mask, ((0, 0), (1, 0)))
    inputs = {
        "input_ids": torch.zeros(completion_mask.shape, dtype=torch.long),
        "attention_mask": torch.ones(completion_mask.shape, dtype=torch.long),
        "completion_mask": torch.tensor(completion_mask),
        "ref_chosen_logps": torch.tensor(ref_c, dtype=torch.float64),
        "ref_rejected_logps": torch.tensor(ref_r, dtype=torch.float64),
    }
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert log_probs.grad is not None
    grad = log_probs.grad.numpy()
    return loss.item(), metrics, grad[:n], grad[n:]


def _ours(tok_c, tok_r, mask_c, mask_r, ref_c, ref_r, **kw):
    """Our loss, its output, and d loss / d summed log-probs, in float64."""
    lengths = {}
    if kw.get("loss_type") == "ipo":
        lengths = {"chosen_lengths": mask_c.sum(1), "rejected_lengths": mask_r.sum(1)}

    def loss(c, r):
        out = dpo_loss(c, r, jnp.asarray(ref_c), jnp.asarray(ref_r), **kw, **lengths)
        return out.loss, out

    c, r = jnp.asarray(tok_c.sum(1)), jnp.asarray(tok_r.sum(1))
    (value, out), (grad_c, grad_r) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(c, r)
    return float(value), out, np.asarray(grad_c), np.asarray(grad_r)


CASES = [
    ("sigmoid", 0.1, 0.0),
    ("sigmoid", 0.5, 0.0),
    ("hinge", 0.5, 0.0),
    ("hinge", 0.1, 0.0),
    ("ipo", 0.1, 0.0),
    ("ipo", 0.5, 0.0),
    ("robust", 0.1, 0.0),
    ("robust", 0.5, 0.2),
    ("robust", 0.3, 0.45),
]


@pytest.mark.parametrize(("loss_type", "beta", "label_smoothing"), CASES)
def test_matches_trl(loss_type, beta, label_smoothing):
    data = _pairs()
    kw = dict(beta=beta, label_smoothing=label_smoothing, loss_type=loss_type)
    want_loss, want_metrics, want_gc, want_gr = _trl(*data, **kw)
    with jax.enable_x64(True):
        loss, out, grad_c, grad_r = _ours(*data, **kw)
        assert out.losses.dtype == jnp.float64
        metrics = {k: float(v) for k, v in out.metrics().items()}
        # each pair's loss: TRL's mean over that pair alone
        for i in range(N):
            one = [x[i : i + 1] for x in data]
            np.testing.assert_allclose(float(out.losses[i]), _trl(*one, **kw)[0], atol=TOL)
    np.testing.assert_allclose(loss, want_loss, rtol=0, atol=TOL)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        np.testing.assert_allclose(metrics[name], want_metrics[name], atol=TOL, err_msg=name)
    # TRL sums each row's per-token log-probs: every position of a row gets the pair's derivative
    np.testing.assert_allclose(want_gc, np.broadcast_to(grad_c[:, None], (N, L)), atol=TOL)
    np.testing.assert_allclose(want_gr, np.broadcast_to(grad_r[:, None], (N, L)), atol=TOL)
    assert np.abs(grad_c).max() > 1e-3  # the gradient is not trivially zero
    if loss_type == "hinge" and beta == 0.5:  # both sides of the hinge are exercised
        assert (np.asarray(out.losses) == 0).any() and (np.asarray(out.losses) > 0).any()


def test_rewards_carry_no_gradient_and_a_tie_is_not_an_accuracy():
    tok_c, tok_r, _, _, ref_c, ref_r = _pairs()
    with jax.enable_x64(True):
        c, r = jnp.asarray(tok_c.sum(1)), jnp.asarray(tok_r.sum(1))
        grads = jax.grad(lambda c: dpo_loss(c, r, ref_c, ref_r, beta=0.5).chosen_rewards.sum())(c)
        out = dpo_loss(c, r, ref_c, ref_r, beta=0.5)
        assert float(out.chosen_rewards[0]) == float(out.rejected_rewards[0])
        acc = (np.asarray(out.chosen_rewards) > np.asarray(out.rejected_rewards)).mean()
        assert float(out.metrics()["rewards/accuracies"]) == acc < 1
    assert (np.asarray(grads) == 0).all()


def test_trl_sigmoid_ignores_label_smoothing_so_it_is_refused():
    """TRL 1.16's sigmoid reads no label_smoothing (older TRL's conservative DPO did)."""
    data = _pairs()
    smoothed = _trl(*data, beta=0.1, label_smoothing=0.1, loss_type="sigmoid")[0]
    plain = _trl(*data, beta=0.1, label_smoothing=0.0, loss_type="sigmoid")[0]
    assert smoothed == plain
    c, r = data[0].sum(1), data[1].sum(1)
    for loss_type in ("sigmoid", "hinge", "ipo"):
        with pytest.raises(ValueError, match=rf"label_smoothing=0.1 with loss_type='{loss_type}'"):
            dpo_loss(c, r, data[4], data[5], label_smoothing=0.1, loss_type=loss_type)


def test_works_under_jit_in_float32():
    tok_c, tok_r, _, _, ref_c, ref_r = _pairs()
    args = [jnp.asarray(x, jnp.float32) for x in (tok_c.sum(1), tok_r.sum(1), ref_c, ref_r)]
    fn = jax.jit(lambda *a: dpo_loss(*a, beta=0.5, loss_type="robust", label_smoothing=0.1))
    out = fn(*args)
    assert out.losses.dtype == jnp.float32
    with jax.enable_x64(True):
        want = dpo_loss(
            *[jnp.asarray(a, jnp.float64) for a in args],
            beta=0.5,
            loss_type="robust",
            label_smoothing=0.1,
        )
        np.testing.assert_allclose(np.asarray(out.losses), np.asarray(want.losses), rtol=1e-6)


def test_bad_inputs_are_named():
    tok_c, tok_r, mask_c, mask_r, ref_c, ref_r = _pairs()
    c, r = tok_c.sum(1), tok_r.sum(1)
    with pytest.raises(ValueError, match=r"loss_type must be one of .*'sigmoid'.*'robust'.*'kto'"):
        dpo_loss(c, r, ref_c, ref_r, loss_type="kto")  # type: ignore[arg-type]
    assert set(DPO_LOSS_TYPES) == {"sigmoid", "ipo", "hinge", "robust"}
    with pytest.raises(
        ValueError, match=r"ref_rejected_logps.shape=\(5,\) and chosen_logps.shape=\(6,\)"
    ):
        dpo_loss(c, r, ref_c, ref_r[:5])
    with pytest.raises(ValueError, match=r"chosen_logps must be \[N\].*\(6, 7\)"):
        dpo_loss(tok_c, tok_r, tok_c, tok_r)
    for beta in (0.0, -0.1):
        with pytest.raises(ValueError, match=rf"beta must be a finite number > 0, got beta={beta}"):
            dpo_loss(c, r, ref_c, ref_r, beta=beta)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0.0, 0.5\).*=0.5"):
        dpo_loss(c, r, ref_c, ref_r, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0.0, 0.5\).*=-0.1"):
        dpo_loss(c, r, ref_c, ref_r, loss_type="robust", label_smoothing=-0.1)
    with pytest.raises(ValueError, match=r"give chosen_lengths .*got chosen_lengths=None"):
        dpo_loss(c, r, ref_c, ref_r, loss_type="ipo", rejected_lengths=mask_r.sum(1))
    with pytest.raises(ValueError, match=r"rejected_lengths.shape=\(2,\) and chosen_logps"):
        dpo_loss(
            c, r, ref_c, ref_r, loss_type="ipo", chosen_lengths=mask_c.sum(1),
            rejected_lengths=mask_r.sum(1)[:2],
        )  # fmt: skip
    with pytest.raises(TypeError, match=r"chosen_lengths must hold integer.*dtype=float"):
        dpo_loss(
            c, r, ref_c, ref_r, loss_type="ipo", chosen_lengths=mask_c.sum(1) * 1.0,
            rejected_lengths=mask_r.sum(1),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"used by loss_type='ipo' only.*loss_type='sigmoid'"):
        dpo_loss(c, r, ref_c, ref_r, chosen_lengths=mask_c.sum(1))
    with pytest.raises(TypeError, match=r"chosen_logps must be a floating array.*int"):
        dpo_loss(mask_c.sum(1), r, ref_c, ref_r)
