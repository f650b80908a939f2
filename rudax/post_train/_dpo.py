"""``dpo_loss``: Direct Preference Optimization and its variants, as TRL 1.16 defines them.

The losses are functions of four numbers per preference pair: the summed log-probabilities of
the chosen and the rejected completion under the policy and under the frozen reference. In
a packed shared-prefix batch (``rudax.models.pack_shared_prefix`` with ``[chosen, rejected]``
as each prompt's completions) they are ``per_completion_sum(token_logprobs(...), completion,
2 * N)`` split into even (chosen) and odd (rejected) completions.

The definitions are TRL's ``DPOTrainer._compute_loss`` (trl 1.16.0,
``trl/trainer/dpo_trainer.py``), with ``f_divergence_type="reverse_kl"``, one loss type,
``ld_alpha=None`` and no WPO weighting (TRL's defaults); tests/post_train/test_dpo.py runs
TRL's own method on the same numbers.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from rudax._validation import check_in_range, check_positive
from rudax.post_train._logprobs import _compute_dtype, _floating

__all__ = ["DPO_LOSS_TYPES", "DPOOutput", "dpo_loss"]

DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust"]
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "robust")


class DPOOutput(NamedTuple):
    """What ``dpo_loss`` returns: per-pair losses and implicit rewards.

    Attributes:
      losses: shape=[N]: each pair's loss; the training loss is their mean (``loss``).
      chosen_rewards: shape=[N]: ``beta * (chosen_logps - ref_chosen_logps)``, no gradient.
      rejected_rewards: shape=[N]: ``beta * (rejected_logps - ref_rejected_logps)``, no
        gradient.
    """

    losses: jax.Array
    chosen_rewards: jax.Array
    rejected_rewards: jax.Array

    @property
    def loss(self) -> jax.Array:
        """The mean of the per-pair losses: TRL's loss."""
        return jnp.mean(self.losses)

    def metrics(self) -> dict[str, jax.Array]:
        """The reward statistics TRL logs, under TRL's names (means over the N pairs).

        ``rewards/chosen`` and ``rewards/rejected`` are the mean rewards, ``rewards/margins``
        the mean of ``chosen - rejected`` and ``rewards/accuracies`` the fraction of pairs
        whose chosen reward is strictly greater. Over several microbatches or devices, weight
        each batch's means by its number of pairs (TRL gathers all pairs, then averages).
        """
        chosen, rejected = self.chosen_rewards, self.rejected_rewards
        return {
            "rewards/chosen": jnp.mean(chosen),
            "rewards/rejected": jnp.mean(rejected),
            "rewards/accuracies": jnp.mean((chosen > rejected).astype(chosen.dtype)),
            "rewards/margins": jnp.mean(chosen - rejected),
        }


