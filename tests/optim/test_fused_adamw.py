"""Tests of rudax.optim.fused_adamw: equal to rudax.optim's unfused chain, the skip, bad input."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import rudax.optim as ro
from tests.kernels._lowering import assert_lowers_for_gpu
from tests.optim._bad_input import rejects
from tests.optim._harness import (
    as_tree_kind,
    assert_follows_replaced_params,
    conditionals,
    halving,
    skip_by_cond,
)
from tests.optim._injection import assert_bf16_keeps_fp32_hyperparameters, assert_injectable

# Pallas runs compiled on a GPU (benchmarks/gpu_check.sh), interpreted elsewhere.
INTERPRET = jax.default_backend() != "gpu"

SHAPES = {"dense": {"kernel": (3, 5), "bias": (7,)}, "scale": ()}
IMPLS = [pytest.param("xla", id="xla"), pytest.param("pallas", id="pallas")]


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def problem(num_steps, dtype, seed=0):
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    tree = lambda: treedef.unflatten(
        [jnp.asarray(rng.normal(size=s).astype(np.float32)).astype(dtype) for s in leaves]
    )
    return tree(), [tree() for _ in range(num_steps)]


def run(tx, params, grads):
    """Jitted updates; returns (params after each update, final state); asserts one compile."""
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    trajectory = []
    for g in grads:
        params, state = step(params, state, g)
        trajectory.append(params)
    assert step._cache_size() == 1
    return trajectory, state


def unfused(learning_rate, dtype, max_grad_norm, **kwargs):
    """What fused_adamw computes, as rudax.optim's chain of separate transforms."""
    tx = ro.adamw(learning_rate, **kwargs)
    if max_grad_norm is not None:
        tx = optax.chain(ro.clip_by_global_norm(max_grad_norm), tx)
    return ro.fp32_master(tx) if dtype == jnp.bfloat16 else tx


