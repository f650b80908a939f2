"""rudax.optim.lbfgs against plain numpy: torch's two-loop recursion, convergence, Wolfe steps."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rudax.optim as ro
from tests.optim._bad_input import rejects
from tests.optim._harness import as_tree_kind, make_problem, run_optimizer
from tests.optim._injection import assert_bf16_keeps_fp32_hyperparameters, assert_injectable

# ----------------------------------------------------------------------------------------------
# Numpy references, written from torch.optim.LBFGS's documented algorithm.


def lbfgs_reference(x0, grads, *, lr, history_size):
    """torch's LBFGS with max_iter=1 and no line search, one iteration per gradient.

    Returns the parameters after each iteration and the number of (s, y) pairs stored.
    """
    x = x0.astype(np.float64)
    old_s, old_y, rho, h_diag = [], [], [], 1.0
    trajectory, num_pairs, prev_g, d, t = [], 0, None, None, None
    for k, g in enumerate(grads):
        g = g.astype(np.float64)
        if k == 0:
            d = -g
        else:
            s, y = t * d, g - prev_g
            if y @ s > 1e-10:
                if len(old_s) == history_size:
                    old_s.pop(0), old_y.pop(0), rho.pop(0)
                old_s.append(s), old_y.append(y), rho.append(1.0 / (y @ s))
                h_diag = (y @ s) / (y @ y)
                num_pairs += 1
            q, alpha = -g, [0.0] * len(old_s)
            for i in reversed(range(len(old_s))):
                alpha[i] = rho[i] * (old_s[i] @ q)
                q = q - alpha[i] * old_y[i]
            d = h_diag * q
            for i in range(len(old_s)):
                beta = rho[i] * (old_y[i] @ d)
                d = d + (alpha[i] - beta) * old_s[i]
        t = min(1.0, 1.0 / np.abs(g).sum()) * lr if k == 0 else lr
        x = x + t * d
        prev_g = g
        trajectory.append(x)
    return trajectory, num_pairs


def quadratic(n, seed=0):
    """0.5 x'Ax - b'x with eigenvalues in [1, 10], in numpy float64, and its minimiser."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    a = q @ np.diag(np.linspace(1.0, 10.0, n)) @ q.T
    b = rng.normal(size=n)
    f = lambda x: 0.5 * x @ a @ x - b @ x
    grad = lambda x: a @ x - b
    return f, grad, a, b, np.linalg.solve(a, b)


def rosenbrock_np(x):
    return np.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def rosenbrock_grad_np(x):
    g = np.zeros_like(x)
    r = x[1:] - x[:-1] ** 2
    g[:-1] = -400.0 * x[:-1] * r - 2.0 * (1.0 - x[:-1])
    g[1:] += 200.0 * r
    return g


def assert_strong_wolfe(f, grad, x0, x1, *, c1=1e-4, c2=0.9, step=""):
    """The step x0 -> x1 satisfies both strong Wolfe conditions, evaluated in float64."""
    x0, x1 = np.asarray(x0, np.float64), np.asarray(x1, np.float64)
    u = x1 - x0
    slope0 = grad(x0) @ u
    assert slope0 < 0, f"{step}: not a descent step, g.u={slope0}"
    assert f(x1) <= f(x0) + c1 * slope0, f"{step}: sufficient decrease fails"
    assert abs(grad(x1) @ u) <= c2 * abs(slope0), f"{step}: curvature condition fails"


def minimise(tx, value_fn, params, num_updates):
    """Jitted L-BFGS updates with optax's value/grad reuse; returns the iterates."""
    value_and_grad = optax.value_and_grad_from_state(value_fn)

    @jax.jit
    def step(params, state):
        value, grad = value_and_grad(params, state=state)
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=value_fn)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    iterates = [params]
    for _ in range(num_updates):
        params, state = step(params, state)
        iterates.append(params)
    assert step._cache_size() == 1, f"update compiled {step._cache_size()} times"
    return iterates, state


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


