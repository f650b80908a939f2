"""``group_advantages`` and ``grpo_loss`` against TRL 1.16's own ``GRPOTrainer`` methods.

TRL's methods run on a bare trainer (``object.__new__(GRPOTrainer)``) holding only the
attributes they read:

* the loss: ``_compute_loss(model, inputs)``, its ``_get_per_token_logps_and_entropies``
  replaced to return the given per-token log-probs, so torch autograd differentiates TRL's
  own lines;
* the advantages: ``_generate_and_score_completions`` (the smallest TRL function holding
  them), its ``_generate`` and ``_calculate_rewards`` replaced to return fixed completions
  and the given rewards.

Both sides are float64; the losses, KL and gradients agree to 1e-12, and so do unscaled
advantages. 1e-7 where TRL itself rounds to float32: its clip ratios (logged from float32
flags) and its std (Bessel's n / (n - 1) taken in torch's default float32). Then the claims
TRL cannot check: the same completions in
TRL's padded ``[N, L]`` and in packed rows give the same loss and per-token gradients, NaN
padding is never read, a group of equal rewards has advantage exactly 0 and finite
gradients, and every bad argument is a ValueError naming it.
"""

from __future__ import annotations

import collections
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rudax.post_train import GRPO_LOSS_TYPES, group_advantages, grpo_loss

torch = pytest.importorskip(
    "torch", reason="torch runs TRL, the reference (the test extra pins it)"
)
grpo_trainer = pytest.importorskip(
    "trl.trainer.grpo_trainer", reason="TRL is the post-training reference (the test extra pins it)"
)

TOL = 1e-12
N, L = 6, 8
LENGTHS = np.array([8, 5, 1, 3, 0, 6])  # completion 4 is empty: TRL's clamp(min=1) and nanmin
ADVANTAGES = np.array([1.2, -0.7, 0.3, -1.5, 0.9, -0.2])  # mixed signs


def _metrics_store():
    return {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}


# --- TRL's advantages ------------------------------------------------------------------------


def _trl_advantages(rewards, group_size, scale_rewards):
    n = len(rewards)
    rewards_per_func = torch.tensor(rewards, dtype=torch.float64)[:, None]
    t = object.__new__(grpo_trainer.GRPOTrainer)
    t.accelerator = types.SimpleNamespace(
        device=torch.device("cpu"), gather=lambda x: x, process_index=0
    )
    t.model = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
    t.args = types.SimpleNamespace(
        per_device_train_batch_size=n,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        gradient_checkpointing_kwargs=None,
    )
    t.environment_factories = t.tools = t.environments = None
    t._generate = lambda prompts: (
        [[1]] * len(prompts), [[2, 3]] * len(prompts), None, ["c"] * len(prompts), None, {},
        None, None,
    )  # fmt: skip
    t._calculate_rewards = lambda inputs, prompts, completions, ids: rewards_per_func
    t._tokenizer = types.SimpleNamespace(pad_token_id=0)
    t.pad_to_multiple_of = None
    t.mask_truncated_completions = False
    t.num_iterations = 1
    t.use_vllm = False
    t.beta = 0.0
    t.num_generations = group_size
    t.multi_objective_aggregation = "sum_then_normalize"
    t.reward_weights = torch.ones(1, dtype=torch.float64)
    t.scale_rewards = scale_rewards
    t.reward_func_names = ["reward"]
    t._metrics = _metrics_store()
    t._logs = {
        "prompt": [], "completion": [], "advantages": [],
        "rewards": collections.defaultdict(list), "extra": collections.defaultdict(list),
    }  # fmt: skip
    t._pending_extra_logs, t._pending_metrics = {}, {}
    t.log_multimodal = False
    out = t._generate_and_score_completions([{"prompt": "p"}] * n)
    return out["advantages"].numpy()


