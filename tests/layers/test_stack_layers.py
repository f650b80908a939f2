"""rudax.layers.stack_layers / unstack_layers, and scan_layers over layers stored stacked: the
same results as a scan over the modules, without the per-call copy of their parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl


class Block(nnx.Module):
    """A residual MLP block: ``x + up(norm(x)) @ down``."""

    def __init__(self, d, h, *, rngs):
        self.norm = rl.RMSNorm(d)
        self.up = rl.Linear(d, h, rngs=rngs)
        self.down = rl.Linear(h, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x)))), None


def _blocks(n, d=8, h=16):
    return [Block(d, h, rngs=nnx.Rngs(i)) for i in range(n)]


def test_stack_then_unstack_gives_the_layers_back_bitwise():
    layers = _blocks(3)
    want = [jax.tree.map(np.asarray, nnx.state(b)) for b in layers]
    stacked = rl.stack_layers(layers)
    assert stacked.stacked_layers == 3 and stacked.up.kernel.shape == (3, 8, 16)
    assert layers[0].up.kernel.shape == (0,)  # released as it was stacked
    back = rl.unstack_layers(stacked)
    assert stacked.up.kernel.shape == (0,)  # released as it was split
    for layer, state in zip(back, want, strict=True):
        assert not hasattr(layer, "stacked_layers")
        for a, b in zip(jax.tree.leaves(nnx.state(layer)), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)


def test_a_scan_over_stacked_layers_equals_one_over_the_modules():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    layers = _blocks(3)
    graphdef, states = nnx.split(nnx.List(layers))

    def over_modules(states, x):
        return jnp.sum(rl.scan_layers(list(nnx.merge(graphdef, states)), x)[0] ** 2)

    want, want_grads = jax.jit(jax.value_and_grad(over_modules))(states, x)
    stacked = rl.stack_layers(layers)
    sgraph, sstate = nnx.split(stacked)

    def over_stacked(state, x):
        return jnp.sum(rl.scan_layers(nnx.merge(sgraph, state), x, remat_policy="full")[0] ** 2)

    got, grads = jax.jit(jax.value_and_grad(over_stacked))(sstate, x)
    assert float(got) == float(want)
    # the stacked gradient's slice i is layer i's
    stacked_grads = dict(nnx.to_flat_state(grads))
    for path, g in nnx.to_flat_state(want_grads):
        np.testing.assert_allclose(
            np.asarray(stacked_grads[path[1:]][path[0]]), np.asarray(g), rtol=1e-6, atol=1e-7
        )


def test_stacked_storage_saves_the_per_step_copy_of_the_parameters():
    """XLA's own accounting of a gradient step: scanning modules stacks their parameters
    inside the step (a temporary the size of the parameters), a stacked module does not."""
    d, h, n = 256, 1024, 4  # 4 MiB of fp32 parameters, against 8 KiB of activations
    x = jnp.ones((2, d), jnp.float32)
    layers = _blocks(n, d, h)
    param_bytes = sum(a.nbytes for a in jax.tree.leaves(nnx.state(nnx.List(layers))))
    graphdef, states = nnx.split(nnx.List(layers))

    def over_modules(states):
        return jnp.sum(rl.scan_layers(list(nnx.merge(graphdef, states)), x)[0])

    sgraph, sstate = nnx.split(rl.stack_layers(_blocks(n, d, h)))

    def over_stacked(state):
        return jnp.sum(rl.scan_layers(nnx.merge(sgraph, state), x)[0])

    def temp(f, state):
        return jax.jit(jax.grad(f)).lower(state).compile().memory_analysis().temp_size_in_bytes

    saved = temp(over_modules, states) - temp(over_stacked, sstate)
    assert saved >= 0.9 * param_bytes, (saved, param_bytes)


def test_bad_layers_are_named():
    with pytest.raises(ValueError, match="layers is empty"):
        rl.stack_layers([])
    with pytest.raises(ValueError, match=r"layers\[1\] differs in structure"):
        rl.stack_layers([Block(8, 16, rngs=nnx.Rngs(0)), Block(8, 12, rngs=nnx.Rngs(0))])
    dropout = [rl.Dropout(0.1, rngs=nnx.Rngs(0)) for _ in range(2)]
    with pytest.raises(ValueError, match=r"layers\[0\] holds RNG state"):
        rl.stack_layers(dropout)
    stacked = rl.stack_layers(_blocks(2))
    with pytest.raises(ValueError, match=r"layers\[0\] is already stacked"):
        rl.stack_layers([stacked])
    with pytest.raises(ValueError, match="Block is not stacked layers"):
        rl.unstack_layers(Block(8, 16, rngs=nnx.Rngs(0)))
