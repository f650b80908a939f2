"""optax's generic optimizer checks, in our own words, run against every rudax optimizer.

optax holds each of its optimizers to the same checks (``optax/_src/alias_test.py``: the
``AliasTest`` class and the L-BFGS tests). This file applies them to rudax.optim:

* convergence on the parabola and on Rosenbrock's function in f32, in 10k jitted
  steps (one ``lax.fori_loop``, whose carry must keep its dtypes and shapes: optax's "does not
  recompile" check);
* extra keyword arguments to ``update`` are accepted;
* ``optax.inject_hyperparams`` and ``rudax.optim.inject_hyperparams`` give the plain optimizer's
  updates and state;
* explicit state dtypes (``moment_dtype``, optax's ``mu_dtype``) for real and complex
  parameters; complex parameters follow torch's real-view rule;
* updates keep the gradients' dtype, and the state its dtypes, in f16, bf16, f32 and f64;
* ``optax.MultiSteps`` accumulates and then applies the optimizer;
* L-BFGS against scipy's BFGS on the standard test functions.

rudax follows ``torch.optim``, not optax, where the two disagree. Those places are deliberate,
and each test that meets one says why and asserts rudax's documented behaviour:

* torch's default weight decay (AdamW 1e-2 where optax has 1e-4; Muon 0.1 where
  ``optax.contrib.muon`` has 0): the convergence table passes ``weight_decay=0`` and
  ``test_default_weight_decay_is_torchs`` checks the defaults;
* torch's L-BFGS tolerances (``tolerance_change=1e-9`` on the directional derivative): L-BFGS
  stops about 1e-5 from Matyas's minimizer, where optax's stops within 1e-5;
* complex parameters: torch's real view (each real and imaginary part its own coordinate, as
  ``torch.view_as_real``), where optax's adaptive optimizers share one ``|g|**2`` between the
  two; Muon, L-BFGS and fused AdamW refuse them with a TypeError; ``moment_dtype`` is a real
  dtype (a complex parameter's buffers are its complex counterpart), where optax takes
  ``mu_dtype=complex64``;
* float64 parameters for fused AdamW (its kernels store bf16, fp16 or fp32): a TypeError;
* L-BFGS passes ``update``'s extra keyword arguments on to the loss (``value_fn``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize

import rudax.optim as ro
from tests.optim._optax_problems import (
    STANDARD_FUNCTIONS,
    Target,
    as_row_matrix,
    parabola,
    rosenbrock,
)

# ----------------------------------------------------------------------------------------------
# The optimizers under test: optax's _OPTIMIZERS_UNDER_TEST for rudax, one entry per
# configuration, with learning rates at which each converges in 10k steps.


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    name: str  # the rudax.optim factory
    kwargs: dict[str, Any]

    @property
    def factory(self):
        return getattr(ro, self.name)

    def make(self, **overrides: Any) -> optax.GradientTransformation:
        return self.factory(**{**self.kwargs, **overrides})


CASES = [
    # optax's entry, the same: torch's momentum rule equals optax's without dampening.
    Case("sgd", "sgd", dict(learning_rate=1e-3, momentum=0.9)),
    Case("adam", "adam", dict(learning_rate=1e-1)),
    # optax's "amsgrad" entry (torch keeps the maximum of the raw second moment).
    Case("adam-amsgrad", "adam", dict(learning_rate=1e-1, amsgrad=True)),
    # weight_decay=0, not torch's default 1e-2: the decay pulls the fixed point toward 0, and
    # at the end of Rosenbrock's flat valley that is 6e-2 off (1, 1), twice the tolerance.
    Case("adamw", "adamw", dict(learning_rate=1e-1, weight_decay=0.0)),
    # optax's rate; torch's accumulator starts at 0 (optax's at 0.1) and adds eps outside.
    Case("adagrad", "adagrad", dict(learning_rate=1.0)),
    Case("rmsprop", "rmsprop", dict(learning_rate=5e-3)),
    Case("rmsprop-momentum", "rmsprop", dict(learning_rate=5e-3, momentum=0.9)),
    # optax's rate; rudax's default weight_decay is the official code's 0.
    Case("adan", "adan", dict(learning_rate=1e-1)),
    # Not in optax's table (its Muon is optax.contrib's, another rule). On a (1, n) row
    # Newton-Schulz leaves the momentum's direction with its one singular value near 1, so each
    # step moves about lr: 1e-3 covers the distance in 10k steps and ends within 1e-3.
    # weight_decay=0 as for adamw (torch's default is 0.1).
    Case("muon", "muon", dict(learning_rate=1e-3, weight_decay=0.0)),
    # AdamW's rate and, for AdamW's reason, weight_decay=0 (torch's default 1e-2).
    Case("fused_adamw", "fused_adamw", dict(learning_rate=1e-1, weight_decay=0.0)),
    # torch's lr=1 with the strong-Wolfe search (rudax's default line search). optax checks
    # its L-BFGS apart from the table; here it is in both.
    Case("lbfgs", "lbfgs", dict(learning_rate=1.0)),
]
BY_CASE = pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])

# Refuse complex parameters with a TypeError naming the complex dtype: Muon (as torch.optim.Muon:
# Newton-Schulz orthogonalizes real matrices), L-BFGS (torch's LBFGS takes the real view;
# rudax's raises a TypeError) and fused AdamW (its kernels store bf16, fp16 or fp32).
REAL_ONLY = {"muon", "lbfgs", "fused_adamw"}

# The argument that sets each optimizer's state dtype: optax's mu_dtype / accumulator_dtype.
STATE_DTYPE_ARG = {"lbfgs": "history_dtype", "fused_adamw": "master_dtype"}

# Arguments that shape the program rather than its numbers. optax.inject_hyperparams would make
# an int an array and a dtype (a callable) a schedule, so plain optax needs them in static_args;
# rudax.optim.inject_hyperparams knows them itself.
STRUCTURAL = (
    "nesterov",
    "amsgrad",
    "centered",
    "moment_dtype",
    "mask",
    "ns_steps",
    "ns_coefficients",
    "ns_dtype",
    "adjust_lr_fn",
    "matrix_layout",
    "muon_mask",
    "history_size",
    "history_dtype",
    "line_search",
    "max_linesearch_steps",
    "master_dtype",
    "skip_nonfinite",
    "hierarchical_stats",
    "impl",
    "interpret",
)


def static_args(case: Case) -> tuple[str, ...]:
    """What a user of optax's own wrapper passes as static_args for a rudax optimizer.

    The structural arguments, and (rudax's documented rule, which rudax.optim's wrapper
    applies itself) a momentum given as 0: zero means no momentum buffer in the plain state,
    and under ``jax.jit(init)`` an injected 0 is a tracer that cannot say it is zero.
    """
    parameters = inspect.signature(case.factory).parameters
    zero_momentum = (
        "momentum" in parameters
        and case.kwargs.get("momentum", parameters["momentum"].default) == 0
    )
    names = [name for name in STRUCTURAL if name in parameters]
    return (*names, *(["momentum"] if zero_momentum else []))


def target_for(case: Case, make_target, dtype) -> Target:
    """The problem in dtype, as a (1, n) matrix for Muon (a vector would go to its AdamW)."""
    target = make_target(dtype)
    return as_row_matrix(target) if case.name == "muon" else target


def line_search_args(case: Case, value, grads, value_fn) -> dict[str, Any]:
    """What L-BFGS's line search needs in ``update``: the loss, its value and gradient."""
    if case.name != "lbfgs":
        return {}
    return dict(value=value, grad=grads, value_fn=value_fn)