def assert_close_trees(got, want, dtype, what):
    # fp32: to rounding (a compiler may contract a multiply-add into an FMA on one side only);
    # bf16 storage: to one unit in the last place, for a master that lands on a rounding tie.
    rtol = 2**-7 if dtype == jnp.bfloat16 else 1e-5
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        assert g.dtype == w.dtype, f"{what} {jax.tree_util.keystr(path)}"
        np.testing.assert_allclose(
            np.asarray(g, np.float32),
            np.asarray(w, np.float32),
            rtol=rtol,
            atol=1e-6,
            err_msg=f"{what} {jax.tree_util.keystr(path)}",
        )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "dtype, learning_rate, max_grad_norm, tree_kind",
    [
        (jnp.float32, 1e-2, None, "dict"),
        (jnp.float32, halving, 1.0, "nnx_state"),
        (jnp.bfloat16, 1e-2, 1.0, "dict"),
        (jnp.bfloat16, halving, None, "nnx_state"),
    ],
    ids=["fp32", "fp32-schedule-clip-nnx", "bf16-clip", "bf16-schedule-nnx"],
)
def test_matches_unfused_chain(dtype, learning_rate, max_grad_norm, tree_kind, impl):
    params, grads = problem(20, dtype)
    params = as_tree_kind(params, tree_kind)
    grads = [as_tree_kind(g, tree_kind) for g in grads]
    # max_grad_norm 1.0 clips most of these steps (the gradients' norm is about 5).
    hyper = dict(b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)
    fused = ro.fused_adamw(
        learning_rate, **hyper, max_grad_norm=max_grad_norm, impl=impl, interpret=INTERPRET
    )
    got, state = run(fused, params, grads)
    want, want_state = run(unfused(learning_rate, dtype, max_grad_norm, **hyper), params, grads)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close_trees(g, w, dtype, f"params after update {step + 1}:")

    inner = want_state.inner_state if dtype == jnp.bfloat16 else want_state
    adam = (inner[1] if max_grad_norm else inner)[0]  # scale_by_torch_adam, first in the chain
    assert int(state.count) == int(adam.count) == 20
    assert_close_trees(state.exp_avg, adam.exp_avg, jnp.float32, "exp_avg")
    assert_close_trees(state.exp_avg_sq, adam.exp_avg_sq, jnp.float32, "exp_avg_sq")
    if max_grad_norm:
        np.testing.assert_allclose(float(state.global_norm), float(inner[0].global_norm), 1e-6)
    if dtype == jnp.bfloat16:
        assert_close_trees(state.master, want_state.master, jnp.float32, "master")
        for p, w in zip(jax.tree.leaves(got[-1]), jax.tree.leaves(state.master), strict=True):
            np.testing.assert_array_equal(bits(p), bits(w.astype(p.dtype)))
    else:
        assert jax.tree.leaves(state.master) == []  # fp32 parameters are their own masters
    assert not bool(state.skipped) and int(state.num_skipped) == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_nonfinite_step_is_skipped_whole(impl):
    params, grads = problem(4, jnp.bfloat16, seed=1)
    params["scale"] = jnp.asarray(-0.0, jnp.bfloat16)  # -0.0 must keep its sign bit
    tx = ro.fused_adamw(halving, max_grad_norm=1.0, impl=impl, interpret=INTERPRET)
    state = tx.init(params)
    step = jax.jit(tx.update)
    for g in grads[:2]:
        updates, state = step(g, state, params)
        params = optax.apply_updates(params, updates)
    bad = jax.tree.map(lambda g: g, grads[2])
    bad["dense"]["kernel"] = bad["dense"]["kernel"].at[1, 2].set(jnp.nan)
    bad["dense"]["bias"] = bad["dense"]["bias"].at[0].set(-jnp.inf)
    updates, skipped_state = step(bad, state, params)
    new_params = optax.apply_updates(params, updates)

    assert bool(skipped_state.skipped) and int(skipped_state.num_skipped) == 1
    assert all(
        np.all(bits(u) == bits(jnp.asarray(-0.0, u.dtype))) for u in jax.tree.leaves(updates)
    )
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new_params), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    unchanged = lambda s: (s.count, s.exp_avg, s.exp_avg_sq, s.master)
    for a, b in zip(
        jax.tree.leaves(unchanged(state)), jax.tree.leaves(unchanged(skipped_state)), strict=True
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert np.isnan(float(skipped_state.global_norm))

    # The next finite step continues as if the bad one never came (the schedule included).
    updates, after = step(grads[3], skipped_state, params)
    want_updates, want = step(grads[3], state, params)
    assert not bool(after.skipped) and int(after.count) == 3 and int(after.num_skipped) == 1
    for a, b in zip(
        jax.tree.leaves((updates, unchanged(after))),
        jax.tree.leaves((want_updates, unchanged(want))),
        strict=True,
    ):
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("impl", IMPLS)
def test_skip_is_a_select_not_a_conditional(impl):
    # A lax.cond around the update would materialize both branches' outputs, break
    # donation and fusion, and on a GPU read its predicate back to the host every step.
    params, (grads,) = problem(1, jnp.bfloat16)
    tx = ro.fused_adamw(halving, max_grad_norm=1.0, impl=impl, interpret=INTERPRET)
    assert conditionals(tx, params, grads, compiled=False) == 0
    # The interpreter lowers a Pallas grid to loops of its own: compiled HLO for XLA only.
    if impl == "xla":
        assert conditionals(tx, params, grads, compiled=True) == 0
    # and the counts see a skip written as a conditional
    cond_skip = skip_by_cond(unfused(1e-2, jnp.bfloat16, 1.0))
    assert conditionals(cond_skip, params, grads, compiled=False) >= 1
    # XLA:CPU keeps the conditional in the compiled program; XLA:GPU turned this small one
    # into selects (seen on an H200), so there only the traced count can see it.
    if jax.default_backend() == "cpu":
        assert conditionals(cond_skip, params, grads, compiled=True) >= 1


def test_without_skip_nonfinite_gradients_flow_through():
    params, grads = problem(1, jnp.float32)
    grads = grads[0]
    grads["scale"] = jnp.asarray(jnp.nan)
    tx = ro.fused_adamw(0.1, skip_nonfinite=False, impl="xla")
    updates, state = tx.update(grads, tx.init(params), params)
    assert not bool(state.skipped) and int(state.count) == 1
    assert np.isnan(float(updates["scale"])) and np.all(np.isfinite(updates["dense"]["bias"]))


@pytest.mark.parametrize("impl", IMPLS)
def test_finite_gradient_with_overflowing_norm_is_clipped_not_skipped(impl):
    params, grads = problem(1, jnp.float32)
    grads = grads[0]
    grads["scale"] = jnp.asarray(1e30, jnp.float32)  # its square overflows fp32
    tx = ro.fused_adamw(0.1, max_grad_norm=1.0, impl=impl, interpret=INTERPRET)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    ref = ro.skip_nonfinite(unfused(0.1, jnp.float32, 1.0))
    want, ref_state = jax.jit(ref.update)(grads, ref.init(params), params)
    assert not bool(state.skipped) and not bool(ref_state.last_skipped)
    assert float(state.global_norm) == np.inf
    assert_close_trees(updates, want, jnp.float32, "updates")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_hierarchical_stats_give_the_same_norm(dtype):
    params, grads = problem(3, dtype)
    flat = ro.fused_adamw(1e-2, max_grad_norm=1.0, impl="pallas", interpret=INTERPRET)
    two_level = ro.fused_adamw(
        1e-2, max_grad_norm=1.0, hierarchical_stats=True, impl="pallas", interpret=INTERPRET
    )
    got, state = run(two_level, params, grads)
    want, want_state = run(flat, params, grads)
    np.testing.assert_allclose(float(state.global_norm), float(want_state.global_norm), 1e-6)
    assert_close_trees(got[-1], want[-1], dtype, "params")


def test_master_dtype_none_keeps_moments_in_parameter_dtype():
    params, grads = problem(5, jnp.bfloat16)
    # fp32 gradients: the unfused optimizer then computes in fp32 too (its moment-dtype rule)
    grads = [jax.tree.map(lambda g: g.astype(jnp.float32), g) for g in grads]
    tx = ro.fused_adamw(1e-2, master_dtype=None, impl="xla")
    got, state = run(tx, params, grads)
    want, _ = run(ro.adamw(1e-2), params, grads)
    assert jax.tree.leaves(state.master) == []
    assert {x.dtype for x in jax.tree.leaves((state.exp_avg, state.exp_avg_sq))} == {
        jnp.dtype(jnp.bfloat16)
    }
    assert_close_trees(got[-1], want[-1], jnp.bfloat16, "params")


def test_state_dtypes_and_fields():
    params = {"a": jnp.ones((2,), jnp.bfloat16), "b": jnp.ones((3,), jnp.float16)}
    params["c"] = jnp.ones((), jnp.float32)
    state = ro.fused_adamw(1e-3).init(params)
    assert state.master["c"] is None
    assert state.master["a"].dtype == state.master["b"].dtype == jnp.float32
    for leaf in jax.tree.leaves((state.exp_avg, state.exp_avg_sq)):
        assert leaf.dtype == jnp.float32
    assert state.count.dtype == state.num_skipped.dtype == jnp.int32
    assert state.global_norm.dtype == jnp.float32 and state.skipped.dtype == jnp.bool_
    # masters are copies, never aliases of the parameters
    assert state.master["a"] is not params["a"]


def test_lowers_for_gpu():
    S = jax.ShapeDtypeStruct
    tx = ro.fused_adamw(
        halving, max_grad_norm=1.0, hierarchical_stats=True, impl="pallas", interpret=False
    )

    def update(kernel, bias, grad_kernel, grad_bias):
        params = {"kernel": kernel, "bias": bias}
        grads = {"kernel": grad_kernel, "bias": grad_bias}
        return tx.update(grads, tx.init(params), params)

    text = assert_lowers_for_gpu(
        update,
        S((300, 7), jnp.bfloat16),
        S((7,), jnp.float32),
        S((300, 7), jnp.bfloat16),
        S((7,), jnp.float32),
        kernels=["global_norm_partials", "adamw_update"],
    )
    # No branch for the GPU to sync on: lax.cond lowers to stablehlo.case (or .if).
    assert "stablehlo.case" not in text and "stablehlo.if" not in text


test_bad_hyperparameters = rejects(
    ro.fused_adamw,
    [
        ({"learning_rate": -1.0}, ValueError, r"learning_rate=-1\.0"),
        ({"b1": 1.0}, ValueError, r"b1=1\.0"),
        ({"b2": -0.5}, ValueError, r"b2=-0\.5"),
        ({"eps": -1e-8}, ValueError, "eps=-1e-08"),
        ({"weight_decay": float("nan")}, ValueError, "weight_decay=nan"),
        ({"max_grad_norm": 0.0}, ValueError, r"max_grad_norm=0\.0"),
        ({"skip_nonfinite": "yes"}, TypeError, "skip_nonfinite='yes'"),
        ({"master_dtype": jnp.bfloat16}, ValueError, "master_dtype="),
        ({"master_dtype": jnp.int32}, TypeError, "master_dtype="),
        ({"hierarchical_stats": 1}, TypeError, "hierarchical_stats=1"),
        ({"impl": "cuda"}, ValueError, "impl='cuda'"),
        ({"interpret": None}, TypeError, "interpret=None"),
    ],
    learning_rate=0.1,
)


@pytest.mark.parametrize(
    "params, grads, error, match",
    [
        ({"w": jnp.zeros(2)}, None, ValueError, "needs params"),
        ({"n": jnp.zeros(2, jnp.int32)}, {"n": jnp.zeros(2)}, TypeError, r"\['n'\].*int32"),
        ({"w": jnp.zeros(2)}, {"w": jnp.zeros(3)}, ValueError, r"\['w'\] has shape \(3,\)"),
        ({"w": jnp.zeros(2)}, {"w": jnp.zeros(2, jnp.int32)}, TypeError, r"\['w'\]"),
    ],
    ids=["no-params", "int-param", "shape", "int-grad"],
)
def test_bad_update_input(params, grads, error, match):
    tx = ro.fused_adamw(0.1, impl="xla")
    state = tx.init({"w": jnp.zeros(2)})
    with pytest.raises(error, match=match):
        if grads is None:
            tx.update(params, state)
        else:
            tx.update(grads, state, params)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=jnp.dtype)