# ----------------------------------------------------------------------------------------------
# (1) The direction: torch's two-loop recursion and history, without a line search.


# Seed 1 is a gradient sequence under which torch rejects two of the seven (s, y) pairs
# (y.s <= 1e-10), so both the store and the skip paths run; with history_size=3 the ring wraps.
SEED = 1


@pytest.mark.parametrize(
    "history_size, jit, tree_kind",
    [(3, True, "dict"), (3, False, "nnx_state"), (100, True, "nnx_state"), (100, False, "dict")],
)
def test_two_loop_direction_matches_numpy(history_size, jit, tree_kind):
    num_steps, lr = 8, 0.5
    params, grads = make_problem(num_steps, seed=SEED)
    tx = ro.lbfgs(lr, history_size=history_size, line_search=None)
    got = run_optimizer(tx, params, grads, jit=jit, tree_kind=tree_kind)

    # L-BFGS couples leaves through its dot products: the reference sees one flat vector, in the
    # order jax.tree.leaves gives both the params and the trajectory.
    want, _ = lbfgs_reference(
        flat(params), [flat(g) for g in grads], lr=lr, history_size=history_size
    )
    for step in range(num_steps):
        np.testing.assert_allclose(
            np.concatenate([np.ravel(x) for x in got[step]]),
            want[step],
            rtol=1e-5,
            atol=1e-6,
            err_msg=f"after update {step + 1}",
        )


def test_stored_pairs_match_reference():
    num_steps, lr = 8, 0.5
    params, grads = make_problem(num_steps, seed=SEED)
    _, want_pairs = lbfgs_reference(flat(params), [flat(g) for g in grads], lr=lr, history_size=3)
    assert 3 < want_pairs < num_steps - 1  # the ring wrapped and some pairs were skipped
    tx = ro.lbfgs(lr, history_size=3, line_search=None)

    @jax.jit
    def step(p, state, g):
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    p = as_tree_kind(params, "dict")
    state = tx.init(p)
    for g in grads:
        p, state = step(p, state, as_tree_kind(g, "dict"))
    assert int(state[0].num_pairs) == want_pairs
    assert int(state[0].count) == num_steps


# ----------------------------------------------------------------------------------------------
# Zero updates: converged gradient (torch returns before touching its state) and no descent.


def test_small_gradient_gives_zero_update_and_keeps_state():
    tx = ro.lbfgs(0.5, line_search=None, tolerance_grad=1e-3)
    x = jnp.array([1.0, -2.0, 3.0])
    initial = tx.init(x)
    updates, state = tx.update(jnp.full(3, 1e-3), initial, x)
    np.testing.assert_array_equal(updates, np.zeros(3))
    assert bool(state[0].stopped)
    jax.tree.map(
        np.testing.assert_array_equal, state[0]._replace(stopped=initial[0].stopped), initial[0]
    )

    # The next real gradient is still the first iteration: step min(1, 1/|g|_1) * lr.
    g = np.array([0.5, -1.0, 2.0], np.float32)
    updates, state = tx.update(jnp.asarray(g), state, x)
    np.testing.assert_allclose(updates, -0.5 * g / np.abs(g).sum(), rtol=1e-6)
    assert not bool(state[0].stopped) and int(state[0].count) == 1


def test_no_descent_direction_gives_zero_update():
    # g.d = -|g|^2 = -4e-12 > -tolerance_change although max|g| > tolerance_grad.
    tx = ro.lbfgs(line_search=None)
    x = jnp.ones(4)
    updates, state = tx.update(jnp.full(4, 1e-6), tx.init(x), x)
    np.testing.assert_array_equal(updates, np.zeros(4))
    assert bool(state[0].stopped) and int(state[0].count) == 1


def test_zero_direction_skips_line_search():
    f = lambda x: jnp.sum(x**2)
    tx = ro.lbfgs()
    x = jnp.zeros(3)
    value, grad = jax.value_and_grad(f)(x)
    updates, state = jax.jit(lambda s: tx.update(grad, s, x, value=value, grad=grad, value_fn=f))(
        tx.init(x)
    )
    np.testing.assert_array_equal(updates, np.zeros(3))
    assert int(optax.tree.get(state, "num_linesearch_steps")) == 0
    assert float(optax.tree.get(state, "value")) == 0.0