def dpo_loss(
    chosen_logps: ArrayLike,
    rejected_logps: ArrayLike,
    ref_chosen_logps: ArrayLike,
    ref_rejected_logps: ArrayLike,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: DPOLossType = "sigmoid",
    chosen_lengths: ArrayLike | None = None,
    rejected_lengths: ArrayLike | None = None,
) -> DPOOutput:
    """The DPO loss of N preference pairs (and its IPO, hinge and robust variants).

    With the log-ratios ``c = chosen_logps - ref_chosen_logps``, ``r = rejected_logps -
    ref_rejected_logps`` and ``d = c - r``, each pair's loss is::

        sigmoid: -log sigmoid(beta d)
        hinge:   max(0, 1 - beta d)
        ipo:     (c / |chosen| - r / |rejected| - 1 / (2 beta))^2
        robust:  (-(1 - eps) log sigmoid(beta d) + eps log sigmoid(-beta d)) / (1 - 2 eps)

    with ``eps = label_smoothing`` and ``|chosen|``, ``|rejected|`` the completions' token
    counts (at least 1). The loss is the mean over pairs; the rewards are ``beta c`` and
    ``beta r`` without gradient.

    Where TRL 1.16 differs from older TRL (and from the papers' formulas as often quoted):

    * ``sigmoid`` takes no label smoothing: the conservative-DPO term ``-eps log
      sigmoid(-beta d)`` of older TRL's ``dpo_loss`` is gone, and ``label_smoothing`` is read
      by ``robust`` (and EXO) only. Here a nonzero ``label_smoothing`` with another loss type
      is a ValueError rather than silently ignored.
    * ``ipo`` divides each log-ratio by its completion's token count inside the loss (the IPO
      authors' per-token form, TRL's comment says), so it needs ``chosen_lengths`` and
      ``rejected_lengths``; older TRL averaged the log-probs in its forward pass instead, so
      its ipo rewards were per token too, while 1.16's rewards are ``beta`` times the summed
      log-ratios for every loss type.

    Args:
      chosen_logps: ``[N]`` the policy's log-probabilities of the chosen completions, summed
        over their tokens.
      rejected_logps: ``[N]`` the same for the rejected completions.
      ref_chosen_logps: ``[N]`` the reference policy's, for the chosen completions.
      ref_rejected_logps: ``[N]`` the reference policy's, for the rejected completions.
      beta: the strength of the KL regularization, a number > 0 (TRL's default 0.1); for
        ``ipo`` the regularization parameter tau.
      label_smoothing: for ``robust``, the probability that a preference label is flipped,
        in ``[0, 0.5)`` (TRL warns outside it; at 0.5 the loss divides by zero); must be 0
        for the other loss types.
      loss_type: ``"sigmoid"`` (TRL's default), ``"ipo"``, ``"hinge"`` or ``"robust"``.
      chosen_lengths: ``[N]`` integer token counts of the chosen completions, needed by
        ``ipo`` only (``completion_token_counts``).
      rejected_lengths: ``[N]`` the same for the rejected completions.

    The inputs are computed in float32 (float64 if any is float64). Shapes and arguments are
    checked at trace time.

    Returns:
      A ``DPOOutput``: ``losses`` ``[N]``, ``chosen_rewards``, ``rejected_rewards``; its
      ``loss`` is the mean and ``metrics()`` TRL's logged reward statistics.

    Example:
      >>> import jax.numpy as jnp
      >>> from rudax.post_train import dpo_loss
      >>> out = dpo_loss(jnp.array([-5.0, -9.0]), jnp.array([-7.0, -8.0]),
      ...                jnp.array([-6.0, -8.0]), jnp.array([-6.0, -8.0]), beta=0.5)
      >>> round(float(out.loss), 4), out.chosen_rewards.tolist()
      (0.6437, [0.5, -0.5])
      >>> {k: round(float(v), 3) for k, v in out.metrics().items()}
      {'rewards/chosen': 0.0, 'rewards/rejected': -0.25,
       'rewards/accuracies': 0.5, 'rewards/margins': 0.25}

    References:
      Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly
      a Reward Model" (https://arxiv.org/abs/2305.18290). Azar et al. 2023, "A General
      Theoretical Paradigm to Understand Learning from Human Preferences" (IPO,
      https://arxiv.org/abs/2310.12036). Chowdhury et al. 2024, "Provably Robust DPO:
      Aligning Language Models with Noisy Feedback" (https://arxiv.org/abs/2403.00409).
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type=!r}")
    beta = check_positive("beta", beta, accept="concrete")
    if loss_type == "robust":
        label_smoothing = check_in_range(
            "label_smoothing", label_smoothing, 0.0, 0.5, accept="concrete"
        )
    elif check_in_range("label_smoothing", label_smoothing, 0.0, 1.0, accept="concrete") != 0:
        raise ValueError(
            f"label_smoothing is used by loss_type='robust' only (TRL 1.16's {loss_type!r} loss "
            f"has no label smoothing), got {label_smoothing=} with {loss_type=!r}"
        )
    if loss_type != "ipo" and (chosen_lengths is not None or rejected_lengths is not None):
        raise ValueError(
            f"chosen_lengths and rejected_lengths are used by loss_type='ipo' only, got them "
            f"with {loss_type=!r}"
        )
    named = {
        "chosen_logps": chosen_logps,
        "rejected_logps": rejected_logps,
        "ref_chosen_logps": ref_chosen_logps,
        "ref_rejected_logps": ref_rejected_logps,
    }
    arrays = {name: _floating(name, value) for name, value in named.items()}
    shape = arrays["chosen_logps"].shape
    if len(shape) != 1:
        raise ValueError(f"chosen_logps must be [N], one number per pair, got shape {shape}")
    for name, array in arrays.items():
        if array.shape != shape:
            raise ValueError(
                f"{name} must have chosen_logps's shape, got {name}.shape={array.shape} and "
                f"chosen_logps.shape={shape}"
            )
    dtype = _compute_dtype(*arrays.values())
    policy_c, policy_r, ref_c, ref_r = (a.astype(dtype) for a in arrays.values())
    chosen_logratios = policy_c - ref_c
    rejected_logratios = policy_r - ref_r
    delta = chosen_logratios - rejected_logratios

    if loss_type == "sigmoid":
        losses = -jax.nn.log_sigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = jax.nn.relu(1 - beta * delta)
    elif loss_type == "ipo":
        chosen_n = _lengths("chosen_lengths", chosen_lengths, shape, dtype)
        rejected_n = _lengths("rejected_lengths", rejected_lengths, shape, dtype)
        # Per-token log-ratios: TRL's clamp(min=1) keeps an empty completion finite.
        ipo_delta = chosen_logratios / chosen_n - rejected_logratios / rejected_n
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    else:  # robust: the unbiased estimate of the clean loss under flip rate label_smoothing
        eps = label_smoothing
        clean = -(1 - eps) * jax.nn.log_sigmoid(beta * delta)
        flipped = -eps * jax.nn.log_sigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * eps)
    return DPOOutput(
        losses=losses,
        chosen_rewards=beta * jax.lax.stop_gradient(chosen_logratios),
        rejected_rewards=beta * jax.lax.stop_gradient(rejected_logratios),
    )


def _lengths(
    name: str, value: ArrayLike | None, shape: tuple[int, ...], dtype: DTypeLike
) -> jax.Array:
    """Token counts ``[N]`` as ``dtype``, at least 1 (TRL's ``clamp(min=1.0)``)."""
    if value is None:
        raise ValueError(
            f"loss_type='ipo' divides each log-ratio by its completion's token count: give "
            f"{name} ([N] ints, e.g. completion_token_counts(...)), got {name}=None"
        )
    lengths = jnp.asarray(value)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer token counts, got {name}.dtype={lengths.dtype}")
    if lengths.shape != shape:
        raise ValueError(
            f"{name} must have chosen_logps's shape, got {name}.shape={lengths.shape} and "
            f"chosen_logps.shape={shape}"
        )
    return jnp.maximum(lengths, 1).astype(dtype)