@pytest.mark.parametrize("impl", IMPLS)
def test_params_replaced_after_init_are_adopted(impl, dtype):
    assert_follows_replaced_params(
        lambda lr: ro.fused_adamw(
            lr, weight_decay=0.1, max_grad_norm=1.0, impl=impl, interpret=INTERPRET
        ),
        jnp.dtype(dtype),
    )


def test_bf16_storage_example_in_numbers():
    # 1e-4 steps are below bf16's resolution at 1.0: only the master remembers them.
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    tx = ro.fused_adamw(1e-4, weight_decay=0.0, impl="xla")
    trajectory, state = run(tx, params, [{"w": jnp.ones((3,), jnp.bfloat16)}] * 30)
    master = float(state.master["w"][0])
    np.testing.assert_allclose(master, 1.0 - 30 * 1e-4, rtol=1e-6)  # Adam's first steps are lr
    # Plain bf16 steps of 1e-4 would leave 1.0 (half of bf16's spacing below 1 is 2**-9).
    assert float(trajectory[-1]["w"][0]) == float(ml_dtypes.bfloat16(master)) == 255 / 256


# ---------------------------------------------------------------------------------------------
# mask=: torch.optim.AdamW with a weight_decay=0 parameter group for the biases and norms.

torch = pytest.importorskip("torch", reason="torch is the reference (the test extra pins it)")