def make_step(case: Case, tx, objective, **extra_args):
    """One update on ``objective``: (params, state) -> (params, state)."""
    value_and_grad = jax.value_and_grad(objective)

    def step(params, state):
        value, grads = value_and_grad(params)
        # jax.grad of a real loss of complex z is df/dx - i df/dy; its conjugate is the
        # gradient of the real view (x, y), torch's p.grad and what optax's test feeds.
        grads = jax.tree.map(jnp.conj, grads)
        kwargs = line_search_args(case, value, grads, objective)
        updates, state = tx.update(grads, state, params, **kwargs, **extra_args)
        return optax.apply_updates(params, updates), state

    return step


def linesearch_promotion(case: Case, dtype):
    """Standard promotion for L-BFGS on bf16 or f16 parameters, strict otherwise.

    optax code needs it: rudax's L-BFGS runs optax's zoom line search, whose interpolation
    mixes its float32 step sizes with the loss values and updates in the parameters' dtype.
    """
    narrow = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    standard = case.name == "lbfgs" and narrow
    return jax.numpy_dtype_promotion("standard" if standard else "strict")


def assert_trees_close(got, want, *, rtol, atol=0.0, what=""):
    assert jax.tree.structure(got) == jax.tree.structure(want), (
        f"{what}: tree {jax.tree.structure(got)} != {jax.tree.structure(want)}"
    )
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        where = f"{what}{jax.tree_util.keystr(path)}"
        assert jnp.result_type(g) == jnp.result_type(w), f"{where}: {g.dtype} != {w.dtype}"
        np.testing.assert_allclose(
            np.asarray(g, np.float64 if not jnp.iscomplexobj(g) else np.complex128),
            np.asarray(w, np.float64 if not jnp.iscomplexobj(w) else np.complex128),
            rtol=rtol,
            atol=atol,
            err_msg=where,
        )


