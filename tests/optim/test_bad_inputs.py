"""rudax.optim's part of the catalog of bad inputs (issue 11): real user mistakes, one table.

Each case is a mistake a user makes with the optimizers, schedules, clipping, accumulation,
fp32 masters or loss scaling, and what rudax must answer: the exception and the words that
name the argument, the pytree path or the value. The ``Holds`` cases are mistakes that used to
give a silently wrong result and are now handled (weights loaded after ``tx.init``, an empty
matrix under Muon); their checks assert the right result.
"""

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import rudax.optim as ro
from tests._catalog import Bad, Holds, catalog
from tests.optim._harness import assert_follows_replaced_params

P = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
ONE_ROW = {"w": jnp.ones((1, 3)), "b": jnp.ones((3,))}  # broadcasts over the four rows
TRANSPOSED = {"w": jnp.ones((3, 4)), "b": jnp.ones((3,))}


def update(tx, grads, params=P, *, state_params=None):
    """One update of tx built on state_params (default params) with the given gradients."""
    return tx.update(grads, tx.init(P if state_params is None else state_params), params)


def add(grads, weight=None, params=P):
    return ro.GradientAccumulator.init(params).add(grads, weight=weight)


def muon_empty_matrix():
    params = {"w": jnp.ones((0, 3)), "b": jnp.ones((3,))}
    updates, _ = update(ro.muon(0.02), params, params, state_params=params)
    assert updates["w"].shape == (0, 3)
    assert bool(jnp.all(jnp.isfinite(updates["b"])))


def loss_scale_then_masters_on_loaded_weights():
    tx = ro.dynamic_loss_scale(ro.fp32_master(ro.sgd(0.0)), init_scale=4.0)
    zeros = {"w": jnp.zeros((3,), jnp.float16)}
    loaded = {"w": jnp.full((3,), 7.0, jnp.float16)}
    updates, _ = tx.update(zeros, tx.init(zeros), loaded)
    np.testing.assert_array_equal(np.asarray(optax.apply_updates(loaded, updates)["w"]), 7.0)