GROUP_SHAPES = {"w": (3, 4), "b": (4,), "norm": {"scale": (4,)}}


def _flat(tree):
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _group_problem(num_steps, seed=0):
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(GROUP_SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    params = treedef.unflatten([rng.standard_normal(s).astype(np.float32) for s in leaves])
    # Gradients that change sign and size, with a global norm near 4: a max_grad_norm of 1
    # clips every step.
    grads = [
        jax.tree.map(lambda p, t=t: (np.cos(t) + rng.standard_normal(p.shape)).astype(np.float32),
                     params)
        for t in range(num_steps)
    ]  # fmt: skip
    return params, grads


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "mask",
    [
        pytest.param(lambda p: jax.tree.map(lambda x: x.ndim >= 2, p), id="callable"),
        pytest.param({"w": True, "b": False, "norm": {"scale": False}}, id="tree"),
        pytest.param({"w": True, "b": False, "norm": False}, id="prefix"),
    ],
)
@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["no-clip", "clip"])
def test_mask_is_a_torch_parameter_group_without_decay(mask, max_grad_norm, impl):
    params, grads = _group_problem(8)
    tx = ro.fused_adamw(
        0.05, b1=0.8, b2=0.9, weight_decay=0.5, max_grad_norm=max_grad_norm, mask=mask,
        impl=impl, interpret=INTERPRET,
    )  # fmt: skip
    got, _ = run(
        tx, jax.tree.map(jnp.asarray, params), [jax.tree.map(jnp.asarray, g) for g in grads]
    )

    t = {k: torch.tensor(v, requires_grad=True) for k, v in _flat(params).items()}
    opt = torch.optim.AdamW(
        [{"params": [t["['w']"]]},
         {"params": [t["['b']"], t["['norm']['scale']"]], "weight_decay": 0.0}],
        lr=0.05, betas=(0.8, 0.9), weight_decay=0.5,
    )  # fmt: skip
    for g in grads:
        for k, v in _flat(g).items():
            t[k].grad = torch.tensor(v)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(t.values()), max_grad_norm)
        opt.step()
    for k, v in _flat(got[-1]).items():
        np.testing.assert_allclose(v, t[k].detach().numpy(), rtol=2e-5, atol=2e-6, err_msg=k)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_masked_leaves_step_exactly_as_without_decay(dtype):
    # Bit for bit: a spared leaf's trajectory is weight_decay=0's, a decayed one the decay's,
    # parameters, moments and masters alike.
    params, grads = problem(6, dtype, seed=2)
    mask = {"dense": {"kernel": True, "bias": False}, "scale": False}
    make = lambda **kw: ro.fused_adamw(0.05, max_grad_norm=1.0, **kw)
    masked, masked_state = run(make(weight_decay=0.5, mask=mask), params, grads)
    decayed, decayed_state = run(make(weight_decay=0.5), params, grads)
    spared, spared_state = run(make(weight_decay=0.0), params, grads)
    for got, with_decay, without in zip(
        [*masked, masked_state.exp_avg, masked_state.master],
        [*decayed, decayed_state.exp_avg, decayed_state.master],
        [*spared, spared_state.exp_avg, spared_state.master],
        strict=True,
    ):
        want = {
            "dense": {"kernel": with_decay["dense"]["kernel"], "bias": without["dense"]["bias"]},
            "scale": without["scale"],
        }
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(bits(a), bits(b)), got, want)


