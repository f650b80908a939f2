"""rudax.optim.update_and_apply: tx.update then optax.apply_updates, bit for bit; for
fused_adamw one pass that writes the parameters, moments and masters over their inputs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rudax.optim as ro
from tests.kernels._lowering import export


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "w": jax.random.normal(k[0], (33, 40), jnp.float32).astype(jnp.bfloat16),  # a master
        "b": jax.random.normal(k[1], (40,), jnp.float32),  # fp32: its own master
        "e": jax.random.normal(k[2], (7, 5), jnp.float32).astype(jnp.bfloat16),
    }


def _grads(step, params):
    grads = jax.tree.map(
        lambda p: (0.3 * jax.random.normal(jax.random.key(step), p.shape)).astype(p.dtype),
        params,
    )
    if step == 2:  # a non-finite step: skipped, every bit kept
        grads["b"] = grads["b"].at[3].set(jnp.inf)
    return grads


def _run(tx, step_fn, steps=4):
    params = _params()
    state = tx.init(params)
    step_fn = jax.jit(step_fn)
    for i in range(steps):
        params, state = step_fn(params, state, _grads(i, params))
    return params, state


def _two_calls(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _one_call(tx):
    return lambda params, state, grads: ro.update_and_apply(tx, grads, state, params)


def _assert_bitwise(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert x.dtype == y.dtype


ON_GPU = jax.default_backend() == "gpu"
ON_GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="the compiled Pallas kernel needs a GPU")


@pytest.mark.parametrize("impl", ["xla", "interpret", pytest.param("pallas", marks=ON_GPU_ONLY)])
def test_fused_adamw_in_one_pass_is_the_two_calls_bit_for_bit(impl):
    tx = ro.fused_adamw(
        3e-2,
        weight_decay=0.1,
        max_grad_norm=0.5,
        impl="xla" if impl == "xla" else "pallas",
        interpret=impl == "interpret",
        mask={"w": True, "b": False, "e": True},
    )
    one = _run(tx, _one_call(tx))
    two = _run(tx, _two_calls(tx))
    _assert_bitwise(one, two)
    assert int(one[1].num_skipped) == 1 and int(one[1].count) == 3


def test_the_pallas_pass_and_the_xla_pass_write_the_same_parameters():
    kw = dict(weight_decay=0.1, max_grad_norm=0.5)
    pallas = ro.fused_adamw(3e-2, impl="pallas", interpret=True, **kw)
    xla = ro.fused_adamw(3e-2, impl="xla", **kw)
    _assert_bitwise(_run(pallas, _one_call(pallas)), _run(xla, _one_call(xla)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: ro.adamw(3e-2),
        lambda: optax.chain(ro.clip_by_global_norm(1.0), ro.fused_adamw(3e-2)),
        lambda: ro.inject_hyperparams(ro.fused_adamw)(learning_rate=3e-2),
    ],
    ids=["adamw", "chain-of-fused", "injected-fused"],
)
def test_any_other_optimizer_takes_the_two_calls(make):
    tx = make()
    _assert_bitwise(_run(tx, _one_call(tx)), _run(tx, _two_calls(tx)))


def _aliases(text):
    """{output index: operand index} of each Triton call in an export's text."""
    calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
    pattern = r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)"
    return [{int(o): int(i) for o, i in re.findall(pattern, call)} for call in calls]


def test_on_a_gpu_the_one_pass_writes_over_its_inputs():
    # Exported for CUDA: the kernel of update_and_apply aliases the parameter, moments and
    # master to its outputs (in place when the step donates them); the update's kernel writes
    # new buffers (the update is a new array).
    params = {"w": jnp.zeros((64, 32), jnp.bfloat16)}
    tx = ro.fused_adamw(1e-3, impl="pallas")
    state = tx.init(params)
    grads = {"w": jnp.ones((64, 32), jnp.bfloat16)}
    one = export(lambda p, s, g: ro.update_and_apply(tx, g, s, p), params, state, grads)
    two = export(lambda p, s, g: tx.update(g, s, p), params, state, grads)
    # operands (scalars, param, grad, m, v, master) -> outputs (param, m, v, master)
    assert {0: 1, 1: 3, 2: 4, 3: 5} in _aliases(one.mlir_module())
    assert all(a == {} for a in _aliases(two.mlir_module()))
