"""Tests of rudax.kernels.adamw_update: the Pallas kernel against the reference and numpy."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import rudax.kernels as rk
from rudax.kernels._adamw_leaves import adamw_update_leaves
from tests.kernels._lowering import assert_lowers_for_gpu

# Pallas runs compiled on a GPU (benchmarks/gpu_check.sh), interpreted elsewhere.
INTERPRET = jax.default_backend() != "gpu"

# Leaves of 15, 7 and 1 elements: with 8-element blocks, a ragged grid of 2 steps, a single
# overhanging block, and a scalar.
SHAPES = [(3, 5), (7,), ()]
BLOCK = rk.AdamWBlock(size=8)

# (param dtype, moment dtype, with an fp32 master)
CONFIGS = [
    pytest.param(jnp.float32, jnp.float32, False, id="fp32"),
    pytest.param(jnp.bfloat16, jnp.float32, True, id="bf16-master"),
    pytest.param(jnp.float16, jnp.float32, True, id="fp16-master"),
    pytest.param(jnp.bfloat16, jnp.bfloat16, False, id="bf16-moments"),
]

NP_BITS = {
    jnp.dtype(jnp.bfloat16): (ml_dtypes.bfloat16, np.uint16),
    jnp.dtype(jnp.float16): (np.float16, np.uint16),
    jnp.dtype(jnp.float32): (np.float32, np.uint32),
}


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(NP_BITS[jnp.dtype(x.dtype)][1])


def random_state(rng, shape, param_dtype, moment_dtype, with_master):
    normal = lambda scale: jnp.asarray((rng.normal(size=shape) * scale).astype(np.float32))
    master = normal(1.0)
    return {
        "param": master.astype(param_dtype),
        "exp_avg": normal(0.1).astype(moment_dtype),
        "exp_avg_sq": jnp.abs(normal(0.01)).astype(moment_dtype),
        "master": master if with_master else None,
    }


def run_steps(fn, state, grads, **hyper):
    """Applies fn for len(grads) steps (count 2, 3, ...); returns the state after each."""
    out = []
    for i, g in enumerate(grads):
        s = state
        args = (s["param"], g, s["exp_avg"], s["exp_avg_sq"], s["master"])
        update, m, v, w = fn(*args, count=i + 2, **hyper)
        param = (s["param"] + update).astype(s["param"].dtype)
        state = {"param": param, "exp_avg": m, "exp_avg_sq": v, "master": w, "update": update}
        out.append(state)
    return out


@pytest.mark.parametrize(
    "param_dtype, moment_dtype, with_master, grad_scale, weight_decay",
    [
        pytest.param(*config.values, *options, id=f"{config.id}-{name}")
        for config, (name, options) in zip(
            CONFIGS,
            [("plain", (None, 1e-2)), ("scaled-nodecay", (0.7, 0.0))] * 2,
            strict=True,
        )
    ],
)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_pallas_matches_reference(
    shape, grad_scale, weight_decay, param_dtype, moment_dtype, with_master
):
    rng = np.random.default_rng(0)
    state = random_state(rng, shape, param_dtype, moment_dtype, with_master)
    grads = [
        jnp.asarray(rng.normal(size=shape).astype(np.float32)).astype(param_dtype) for _ in range(3)
    ]
    hyper = dict(learning_rate=0.05, weight_decay=weight_decay, grad_scale=grad_scale)
    got = run_steps(
        lambda *a, **k: rk.adamw_update(*a, impl="pallas", interpret=INTERPRET, block=BLOCK, **k),
        state,
        grads,
        **hyper,
    )
    want = run_steps(rk.adamw_update_reference, state, grads, **hyper)
    # The interpreted kernel may contract a multiply-add into an FMA where the reference
    # does not: fp32 values agree to rounding, narrow ones to one unit in their last place.
    rtol = {jnp.dtype(jnp.float32): 1e-6, jnp.dtype(jnp.bfloat16): 2**-7}
    rtol[jnp.dtype(jnp.float16)] = 2**-10
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in ("update", "exp_avg", "exp_avg_sq", "master", "param"):
            if w[key] is None:
                assert g[key] is None
                continue
            assert g[key].dtype == w[key].dtype and g[key].shape == shape, key
            np.testing.assert_allclose(
                np.asarray(g[key], np.float32),
                np.asarray(w[key], np.float32),
                rtol=rtol[jnp.dtype(w[key].dtype)],
                atol=1e-7,
                err_msg=f"{key} after step {step + 1}",
            )
        if with_master:
            # The storage guarantee holds on both paths, bit for bit.
            for out in (g, w):
                np.testing.assert_array_equal(
                    bits(out["param"]), bits(out["master"].astype(param_dtype))
                )


def numpy_adamw(p, m, v, grads, *, lr, b1, b2, eps, wd, scale, first_count):
    """torch.optim.AdamW's rule written plainly (cross-checked against torch by hand)."""
    f = np.float32
    out = []
    for i, g in enumerate(grads):
        t = first_count + i
        g = g * f(scale)
        m = f(b1) * m + f(1 - b1) * g
        v = f(b2) * v + f(1 - b2) * g * g
        u = (m / f(1 - b1**t)) / (np.sqrt(v) / np.sqrt(f(1 - b2**t)) + f(eps))
        p = p - f(lr) * (u + f(wd) * p)
        out.append((p, m, v))
    return out


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_fp32_matches_numpy(impl):
    rng = np.random.default_rng(1)
    p = rng.normal(size=(13,)).astype(np.float32)
    m, v = np.zeros_like(p), np.zeros_like(p)
    grads = [rng.normal(size=(13,)).astype(np.float32) for _ in range(4)]
    hyper = dict(lr=3e-2, b1=0.8, b2=0.99, eps=1e-6, wd=0.1, scale=0.5)
    want = numpy_adamw(p, m, v, grads, first_count=1, **hyper)
    state = {"param": jnp.asarray(p), "exp_avg": jnp.asarray(m), "exp_avg_sq": jnp.asarray(v)}
    for t, (g, (wp, wm, wv)) in enumerate(zip(grads, want, strict=True), start=1):
        update, em, ev, master = rk.adamw_update(
            state["param"],
            jnp.asarray(g),
            state["exp_avg"],
            state["exp_avg_sq"],
            count=jnp.int32(t),
            learning_rate=jnp.float32(hyper["lr"]),
            b1=hyper["b1"],
            b2=hyper["b2"],
            eps=hyper["eps"],
            weight_decay=hyper["wd"],
            grad_scale=jnp.float32(hyper["scale"]),
            impl=impl,
            interpret=INTERPRET,
            block=BLOCK,
        )
        assert master is None
        state = {"param": state["param"] + update, "exp_avg": em, "exp_avg_sq": ev}
        for got, w in zip(state.values(), (wp, wm, wv), strict=True):
            np.testing.assert_allclose(np.asarray(got), w, rtol=1e-6, atol=1e-7)


