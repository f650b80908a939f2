"""Tests of rudax.layers.Dropout: the mask's values and rate, modes, fresh masks, flax's
randomness (call-time and construction rngs give nnx.Dropout's mask), sharding, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
from tests.optim._bad_input import rejects


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_keeps_with_probability_one_minus_rate_and_rescales(dtype):
    drop = rl.Dropout(0.25, rngs=nnx.Rngs(dropout=0))
    x = jnp.full((4000,), 3.0, dtype)
    y = np.asarray(drop(x), np.float32)
    assert drop(x).dtype == dtype
    kept = y != 0
    np.testing.assert_array_equal(y[kept], np.float32(jnp.asarray(3.0 / 0.75, dtype)))
    # 4000 Bernoulli(0.75) draws: std of the kept fraction is ~0.007.
    assert abs(kept.mean() - 0.75) < 0.03


def test_fresh_mask_every_call_also_under_jit():
    drop = rl.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
    x = jnp.ones((64,))
    a, b = drop(x), drop(x)
    assert not np.array_equal(a, b)
    step = nnx.jit(lambda m, x: m(x))
    c, d = step(drop, x), step(drop, x)
    assert not np.array_equal(c, d)


def test_modes():
    x = jnp.arange(1.0, 9.0)
    drop = rl.Dropout(0.5, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(drop(x, deterministic=True), x)
    model = nnx.List([drop])
    model.eval()
    assert drop.deterministic
    np.testing.assert_array_equal(drop(x), x)
    assert not np.array_equal(drop(x, deterministic=False), x)  # the call's flag wins
    model.train()
    assert not drop.deterministic
    assert nnx.view(drop, deterministic=True).deterministic
    np.testing.assert_array_equal(rl.Dropout(0.0)(x), x)  # rate 0 needs no rngs


def test_without_rngs_only_deterministic_or_call_rngs():
    drop = rl.Dropout(0.5, deterministic=True)
    np.testing.assert_array_equal(drop(jnp.ones(3)), jnp.ones(3))
    with pytest.raises(ValueError, match=r"rngs=None.*to the constructor or to the call"):
        drop(jnp.ones(3), deterministic=False)
    assert not np.array_equal(drop(X, deterministic=False, rngs=jax.random.key(0)), X)


test_bad_arguments = rejects(
    rl.Dropout,
    [
        ({"rate": 1.0}, ValueError, r"rate must be in \[0, 1\), got rate=1.0"),
        ({"rate": -0.1}, ValueError, "rate=-0.1"),
        ({"rate": "0.1"}, TypeError, "rate='0.1'"),
        ({"deterministic": None}, TypeError, "deterministic=None"),
        ({"rngs": 0}, TypeError, "rngs=0"),
        ({"rngs": jax.random.key(0)}, TypeError, "nnx.Rngs, an nnx.RngStream or None"),
    ],
    rate=0.1,
)


# --- the mask's randomness is flax's nnx.Dropout's ------------------------------------------

RATE = 0.3
X = jnp.arange(1.0, 257.0)  # no zero element, so a zero in the output is a dropped element

# Each way of passing randomness, built fresh for each side so both start from the same state.
CALL_RNGS = {
    "rngs-dropout-stream": lambda: nnx.Rngs(dropout=3),
    "rngs-default-stream-only": lambda: nnx.Rngs(3),  # falls back to the default stream
    "rng-stream": lambda: nnx.Rngs(dropout=3)["dropout"],
    "typed-key": lambda: jax.random.key(3),
    "raw-uint32-key": lambda: jax.random.PRNGKey(3),
}


def assert_flax_mask(y, want):
    """y drops exactly where flax's output is zero and keeps x * (1 / (1 - rate)) elsewhere."""
    y, want = np.asarray(y), np.asarray(want)
    np.testing.assert_array_equal(y == 0, want == 0)
    assert 0 < (y == 0).sum() < y.size  # some dropped, some kept: the comparison means something
    kept = y != 0
    np.testing.assert_array_equal(y[kept], np.asarray(X * (1.0 / (1.0 - RATE)))[kept])


@pytest.mark.parametrize("kind", CALL_RNGS)
def test_call_rngs_give_flax_mask(kind):
    ours, theirs = CALL_RNGS[kind](), CALL_RNGS[kind]()
    drop, flax_drop = rl.Dropout(RATE), nnx.Dropout(RATE)
    for _ in range(2):  # a stream advances the same way on both sides; a key repeats
        assert_flax_mask(drop(X, rngs=ours), flax_drop(X, rngs=theirs))


def test_call_rngs_advance_a_stream_and_repeat_a_key():
    drop = rl.Dropout(RATE)
    rngs, key = nnx.Rngs(dropout=3), jax.random.key(3)
    assert not np.array_equal(drop(X, rngs=rngs), drop(X, rngs=rngs))
    np.testing.assert_array_equal(drop(X, rngs=key), drop(X, rngs=key))


@pytest.mark.parametrize("kind", ["rngs", "rng-stream"])
def test_construction_rngs_give_flax_mask(kind):
    make = (lambda: nnx.Rngs(dropout=5)) if kind == "rngs" else lambda: nnx.Rngs(5)["dropout"]
    drop, flax_drop = rl.Dropout(RATE, rngs=make()), nnx.Dropout(RATE, rngs=make())
    for _ in range(3):
        assert_flax_mask(drop(X), flax_drop(X))