CASES = [
    # --- hyperparameters -----------------------------------------------------------------
    Bad("adamw-negative-lr", lambda: ro.adamw(-1e-3), ValueError, r"learning_rate=-0\.001"),
    Bad("adam-b1-one", lambda: ro.adam(0.1, b1=1.0), ValueError, r"b1 must be in \[0\.0, 1\.0\)"),
    Bad("adamw-lr-as-string", lambda: ro.adamw("3e-4"), TypeError, r"learning_rate='3e-4'"),
    Bad(
        "sgd-nesterov-without-momentum",
        lambda: ro.sgd(0.1, nesterov=True),
        ValueError,
        r"nesterov=True requires momentum > 0",
    ),
    Bad("rmsprop-nan-alpha", lambda: ro.rmsprop(0.1, alpha=float("nan")), ValueError, "alpha=nan"),
    Bad(
        "adagrad-negative-lr-decay", lambda: ro.adagrad(0.1, lr_decay=-0.1), ValueError, "lr_decay"
    ),
    Bad("adan-b3-above-one", lambda: ro.adan(0.1, b3=1.5), ValueError, r"b3=1\.5"),
    Bad("muon-ns-steps-100", lambda: ro.muon(0.02, ns_steps=100), ValueError, "ns_steps=100"),
    Bad("lbfgs-c2-below-c1", lambda: ro.lbfgs(c1=0.5, c2=0.4), ValueError, "c2 must be larger"),
    Bad(
        "fused_adamw-bf16-masters",
        lambda: ro.fused_adamw(0.1, master_dtype=jnp.bfloat16),
        ValueError,
        "master_dtype",
    ),
    # --- schedules --------------------------------------------------------------------------
    Bad(
        "step_schedule-zero-step-size",
        lambda: ro.step_schedule(0.1, 0, 0.5),
        ValueError,
        "step_size=0",
    ),
    Bad(
        "warmup-longer-than-decay",
        lambda: ro.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=100, decay_steps=50),
        ValueError,
        r"decay_steps=50, warmup_steps=100",
    ),
    Bad(
        "schedule-of-a-float-count",
        lambda: ro.step_schedule(0.1, 10, 0.5)(jnp.float32(3.0)),
        TypeError,
        "integer update count",
    ),
    # --- clipping ---------------------------------------------------------------------------
    Bad("clip-zero-max-norm", lambda: ro.clip_by_global_norm(0.0), ValueError, r"max_norm=0\.0"),
    Bad(
        "clip-int-gradient",
        lambda: update(ro.clip_per_parameter(1.0), {"w": jnp.ones((4, 3)), "b": jnp.ones(3, int)}),
        TypeError,
        r"\['b'\] must have a floating dtype",
    ),
    Bad(
        "clip-one-row-gradient",
        lambda: update(ro.clip_by_global_norm(1.0), ONE_ROW),
        ValueError,
        r"gradients\['w'\] has shape \(1, 3\), params\['w'\] has shape \(4, 3\)",
    ),
    # --- wrong trees and shapes (item 2) ----------------------------------------------------
    Bad(
        "adamw-one-row-gradient",
        lambda: update(ro.adamw(0.1), ONE_ROW),
        ValueError,
        r"adamw: gradients\['w'\] has shape \(1, 3\), params\['w'\] has shape \(4, 3\)",
    ),
    Bad(
        "sgd-transposed-gradient",
        lambda: update(ro.sgd(0.1, momentum=0.9), TRANSPOSED),
        ValueError,
        r"sgd: gradients\['w'\] has shape \(3, 4\)",
    ),
    Bad(
        "muon-gradient-extra-leaf",
        lambda: update(ro.muon(0.02), {**P, "head": jnp.ones((3, 2))}),
        ValueError,
        r"muon: gradients .*unexpected leaves .*\['head'\]",
    ),
    Bad(
        "adan-gradient-missing-leaf",
        lambda: update(ro.adan(0.1), {"w": P["w"]}),
        ValueError,
        r"adan: gradients .*missing leaves .*\['b'\]",
    ),
    Bad(
        "rmsprop-state-from-other-params",
        lambda: update(ro.rmsprop(0.1), P, state_params=ONE_ROW),
        ValueError,
        r"state\.square_avg\['w'\] has shape \(1, 3\), gradients\['w'\] has shape \(4, 3\)",
    ),
    Bad(
        "fused_adamw-state-from-other-params",
        lambda: update(ro.fused_adamw(0.1, impl="xla"), P, state_params=ONE_ROW),
        ValueError,
        r"fused_adamw: state\.exp_avg\['w'\] has shape \(1, 3\)",
    ),
    Bad(
        "lbfgs-transposed-gradient",
        lambda: update(ro.lbfgs(line_search=None), TRANSPOSED),
        ValueError,
        r"lbfgs: gradients\['w'\] has shape \(3, 4\)",
    ),
    Bad(
        "skip_nonfinite-one-row-gradient",
        lambda: update(ro.skip_nonfinite(ro.sgd(0.1)), ONE_ROW),
        ValueError,
        r"skip_nonfinite: gradients\['w'\]",
    ),
    Bad(
        "adagrad-nnx-state-gradients-for-dict-params",
        lambda: update(ro.adagrad(0.1), nnx.State(P)),
        ValueError,
        "different containers",
    ),
    # --- missing arguments -----------------------------------------------------------------
    Bad(
        "lbfgs-line-search-without-value-fn",
        lambda: update(ro.lbfgs(), P),
        TypeError,
        r"needs \['value', 'grad', 'value_fn'\]",
    ),
    Bad("muon-update-without-params", lambda: update(ro.muon(0.02), P, None), ValueError, "params"),
    Bad(
        "muon-3d-kernel-in-mask",
        lambda: ro.muon(0.02, muon_mask={"k": True}).init({"k": jnp.ones((2, 2, 2))}),
        ValueError,
        r"params\['k'\] has shape \(2, 2, 2\)",
    ),
    # --- accumulation -----------------------------------------------------------------------
    Bad(
        "accumulate-transposed-gradient",
        lambda: add(TRANSPOSED),
        ValueError,
        r"GradientAccumulator\.add: gradients\['w'\] has shape \(3, 4\), sums\['w'\]",
    ),
    Bad("accumulate-missing-leaf", lambda: add({"w": P["w"]}), ValueError, r"missing leaves .*'b'"),
    Bad("accumulate-negative-weight", lambda: add(P, weight=-3), ValueError, "weight=-3"),
    Bad(
        "accumulator-on-int-buffer",
        lambda: ro.GradientAccumulator.init({"step": jnp.zeros((), jnp.int32)}),
        TypeError,
        r"\['step'\] has dtype=int32",
    ),
    # --- fp32 masters (items 1 and 3) -------------------------------------------------------
    Bad(
        "fp32_master-complex-gradient",
        lambda: update(ro.fp32_master(ro.sgd(0.1)), {**P, "b": jnp.ones(3, jnp.complex64)}),
        TypeError,
        r"fp32_master: gradient \['b'\] must have a floating dtype, got dtype=complex64",
    ),
    Bad(
        "fp32_master-int-gradient",
        lambda: update(ro.fp32_master(ro.sgd(0.1)), {**P, "w": jnp.ones((4, 3), jnp.int32)}),
        TypeError,
        r"gradient \['w'\] .*dtype=int32",
    ),
    Bad(
        "fp32_master-one-row-gradient",
        lambda: update(ro.fp32_master(ro.adamw(0.1)), ONE_ROW),
        ValueError,
        r"fp32_master: gradients\['w'\] has shape \(1, 3\)",
    ),
    Bad(
        "fp32_master-int-buffer-in-params",
        lambda: ro.fp32_master(ro.sgd(0.1)).init({**P, "step": jnp.zeros((), jnp.int32)}),
        TypeError,
        r"parameter \['step'\] has dtype=int32",
    ),
    Bad("fp32_master-uncalled-inner", lambda: ro.fp32_master(ro.sgd), TypeError, "inner"),
    Bad(
        "fp32_master-update-without-params",
        lambda: update(ro.fp32_master(ro.sgd(0.1)), P, None),
        ValueError,
        "needs params",
    ),
    Holds(
        "fp32_master-weights-loaded-after-init",
        lambda: assert_follows_replaced_params(
            lambda lr: ro.fp32_master(ro.adamw(lr)), jnp.dtype(jnp.bfloat16)
        ),
    ),
    Holds(
        "fused_adamw-weights-loaded-after-init",
        lambda: assert_follows_replaced_params(
            lambda lr: ro.fused_adamw(lr, impl="xla"), jnp.dtype(jnp.float16)
        ),
    ),
    Holds("muon-empty-matrix", muon_empty_matrix),
    # --- loss scaling -----------------------------------------------------------------------
    Bad(
        "loss-scale-min-above-init",
        lambda: ro.dynamic_loss_scale(ro.sgd(0.1), init_scale=8.0, min_scale=16.0),
        ValueError,
        r"min_scale=16\.0 and init_scale=8\.0",
    ),
    Bad(
        "loss-scale-growth-factor-one",
        lambda: ro.dynamic_loss_scale(ro.sgd(0.1), growth_factor=1.0),
        ValueError,
        r"growth_factor=1\.0",
    ),
    Bad(
        "loss_scale-of-a-state-without-one",
        lambda: ro.loss_scale(ro.adamw(0.1).init(P)),
        ValueError,
        "holds no DynamicLossScaleState",
    ),
    Bad(
        "loss-scale-one-row-gradient",
        lambda: update(ro.dynamic_loss_scale(ro.fp32_master(ro.sgd(0.1))), ONE_ROW),
        ValueError,
        r"dynamic_loss_scale: gradients\['w'\] has shape \(1, 3\)",
    ),
    Holds("loss-scale-masters-on-loaded-weights", loss_scale_then_masters_on_loaded_weights),
]

test_bad_input = catalog(CASES)


def test_catalog_is_large_enough():
    assert len(CASES) >= 18, len(CASES)