# ----------------------------------------------------------------------------------------------
# (2)-(4) Convergence with the strong-Wolfe search, every accepted step checked in numpy.


@pytest.mark.parametrize("n", [5, 10])
def test_quadratic_converges_to_solution(n):
    f_np, grad_np, a, b, solution = quadratic(n)
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    loss = lambda x: 0.5 * x @ (a32 @ x) - b32 @ x
    # Zero tolerances: run to fp32's floor rather than stop at torch's (about 1e-5 here).
    tx = ro.lbfgs(tolerance_grad=0.0, tolerance_change=0.0)
    iterates, _ = minimise(tx, loss, jnp.zeros(n, jnp.float32), 30)

    np.testing.assert_allclose(iterates[-1], solution, rtol=1e-5, atol=1e-6)
    checked = 0
    for k, (x0, x1) in enumerate(itertools.pairwise(iterates)):
        if f_np(np.asarray(x0, np.float64)) - f_np(solution) < 1e-6 * abs(f_np(solution)):
            break  # fp32 cannot resolve the decrease any more (see scale_by_strong_wolfe)
        assert_strong_wolfe(f_np, grad_np, x0, x1, step=f"update {k + 1}")
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("n", [2, 6])
def test_rosenbrock_converges_to_ones(n):
    rosenbrock = lambda x: jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)
    x0 = jnp.array([-1.2, 1.0] * (n // 2), jnp.float32)
    iterates, state = minimise(ro.lbfgs(), rosenbrock, x0, 60)

    np.testing.assert_allclose(iterates[-1], np.ones(n), atol=1e-4)
    assert bool(optax.tree.get(state, "stopped"))
    checked = 0
    for k, (x0, x1) in enumerate(itertools.pairwise(iterates)):
        if rosenbrock_np(np.asarray(x0, np.float64)) < 1e-6:
            break
        assert_strong_wolfe(rosenbrock_np, rosenbrock_grad_np, x0, x1, step=f"update {k + 1}")
        checked += 1
    assert checked >= 20


# ----------------------------------------------------------------------------------------------
# (5) Pytrees, jit and no jit, extra arguments to the loss.


@pytest.mark.parametrize("tree_kind", ["dict", "nnx_state"])
def test_nested_pytree_jit_and_no_jit(tree_kind):
    _, _, a, b, solution = quadratic(10, seed=1)
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)

    def loss(p):
        x = jnp.concatenate([p["layer"]["w"].reshape(-1), p["bias"]])
        return 0.5 * x @ (a32 @ x) - b32 @ x

    params = as_tree_kind(
        {"layer": {"w": np.zeros((3, 2), np.float32)}, "bias": np.zeros(4, np.float32)}, tree_kind
    )
    tx = ro.lbfgs(history_size=5)
    iterates, _ = minimise(tx, loss, params, 30)
    last = iterates[-1]
    np.testing.assert_allclose(
        np.concatenate([np.ravel(last["layer"]["w"]), last["bias"]]),
        solution,
        rtol=1e-5,
        atol=1e-5,
    )

    state, p = tx.init(params), params
    for k in range(2):
        value, grad = jax.value_and_grad(loss)(p)
        updates, state = tx.update(grad, state, p, value=value, grad=grad, value_fn=loss)
        p = optax.apply_updates(p, updates)
        np.testing.assert_allclose(
            flat(p), flat(iterates[k + 1]), rtol=1e-6, atol=1e-7, err_msg=f"no-jit update {k + 1}"
        )


def test_extra_keyword_arguments_reach_value_fn():
    rng = np.random.default_rng(0)
    data, target = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), jnp.ones(8, jnp.float32)
    loss = lambda w, data, target: jnp.mean((data @ w - target) ** 2)
    closed = lambda w: loss(w, data, target)
    tx, w = ro.lbfgs(), jnp.zeros(3)
    value, grad = jax.value_and_grad(closed)(w)

    @jax.jit
    def updates(state, data, target):
        with_kwargs, _ = tx.update(
            grad, state, w, value=value, grad=grad, value_fn=loss, data=data, target=target
        )
        closure, _ = tx.update(grad, state, w, value=value, grad=grad, value_fn=closed)
        return with_kwargs, closure

    got, want = updates(tx.init(w), data, target)
    np.testing.assert_array_equal(got, want)
    assert float(jnp.max(jnp.abs(got))) > 0


