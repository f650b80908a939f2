"""rudax.post_train: DPO and GRPO losses as pure functions over log-probabilities.

The definitions are TRL 1.16's (``DPOTrainer``, ``GRPOTrainer``), checked against TRL's own
code in the tests. ``token_logprobs`` takes a model's logits to per-token log-probabilities
(at the sampling temperature); ``per_completion_sum`` and ``completion_token_counts`` reduce
per-token values to per-completion ones over any layout, TRL's one completion per row or
rows packed with a shared prompt (``rudax.models.pack_shared_prefix``'s ``completion``);
``dpo_loss`` is DPO and its IPO, hinge and robust variants; ``group_advantages`` and
``grpo_loss`` are GRPO with the Dr. GRPO, BNPO and DAPO normalizations. ``dpo_loss_sum``
and ``grpo_loss_sum`` are the losses of a LoRA policy on packed shared-prefix rows (each
prompt computed once for its answers, the reference the model with its adapters off), as
``rudax.sharding.make_train_steps`` takes a loss: a sum and its weight.
"""

# Public names, re-exported one per line (``from rudax.post_train._x import a as a``), sorted
# as isort sorts them, and listed again in __all__.
from rudax.post_train._dpo import DPO_LOSS_TYPES as DPO_LOSS_TYPES
from rudax.post_train._dpo import DPOOutput as DPOOutput
from rudax.post_train._dpo import dpo_loss as dpo_loss
from rudax.post_train._dpo_batch import dpo_loss_sum as dpo_loss_sum
from rudax.post_train._grpo import GRPO_LOSS_TYPES as GRPO_LOSS_TYPES
from rudax.post_train._grpo import GRPOOutput as GRPOOutput
from rudax.post_train._grpo import group_advantages as group_advantages
from rudax.post_train._grpo import grpo_loss as grpo_loss
from rudax.post_train._grpo_batch import grpo_loss_sum as grpo_loss_sum
from rudax.post_train._logprobs import IGNORE_INDEX as IGNORE_INDEX
from rudax.post_train._logprobs import completion_token_counts as completion_token_counts
from rudax.post_train._logprobs import per_completion_sum as per_completion_sum
from rudax.post_train._logprobs import token_logprobs as token_logprobs
from rudax.post_train._preference import tokenize_preference as tokenize_preference
from rudax.post_train._rewards import RewardError as RewardError
from rudax.post_train._rewards import Rewards as Rewards
from rudax.post_train._rewards import compute_rewards as compute_rewards
from rudax.post_train._rewards import exact_match_reward as exact_match_reward
from rudax.post_train._rewards import format_reward as format_reward
from rudax.post_train._rewards import load_reward as load_reward
from rudax.post_train._rollout import LogprobMismatchError as LogprobMismatchError
from rudax.post_train._rollout import Rollout as Rollout
from rudax.post_train._rollout import rollout as rollout

__all__ = [
    "DPO_LOSS_TYPES",
    "GRPO_LOSS_TYPES",
    "IGNORE_INDEX",
    "DPOOutput",
    "GRPOOutput",
    "LogprobMismatchError",
    "RewardError",
    "Rewards",
    "Rollout",
    "completion_token_counts",
    "compute_rewards",
    "dpo_loss",
    "dpo_loss_sum",
    "exact_match_reward",
    "format_reward",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_sum",
    "load_reward",
    "per_completion_sum",
    "rollout",
    "token_logprobs",
    "tokenize_preference",
]