def test_nonfinite_gradients_stay_in_their_elements():
    shape = (3, 5)
    state = random_state(np.random.default_rng(2), shape, jnp.bfloat16, jnp.float32, True)
    g = jnp.ones(shape, jnp.bfloat16).at[0, 1].set(jnp.nan).at[2, 4].set(jnp.inf)
    args = (state["param"], g, state["exp_avg"], state["exp_avg_sq"], state["master"])
    hyper = dict(count=1, learning_rate=0.1)
    got = rk.adamw_update(*args, impl="pallas", interpret=INTERPRET, block=BLOCK, **hyper)
    want = rk.adamw_update_reference(*args, **hyper)
    bad = np.zeros(shape, bool)
    bad[0, 1] = bad[2, 4] = True
    for x, y in zip(got, want, strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
        assert np.all(np.isfinite(x[~bad])) and not np.any(np.isfinite(x[bad]))
        np.testing.assert_allclose(x[~bad], y[~bad], rtol=2**-7)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("param_dtype, moment_dtype, with_master", [CONFIGS[i] for i in (0, 1, 3)])
def test_skip_returns_every_input_bit_for_bit(impl, param_dtype, moment_dtype, with_master):
    rng = np.random.default_rng(4)
    states = [random_state(rng, s, param_dtype, moment_dtype, with_master) for s in SHAPES]
    states[1]["param"] = states[1]["param"].at[3].set(-0.0)  # keeps its sign when skipped
    finite = [
        jnp.asarray(rng.normal(size=s).astype(np.float32)).astype(param_dtype) for s in SHAPES
    ]
    nonfinite = [finite[0].at[1, 2].set(jnp.nan), finite[1].at[0].set(jnp.inf), finite[2]]
    buffers = [[s[k] for s in states] for k in ("param", "exp_avg", "exp_avg_sq", "master")]
    kwargs = dict(impl=impl, interpret=INTERPRET, block=BLOCK)

    @jax.jit
    def step(grads, skip):
        return adamw_update_leaves(
            buffers[0], grads, *buffers[1:], count=3, learning_rate=0.1, skip=skip, **kwargs
        )

    updates, *new = step(nonfinite, jnp.asarray(True))
    for u, p in zip(updates, buffers[0], strict=True):
        assert u.dtype == p.dtype
        np.testing.assert_array_equal(bits(u), bits(jnp.full_like(u, -0.0)))
        np.testing.assert_array_equal(bits((p + u).astype(p.dtype)), bits(p))
    for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(buffers[1:]), strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))

    # Not skipped, from the same compiled step: the op itself, to fp32 rounding (XLA folds
    # the per-step scalars of a jitted step, and may round them differently from eager ops).
    got = step(finite, jnp.asarray(False))
    assert step._cache_size() == 1
    rtol = {jnp.dtype(jnp.float32): 1e-6, jnp.dtype(jnp.bfloat16): 2**-7}
    rtol[jnp.dtype(jnp.float16)] = 2**-10
    for i, g in enumerate(finite):
        args = [b[i] for b in buffers]
        want = rk.adamw_update(args[0], g, *args[1:], count=3, learning_rate=0.1, **kwargs)
        for x, y in zip(jax.tree.leaves([o[i] for o in got]), jax.tree.leaves(want), strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_allclose(
                np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol[x.dtype], atol=1e-7
            )


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16], ids=jnp.dtype)
def test_master_follows_a_param_replaced_outside(impl, param_dtype):
    # A parameter that is not its master rounded (weights loaded after init) is adopted as
    # the master before the step, so the decay acts on it; a consistent one keeps its master.
    rng = np.random.default_rng(6)
    shape = (3, 5)
    master = jnp.asarray(rng.normal(size=shape).astype(np.float32))
    param = master.astype(param_dtype).at[0].set(7.0).at[1, 2].set(-0.0)
    zeros = jnp.zeros(shape, jnp.float32)
    kwargs = dict(impl=impl, interpret=INTERPRET, block=BLOCK)
    args = (param, zeros, zeros, zeros, master)
    update, _, _, new_master = rk.adamw_update(
        *args, count=1, learning_rate=0.0, weight_decay=0.5, **kwargs
    )
    replaced = np.zeros(shape, bool)
    replaced[0] = replaced[1, 2] = True
    want = np.where(replaced, np.asarray(param, np.float32), np.asarray(master))
    np.testing.assert_array_equal(bits(new_master), bits(jnp.asarray(want)))
    np.testing.assert_array_equal(bits((param + update).astype(param_dtype)), bits(param))

    # The decay of the first row shrinks 7.0, not the stale master.
    update, _, _, new_master = rk.adamw_update(
        *args, count=1, learning_rate=0.1, weight_decay=0.5, **kwargs
    )
    np.testing.assert_allclose(np.asarray(new_master[0]), 7.0 * (1 - 0.05), rtol=1e-6)