REWARDS = np.array(
    [
        [1.0, 0.0, 0.5, 0.25],  # mixed
        [0.1, 0.1, 0.1, 0.1],  # equal, and 0.1 * 4 / 4 != 0.1 in floating point
        [np.nan, 2.0, 1.0, 3.0],  # one unscorable completion
        [3.0, np.nan, np.nan, np.nan],  # one scorable: its std is undefined
        [-2.0, 5.0, -2.0, 0.5],
    ]
).reshape(-1)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [("group", "group"), ("batch", "batch"), ("none", "none"), (True, "group"), (False, "none")],
)
def test_group_advantages_match_trl(ours, theirs):
    want = _trl_advantages(REWARDS, 4, theirs)
    with jax.enable_x64(True):
        got = np.asarray(group_advantages(jnp.asarray(REWARDS), 4, scale_rewards=ours))
    # TRL's nanstd takes Bessel's n / (n - 1) as int64 / int64, which torch computes in its
    # default float32 (trl/trainer/utils.py:1041): its std is off by up to 3e-8 relative,
    # even in float64. rudax keeps n / (n - 1) exact.
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL if theirs == "none" else 1e-7)
    assert np.isfinite(got).all()
    # equal rewards: exactly 0 here (TRL: within rounding of 0); unscorable: 0
    assert (got[4:8] == 0).all() and got[8] == 0 and (got[12:16] == 0).all()
    if theirs != "none":
        assert np.abs(want[4:8]).max() < 1e-9


def test_group_advantages_default_to_trl_default_in_float32():
    got = group_advantages(jnp.asarray(REWARDS, jnp.float32), 4)
    assert got.dtype == jnp.float32
    want = _trl_advantages(REWARDS, 4, "group")
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


# --- TRL's loss ------------------------------------------------------------------------------


def _data(seed=0):
    """Per-token log-probs in TRL's layout; padding holds finite garbage, as a model's would.

    old_logps differ by up to +-0.6 nats: ratios from 0.55 to 1.8, clipped on both sides.
    """
    rng = np.random.default_rng(seed)
    mask = np.arange(L) < LENGTHS[:, None]
    logps = -rng.uniform(0.05, 3.0, (N, L))
    old = logps + rng.uniform(-0.6, 0.6, (N, L))
    ref = logps + 0.3 * rng.standard_normal((N, L))
    return logps, old, ref, mask


def _trl_loss(logps, old, ref, advantages, mask, *, loss_type, beta, epsilon, epsilon_high,
              max_completion_length, num_items_in_batch):  # fmt: skip
    """TRL's loss, its logged metrics and d loss / d logps."""
    policy = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    t = object.__new__(grpo_trainer.GRPOTrainer)
    t._get_per_token_logps_and_entropies = lambda model, ids, attention, keep, **kw: (
        policy,
        torch.zeros_like(policy),
        None,
    )
    t.top_entropy_quantile = 1.0
    t.off_policy_mask_threshold = None
    t.importance_sampling_level = "token"
    t.beta = beta
    t.args = types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    t.loss_type = loss_type
    t.epsilon_low = epsilon
    t.epsilon_high = epsilon if epsilon_high is None else epsilon_high  # as TRL's __init__
    t.use_vllm = False
    t.model = types.SimpleNamespace(training=True)
    t.current_gradient_accumulation_steps = 1
    t.max_completion_length = max_completion_length
    t.accelerator = types.SimpleNamespace(
        num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x
    )
    t._entropy_bonus_enabled = False
    t.aux_loss_enabled = False
    t._metrics = _metrics_store()
    n, length = logps.shape
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, length, dtype=torch.long),
        "completion_mask": torch.tensor(mask.astype(np.int64)),
        "advantages": torch.tensor(advantages, dtype=torch.float64),
        "num_items_in_batch": torch.tensor(
            mask.sum() if num_items_in_batch is None else num_items_in_batch
        ),
    }
    if old is not None:
        inputs["old_per_token_logps"] = torch.tensor(old, dtype=torch.float64)
    if beta != 0:
        inputs["ref_per_token_logps"] = torch.tensor(ref, dtype=torch.float64)
    loss = t._compute_loss(None, inputs)
    loss.backward()
    assert policy.grad is not None
    metrics = {k: v[-1] for k, v in t._metrics["train"].items()}
    return loss.item(), metrics, policy.grad.numpy()