def test_mask_matches_the_unfused_chain_with_bf16_masters():
    params, grads = problem(10, jnp.bfloat16, seed=3)
    mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    hyper = dict(b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.3, mask=mask)
    got, _ = run(ro.fused_adamw(1e-2, **hyper, max_grad_norm=1.0), params, grads)
    want, _ = run(unfused(1e-2, jnp.bfloat16, 1.0, **hyper), params, grads)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close_trees(g, w, jnp.bfloat16, f"params after update {step + 1}:")


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        ({"dense": {"kernel": 1, "bias": False}, "scale": False}, TypeError, r"mask\['dense'\]"),
        ({"dense": True}, ValueError, "fused_adamw: mask must have the parameters' tree"),
        (lambda p: [True], ValueError, "fused_adamw: mask must have"),
    ],
)
def test_bad_mask(mask, error, match):
    params, grads = problem(1, jnp.float32)
    with pytest.raises(error, match=match):
        tx = ro.fused_adamw(0.1, mask=mask)
        tx.update(grads[0], tx.init(params), params)


# ---------------------------------------------------------------------------------------------
# inject_hyperparams.

STRUCTURAL = ("skip_nonfinite", "master_dtype", "hierarchical_stats", "impl", "interpret", "mask")
INJECT_PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.array([0.5, -0.25])}
# Dyadic values, exact in float32 and float64 alike (test_adan.py's INJECT_KWARGS).
INJECT_KWARGS = dict(
    learning_rate=0.0625, b1=0.875, b2=0.9375, eps=2.0**-10, weight_decay=0.25, max_grad_norm=2.0
)
# A max_grad_norm of 0.25 clips these gradients (their norm is about 1.5); 2.0 does not.
NEW_VALUES = dict(
    learning_rate=0.125, b1=0.5, b2=0.75, eps=0.5, weight_decay=0.75, max_grad_norm=0.25
)