# ----------------------------------------------------------------------------------------------
# Convergence: optax's test_optimization.

NUM_STEPS = 10_000


@BY_CASE
@pytest.mark.parametrize("make_target", [parabola, rosenbrock], ids=["parabola", "rosenbrock"])
def test_optimization(case, make_target):
    """10k steps in f32 end within optax's tolerance of the minimizer.

    optax also runs this in complex64. Here complex parameters are held to more than that:
    ``test_complex_params_follow_torchs_real_view`` asserts that they take exactly the steps
    of their real view, which this test covers in f32.
    """
    target = target_for(case, make_target, jnp.float32)
    tx = case.make()
    state = tx.init(target.init)
    step = make_step(case, tx, target.objective)

    @jax.jit
    def run(params, state):
        # fori_loop refuses a carry whose dtype or shape changes from one step to the next:
        # the change that would make optax's jitted step recompile on its second call.
        return jax.lax.fori_loop(0, NUM_STEPS, lambda _, carry: step(*carry), (params, state))

    params, _ = run(target.init, state)
    # optax's tolerance.
    assert_trees_close(params, target.minimizer, rtol=3e-2, atol=3e-2, what="params")


@BY_CASE
def test_tree_map_params(case):
    """optax.tree.map_params finds the state's parameter-shaped leaves (it inits on a stand-in
    for the parameters); a no-op map keeps the state."""
    target = target_for(case, parabola, jnp.float32)
    tx = case.make()
    state = tx.init(target.init)
    mapped = optax.tree.map_params(tx, lambda p: p, state)
    assert_trees_close(mapped, state, rtol=0.0, what="state")


@pytest.mark.parametrize(
    "name, torch_default, optax_default",
    [
        ("adamw", 1e-2, inspect.signature(optax.adamw).parameters["weight_decay"].default),
        ("fused_adamw", 1e-2, inspect.signature(optax.adamw).parameters["weight_decay"].default),
        ("muon", 0.1, inspect.signature(optax.contrib.muon).parameters["weight_decay"].default),
    ],
    ids=["adamw", "fused_adamw", "muon"],
)
def test_default_weight_decay_is_torchs(name, torch_default, optax_default):
    """Deliberate: the defaults are torch's, which is why the table passes weight_decay=0.

    With a zero gradient the direction is 0 (Adam: m = 0; Muon: the orthogonalized zero
    matrix), so one update is the decoupled decay alone: p * (1 - lr * weight_decay).
    """
    assert optax_default != torch_default  # optax: 1e-4 for adamw, 0 for contrib.muon
    lr = 0.1
    params = {"w": jnp.full((2, 3), 2.0), "b": jnp.full((3,), -1.0)}  # Muon takes w, AdamW b
    tx = getattr(ro, name)(lr)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    new_params = optax.apply_updates(params, updates)
    for key in params:
        np.testing.assert_allclose(
            new_params[key], params[key] * (1 - lr * torch_default), rtol=1e-6, err_msg=key
        )


# ----------------------------------------------------------------------------------------------
# Extra arguments: optax's test_optimizers_accept_extra_args.


EXTRA = "unexpected_extra_arg_the_optimizer_does_not_expect"