def test_call_rngs_take_precedence_and_leave_the_kept_stream_alone():
    drop = rl.Dropout(RATE, rngs=nnx.Rngs(dropout=5))
    flax_drop = nnx.Dropout(RATE, rngs=nnx.Rngs(dropout=5))
    key = jax.random.key(11)
    assert_flax_mask(drop(X, rngs=key), flax_drop(X, rngs=key))
    assert_flax_mask(drop(X, rngs=key), nnx.Dropout(RATE)(X, rngs=key))  # not the kept stream's
    assert int(drop.rngs.count[...]) == 0
    # The kept stream's first mask is still the one a fresh layer draws first.
    assert_flax_mask(drop(X), nnx.Dropout(RATE, rngs=nnx.Rngs(dropout=5))(X))


@pytest.mark.parametrize("how", ["call-flag", "eval", "rate-0"])
def test_deterministic_draws_no_key_from_call_rngs(how):
    rngs = nnx.Rngs(dropout=3)
    drop = rl.Dropout(0.0 if how == "rate-0" else RATE)
    if how == "eval":
        nnx.List([drop]).eval()
    y = drop(X, deterministic=True if how == "call-flag" else None, rngs=rngs)
    np.testing.assert_array_equal(y, X)
    assert int(rngs["dropout"].count[...]) == 0


def test_call_rngs_under_jit_draw_fresh_masks_as_flax():
    ours, theirs = nnx.Rngs(dropout=3), nnx.Rngs(dropout=3)
    drop, flax_drop = rl.Dropout(RATE), nnx.Dropout(RATE)
    step = nnx.jit(lambda m, x, rngs: m(x, rngs=rngs))
    a, b = step(drop, X, ours), step(drop, X, ours)
    assert not np.array_equal(a, b)
    assert_flax_mask(a, step(flax_drop, X, theirs))
    assert_flax_mask(b, step(flax_drop, X, theirs))
    key_step = nnx.jit(lambda m, x, key: m(x, rngs=key))
    assert_flax_mask(key_step(drop, X, jax.random.key(4)), flax_drop(X, rngs=jax.random.key(4)))


def test_mnist_tutorial_step_with_call_rngs_matches_flax():
    """The flax.nnx MNIST tutorial's pattern: a Dropout built without rngs, an ``nnx.Rngs``
    passed through ``nnx.jit`` and ``nnx.value_and_grad`` to the call. Rate 0.5 makes both
    scalings exact, so the loss and gradients equal flax's bit for bit."""

    class MLP(nnx.Module):
        def __init__(self, dropout, *, rngs):
            self.linear = nnx.Linear(4, 8, rngs=rngs)
            self.dropout = dropout(rate=0.5)

        def __call__(self, x, rngs=None):
            return self.dropout(nnx.relu(self.linear(x)), rngs=rngs)

    def loss_fn(model, rngs, x):
        return (model(x, rngs) ** 2).sum()

    @nnx.jit
    def train_step(model, rngs, x):
        return nnx.value_and_grad(loss_fn)(model, rngs, x)

    x = jnp.linspace(-1.0, 1.0, 2 * 4).reshape(2, 4)
    ours, theirs = MLP(rl.Dropout, rngs=nnx.Rngs(0)), MLP(nnx.Dropout, rngs=nnx.Rngs(0))
    ours_rngs, theirs_rngs = nnx.Rngs(dropout=1), nnx.Rngs(dropout=1)
    for _ in range(2):
        loss, grads = train_step(ours, ours_rngs, x)
        want_loss, want_grads = train_step(theirs, theirs_rngs, x)
        assert float(loss) == float(want_loss)
        kernel, want_kernel = grads["linear"]["kernel"][...], want_grads["linear"]["kernel"][...]
        np.testing.assert_array_equal(kernel, want_kernel)
    assert int(ours_rngs["dropout"].count[...]) == 2


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_sharded_input_keeps_its_sharding_and_flax_mask(axes):
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets them on CPU)")
    x = jnp.arange(1.0, 1.0 + 8 * 32).reshape(8, 32)
    if axes == "explicit":
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    else:
        mesh = jax.sharding.Mesh(np.asarray(devices), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.device_put(x, sharding)
    step = nnx.jit(lambda m, x: m(x, rngs=jax.random.key(2)))
    with jax.set_mesh(mesh):
        y, want = step(rl.Dropout(RATE), x), step(nnx.Dropout(RATE), x)
    assert y.sharding.is_equivalent_to(sharding, y.ndim)
    np.testing.assert_array_equal(np.asarray(y) == 0, np.asarray(want) == 0)
    kept = np.asarray(y) != 0
    np.testing.assert_array_equal(np.asarray(y)[kept], np.asarray(x * (1.0 / (1.0 - RATE)))[kept])


@pytest.mark.parametrize(
    "rngs, match",
    [
        (0, "rngs=0"),
        ("dropout", "rngs='dropout'"),
        (jnp.ones(2), r"rngs\.dtype=float32, rngs\.shape=\(2,\)"),
        (jax.random.split(jax.random.key(0), 3), r"single PRNG key.*rngs\.shape=\(3,\)"),
    ],
    ids=["int-seed", "string", "float-array", "batch-of-keys"],
)
def test_bad_call_rngs(rngs, match):
    drop = rl.Dropout(RATE, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=match):
        drop(X, rngs=rngs)
    with pytest.raises(TypeError, match=match):  # also in eval, where no key would be drawn
        drop(X, deterministic=True, rngs=rngs)