@pytest.mark.parametrize("mask", [None, {"w": True, "b": False}], ids=["all", "mask"])
def test_inject_hyperparams(mask):
    # Bit for bit: the kernel derives its per-step scalars in float32 from either kind.
    assert_injectable(
        ro.fused_adamw,
        {**INJECT_KWARGS, "mask": mask},
        INJECT_PARAMS,
        optax_static_args=STRUCTURAL,
        new_values=NEW_VALUES,
    )


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_state_structure_is_the_same_with_and_without_clipping(max_grad_norm):
    params = INJECT_PARAMS
    plain = jax.tree.structure(ro.fused_adamw(0.1, max_grad_norm=max_grad_norm).init(params))
    for wrap in (optax.inject_hyperparams(ro.fused_adamw, static_args=STRUCTURAL),
                 ro.inject_hyperparams(ro.fused_adamw)):  # fmt: skip
        state = wrap(0.1, max_grad_norm=max_grad_norm).init(params)
        assert jax.tree.structure(state.inner_state) == plain
        assert ("max_grad_norm" in state.hyperparams) == (max_grad_norm is not None)
    unclipped = ro.fused_adamw(0.1).init(params)
    assert jax.tree.structure(unclipped) == plain


@pytest.mark.parametrize("master_dtype", [jnp.float32, None])
def test_inject_hyperparams_bf16_params_keep_fp32_hyperparameters(master_dtype):
    assert_bf16_keeps_fp32_hyperparameters(
        ro.fused_adamw, {**INJECT_KWARGS, "master_dtype": master_dtype}, INJECT_PARAMS
    )


def test_inject_without_static_args_names_the_fix():
    # A dtype is a callable, which optax takes for a schedule.
    tx = optax.inject_hyperparams(ro.fused_adamw)(learning_rate=0.1)
    with pytest.raises(TypeError, match=r"fused_adamw: master_dtype .*static_args"):
        tx.init(INJECT_PARAMS)


# ---------------------------------------------------------------------------------------------
# Complex parameters: real-only kernels, a TypeError naming the leaf and rudax.optim.adamw.


@pytest.mark.parametrize("where", ["init", "update"])
def test_complex_params_are_a_type_error_naming_the_path(where):
    params = {"layer": {"z": jnp.ones((2,), jnp.complex64)}, "w": jnp.ones(2)}
    tx = ro.fused_adamw(0.1)
    match = r"fused_adamw: (parameter|gradient) \['layer'\]\['z'\] has dtype=complex64.*adamw"
    with pytest.raises(TypeError, match=match):
        if where == "init":
            tx.init(params)
        else:
            real = jax.tree.map(jnp.real, params)
            tx.update(params, tx.init(real), real)


def test_update_accepts_extra_keyword_arguments():
    # optax's convention (GradientTransformationExtraArgs): arguments meant for other
    # transforms in a chain pass through.
    params, grads = problem(1, jnp.float32)
    tx = ro.fused_adamw(0.1)
    want, _ = tx.update(grads[0], tx.init(params), params)
    got, _ = tx.update(grads[0], tx.init(params), params, loss=jnp.float32(1.0))
    jax.tree.map(np.testing.assert_array_equal, got, want)
