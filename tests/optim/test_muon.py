"""rudax.optim.muon against plain numpy Muon (torch.optim.Muon's rule) and torch-style AdamW."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import rudax.optim as ro
from tests.optim._bad_input import rejects
from tests.optim._harness import assert_matches_reference
from tests.optim._injection import assert_bf16_keeps_fp32_hyperparameters, assert_injectable

# The harness's leaves plus a wide matrix, so both Newton-Schulz orientations run.
SHAPES = {
    "dense": {"kernel": (5, 3), "bias": (3,)},
    "wide": (3, 5),
    "scale": (),
    "deep": {"block": {"w": (2, 3, 4)}},
}
TORCH_NS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g, *, steps=5, coefficients=TORCH_NS, eps=1e-7):
    a, b, c = coefficients
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    x = x / max(np.linalg.norm(x), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_step_reference(p, grads, *, lr, wd, momentum, nesterov, adjust, layout, ns_kwargs):
    # torch's ratio is sqrt(max(1, A / B)) for its (out, in) = (A, B) weights.
    out_features, in_features = p.shape if layout == "out_in" else p.shape[::-1]
    if adjust == "match_rms_adamw":
        ratio = 0.2 * np.sqrt(max(out_features, in_features))
    else:
        ratio = np.sqrt(max(1.0, out_features / in_features))
    buf = np.zeros_like(p)
    out = []
    for t, g in enumerate(grads):
        lr_t = lr(t) if callable(lr) else lr
        buf = momentum * buf + (1 - momentum) * g
        m = (1 - momentum) * g + momentum * buf if nesterov else buf
        p = p * (1 - lr_t * wd) - lr_t * ratio * newton_schulz(m, **ns_kwargs)
        out.append(p)
    return out


def adamw_reference(p, grads, *, lr, wd, b1, b2, eps):
    m, v = np.zeros_like(p), np.zeros_like(p)
    out = []
    for t, g in enumerate(grads, start=1):
        lr_t = lr(t - 1) if callable(lr) else lr
        p = p * (1 - lr_t * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr_t / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
        out.append(p)
    return out


def reference(
    p,
    grads,
    *,
    lr,
    wd=0.1,
    momentum=0.95,
    nesterov=True,
    adjust=None,
    layout="in_out",
    ns_kwargs=None,
    adamw_lr=None,
    adamw_wd=None,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    to_muon=lambda p: p.ndim == 2,
):
    """Routes a leaf as muon_mask would: the harness gives the reference no path, so tests
    that move a matrix to AdamW give it a shape of its own."""
    if to_muon(p):
        return muon_step_reference(
            p, grads, lr=lr, wd=wd, momentum=momentum, nesterov=nesterov, adjust=adjust,
            layout=layout, ns_kwargs=ns_kwargs or {},
        )  # fmt: skip
    return adamw_reference(
        p, grads, lr=adamw_lr or lr, wd=wd if adamw_wd is None else adamw_wd, b1=b1, b2=b2,
        eps=eps,
    )  # fmt: skip


@pytest.mark.parametrize("tree_kind", ["dict", "nnx_state"])
@pytest.mark.parametrize("jit", [True, False])
def test_matches_reference_torch_defaults(jit, tree_kind):
    tx = ro.muon(0.02, adamw_learning_rate=0.01, ns_dtype=jnp.float32)
    ref = functools.partial(reference, lr=0.02, adamw_lr=0.01)
    assert_matches_reference(tx, ref, num_steps=4, jit=jit, tree_kind=tree_kind, shapes=SHAPES)


def test_matches_reference_other_options_and_schedule():
    schedule = lambda count: 0.05 * 0.5 ** count.astype(jnp.float32)
    coefficients = (3.0, -3.2, 1.2)
    tx = ro.muon(
        schedule, 0.2, 0.8, False, 3,
        ns_coefficients=coefficients, eps=1e-5, adjust_lr_fn="match_rms_adamw",
        adamw_b1=0.8, adamw_b2=0.9, adamw_eps=1e-6, adamw_weight_decay=0.05,
        ns_dtype=jnp.float32,
    )  # fmt: skip
    ref = functools.partial(
        reference, lr=lambda t: 0.05 * 0.5**t, wd=0.2, momentum=0.8, nesterov=False,
        adjust="match_rms_adamw", ns_kwargs={"steps": 3, "coefficients": coefficients,
        "eps": 1e-5}, b1=0.8, b2=0.9, eps=1e-6, adamw_wd=0.05,
    )  # fmt: skip
    assert_matches_reference(tx, ref, num_steps=4, seed=2, shapes=SHAPES)


MASK_SHAPES = {"dense": {"kernel": (5, 3), "bias": (3,)}, "embed": (4, 6), "scale": ()}


@pytest.mark.parametrize(
    ("mask_kind", "tree_kind"), [("tree", "dict"), ("tree", "nnx_state"), ("callable", "dict")]
)
def test_mask_sends_a_matrix_to_adamw_torch_layout(mask_kind, tree_kind):
    tree_mask = {"dense": {"kernel": True, "bias": False}, "embed": False, "scale": False}
    if mask_kind == "tree":
        mask = tree_mask  # a plain dict also masks nnx.State params: matched by path
    else:
        mask = lambda params: jax.tree_util.tree_map_with_path(
            lambda path, p: p.ndim == 2 and "embed" not in jax.tree_util.keystr(path), params
        )
    tx = ro.muon(0.02, muon_mask=mask, matrix_layout="out_in", ns_dtype=jnp.float32)
    ref = functools.partial(
        reference, lr=0.02, layout="out_in", to_muon=lambda p: p.shape == (5, 3)
    )
    assert_matches_reference(tx, ref, num_steps=3, tree_kind=tree_kind, shapes=MASK_SHAPES)


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (16, 16)])
def test_newton_schulz_output_is_nearly_orthogonal(shape):
    # torch's quintic trades exactness for speed: singular values oscillate in about
    # [0.68, 1.13] instead of converging to 1. Default (bf16) iteration, as torch.
    g = jax.random.normal(jax.random.key(1), shape)
    tx = ro.scale_by_muon(momentum=0.0)
    u, _ = tx.update(g, tx.init(g))
    ratio = np.sqrt(max(1.0, shape[1] / shape[0]))  # fan_out / fan_in of an (in, out) kernel
    s = np.linalg.svd(np.asarray(u, np.float64) / ratio, compute_uv=False)
    assert 0.65 <= s.min() and s.max() <= 1.2, s


def test_layouts_agree_on_the_same_layer():
    # One layer with 3 inputs and 7 outputs: a flax kernel (3, 7), a torch weight (7, 3).
    kernel = jax.random.normal(jax.random.key(3), (3, 7))
    grad = jax.random.normal(jax.random.key(4), (3, 7))
    flax_tx = ro.muon(0.02, ns_dtype=jnp.float32)
    torch_tx = ro.muon(0.02, matrix_layout="out_in", ns_dtype=jnp.float32)
    u_flax, _ = flax_tx.update(grad, flax_tx.init(kernel), kernel)
    u_torch, _ = torch_tx.update(grad.T, torch_tx.init(kernel.T), kernel.T)
    np.testing.assert_allclose(u_flax, u_torch.T, rtol=1e-5, atol=1e-7)
    # fan_out > fan_in: torch scales this layer's step by sqrt(7 / 3).
    o = (np.asarray(u_flax) + 0.02 * 0.1 * np.asarray(kernel)) / -0.02
    np.testing.assert_allclose(o, newton_schulz(np.asarray(grad)) * np.sqrt(7 / 3), rtol=1e-4)


def test_newton_schulz_runs_in_bf16_by_default():
    g = jax.random.normal(jax.random.key(2), (24, 8))
    bf16_tx, f32_tx = ro.scale_by_muon(momentum=0.0), ro.scale_by_muon(0.0, ns_dtype=jnp.float32)
    u_bf16, _ = bf16_tx.update(g, bf16_tx.init(g))
    u_f32, _ = f32_tx.update(g, f32_tx.init(g))
    assert u_bf16.dtype == jnp.float32  # without params: the gradient's dtype
    # fan_out < fan_in gives lr ratio 1: the output holds the bf16 iterate's values exactly.
    np.testing.assert_array_equal(u_bf16, u_bf16.astype(jnp.bfloat16).astype(jnp.float32))
    assert not np.array_equal(u_f32, u_f32.astype(jnp.bfloat16).astype(jnp.float32))
    # bf16 rounding (2**-8 relative) over five iterations, against the fp32 iteration.
    np.testing.assert_allclose(u_bf16, u_f32, atol=0.02 * np.abs(u_f32).max())


def test_bf16_params_keep_fp32_moments():
    params = {"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.zeros(3, jnp.bfloat16)}
    grads = jax.tree.map(lambda x: jnp.linspace(-1, 1, x.size).reshape(x.shape), params)
    grads = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)
    tx = ro.muon(0.02, moment_dtype=jnp.float32)
    state = tx.init(params)
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert len(floats) == 3 and all(x.dtype == jnp.float32 for x in floats)
    step = jax.jit(tx.update)
    updates, state = step(grads, state, params)
    updates, state = step(grads, state, params)
    assert step._cache_size() == 1
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
    muon_buf = state.inner_states["muon"].inner_state[0].momentum["w"]
    want = 0.95 * 0.05 * np.asarray(grads["w"], np.float32) + 0.05 * np.asarray(
        grads["w"], np.float32
    )
    np.testing.assert_allclose(muon_buf, want, rtol=1e-6)


test_bad_hyperparameters = rejects(
    ro.muon,
    [
        ({"learning_rate": -0.02}, ValueError, "learning_rate=-0.02"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay=-0.1"),
        ({"momentum": 1.0}, ValueError, "momentum=1.0"),
        ({"momentum": -0.5}, ValueError, "momentum=-0.5"),
        ({"nesterov": 1}, TypeError, "nesterov=1"),
        ({"ns_steps": 0}, ValueError, "ns_steps=0"),
        ({"ns_steps": 100}, ValueError, "ns_steps=100"),
        ({"ns_steps": 2.0}, TypeError, "ns_steps=2.0"),
        ({"ns_coefficients": (3.4, -4.7)}, TypeError, "ns_coefficients"),
        ({"ns_coefficients": (3.4, float("inf"), 2.0)}, ValueError, r"ns_coefficients\[1\]"),
        ({"eps": 0.0}, ValueError, "eps=0.0"),
        ({"adjust_lr_fn": "spectral"}, ValueError, "adjust_lr_fn='spectral'"),
        ({"matrix_layout": "oi"}, ValueError, "matrix_layout='oi'"),
        ({"adamw_learning_rate": -1.0}, ValueError, "adamw_learning_rate=-1.0"),
        ({"adamw_b1": 1.0}, ValueError, "adamw_b1=1.0"),
        ({"adamw_b2": 2.0}, ValueError, "adamw_b2=2.0"),
        ({"adamw_eps": -1.0}, ValueError, "adamw_eps=-1.0"),
        ({"adamw_weight_decay": -1.0}, ValueError, "adamw_weight_decay=-1.0"),
        ({"stacked": "yes"}, TypeError, "stacked='yes'"),
        ({"ns_dtype": None}, TypeError, "ns_dtype=None"),
        ({"ns_dtype": jnp.int8}, TypeError, "ns_dtype"),
        ({"moment_dtype": jnp.int32}, TypeError, "moment_dtype"),
    ],
    learning_rate=0.02,
)


PARAMS = {"dense": {"kernel": jnp.ones((5, 3)), "bias": jnp.ones(3)}, "conv": jnp.ones((2, 3, 4))}


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        ({"dense": {"kernel": True}, "conv": False}, ValueError, r"params\['dense'\]\['bias'\]"),
        (
            {"dense": {"kernel": True, "bias": False, "extra": True}, "conv": False},
            ValueError,
            r"muon_mask\['dense'\]\['extra'\]",
        ),
        (
            {"dense": {"kernel": 1, "bias": False}, "conv": False},
            TypeError,
            r"muon_mask\['dense'\]\['kernel'\] must be a bool",
        ),
        (
            {"dense": {"kernel": True, "bias": False}, "conv": True},
            ValueError,
            r"params\['conv'\] has shape \(2, 3, 4\)",
        ),
        (lambda p: {"dense": p["dense"]}, ValueError, r"params\['conv'\]"),
    ],
)
@pytest.mark.parametrize("tree_kind", ["dict", "nnx_state"])
def test_bad_mask_names_the_path(mask, error, match, tree_kind):
    params = PARAMS if tree_kind == "dict" else nnx.State(PARAMS)
    with pytest.raises(error, match=match):
        ro.muon(0.02, muon_mask=mask).init(params)


def test_scale_by_muon_rejects_non_matrices_by_path():
    tx = ro.scale_by_muon()
    with pytest.raises(ValueError, match=r"params\['dense'\]\['bias'\] has shape \(3,\)"):
        tx.init({"dense": {"kernel": jnp.ones((5, 3)), "bias": jnp.ones(3)}})


def test_update_needs_params():
    params = {"w": jnp.ones((3, 2))}
    tx = ro.muon(0.02)
    with pytest.raises(ValueError, match="params"):
        tx.update(params, tx.init(params))


def test_second_update_reuses_the_compilation_under_optax_chain():
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    tx = optax.chain(optax.clip(1.0), ro.muon(0.02))
    state = tx.init(params)
    step = jax.jit(tx.update)
    for _ in range(3):
        updates, state = step(params, state, params)
    assert step._cache_size() == 1
    assert np.all(np.isfinite(updates["w"]))


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 0)], ids=str)
@pytest.mark.parametrize("matrix_layout", ["in_out", "out_in"])
def test_empty_matrix_gets_an_empty_update(shape, matrix_layout):
    # torch's lr ratio divides by zero for one orientation of an empty matrix; an empty
    # matrix has nothing to orthogonalize, so its update is empty and the others are as
    # without it.
    full = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    tx = ro.muon(0.02, matrix_layout=matrix_layout)
    params = {**full, "empty": jnp.ones(shape)}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert updates["empty"].shape == shape and updates["empty"].dtype == jnp.float32
    want, _ = jax.jit(tx.update)({k: grads[k] for k in full}, tx.init(full), full)
    for key in full:
        np.testing.assert_array_equal(np.asarray(updates[key]), np.asarray(want[key]))


# ---------------------------------------------------------------------------------------------
# stacked=True: a leaf [L, ..., m, n] of layers stored stacked is L independent matrices.


def unstack(x):
    """The matrices x[i, ..., :, :] of a stack, in row-major order of its leading axes."""
    return [x[i] for i in np.ndindex(*x.shape[:-2])]


def restack(matrices, shape):
    return np.stack([np.asarray(m) for m in matrices]).reshape(shape)


def run_steps(tx, params, grads, *, jit=False):
    """The updates and states of len(grads) steps, each applied to the parameters."""
    state, update = tx.init(params), jax.jit(tx.update) if jit else tx.update
    trajectory = []
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        trajectory.append((updates, state))
    return trajectory, update


def stacked_problem(shape, dtype, steps=3):
    """A stacked kernel "w" and a stacked bias "b" [..., n], with `steps` gradients."""
    key = jax.random.key(sum(shape))
    draw = lambda k, s: jax.random.normal(jax.random.fold_in(key, k), s).astype(dtype)
    params = {"w": draw(0, shape), "b": draw(1, shape[:-2] + shape[-1:])}
    grads = [{"w": draw(2 + t, shape), "b": draw(10 + t, params["b"].shape)} for t in range(steps)]
    return params, grads


def per_matrix(tree):
    """The layers unstacked: the kernel "w" as a list of its matrices, the bias "b" (if any)
    as a list of its vectors."""
    out = {"w": unstack(tree["w"])}
    if "b" in tree:
        out["b"] = [tree["b"][i] for i in np.ndindex(*tree["b"].shape[:-1])]
    return out


# [2, 2, 4, 6]: two leading axes (experts of stacked layers). [3, 64, 32]: summed over its last
# two axes at once, XLA rounds the Frobenius norms differently than for each [64, 32] matrix,
# which the fp32 Newton-Schulz shows (the bf16 one rounds it away for these gradients).
STACKED_SHAPES = [(3, 8, 5), (2, 2, 4, 6), (3, 64, 32)]


def muon_momentum(state):
    """The Muon momentum tree in a scale_by_muon or a muon state."""
    if hasattr(state, "inner_states"):  # muon's optax.partition
        return state.inner_states["muon"].inner_state[0].momentum
    return state.momentum


@pytest.mark.parametrize("ns", [{}, {"ns_dtype": jnp.float32}], ids=["ns-default", "ns-fp32"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", STACKED_SHAPES, ids=str)
@pytest.mark.parametrize("which", ["scale_by_muon", "muon"])
def test_stacked_equals_each_matrix_as_a_leaf_bit_for_bit(which, shape, dtype, ns):
    """Op by op (no jit: XLA may fuse and round two programs differently), over three steps:
    each matrix of a stacked leaf gets the update and momentum it gets as a leaf of its own,
    with the default (bf16) and the fp32 Newton-Schulz. muon also sends a stacked bias to
    AdamW."""
    params, grads = stacked_problem(shape, dtype)
    if which == "scale_by_muon":
        params, grads = {"w": params["w"]}, [{"w": g["w"]} for g in grads]
        stacked, single = ro.scale_by_muon(stacked=True, **ns), ro.scale_by_muon(**ns)
    else:
        stacked = ro.muon(0.02, stacked=True, muon_mask={"w": True, "b": False}, **ns)
        single = ro.muon(0.02, **ns)  # the default mask: matrices to Muon, biases to AdamW
    got, _ = run_steps(stacked, params, grads)
    want, _ = run_steps(single, per_matrix(params), [per_matrix(g) for g in grads])
    for (u, state), (u_want, state_want) in zip(got, want, strict=True):
        for key in u:
            assert u[key].dtype == dtype
            np.testing.assert_array_equal(u[key], restack(u_want[key], u[key].shape), key)
        buf, buf_want = muon_momentum(state)["w"], muon_momentum(state_want)["w"]
        np.testing.assert_array_equal(buf, restack(buf_want, shape))


def test_stacked_takes_a_plain_matrix_too():
    params = {"layers": jnp.linspace(-1, 1, 4 * 6 * 3).reshape(4, 6, 3), "head": jnp.ones((3, 5))}
    grads = [jax.tree.map(lambda p, t=t: jnp.cos(3.0 * p + t), params) for t in range(3)]
    got, _ = run_steps(ro.scale_by_muon(stacked=True), params, grads)
    split = lambda tree: {"layers": unstack(tree["layers"]), "head": tree["head"]}
    want, _ = run_steps(ro.scale_by_muon(), split(params), [split(g) for g in grads])
    for (u, _), (u_want, _) in zip(got, want, strict=True):
        np.testing.assert_array_equal(u["head"], u_want["head"])
        np.testing.assert_array_equal(u["layers"], restack(u_want["layers"], (4, 6, 3)))


def test_stacked_under_jit_compiles_once_and_matches_each_matrix():
    # Under jit the stacked and per-matrix programs are two XLA programs, fused and rounded
    # each its own way (x / norm becomes x * (1 / norm), say): they differ by what the
    # per-matrix transform's own jitted and op-by-op updates differ by, ~1e-6 of the largest.
    params, grads = stacked_problem((3, 64, 32), jnp.float32)
    tx = ro.muon(0.02, stacked=True, muon_mask={"w": True, "b": False}, ns_dtype=jnp.float32)
    got, update = run_steps(tx, params, grads, jit=True)
    assert update._cache_size() == 1
    single = ro.muon(0.02, ns_dtype=jnp.float32)
    want, _ = run_steps(single, per_matrix(params), [per_matrix(g) for g in grads], jit=True)
    for (u, _), (u_want, _) in zip(got, want, strict=True):
        for key in u:
            w = restack(u_want[key], u[key].shape)
            np.testing.assert_allclose(u[key], w, rtol=0, atol=1e-5 * np.abs(w).max())


@pytest.mark.parametrize(
    ("shape", "matrix_layout", "adjust_lr_fn", "ratio"),
    [
        ((2, 4, 16), "in_out", None, 2.0),  # fan_out / fan_in = 16 / 4; not (4 / 2) ** 0.5
        ((2, 16, 4), "out_in", None, 2.0),  # torch's (out, in) = (16, 4); not 1 from (2, 16)
        ((3, 2, 4, 16), "in_out", "match_rms_adamw", 0.8),  # 0.2 sqrt(max(4, 16))
    ],
)
def test_stacked_lr_ratio_is_of_the_last_two_dims(shape, matrix_layout, adjust_lr_fn, ratio):
    g = jax.random.normal(jax.random.key(5), shape)
    kw = dict(momentum=0.0, adjust_lr_fn=adjust_lr_fn, matrix_layout=matrix_layout)
    tx = ro.scale_by_muon(stacked=True, ns_dtype=jnp.float32, **kw)
    u, _ = tx.update(g, tx.init(g))
    for u_i, g_i in zip(unstack(u), unstack(g), strict=True):
        want = ratio * newton_schulz(np.asarray(g_i, np.float64))
        np.testing.assert_allclose(u_i, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 0, 3), (2, 3, 0)], ids=str)
def test_stacked_empty_stack_or_matrices_get_an_empty_update(shape):
    params = {"w": jnp.ones(shape), "v": jnp.ones((3, 2))}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    tx = ro.scale_by_muon(stacked=True)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params))
    assert updates["w"].shape == shape
    want, _ = jax.jit(tx.update)({"v": grads["v"]}, tx.init({"v": params["v"]}))
    np.testing.assert_array_equal(updates["v"], want["v"])


def test_stacked_still_refuses_a_vector():
    with pytest.raises(ValueError, match=r"params\['b'\] has shape \(3,\)\. Send it to the"):
        ro.scale_by_muon(stacked=True).init({"w": jnp.ones((2, 3, 4)), "b": jnp.ones(3)})
    tx = ro.muon(0.02, stacked=True, muon_mask={"w": True, "b": True})
    with pytest.raises(ValueError, match=r"params\['b'\] has shape \(3,\)"):
        tx.init({"w": jnp.ones((2, 3, 4)), "b": jnp.ones(3)})


def test_stacked_must_be_a_bool():
    with pytest.raises(TypeError, match="stacked must be a bool, got stacked='yes'"):
        ro.scale_by_muon(stacked="yes")


def test_unstacked_refusal_of_a_stack_names_stacked():
    match = (
        r"params\['w'\] has shape \(2, 3, 4\)\. Send it to the AdamW fallback with muon_mask, "
        r"or pass stacked=True if its leading axes index a stack of matrices "
        r"\(rudax\.layers\.stack_layers\)"
    )
    with pytest.raises(ValueError, match=match):
        ro.scale_by_muon().init({"w": jnp.ones((2, 3, 4))})
    with pytest.raises(ValueError, match=match):
        ro.muon(0.02, muon_mask={"w": True}).init({"w": jnp.ones((2, 3, 4))})


def test_stacked_is_static_under_inject_hyperparams():
    g = jnp.linspace(-1.0, 1.0, 24).reshape(2, 3, 4)
    tx = ro.inject_hyperparams(ro.scale_by_muon)(momentum=0.5, stacked=True)
    state = tx.init(g)
    assert set(state.hyperparams) == {"momentum", "eps"}
    u, _ = jax.jit(tx.update)(g, state)
    plain = ro.scale_by_muon(momentum=0.5, stacked=True)
    want, _ = jax.jit(plain.update)(g, plain.init(g))
    np.testing.assert_array_equal(u, want)


# ---------------------------------------------------------------------------------------------
# mask=: torch parameter groups with weight_decay=0, in torch.optim.Muon and torch.optim.AdamW.

torch = pytest.importorskip("torch", reason="torch is the reference (the test extra pins it)")


def _torch_newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim._muon._zeropower_via_newtonschulz with ``grad.float()`` for its
    ``grad.bfloat16()``: torch's iteration, in fp32 as ``ns_dtype=jnp.float32`` runs ours, so
    the comparison is to fp32 rounding instead of bf16's."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def _flat(tree):
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


GROUP_PARAMS = {
    "w": (3, 4),  # to Muon, decayed
    "embed": (6, 4),  # to Muon, not decayed (a 2-D leaf the mask spares)
    "b": (4,),  # to AdamW, not decayed
    "norm": {"scale": (4,)},  # to AdamW, not decayed
}


@pytest.mark.parametrize(
    "mask",
    [
        pytest.param({"w": True, "embed": False, "b": False, "norm": False}, id="prefix"),
        pytest.param(
            lambda p: jax.tree_util.tree_map_with_path(
                lambda path, x: x.ndim == 2 and "embed" not in jax.tree_util.keystr(path), p
            ),
            id="callable",
        ),
    ],
)
def test_mask_is_a_torch_parameter_group_without_decay(mask, monkeypatch):
    """torch.optim.Muon for the 2-D leaves and torch.optim.AdamW for the rest, each with a
    weight_decay=0 group: the spared leaves still take their optimizer's step."""
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _torch_newton_schulz_fp32)
    rng = np.random.default_rng(0)
    shapes = jax.tree.leaves(GROUP_PARAMS, is_leaf=lambda x: isinstance(x, tuple))
    treedef = jax.tree.structure(GROUP_PARAMS, is_leaf=lambda x: isinstance(x, tuple))
    params = treedef.unflatten([rng.standard_normal(s).astype(np.float32) for s in shapes])
    grads = [
        jax.tree.map(lambda p, t=t: (np.cos(t) + rng.standard_normal(p.shape)).astype(np.float32),
                     params)
        for t in range(6)
    ]  # fmt: skip
    tx = ro.muon(
        0.05, weight_decay=0.5, matrix_layout="out_in", adamw_learning_rate=0.02,
        adamw_b1=0.8, adamw_b2=0.9, adamw_weight_decay=0.3, ns_dtype=jnp.float32, mask=mask,
    )  # fmt: skip
    p = jax.tree.map(jnp.asarray, params)
    state, update = tx.init(p), jax.jit(tx.update)
    for g in grads:
        updates, state = update(jax.tree.map(jnp.asarray, g), state, p)
        p = optax.apply_updates(p, updates)

    t = {k: torch.tensor(v, requires_grad=True) for k, v in _flat(params).items()}
    muon = torch.optim.Muon(
        [{"params": [t["['w']"]]}, {"params": [t["['embed']"]], "weight_decay": 0.0}],
        lr=0.05, weight_decay=0.5,
    )  # fmt: skip
    adamw = torch.optim.AdamW(
        [{"params": [t["['b']"], t["['norm']['scale']"]], "weight_decay": 0.0}],
        lr=0.02, betas=(0.8, 0.9), weight_decay=0.3,
    )  # fmt: skip
    for g in grads:
        for k, v in _flat(g).items():
            t[k].grad = torch.tensor(v)
        muon.step()
        adamw.step()
    for k, v in _flat(p).items():
        np.testing.assert_allclose(v, t[k].detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


def test_mask_spares_a_muon_leaf_and_an_adamw_leaf_exactly():
    # Bit for bit: a spared leaf's update is the one with weight_decay=0 (and
    # adamw_weight_decay=0), a decayed leaf's the one with the decay.
    params = {"w": jnp.linspace(-1, 1, 12).reshape(3, 4), "v": jnp.ones((2, 3)),
              "b": jnp.linspace(0, 1, 4), "c": jnp.ones(3)}  # fmt: skip
    grads = jax.tree.map(lambda x: jnp.cos(3.0 * x + 1.0), params)
    mask = {"w": True, "v": False, "b": True, "c": False}
    run = lambda **kw: ro.muon(0.05, ns_dtype=jnp.float32, **kw).update(
        grads, ro.muon(0.05).init(params), params
    )[0]
    masked = run(weight_decay=0.5, adamw_weight_decay=0.3, mask=mask)
    decayed = run(weight_decay=0.5, adamw_weight_decay=0.3)
    spared = run(weight_decay=0.0, adamw_weight_decay=0.0)
    for key, decays in mask.items():
        np.testing.assert_array_equal(masked[key], (decayed if decays else spared)[key])


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        ({"w": 1, "b": False}, TypeError, r"muon: mask\['w'\] must be a Python bool"),
        ({"w": True}, ValueError, "muon: mask must have the parameters' tree structure"),
        (lambda p: [True, False], ValueError, "muon: mask must have"),
    ],
)
def test_bad_decay_mask(mask, error, match):
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    with pytest.raises(error, match=match):
        tx = ro.muon(0.02, mask=mask)
        tx.update(params, tx.init(params), params)