def _ours(logps, old, ref, advantages, completion, **kw):
    def loss(lp):
        out = grpo_loss(lp, old, ref, advantages, completion, num_completions=N, **kw)
        return out.loss, out

    (value, out), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logps))
    return float(value), out, np.asarray(grad)


CONFIGS = {  # beta, epsilon_high, whether old_logps are given, dapo's num_items_in_batch
    "beta0-symmetric": dict(beta=0.0, epsilon_high=None, old=True, num_items=None),
    "kl-clip_higher": dict(beta=0.04, epsilon_high=0.28, old=True, num_items=40),
    "kl-on_policy": dict(beta=0.04, epsilon_high=None, old=False, num_items=None),
    "beta0-clip_higher-on_policy": dict(beta=0.0, epsilon_high=0.28, old=False, num_items=70),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_loss_metrics_and_gradient_match_trl(loss_type, config):
    c = CONFIGS[config]
    logps, old, ref, mask = _data()
    old = old if c["old"] else None
    kw = dict(loss_type=loss_type, beta=c["beta"], epsilon=0.2, epsilon_high=c["epsilon_high"])
    extra = {}
    if loss_type == "dr_grpo":
        extra["max_completion_length"] = 10  # the generation limit, longer than this batch
    if loss_type == "dapo":
        extra["num_items_in_batch"] = c["num_items"]
    trl_extra = {"max_completion_length": 10, "num_items_in_batch": None, **extra}
    want_loss, want_metrics, want_grad = _trl_loss(
        logps, old, ref, ADVANTAGES, mask, **kw, **trl_extra
    )
    completion = np.where(mask, np.arange(N)[:, None], -1).astype(np.int32)
    with jax.enable_x64(True):
        loss, out, grad = _ours(
            logps, old, ref if c["beta"] else None, ADVANTAGES, completion, **kw, **extra
        )
        metrics = {k: float(v) for k, v in out.metrics().items()}
    np.testing.assert_allclose(loss, want_loss, rtol=0, atol=TOL)
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=TOL)
    assert np.abs(grad).max() > 1e-3 and (grad[~mask] == 0).all()
    assert ("kl" in metrics) == (c["beta"] > 0) == ("kl" in want_metrics)
    if c["beta"]:
        np.testing.assert_allclose(metrics["kl"], want_metrics["kl"], rtol=0, atol=TOL)
    for name in (
        "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
        "clip_ratio/low_min", "clip_ratio/high_max",
    ):  # fmt: skip
        np.testing.assert_allclose(metrics[name], want_metrics[name], atol=1e-7, err_msg=name)
    if c["old"]:  # ratios outside the clip range on both sides, where the sign makes it bite
        assert want_metrics["clip_ratio/low_mean"] > 0 and want_metrics["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_nan_padding_is_never_read(loss_type):
    logps, old, ref, mask = _data(seed=1)
    completion = np.where(mask, np.arange(N)[:, None], -1).astype(np.int32)
    kw = dict(beta=0.04, loss_type=loss_type)
    if loss_type == "dr_grpo":
        kw["max_completion_length"] = L
    nan = lambda x: np.where(mask, x, np.nan)
    with jax.enable_x64(True):
        clean = _ours(logps, old, ref, ADVANTAGES, completion, **kw)
        dirty = _ours(nan(logps), nan(old), nan(ref), ADVANTAGES, completion, **kw)
    assert clean[0] == dirty[0]
    np.testing.assert_array_equal(clean[2], dirty[2])
    assert all(np.isfinite(float(v)) for v in dirty[1].metrics().values())


def _packed(values, mask, fill):
    """The completions of a [N, L] array laid out in 2 packed rows of 20, with unlabelled
    positions (a prompt, a completion's last token, padding) between them: completion i's
    tokens at positions[i], the others holding ``fill``."""
    rows = np.full((2, 20), fill, dtype=values.dtype)
    completion = np.full((2, 20), -1, np.int32)
    starts = {0: (0, 2), 1: (0, 12), 2: (0, 18), 3: (1, 1), 4: (1, 5), 5: (1, 6)}  # (row, start)
    positions = {}
    for i, (r, s) in starts.items():
        cols = np.arange(s, s + LENGTHS[i])
        positions[i] = (r, cols)
        rows[r, cols] = values[i, mask[i]]
        completion[r, cols] = i
    assert (completion >= 0).sum() == mask.sum() and (completion == -1).any()
    return rows, completion, positions


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_packed_rows_equal_the_padded_layout(loss_type):
    """One loss for any layout: TRL's padded [N, L] and packed rows with interleaved -1s."""
    logps, old, ref, mask = _data(seed=2)
    kw = dict(beta=0.04, epsilon_high=0.28, loss_type=loss_type, num_completions=N)
    if loss_type == "dr_grpo":
        kw["max_completion_length"] = L
    padded_completion = np.where(mask, np.arange(N)[:, None], -1).astype(np.int32)
    packed = [_packed(x, mask, np.nan) for x in (logps, old, ref)]
    completion = packed[0][1]
    with jax.enable_x64(True):
        adv = jnp.asarray(ADVANTAGES)
        f = lambda lp, o, r, c: grpo_loss(lp, o, r, adv, c, **kw)
        padded = jax.value_and_grad(lambda lp: f(lp, old, ref, padded_completion).loss)
        rows = jax.value_and_grad(lambda lp: f(lp, packed[1][0], packed[2][0], completion).loss)
        loss_a, grad_a = padded(jnp.asarray(logps))
        loss_b, grad_b = rows(jnp.asarray(packed[0][0]))
        metrics_a = f(logps, old, ref, padded_completion).metrics()
        metrics_b = f(packed[0][0], packed[1][0], packed[2][0], completion).metrics()
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-14, atol=0)
    grad_a, grad_b = np.asarray(grad_a), np.asarray(grad_b)
    for i, (r, cols) in packed[0][2].items():
        np.testing.assert_allclose(grad_b[r, cols], grad_a[i, mask[i]], rtol=1e-14, atol=1e-16)
    assert (grad_b[completion == -1] == 0).all()
    for name, value in metrics_a.items():
        np.testing.assert_allclose(float(metrics_b[name]), float(value), rtol=1e-14, err_msg=name)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_a_group_of_equal_rewards_has_zero_advantage_and_finite_gradients(scale_rewards):
    rewards = jnp.array([0.1, 0.1, 0.1, 0.7, 0.2, 0.1])  # group 0 all equal
    advantages = group_advantages(rewards, 3, scale_rewards=scale_rewards)
    assert advantages.tolist()[:3] == [0.0, 0.0, 0.0]
    assert np.abs(np.asarray(advantages[3:])).min() > 0
    logps, old, _, mask = _data(seed=3)
    completion = jnp.asarray(np.where(mask, np.arange(N)[:, None], -1).astype(np.int32))
    loss = lambda lp: grpo_loss(lp, old, None, advantages, completion, num_completions=N).loss
    value, grad = jax.value_and_grad(loss)(jnp.asarray(logps, jnp.float32))
    grad = np.asarray(grad)
    assert np.isfinite(float(value)) and np.isfinite(grad).all()
    assert (grad[:3] == 0).all() and np.abs(grad[3:]).max() > 0  # zero advantage: no push