def test_fp32_history_for_bf16_params():
    lr = 0.5
    tx = ro.lbfgs(lr, line_search=None, history_dtype=jnp.float32)
    x0 = jnp.array([1.0, -2.0, 3.0], jnp.bfloat16)
    state = tx.init(x0)
    assert state[0].s_history.dtype == jnp.float32 and state[0].prev_params.dtype == jnp.float32
    g0 = jnp.array([0.3, -0.7, 1.1], jnp.bfloat16)
    g1 = jnp.array([1.3, 0.2, -0.4], jnp.bfloat16)

    update0, state = tx.update(g0, state, x0)
    x1 = optax.apply_updates(x0, update0)
    update1, state = tx.update(g1, state, x1)
    assert update0.dtype == update1.dtype == jnp.bfloat16

    # The memory sees the bf16 values exactly, in fp32; each update is rounded to bf16 once.
    f32 = lambda a: np.asarray(a, np.float64)
    want0 = -lr * f32(g0) / np.abs(f32(g0)).sum()
    s, y, g = f32(x1) - f32(x0), f32(g1) - f32(g0), f32(g1)
    assert y @ s > 1e-10  # this pair is stored
    rho = 1.0 / (y @ s)
    alpha = rho * (s @ g)
    r = (y @ s) / (y @ y) * (g - alpha * y)
    want1 = -lr * (r + (alpha - rho * (y @ r)) * s)
    bf16_eps = 2.0**-7
    np.testing.assert_allclose(f32(update0), want0, rtol=bf16_eps)
    np.testing.assert_allclose(f32(update1), want1, rtol=bf16_eps)
    assert int(state[0].num_pairs) == 1


def test_fp32_gradients_with_bf16_memory():
    """The moment-dtype rule: memory in the parameters' bf16, arithmetic in fp32, bf16 updates."""
    tx = ro.lbfgs(0.5, line_search=None)
    x0 = jnp.array([1.0, -2.0, 3.0], jnp.bfloat16)
    grads = [jnp.array([0.3, -0.7, 1.1]), jnp.array([1.3, 0.2, -0.4])]
    state = tx.init(x0)
    step = jax.jit(tx.update)
    update0, state = step(grads[0], state, x0)
    update1, state = step(grads[1], state, optax.apply_updates(x0, update0))
    assert step._cache_size() == 1
    assert update0.dtype == update1.dtype == jnp.bfloat16
    memory = (state[0].prev_params, state[0].prev_grads, state[0].s_history, state[0].y_history)
    assert all(m.dtype == jnp.bfloat16 for m in memory)
    # The first update is the fp32 one, rounded once to bf16: within one bf16 ulp.
    x32 = x0.astype(jnp.float32)
    want, _ = tx.update(grads[0], tx.init(x32), x32)
    np.testing.assert_allclose(
        np.asarray(update0, np.float32),
        np.asarray(want.astype(jnp.bfloat16), np.float32),
        rtol=2**-7,
    )


# ----------------------------------------------------------------------------------------------
# (6) Bad input.