# ---------------------------------------------------------------------------------------------
# inject_hyperparams.

INJECT_PARAMS = {
    "w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3),
    "v": jnp.linspace(0.5, -2.0, 6).reshape(3, 2),
    "b": jnp.array([0.5, -0.25]),
    "c": jnp.array([1.0, 2.0, -1.0]),
}
STRUCTURAL = (
    "nesterov", "ns_steps", "ns_coefficients", "adjust_lr_fn", "matrix_layout", "stacked",
    "muon_mask", "ns_dtype", "moment_dtype", "mask",
)  # fmt: skip
# Dyadic values, exact in float32 and in float64 alike (see test_adan.py's INJECT_KWARGS).
INJECT_KWARGS = dict(
    learning_rate=0.0625, weight_decay=0.25, momentum=0.875, eps=2.0**-20,
    adamw_learning_rate=0.03125, adamw_b1=0.75, adamw_b2=0.9375, adamw_eps=2.0**-10,
    adamw_weight_decay=0.125, ns_dtype=jnp.float32,
)  # fmt: skip
# eps at 64 exceeds the momentum's norm, so it sets the normalization: a value that matters.
NEW_VALUES = dict(
    learning_rate=0.125, weight_decay=0.5, momentum=0.5, eps=64.0, adamw_learning_rate=0.25,
    adamw_b1=0.5, adamw_b2=0.5, adamw_eps=0.5, adamw_weight_decay=0.75,
)  # fmt: skip


