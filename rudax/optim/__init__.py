"""rudax.optim: optax-compatible optimizers and the training math around them.

Every optimizer here is an ``optax.GradientTransformation`` whose update rule and defaults
follow PyTorch's ``torch.optim``; it composes with ``optax.chain`` and every optax transform.
Every ``update`` checks, at trace time, that the gradients have the parameters' tree and
shapes and that each state tree has them too: a mismatch (a broadcastable (1, 3) gradient for
a (4, 3) parameter included) is a ValueError naming "gradients" or "state", the pytree path
and both shapes, never a silent broadcast.
"""

# Public names, re-exported one per line (``from rudax.optim._x import a as a``), sorted as
# isort sorts them, and listed again in __all__.
from rudax.optim._accumulation import GradientAccumulator as GradientAccumulator
from rudax.optim._adagrad import adagrad as adagrad
from rudax.optim._adam import adam as adam
from rudax.optim._adam import adamw as adamw
from rudax.optim._adan import adan as adan
from rudax.optim._adan import scale_by_adan as scale_by_adan
from rudax.optim._apply import update_and_apply as update_and_apply
from rudax.optim._clipping import ClipByGlobalNormState as ClipByGlobalNormState
from rudax.optim._clipping import clip_by_global_norm as clip_by_global_norm
from rudax.optim._clipping import clip_per_parameter as clip_per_parameter
from rudax.optim._fused_adamw import FusedAdamWState as FusedAdamWState
from rudax.optim._fused_adamw import fused_adamw as fused_adamw
from rudax.optim._inject import inject_hyperparams as inject_hyperparams
from rudax.optim._lbfgs import ScaleByLBFGSState as ScaleByLBFGSState
from rudax.optim._lbfgs import lbfgs as lbfgs
from rudax.optim._lbfgs import scale_by_lbfgs as scale_by_lbfgs
from rudax.optim._linesearch import scale_by_strong_wolfe as scale_by_strong_wolfe
from rudax.optim._loss_scale import DynamicLossScaleState as DynamicLossScaleState
from rudax.optim._loss_scale import dynamic_loss_scale as dynamic_loss_scale
from rudax.optim._loss_scale import loss_scale as loss_scale
from rudax.optim._master import Fp32MasterState as Fp32MasterState
from rudax.optim._master import fp32_master as fp32_master
from rudax.optim._muon import muon as muon
from rudax.optim._muon import scale_by_muon as scale_by_muon
from rudax.optim._nonfinite import SkipNonfiniteState as SkipNonfiniteState
from rudax.optim._nonfinite import skip_nonfinite as skip_nonfinite
from rudax.optim._rmsprop import rmsprop as rmsprop
from rudax.optim._schedules import constant_schedule as constant_schedule
from rudax.optim._schedules import cosine_decay_schedule as cosine_decay_schedule
from rudax.optim._schedules import cosine_onecycle_schedule as cosine_onecycle_schedule
from rudax.optim._schedules import exponential_decay as exponential_decay
from rudax.optim._schedules import join_schedules as join_schedules
from rudax.optim._schedules import linear_schedule as linear_schedule
from rudax.optim._schedules import piecewise_constant_schedule as piecewise_constant_schedule
from rudax.optim._schedules import polynomial_schedule as polynomial_schedule
from rudax.optim._schedules import step_schedule as step_schedule
from rudax.optim._schedules import warmup_cosine_decay_schedule as warmup_cosine_decay_schedule
from rudax.optim._sgd import sgd as sgd

__all__ = [
    "ClipByGlobalNormState",
    "DynamicLossScaleState",
    "Fp32MasterState",
    "FusedAdamWState",
    "GradientAccumulator",
    "ScaleByLBFGSState",
    "SkipNonfiniteState",
    "adagrad",
    "adam",
    "adamw",
    "adan",
    "clip_by_global_norm",
    "clip_per_parameter",
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "dynamic_loss_scale",
    "exponential_decay",
    "fp32_master",
    "fused_adamw",
    "inject_hyperparams",
    "join_schedules",
    "lbfgs",
    "linear_schedule",
    "loss_scale",
    "muon",
    "piecewise_constant_schedule",
    "polynomial_schedule",
    "rmsprop",
    "scale_by_adan",
    "scale_by_lbfgs",
    "scale_by_muon",
    "scale_by_strong_wolfe",
    "sgd",
    "skip_nonfinite",
    "step_schedule",
    "update_and_apply",
    "warmup_cosine_decay_schedule",
]