@BY_CASE
def test_accepts_extra_args(case):
    target = target_for(case, rosenbrock, jnp.float32)
    seen = []

    def objective(params, unexpected_extra_arg_the_optimizer_does_not_expect=None):
        seen.append(unexpected_extra_arg_the_optimizer_does_not_expect)
        return target.objective(params)

    # Not wrapped in optax.with_extra_args_support, on purpose: the optimizer must take them.
    # Not jitted: taking a keyword is decided in Python, the same with or without jit.
    tx = case.make()
    step = make_step(case, tx, objective, **{EXTRA: 1})
    params, state = target.init, tx.init(target.init)
    for _ in range(2):
        params, state = step(params, state)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
    assert not np.array_equal(np.asarray(params), np.asarray(target.init))
    if case.name == "lbfgs":
        # Deliberate, as optax's own line searches: L-BFGS's extra keyword arguments are the
        # loss's inputs (a batch, say). They reach value_fn in the line search, and one that
        # value_fn does not name is an error, not silently dropped.
        assert 1 in seen
        no_such_arg = make_step(case, tx, target.objective, **{EXTRA: 1})
        with pytest.raises(TypeError, match=EXTRA):
            no_such_arg(target.init, tx.init(target.init))


# ----------------------------------------------------------------------------------------------
# inject_hyperparams: optax's test_optimizers_can_be_wrapped_in_inject_hyperparams.

INJECT_PARAMS = [-jnp.ones((2, 3)), jnp.ones((2, 5, 2))]  # Muon takes the matrix, AdamW the rest
INJECT_GRADS = [jnp.ones((2, 3)), -jnp.ones((2, 5, 2))]  # optax's gradients, at INJECT_PARAMS
_CENTERS = [p - g for p, g in zip(INJECT_PARAMS, INJECT_GRADS, strict=True)]


def _inject_objective(params):
    """0.5 |p - c|**2, whose gradient at INJECT_PARAMS is INJECT_GRADS (L-BFGS needs a loss)."""
    terms = [
        0.5 * jnp.sum((p - c.astype(p.dtype)) ** 2) for p, c in zip(params, _CENTERS, strict=True)
    ]
    return sum(terms[1:], terms[0])


def _two_updates(case: Case, tx, params, *, jit_init=True):
    """Two jitted updates from params: (the updates of each, the final state), one compilation.

    ``init`` is jitted too, as optax's test does: inside jit a hyperparameter optax injects is a
    tracer at init as well, so nothing about the state may depend on its value.
    """
    value_and_grad = jax.value_and_grad(_inject_objective)

    @jax.jit
    def update(state, params):
        value, grads = value_and_grad(params)
        kwargs = line_search_args(case, value, grads, _inject_objective)
        return tx.update(grads, state, params, **kwargs)

    state = (jax.jit(tx.init) if jit_init else tx.init)(params)
    first, state = update(state, params)
    second, state = update(state, optax.apply_updates(params, first))
    # optax's "does not recompile on the second call": the state from update is typed as the
    # state from init (an injected hyperparameter that turned weakly typed would recompile).
    assert update._cache_size() == 1, f"update compiled {update._cache_size()} times"
    return (first, second), state


def _b2_is_0999(case: Case) -> bool:
    """Whether the optimizer has a b2 of 0.999 (Adam's second moment; Muon's AdamW)."""
    parameters = inspect.signature(case.factory).parameters
    b2 = [case.kwargs.get(n, parameters[n].default) for n in ("b2", "adamw_b2") if n in parameters]
    return 0.999 in b2


@BY_CASE
def test_inject_hyperparams(case):
    """Every float hyperparameter as an array (optax injects the defaults too), f32 params.

    With optax's wrapper (the structural arguments in static_args) and with rudax's (which
    knows them), the updates and the inner state equal the plain optimizer's, to fp32
    rounding: a Python float hyperparameter is folded into the program in float64, an
    injected one is a float32 array (``1 - 0.9`` differs by 2.4e-7 relative).
    """
    want_updates, want_state = _two_updates(case, case.make(), INJECT_PARAMS)
    wrappers = {
        "optax": optax.inject_hyperparams(case.factory, static_args=static_args(case)),
        "rudax": ro.inject_hyperparams(case.factory),
    }
    for who, wrap in wrappers.items():
        got_updates, got_state = _two_updates(case, wrap(**case.kwargs), INJECT_PARAMS)
        assert_trees_close(got_updates, want_updates, rtol=1e-5, atol=1e-7, what=f"{who} updates")
        assert_trees_close(
            got_state.inner_state, want_state, rtol=1e-5, atol=1e-7, what=f"{who} state"
        )