def test_jit_compiles_once():
    shape = (7,)
    state = random_state(np.random.default_rng(3), shape, jnp.bfloat16, jnp.float32, True)

    @jax.jit
    def step(state, g, count):
        out = rk.adamw_update(
            state["param"],
            g,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["master"],
            count=count,
            learning_rate=0.01,
            impl="pallas",
            interpret=INTERPRET,
            block=BLOCK,
        )
        update, *buffers = out
        param = (state["param"] + update).astype(jnp.bfloat16)
        return dict(
            zip(("param", "exp_avg", "exp_avg_sq", "master"), (param, *buffers), strict=True)
        )

    for count in range(1, 4):
        state = step(state, jnp.ones(shape, jnp.bfloat16), jnp.int32(count))
    assert step._cache_size() == 1


def test_zero_size_leaf():
    z = jnp.zeros((0, 3), jnp.float32)
    update, m, v, _ = rk.adamw_update(
        z, z, z, z, count=1, learning_rate=0.1, impl="pallas", interpret=INTERPRET
    )
    assert update.shape == m.shape == v.shape == (0, 3)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("param_dtype, moment_dtype, with_master", CONFIGS[:2])
def test_lowers_for_gpu(param_dtype, moment_dtype, with_master):
    shape = (37, 29)  # ragged: 1073 elements, the last of two 1024-blocks overhangs
    args = [S(shape, param_dtype), S(shape, jnp.bfloat16), S(shape, moment_dtype)]
    args += [S(shape, moment_dtype)] + ([S(shape, jnp.float32)] if with_master else [])

    def fn(*arrays):
        return rk.adamw_update(
            *arrays,
            count=jnp.int32(3),
            learning_rate=jnp.float32(0.1),
            grad_scale=jnp.float32(0.5),
            impl="pallas",
        )

    assert_lowers_for_gpu(fn, *args, kernels=["adamw_update"])