# One matrix and one vector decay, one of each does not: every decay still matters.
@pytest.mark.parametrize(
    ("mask", "ns_dtype"),
    [
        # The default bf16 Newton-Schulz with every leaf in Muon; fp32 Newton-Schulz with a
        # mask. (fp32 with every leaf in Muon adds nothing these two do not check, and its
        # ten plain compilations cost CI 16 s.)
        pytest.param({"w": True, "v": False, "b": False, "c": True}, jnp.float32, id="mask"),
        pytest.param(None, jnp.bfloat16, id="all-ns-bf16"),
    ],
)
def test_inject_hyperparams(mask, ns_dtype):
    # Bit for bit: every hyperparameter meets the arrays as a weakly typed float32 scalar, as
    # the plain optimizer's Python float does.
    assert_injectable(
        ro.muon,
        {**INJECT_KWARGS, "ns_dtype": ns_dtype, "mask": mask},
        INJECT_PARAMS,
        optax_static_args=STRUCTURAL,
        new_values=NEW_VALUES,
    )


@pytest.mark.parametrize("moment_dtype", [None, jnp.float32])
def test_inject_hyperparams_bf16_params_keep_fp32_hyperparameters(moment_dtype):
    assert_bf16_keeps_fp32_hyperparameters(
        ro.muon, {**INJECT_KWARGS, "moment_dtype": moment_dtype}, INJECT_PARAMS
    )