# L-BFGS's bf16 case is tests/optim/test_lbfgs.py's
# test_inject_hyperparams_bf16_params_keep_fp32_hyperparameters; here its line search's
# compilations would cost CI 10 s for the same check.
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES if c.name != "lbfgs"])
def test_inject_hyperparams_bf16(case):
    """bf16 params: rudax's wrapper keeps the hyperparameters in float32; optax's rounds them.

    A float32 hyperparameter enters the arithmetic as the plain optimizer's Python float does
    (weakly typed, in each buffer's dtype), so the updates are the plain optimizer's bf16 ones.
    Deliberate: plain optax casts the hyperparameters to the parameters' dtype, which makes
    b2=0.999 a bf16 1.0, outside [0, 1): rudax refuses it and names the fix,
    hyperparam_dtype=jnp.float32, with which optax's wrapper gives the plain updates too.
    """
    params = [p.astype(jnp.bfloat16) for p in INJECT_PARAMS]
    # init outside jit (as flax.nnx.Optimizer calls it); test_inject_hyperparams checks the
    # jitted init.
    two_updates = lambda tx: _two_updates(case, tx, params, jit_init=False)
    with linesearch_promotion(case, jnp.bfloat16):
        want_updates, want_state = two_updates(case.make())
        got_updates, got_state = two_updates(ro.inject_hyperparams(case.factory)(**case.kwargs))
        for name, value in got_state.hyperparams.items():
            if jnp.issubdtype(jnp.result_type(value), jnp.floating):
                assert value.dtype == jnp.float32, f"hyperparams[{name!r}]: {value.dtype}"
        # Equal but for the hyperparameters' own rounding (float64 -> bf16 directly, or via
        # float32): one bf16 ulp at most.
        assert_trees_close(got_updates, want_updates, rtol=2**-7, atol=1e-7, what="updates")
        assert_trees_close(got_state.inner_state, want_state, rtol=2**-7, atol=1e-7, what="state")
        if not _b2_is_0999(case):
            return
        wrap = lambda **kw: optax.inject_hyperparams(case.factory, static_args(case), **kw)
        for jit_init in (False, True):
            # Under jax.jit(tx.init) the rounded b2 is a bf16 tracer: its value cannot be
            # checked, its dtype can.
            with pytest.raises((TypeError, ValueError), match="hyperparam_dtype"):
                _two_updates(case, wrap()(**case.kwargs), params, jit_init=jit_init)
        got_updates, _ = two_updates(wrap(hyperparam_dtype=jnp.float32)(**case.kwargs))
        assert_trees_close(got_updates, want_updates, rtol=2**-7, atol=1e-7, what="updates")


# ----------------------------------------------------------------------------------------------
# Explicit dtypes: optax's test_explicit_dtype, for real and complex parameters.

EXPLICIT_PARAMS = {"w": (2, 3), "b": (3,)}  # for Muon: w to Newton-Schulz, b to its AdamW


def _buffers(case: Case, state) -> list:
    """The leaves the state-dtype argument sets: every array shaped like a parameter, and for
    L-BFGS its memory (the line search's copy of the gradient keeps the gradient's dtype)."""
    if case.name == "lbfgs":
        memory = ("prev_params", "prev_grads", "s_history", "y_history")
        return jax.tree.leaves([optax.tree.get(state, name) for name in memory])
    shapes = set(EXPLICIT_PARAMS.values())
    return [x for x in jax.tree.leaves(state) if jnp.ndim(x) > 0 and jnp.shape(x) in shapes]