test_bad_hyperparameters = rejects(
    ro.lbfgs,
    [
        ({"learning_rate": -1.0}, ValueError, "learning_rate=-1.0"),
        ({"history_size": 0}, ValueError, "history_size=0"),
        ({"history_size": 2.5}, TypeError, "history_size=2.5"),
        ({"history_size": True}, TypeError, "history_size=True"),
        ({"line_search": "wolfe"}, ValueError, "line_search='wolfe'"),
        ({"c1": 0.0}, ValueError, "c1=0.0"),
        ({"c1": "big"}, TypeError, "c1='big'"),
        ({"c2": 1.0}, ValueError, "c2=1.0"),
        ({"c1": 0.5, "c2": 0.5}, ValueError, "c2 must be larger than c1"),
        ({"max_linesearch_steps": 0}, ValueError, "max_linesearch_steps=0"),
        ({"tolerance_grad": -1e-7}, ValueError, "tolerance_grad=-1e-07"),
        ({"tolerance_change": float("nan")}, ValueError, "tolerance_change=nan"),
        ({"history_dtype": jnp.int32}, TypeError, "history_dtype"),
    ],
)


def test_bad_line_search_hyperparameters():
    with pytest.raises(ValueError, match="c2 must be larger than c1"):
        ro.scale_by_strong_wolfe(0.9, 0.1)
    with pytest.raises(TypeError, match=r"max_linesearch_steps=3\.0"):
        ro.scale_by_strong_wolfe(max_linesearch_steps=3.0)


def test_integer_params_name_the_path():
    with pytest.raises(TypeError, match=r"\['layer'\]\['step'\].*int32"):
        ro.lbfgs().init({"layer": {"step": jnp.zeros((), jnp.int32), "w": jnp.zeros(2)}})


def test_update_without_params_or_loss_raises():
    tx, x = ro.lbfgs(), jnp.ones(2)
    with pytest.raises(TypeError, match="value_fn"):
        tx.update(x, tx.init(x), x, value=jnp.sum(x), grad=x)
    tx = ro.lbfgs(line_search=None)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(x, tx.init(x))


# ----------------------------------------------------------------------------------------------
# inject_hyperparams: c1, c2, the tolerances and the learning rate traceable; the sizes static.

INJECT_PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.array([0.5, -0.25])}
STRUCTURAL = ("history_size", "line_search", "max_linesearch_steps", "history_dtype")


def quartic(params, targets):
    """sum (p - c)**2 (1 + p**2): not quadratic, so the line search has work to do."""
    f32 = lambda x: x.astype(jnp.float32)
    terms = jax.tree.map(
        lambda p, c: jnp.sum(jnp.square(f32(p) - f32(c)) * (1.0 + jnp.square(f32(p)))),
        params,
        targets,
    )
    return sum(jax.tree.leaves(terms), jnp.zeros((), jnp.float32))


# Dyadic values: exact in float32 and float64 alike, so the plain optimizer's Python floats and
# the injected float32 arrays are the same numbers in every expression (test_adan.py).
INJECT_KWARGS = dict(
    learning_rate=0.75, c1=2.0**-10, c2=0.875, tolerance_grad=2.0**-20, tolerance_change=2.0**-30
)
# Each new value changes the run: a lr of 0.25 a shorter first trial; c1 = 0.75 rejects the
# line's minimiser (a decrease of half the slope, on a nearly quadratic line); c2 = 0.0625 asks
# for a flatter slope; a tolerance_grad of 16 stops at once (max|g| is about 11); a
# tolerance_change of 64 sees no descent in any direction.
NEW_VALUES = dict(
    learning_rate=0.25, c1=0.75, c2=0.0625, tolerance_grad=16.0, tolerance_change=64.0
)


@pytest.mark.parametrize("line_search", ["strong_wolfe", None])
def test_inject_hyperparams(line_search):
    # Bit for bit: the tolerances and c1, c2 enter as float32 scalars either way (jnp.asarray
    # in the memory's dtype; optax's line search in float32), the learning rate weakly typed.
    assert_injectable(
        ro.lbfgs,
        {**INJECT_KWARGS, "line_search": line_search, "history_size": 4},
        INJECT_PARAMS,
        optax_static_args=STRUCTURAL,
        new_values=NEW_VALUES,
        line_search=line_search is not None,
        objective=quartic,
        inert=("c1", "c2") if line_search is None else (),
    )