def test_inject_without_static_args_names_the_fix():
    tx = optax.inject_hyperparams(ro.muon)(learning_rate=0.02)
    with pytest.raises(TypeError, match=r"muon: ns_steps .*static_args=\('ns_steps', \.\.\.\)"):
        tx.init(INJECT_PARAMS)
    # A dtype is a callable, which optax takes for a schedule.
    tx = optax.inject_hyperparams(ro.muon, static_args="ns_steps")(learning_rate=0.02)
    with pytest.raises(TypeError, match=r"muon: ns_dtype .*rudax.optim.inject_hyperparams"):
        tx.init(INJECT_PARAMS)


def test_scale_by_muon_is_injectable():
    tx = ro.inject_hyperparams(ro.scale_by_muon)(momentum=0.5, ns_dtype=jnp.float32)
    state = tx.init(INJECT_PARAMS["w"])
    assert set(state.hyperparams) == {"momentum", "eps"}
    u, _ = jax.jit(tx.update)(INJECT_PARAMS["w"], state)
    plain = ro.scale_by_muon(momentum=0.5, ns_dtype=jnp.float32)
    want, _ = jax.jit(plain.update)(INJECT_PARAMS["w"], plain.init(INJECT_PARAMS["w"]))
    np.testing.assert_array_equal(u, want)