@BY_CASE
@pytest.mark.parametrize(
    "param_dtype", [jnp.bfloat16, jnp.float32, jnp.complex64], ids=["bf16", "f32", "c64"]
)
@pytest.mark.parametrize(
    "state_dtype",
    [None, jnp.bfloat16, jnp.float32, jnp.complex64],
    ids=["none", "bf16", "f32", "c64"],
)
def test_explicit_dtype(case, param_dtype, state_dtype):
    arg = STATE_DTYPE_ARG.get(case.name, "moment_dtype")
    params = {k: jnp.zeros(s, param_dtype) for k, s in EXPLICIT_PARAMS.items()}
    if state_dtype is not None and jnp.issubdtype(state_dtype, jnp.complexfloating):
        # Deliberate: optax takes mu_dtype=complex64. rudax's state dtype is a real precision;
        # a complex parameter's buffers are its complex counterpart (below).
        with pytest.raises(TypeError, match=arg):
            case.make(**{arg: state_dtype})
        return
    if case.name == "fused_adamw" and state_dtype == jnp.bfloat16:
        # Deliberate: fused AdamW keeps fp32 masters and moments, or none (master_dtype=None).
        with pytest.raises(ValueError, match="master_dtype"):
            case.make(**{arg: state_dtype})
        return
    tx = case.make(**{arg: state_dtype})
    if jnp.issubdtype(param_dtype, jnp.complexfloating) and case.name in REAL_ONLY:
        with pytest.raises(TypeError, match="complex"):
            tx.init(params)
        return
    state = tx.init(params)
    if state_dtype is None:
        want = jnp.dtype(param_dtype)
    elif jnp.issubdtype(param_dtype, jnp.complexfloating):
        # torch keeps a complex parameter's buffers complex (its real view is a view of them):
        # the complex dtype of the stated precision, complex64 for fp32 and narrower.
        want = jnp.dtype(jnp.complex64)
    else:
        want = jnp.dtype(state_dtype)
    buffers = _buffers(case, state)
    assert buffers, "no buffer shaped like the parameters in the state"
    assert [b.dtype for b in buffers] == [want] * len(buffers)


@BY_CASE
def test_complex_params_follow_torchs_real_view(case):
    """Deliberate: a complex parameter is optimized as torch does, on its real view.

    ``torch.view_as_real`` makes each real and imaginary part its own coordinate, so k updates
    of a complex parameter equal k updates of the (..., 2) real array of its parts. optax's
    adaptive optimizers differ: their second moments share |g|**2 between the two parts.
    """
    rng = np.random.default_rng(0)
    complex_normal = lambda *s: rng.normal(size=s) + 1j * rng.normal(size=s)
    z0 = {k: jnp.asarray(complex_normal(*s), jnp.complex64) for k, s in EXPLICIT_PARAMS.items()}
    tx = case.make()
    if case.name in REAL_ONLY:
        with pytest.raises(TypeError, match="complex"):
            tx.init(z0)
        return
    grads = [
        {k: jnp.asarray(complex_normal(*s), jnp.complex64) for k, s in EXPLICIT_PARAMS.items()}
        for _ in range(3)
    ]
    real_view = lambda tree: jax.tree.map(lambda z: jnp.stack([z.real, z.imag], axis=-1), tree)

    def run(params, grads):
        step = jax.jit(lambda p, s, g: tx.update(g, s, p))
        state = tx.init(params)
        for g in grads:
            updates, state = step(params, state, g)
            params = optax.apply_updates(params, updates)
        return params

    got = real_view(run(z0, grads))
    want = run(real_view(z0), [real_view(g) for g in grads])
    assert_trees_close(got, want, rtol=1e-6, atol=1e-7, what="params")


# ----------------------------------------------------------------------------------------------
# Dtype stability: optax's test_state_shape_dtype_shard_stability, which also covers its
# test_preserve_dtype (bf16 and f32 updates in the gradients' dtype).


STABILITY_DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64]


@BY_CASE
@pytest.mark.parametrize("dtype", STABILITY_DTYPES, ids=["f16", "bf16", "f32", "f64"])
def test_state_dtype_stability(case, dtype):
    """Two updates, each under a lax.cond whose other branch returns the parameters and state
    unchanged: the branches must agree, so the updates come in the parameters' (and the
    gradients') dtype and the state keeps its dtypes and shapes."""
    with jax.enable_x64(dtype == jnp.float64), linesearch_promotion(case, dtype):
        target = target_for(case, parabola, dtype)
        tx = case.make()
        if case.name == "fused_adamw" and dtype == jnp.float64:
            # Deliberate: fused AdamW's kernels store bf16, fp16 or fp32 (fp32 masters).
            with pytest.raises(TypeError, match="float64"):
                tx.init(target.init)
            return
        value_and_grad = jax.value_and_grad(target.objective)
        # A key-dependent predicate, so the compiler keeps both branches.
        pick = lambda: jax.random.randint(jax.random.key(0), (), 0, 2) == 0

        @jax.jit
        def step(params, state):
            value, grads = value_and_grad(params)
            kwargs = line_search_args(case, value, grads, target.objective)
            updates, state = jax.lax.cond(
                pick(), lambda: tx.update(grads, state, params, **kwargs), lambda: (params, state)
            )
            return optax.apply_updates(params, updates), state

        params, state = target.init, tx.init(target.init)
        for _ in range(2):
            params, new_state = step(params, state)
            assert params.dtype == dtype
            # What a jitted train step's cache keys on: a change would recompile it.
            assert jax.tree.map(_aval, new_state) == jax.tree.map(_aval, state)
            state = new_state
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def _aval(x):
    return (jnp.shape(x), jnp.result_type(x), getattr(x, "weak_type", False))