def test_inject_hyperparams_bf16_params_keep_fp32_hyperparameters():
    assert_bf16_keeps_fp32_hyperparameters(
        ro.lbfgs,
        {**INJECT_KWARGS, "history_dtype": jnp.float32},
        INJECT_PARAMS,
        line_search=True,
        objective=quartic,
    )


def test_inject_without_static_args_names_the_fix():
    tx = optax.inject_hyperparams(ro.lbfgs)()
    with pytest.raises(TypeError, match=r"lbfgs: history_size .*static_args=\('history_size'"):
        tx.init(INJECT_PARAMS)


def test_injected_wolfe_constants_are_checked_at_init():
    # Under jit the constants are tracers and cannot be compared; at init they are concrete.
    tx = ro.inject_hyperparams(ro.lbfgs)(c1=0.5, c2=0.25)
    with pytest.raises(ValueError, match="c2 must be larger than c1"):
        tx.init(INJECT_PARAMS)


# ----------------------------------------------------------------------------------------------
# Complex parameters: a TypeError that names the leaf and the real-view fix.


@pytest.mark.parametrize("where", ["init", "update"])
def test_complex_params_are_a_type_error_naming_the_path(where):
    params = {"layer": {"z": jnp.ones((2,), jnp.complex64)}, "w": jnp.ones(2)}
    tx = ro.lbfgs(line_search=None)
    match = r"lbfgs: (parameter|gradient) \['layer'\]\['z'\] has dtype=complex64.*real view"
    with pytest.raises(TypeError, match=match):
        if where == "init":
            tx.init(params)
        else:
            real = jax.tree.map(jnp.real, params)
            tx.update(params, tx.init(real), real)


def test_strong_wolfe_search_with_bf16_params():
    # optax's zoom search would keep its step in bf16 and mix it with float32 values (which
    # strict promotion refuses): it searches in float32 and evaluates the loss at bf16 points.
    target = jnp.array([0.75, -1.5, 2.0], jnp.bfloat16)
    seen = []

    def loss(x):
        seen.append(x.dtype)
        return jnp.sum(jnp.square(x.astype(jnp.float32) - target.astype(jnp.float32)))

    tx = ro.lbfgs(history_dtype=jnp.float32)
    x = jnp.zeros(3, jnp.bfloat16)
    state = tx.init(x)
    assert optax.tree_utils.tree_get(state, "learning_rate").dtype == jnp.float32
    value_and_grad = optax.value_and_grad_from_state(loss)
    update = jax.jit(lambda g, s, x, v: tx.update(g, s, x, value=v, grad=g, value_fn=loss))
    for _ in range(3):
        value, grad = value_and_grad(x, state=state)
        updates, state = update(grad, state, x, value)
        assert updates.dtype == jnp.bfloat16
        x = optax.apply_updates(x, updates)
    assert set(seen) == {jnp.dtype(jnp.bfloat16)}
    assert optax.tree_utils.tree_get(state, "grad").dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(target, np.float32))


def test_tree_map_params_finds_the_parameter_shaped_state():
    # optax.tree.map_params initializes on a stand-in for the parameters: the memory's
    # previous iterate and gradient and the line search's gradient are parameter-shaped.
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(2)}
    tx = ro.lbfgs(history_size=3)
    state = tx.init(params)
    mapped = optax.tree.map_params(tx, lambda p: p + 1.0, state)
    lbfgs_state, search_state = mapped[0], mapped[2]
    for tree in (lbfgs_state.prev_params, lbfgs_state.prev_grads, search_state.grad):
        jax.tree.map(lambda x, p: np.testing.assert_array_equal(x, jnp.ones_like(p)), tree, params)
    np.testing.assert_array_equal(lbfgs_state.rho, state[0].rho)  # not parameter-shaped
    assert float(search_state.learning_rate) == float(state[2].learning_rate)