# ---------------------------------------------------------------------------------------------
# Complex parameters: Muon's leaves must be real; AdamW's follow AdamW.


@pytest.mark.parametrize("where", ["init", "update"])
def test_complex_muon_leaf_is_a_type_error_naming_it(where):
    params = {"layer": {"w": jnp.ones((3, 2), jnp.complex64)}, "b": jnp.ones(2)}
    tx = ro.muon(0.02)
    match = r"muon: (parameter|gradient) \['layer'\]\['w'\] has dtype=complex64: Muon"
    with pytest.raises(TypeError, match=match):
        if where == "init":
            tx.init(params)
        else:
            real = jax.tree.map(lambda x: jnp.real(x), params)
            tx.update(params, tx.init(real), real)
    with pytest.raises(TypeError, match=r"scale_by_muon: parameter \['w'\] has dtype=complex64"):
        ro.scale_by_muon().init({"w": params["layer"]["w"]})


def test_complex_adamw_leaf_is_stepped_as_adamw():
    params = {"w": jnp.ones((3, 2)), "z": jnp.asarray([1 + 2j, -0.5j], jnp.complex64)}
    grads = {"w": jnp.full((3, 2), 0.5), "z": jnp.asarray([0.25 - 1j, 2 + 0j], jnp.complex64)}
    tx = ro.muon(0.02, adamw_learning_rate=0.1, adamw_weight_decay=0.2)
    updates, _ = tx.update(grads, tx.init(params), params)
    adamw = ro.adamw(0.1, weight_decay=0.2)
    want, _ = adamw.update(grads["z"], adamw.init(params["z"]), params["z"])
    assert updates["z"].dtype == jnp.complex64
    np.testing.assert_array_equal(updates["z"], want)