# ----------------------------------------------------------------------------------------------
# Gradient accumulation: optax's test_gradient_accumulation (optax.MultiSteps).


@pytest.mark.standard_promotion  # optax.MultiSteps divides by its int32 count, adds f32 to bf16
@BY_CASE
def test_multisteps(case):
    """Three zero updates, then the optimizer's first update on the mean gradient, in bf16.

    optax runs this in bf16 and f32; bf16 is the one where the accumulator, the gradients and
    the optimizer's buffers can disagree on a dtype, and f32 adds nothing it does not check.
    The same gradient every mini-step keeps the mean exact in bf16, so the fourth update
    equals, bit for bit, the plain optimizer's first.
    """
    k, dtype = 4, jnp.bfloat16
    fun = lambda x: jnp.sum(x**2)
    params = jnp.array([[1.0, 2.0]], dtype)  # a (1, 2) matrix, for Muon
    grads = jax.grad(fun)(params)
    kwargs = line_search_args(case, fun(params), grads, fun)
    accumulated, plain = optax.MultiSteps(case.make(), every_k_schedule=k), case.make()

    @jax.jit
    def run(params, grads):
        def mini_step(state, _):
            updates, state = accumulated.update(grads, state, params, **kwargs)
            return state, updates

        _, updates = jax.lax.scan(mini_step, accumulated.init(params), length=k)
        want, _ = plain.update(grads, plain.init(params), params, **kwargs)
        return updates, want

    updates, want = run(params, grads)
    assert updates.dtype == want.dtype == dtype
    for mini_step in range(k - 1):
        np.testing.assert_array_equal(updates[mini_step], 0.0, err_msg=f"{mini_step=}")
    as_f32 = lambda x: np.asarray(x, np.float32)
    np.testing.assert_array_equal(as_f32(updates[k - 1]), as_f32(want))
    assert bool(jnp.any(want != 0))


# ----------------------------------------------------------------------------------------------
# L-BFGS against scipy: optax's LBFGSTest.test_against_scipy, test_minimize_bad_initialization
# and test_steep_objective. float32 iterates (as optax's), float64 scipy.

TOL = 1e-5  # optax's, on the gradient norm that ends the loop and on every comparison


def lbfgs_loop(tx, fun, init, *, max_iter=500, tol=TOL):
    """optax's driver: L-BFGS updates in a while_loop until |grad f| < tol or max_iter.

    Returns the final parameters and the optimizer state. Once torch's tolerances fire, rudax's
    updates are zero and the loop runs out its iterations without moving.
    """
    value_and_grad = jax.value_and_grad(fun)

    def keep_going(carry):
        _, _, count, grad = carry
        return (optax.tree.norm(grad) >= tol) & (count < max_iter)

    def body(carry):
        params, state, count, _ = carry
        value, grad = value_and_grad(params)
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fun)
        return optax.apply_updates(params, updates), state, count + 1, grad

    carry = (init, tx.init(init), jnp.zeros((), jnp.int32), jax.grad(fun)(init))
    params, state, _, _ = jax.lax.while_loop(keep_going, body, carry)
    return params, state


def _steep(x):
    """mean((1e4 x)**2): a Hessian of 1e8 I (optax's test_steep_objective)."""
    return jnp.mean((1e4 * x) ** 2)


# The objectives of two variables, behind one lax.switch, so that one compiled loop serves
# them all: each compilation of L-BFGS's line search costs seconds of the CI budget.
PLANE = {
    **{name: STANDARD_FUNCTIONS[name].jnp_fn for name in ("rosenbrock", "himmelblau", "matyas")},
    "eggholder": STANDARD_FUNCTIONS["eggholder"].jnp_fn,
    "steep": _steep,
}