def test_jit_compiles_once_for_new_values():
    logps, old, ref, mask = _data(seed=4)
    completion = np.where(mask, np.arange(N)[:, None], -1).astype(np.int32)
    step = jax.jit(functools.partial(grpo_loss, num_completions=N, beta=0.04, epsilon_high=0.28))
    for seed in range(3):
        rng = np.random.default_rng(seed)
        args = [jnp.asarray(x + rng.normal(size=x.shape), jnp.float32) for x in (logps, old, ref)]
        out = step(*args, jnp.asarray(ADVANTAGES, jnp.float32), completion)
        assert np.isfinite(float(out.loss))
    assert step._cache_size() == 1


# --- Bad arguments ----------------------------------------------------------------------------


def test_group_advantages_bad_arguments_are_named():
    rewards = jnp.arange(6.0)
    with pytest.raises(ValueError, match=r"multiple of group_size.*6 rewards and group_size=4"):
        group_advantages(rewards, 4)
    with pytest.raises(ValueError, match=r"group_size must be >= 2.*group_size=1"):
        group_advantages(rewards, 1)
    with pytest.raises(ValueError, match=r"group_size must be a positive int.*group_size=0"):
        group_advantages(rewards, 0)
    with pytest.raises(TypeError, match=r"group_size must be an int.*group_size=2.0"):
        group_advantages(rewards, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"scale_rewards must be one of .*'group'.*'std'"):
        group_advantages(rewards, 3, scale_rewards="std")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rewards_N must be \[N\].*\(2, 3\)"):
        group_advantages(rewards.reshape(2, 3), 3)
    with pytest.raises(TypeError, match=r"rewards_N must be a floating array.*int"):
        group_advantages(jnp.arange(6), 3)


