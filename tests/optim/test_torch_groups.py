"""sgd, adam, adamw, adagrad and rmsprop against torch.optim itself: weight-decay masks as torch
parameter groups, and complex parameters as torch computes them (on their real view).

The numpy references in test_sgd.py etc. are torch's rules written out; here the reference is
torch 2.13 running the same steps, so a misreading of torch's code cannot hide in both.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rudax.optim as ro

torch = pytest.importorskip("torch", reason="torch is the reference (the test extra pins it)")

STEPS = 8

# (rudax factory, torch class, rudax kwargs, the same in torch's names). Every coefficient is
# non-zero so each term of each rule is exercised, and weight decay is large enough that a
# leaf decayed by mistake ends far from torch's.
OPTIMIZERS = {
    "sgd": (
        ro.sgd,
        torch.optim.SGD,
        dict(learning_rate=0.05, momentum=0.9, dampening=0.1, weight_decay=0.3),
        dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.3),
    ),
    "sgd-nesterov": (
        ro.sgd,
        torch.optim.SGD,
        dict(learning_rate=0.05, momentum=0.9, nesterov=True, weight_decay=0.3),
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.3),
    ),
    "adam": (
        ro.adam,
        torch.optim.Adam,
        dict(learning_rate=0.05, b1=0.8, b2=0.9, weight_decay=0.3, amsgrad=True),
        dict(lr=0.05, betas=(0.8, 0.9), weight_decay=0.3, amsgrad=True),
    ),
    "adamw": (
        ro.adamw,
        torch.optim.AdamW,
        dict(learning_rate=0.05, b1=0.8, b2=0.9, weight_decay=0.5),
        dict(lr=0.05, betas=(0.8, 0.9), weight_decay=0.5),
    ),
    "adagrad": (
        ro.adagrad,
        torch.optim.Adagrad,
        dict(learning_rate=0.05, lr_decay=0.01, weight_decay=0.3, initial_accumulator_value=0.1),
        dict(lr=0.05, lr_decay=0.01, weight_decay=0.3, initial_accumulator_value=0.1),
    ),
    "rmsprop": (
        ro.rmsprop,
        torch.optim.RMSprop,
        dict(learning_rate=0.01, alpha=0.9, weight_decay=0.3, momentum=0.5, centered=True),
        dict(lr=0.01, alpha=0.9, weight_decay=0.3, momentum=0.5, centered=True),
    ),
}


def _params(rng, dtype=np.float32):
    return {
        "w": rng.standard_normal((3, 4)).astype(dtype),
        "b": rng.standard_normal((4,)).astype(dtype),
        "norm": {"scale": (1 + 0.1 * rng.standard_normal((4,))).astype(dtype)},
    }


def _grads(rng, params, step):
    # Gradients that change sign and size from step to step, so momentum, the second moment
    # and amsgrad's maximum all matter.
    return jax.tree.map(
        lambda p: (np.cos(step) + rng.standard_normal(p.shape)).astype(p.dtype), params
    )


def _run_rudax(tx, params, grads):
    params = jax.tree.map(jnp.asarray, params)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in grads:
        updates, state = update(jax.tree.map(jnp.asarray, g), state, params)
        params = optax.apply_updates(params, updates)
    return jax.tree.map(np.asarray, params)


def _run_torch(make, params, grads, groups):
    """torch's run; ``groups`` maps a group's extra options to the leaf paths it holds."""
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in _flat(params).items()}
    opt = make([{"params": [tensors[k] for k in keys], **extra} for extra, keys in groups])
    for g in grads:
        for k, v in _flat(g).items():
            tensors[k].grad = torch.tensor(v)
        opt.step()
    return {k: t.detach().numpy() for k, t in tensors.items()}


def _flat(tree):
    return {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _assert_close(ours, theirs):
    ours = _flat(ours)
    assert ours.keys() == theirs.keys()
    for k in ours:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=2e-5, atol=2e-6, err_msg=k)


MATRICES_ONLY = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)


@pytest.mark.parametrize(
    "mask",
    [
        pytest.param(MATRICES_ONLY, id="callable"),
        pytest.param({"w": True, "b": False, "norm": {"scale": False}}, id="tree"),
        pytest.param({"w": True, "b": False, "norm": False}, id="prefix"),
    ],
)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_mask_is_a_torch_parameter_group_without_decay(name, mask):
    """The masked-out bias and norm scale get torch's step with weight_decay=0, not no step."""
    factory, torch_class, ours, theirs = OPTIMIZERS[name]
    rng = np.random.default_rng(0)
    params = _params(rng)
    grads = [_grads(rng, params, t) for t in range(STEPS)]
    expected = _run_torch(
        lambda groups: torch_class(groups, **theirs),
        params,
        grads,
        [({}, ["['w']"]), ({"weight_decay": 0.0}, ["['b']", "['norm']['scale']"])],
    )
    _assert_close(_run_rudax(factory(**ours, mask=mask), params, grads), expected)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_complex_parameters_follow_torch(name):
    """torch runs a complex parameter's rule on view_as_real: |g|**2 is not what v collects."""
    factory, torch_class, ours, theirs = OPTIMIZERS[name]
    rng = np.random.default_rng(1)
    re, im = _params(rng), _params(rng)
    params = jax.tree.map(lambda a, b: (a + 1j * b).astype(np.complex64), re, im)
    grads = [
        jax.tree.map(
            lambda a, b: (a + 1j * b).astype(np.complex64), _grads(rng, re, t), _grads(rng, im, t)
        )
        for t in range(STEPS)
    ]
    expected = _run_torch(
        lambda groups: torch_class(groups, **theirs), params, grads, [({}, list(_flat(params)))]
    )
    ours_final = _run_rudax(factory(**ours), params, grads)
    assert all(x.dtype == np.complex64 for x in jax.tree.leaves(ours_final))
    _assert_close(ours_final, expected)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_complex_state_keeps_the_parameter_dtype(name):
    """Buffers of a complex parameter are complex, as torch's state tensors are; with
    moment_dtype=float64 they are complex128."""
    factory, _, ours, _ = OPTIMIZERS[name]
    params = {"z": jnp.ones((2, 3), jnp.complex64)}
    buffers = [x for x in jax.tree.leaves(factory(**ours).init(params)) if x.shape == (2, 3)]
    assert buffers and all(x.dtype == jnp.complex64 for x in buffers)