@jax.jit
def _minimize_plane(index, init, tolerance_change):
    fun = lambda x: jax.lax.switch(index, list(PLANE.values()), x)
    # Built inside jit with a traced tolerance_change (as inject_hyperparams would), so the
    # run without torch's tolerance shares the compilation too.
    return lbfgs_loop(ro.lbfgs(tolerance_change=tolerance_change), fun, init)


def minimize_lbfgs(name, init, *, tolerance_change=1e-9):
    """rudax's L-BFGS (torch's defaults but tolerance_change) on a named function, in fp32."""
    init = jnp.asarray(init, jnp.float32)
    if name in PLANE:
        index = jnp.asarray(list(PLANE).index(name), jnp.int32)
        return _minimize_plane(index, init, jnp.asarray(tolerance_change, jnp.float32))
    tx = ro.lbfgs(tolerance_change=tolerance_change)
    return jax.jit(lambda x: lbfgs_loop(tx, STANDARD_FUNCTIONS[name].jnp_fn, x))(init)


@pytest.mark.parametrize("name", list(STANDARD_FUNCTIONS))
def test_lbfgs_against_scipy(name):
    problem = STANDARD_FUNCTIONS[name]
    x, state = minimize_lbfgs(name, problem.init)
    scipy_x = scipy.optimize.minimize(problem.np_fn, problem.init, method="BFGS").x
    x = np.asarray(x, np.float64)

    if name == "matyas":
        # Deliberate: torch's tolerance_change=1e-9 ends L-BFGS once the directional
        # derivative g.d is above -1e-9. Along Matyas's valley x = y the curvature is only
        # 0.08, and that happens about 1e-5 from the minimizer, just outside optax's tolerance
        # (optax's L-BFGS has no such test). tolerance_change stopped it, not tolerance_grad:
        assert bool(optax.tree.get(state, "stopped"))
        assert float(np.max(np.abs(jax.grad(problem.jnp_fn)(jnp.asarray(x, jnp.float32))))) > 1e-7
        np.testing.assert_allclose(x, problem.minimizer, atol=1e-4)
        # and without it, L-BFGS goes on to the minimizer within optax's tolerance.
        x, _ = minimize_lbfgs(name, problem.init, tolerance_change=0.0)
        x = np.asarray(x, np.float64)

    # The minimizer: the known one where there is one, scipy's where the function has several
    # (Himmelblau, the eggholder) or where optax compares with scipy (Rosenbrock).
    want_x = problem.minimizer if name in ("matyas", "zakharov") else scipy_x
    np.testing.assert_allclose(x, want_x, atol=TOL, rtol=TOL, err_msg="minimizer")
    # The minimum: scipy's local one for the eggholder, the known one elsewhere.
    want_f = problem.np_fn(scipy_x) if name == "eggholder" else problem.minimum
    np.testing.assert_allclose(problem.np_fn(x), want_f, atol=TOL, rtol=TOL, err_msg="minimum")


def _himmelblau_grad(p):
    """The gradient of Himmelblau's function, in float64, for scipy."""
    x, y = p
    a, b = x**2 + y - 11.0, x + y**2 - 7.0
    return np.array([4.0 * x * a + 2.0 * b, 2.0 * a + 4.0 * y * b])


def test_lbfgs_bad_initialization_against_scipy():
    """Himmelblau from (92, 0.001): failed line searches early on, the same minimum as scipy."""
    problem = STANDARD_FUNCTIONS["himmelblau"]
    init = np.array([92.0, 0.001])
    x, _ = minimize_lbfgs("himmelblau", init)
    scipy_x = scipy.optimize.minimize(problem.np_fn, init, jac=_himmelblau_grad, method="BFGS").x
    f = problem.np_fn(np.asarray(x, np.float64))
    np.testing.assert_allclose(f, problem.np_fn(scipy_x), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(f, problem.minimum, atol=TOL, rtol=TOL)


def test_lbfgs_steep_objective():
    """A Hessian of 1e8 I: torch's first step min(1, 1/|g|_1) g, then curvature from one pair."""
    x, _ = minimize_lbfgs("steep", np.ones(2))
    np.testing.assert_allclose(x, np.zeros(2), atol=TOL, rtol=TOL)