def good_args():
    x = jnp.zeros((3,), jnp.float32)
    return dict(param=x, grad=x, exp_avg=x, exp_avg_sq=x, count=1, learning_rate=0.1)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"grad": jnp.zeros((4,))}, ValueError, r"grad.shape=\(4,\)"),
        ({"param": jnp.zeros((3,), jnp.int32)}, TypeError, "param.dtype=int32"),
        ({"exp_avg": jnp.zeros((3,), jnp.int8)}, TypeError, "exp_avg.dtype=int8"),
        ({"master": jnp.zeros((3,), jnp.bfloat16)}, TypeError, "master.dtype=bfloat16"),
        ({"count": 0}, ValueError, "count=0"),
        ({"count": 1.0}, TypeError, "count=1.0"),
        (
            {"count": jnp.ones((2,), jnp.int32)},
            TypeError,
            r"count must be a scalar, got shape \(2,\)",
        ),
        ({"count": True}, TypeError, "count=True"),
        ({"grad": None}, TypeError, "grad must be an array, got grad=None"),
        ({"param": None}, TypeError, "param must be an array, got param=None"),
        ({"learning_rate": -1.0}, ValueError, "learning_rate=-1.0"),
        ({"b1": 1.0}, ValueError, r"b1=1\.0"),
        ({"b2": -0.1}, ValueError, r"b2=-0\.1"),
        ({"eps": float("nan")}, ValueError, "eps=nan"),
        ({"weight_decay": "0.1"}, TypeError, "weight_decay='0.1'"),
        ({"grad_scale": -1.0}, ValueError, "grad_scale=-1.0"),
        ({"impl": "cuda"}, ValueError, "impl='cuda'"),
        ({"block": 8}, TypeError, "block=8"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_input(change, error, match):
    with pytest.raises(error, match=match):
        rk.adamw_update(**{**good_args(), **change})


@pytest.mark.parametrize("name", ["param", "grad", "exp_avg", "exp_avg_sq"])
def test_reference_names_a_missing_operand(name):
    change = {k: v for k, v in good_args().items() if k not in ("impl", "block")}
    with pytest.raises(TypeError, match=f"{name} must be an array, got {name}=None"):
        rk.adamw_update_reference(**{**change, name: None})


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"skip": 1}, TypeError, "skip=1"),
        ({"skip": jnp.zeros((2,), bool)}, TypeError, r"shape=\(2,\)"),
        ({"skip": jnp.float32(1.0)}, TypeError, "dtype=float32"),
        ({"grads": [jnp.zeros((3,))]}, ValueError, r"lengths \(2, 1, 2, 2, 2\)"),
        ({"grads": [jnp.zeros((3,)), jnp.zeros((4,))]}, ValueError, r"leaf 1: grad .*=\(4,\)"),
        ({"exp_avgs": [jnp.zeros((3,)), None]}, TypeError, "leaf 1: exp_avg must be an array"),
    ],
    ids=["skip-int", "skip-shape", "skip-dtype", "lengths", "leaf-path", "leaf-none"],
)
def test_bad_leaves_input(change, error, match):
    x = jnp.zeros((3,), jnp.float32)
    args = dict(params=[x, x], grads=[x, x], exp_avgs=[x, x], exp_avg_sqs=[x, x])
    args.update(masters=[None, None], count=1, learning_rate=0.1, impl="xla")
    with pytest.raises(error, match=match):
        adamw_update_leaves(**{**args, **change})


@pytest.mark.parametrize(
    "kwargs, error, match",
    [({"size": 3}, ValueError, "size=3"), ({"num_warps": 2.0}, TypeError, "num_warps=2.0")],
)
def test_bad_block(kwargs, error, match):
    with pytest.raises(error, match=match):
        rk.AdamWBlock(**kwargs)
