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