def test_grpo_loss_bad_arguments_are_named():
    logps, old, ref, mask = _data()
    completion = np.where(mask, np.arange(N)[:, None], -1).astype(np.int32)
    adv = ADVANTAGES
    call = functools.partial(grpo_loss, num_completions=N)
    with pytest.raises(ValueError, match=r"loss_type must be one of .*'dapo'.*got loss_type='ppo'"):
        call(logps, old, ref, adv, completion, loss_type="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"old_logps.shape=\(6, 7\) and logps.shape=\(6, 8\)"):
        call(logps, old[:, :7], ref, adv, completion)
    with pytest.raises(ValueError, match=r"ref_logps.shape=\(8, 6\) and logps.shape=\(6, 8\)"):
        call(logps, old, ref.T, adv, completion)
    with pytest.raises(ValueError, match=r"completion.shape=\(1, 48\) and logps.shape=\(6, 8\)"):
        call(logps, old, ref, adv, completion.reshape(1, -1))
    with pytest.raises(TypeError, match=r"completion must hold integer.*float"):
        call(logps, old, ref, adv, completion.astype(np.float32))
    with pytest.raises(ValueError, match=r"advantages.shape=\(5,\) and num_completions=6"):
        call(logps, old, ref, adv[:5], completion)
    with pytest.raises(ValueError, match=r"beta must be a finite number >= 0, got beta=-0.1"):
        call(logps, old, ref, adv, completion, beta=-0.1)
    for name in ("epsilon", "epsilon_high"):
        for value in (0.0, -0.2):
            with pytest.raises(ValueError, match=rf"{name} must be .* > 0, got {name}={value}"):
                call(logps, old, ref, adv, completion, **{name: value})
    with pytest.raises(ValueError, match=r"ref_logps is None, but beta=0.04 > 0"):
        call(logps, old, None, adv, completion, beta=0.04)
    with pytest.raises(ValueError, match=r"give max_completion_length.*=None"):
        call(logps, old, ref, adv, completion, loss_type="dr_grpo")
    with pytest.raises(ValueError, match=r"max_completion_length must be a positive int.*=0"):
        call(logps, old, ref, adv, completion, loss_type="dr_grpo", max_completion_length=0)
    with pytest.raises(ValueError, match=r"max_completion_length is dr_grpo's.*'grpo'.*=8"):
        call(logps, old, ref, adv, completion, loss_type="grpo", max_completion_length=8)
    with pytest.raises(ValueError, match=r"num_items_in_batch is dapo's.*'bnpo'.*=40"):
        call(logps, old, ref, adv, completion, loss_type="bnpo", num_items_in_batch=40)
    with pytest.raises(ValueError, match=r"num_items_in_batch must be a token count >= 0.*=-1"):
        call(logps, old, ref, adv, completion, num_items_in_batch=-1)
    with pytest.raises(ValueError, match=r"num_completions must be a positive int.*=0"):
        grpo_loss(logps, old, ref, adv, completion, num_completions=0)
