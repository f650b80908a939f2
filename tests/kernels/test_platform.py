"""Each kernel chooses Pallas or XLA where it is lowered, per platform, not where it is traced.

One traced ``impl="auto"`` function exported for ``["cuda", "cpu"]`` holds every Triton call
of the CUDA-only export and, run here on the CPU, gives the XLA path's result bit for bit
(which it could not if its CPU branch held a Triton call: XLA:CPU cannot compile one).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.kernels as rk
from rudax.kernels import _auto, _platform
from tests.kernels._lowering import export, gpu_calls

ON_GPU = jax.default_backend() == "gpu"


def _f32_sum(y):
    return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(y))


def _with_grad(op, argnums):
    """The op's output and its gradient with respect to ``argnums``, one function."""

    def both(*args):
        y = op(*args)
        grads = jax.grad(lambda *a: _f32_sum(op(*a)), argnums=argnums)(*args)
        return y, grads

    return both


def _rms(impl):
    return lambda x, s: rk.rms_norm(x, s, impl=impl)


def _layer(impl):
    return lambda x, s, b: rk.layer_norm(x, s, b, impl=impl)


def _silu(impl):
    return lambda g, u: rk.silu_mul(g, u, impl=impl)


def _adamw(impl):
    def step(p, g, m, v):
        return rk.adamw_update(p, g, m, v, count=jnp.int32(3), learning_rate=1e-3, impl=impl)[:3]

    return step


def _norm(impl):
    return lambda a, b: rk.global_norm_and_finite({"a": a, "b": b}, hierarchical=True, impl=impl)


_Q = rk.nf4_quantize(jax.random.normal(jax.random.key(3), (40, 128), jnp.float32))


def _nf4(impl):
    return lambda x: rk.nf4_matmul(x, _Q, impl=impl)


def _arrays(*shapes_dtypes, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes_dtypes))
    return [jax.random.normal(k, s, d) for k, (s, d) in zip(keys, shapes_dtypes, strict=True)]


bf16, f32 = jnp.bfloat16, jnp.float32
# (name, op factory, arguments, argnums to differentiate or None)
CASES = [
    ("rms_norm", _rms, _arrays(((6, 96), bf16), ((96,), f32)), (0, 1)),
    ("layer_norm", _layer, _arrays(((6, 96), bf16), ((96,), f32), ((96,), f32)), (0, 1, 2)),
    ("silu_mul", _silu, _arrays(((4, 100), bf16), ((4, 100), bf16)), (0, 1)),
    ("adamw_update", _adamw, _arrays(*[((300,), f32)] * 4), None),
    ("global_norm", _norm, _arrays(((300,), f32), ((7, 9), bf16)), None),
    ("nf4_matmul", _nf4, _arrays(((3, 128), bf16)), (0,)),
]
IDS = [c[0] for c in CASES]
# The ops whose impl="auto" takes Pallas on a GPU: those measured faster than their XLA path
# (rudax.kernels._auto; tests/kernels/test_auto.py). The others run XLA on every platform.
AUTO_PALLAS = [c for c in CASES if _auto.auto_takes_pallas(c[0])]
AUTO_XLA = [c for c in CASES if not _auto.auto_takes_pallas(c[0])]


def _fn(case):
    _, factory, _, argnums = case
    op = factory("auto")
    return op if argnums is None else _with_grad(op, argnums)


@pytest.mark.parametrize("case", AUTO_PALLAS, ids=[c[0] for c in AUTO_PALLAS])
def test_one_export_holds_pallas_for_cuda_and_xla_for_the_cpu(case):
    _, factory, args, argnums = case
    fn = _fn(case)
    cuda = gpu_calls(export(fn, *args, platforms=["cuda"]).mlir_module())
    cpu = gpu_calls(export(fn, *args, platforms=["cpu"]).mlir_module())
    both = export(fn, *args, platforms=["cuda", "cpu"])
    # One Triton call per kernel: forward and, when differentiated, backward.
    assert cuda >= (1 if argnums is None else 2)
    assert cpu == 0
    assert gpu_calls(both.mlir_module()) == cuda
    if ON_GPU:
        return  # the CPU branch is what this host runs; on a GPU host the GPU branch runs
    # The multi-platform artifact, run here, takes its CPU branch: the XLA path, bitwise.
    xla = factory("xla")
    expected = jax.jit(xla if argnums is None else _with_grad(xla, argnums))(*args)
    got = both.call(*args)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
    # And so does the op called as usual on this host.
    for g, e in zip(jax.tree.leaves(jax.jit(fn)(*args)), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


@pytest.mark.parametrize("case", AUTO_XLA, ids=[c[0] for c in AUTO_XLA])
def test_auto_exports_the_xla_path_where_pallas_was_measured_slower(case):
    _, factory, args, argnums = case
    fn = _fn(case)
    assert gpu_calls(export(fn, *args, platforms=["cuda"]).mlir_module()) == 0
    xla = factory("xla")
    expected = jax.jit(xla if argnums is None else _with_grad(xla, argnums))(*args)
    for g, e in zip(jax.tree.leaves(jax.jit(fn)(*args)), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


@pytest.mark.skipif(ON_GPU, reason="checks the refusal off a GPU; on a GPU impl='pallas' runs")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_pallas_exports_for_cuda_and_refuses_when_run_here(case):
    _, factory, args, _ = case
    op = factory("pallas")
    assert gpu_calls(export(op, *args, platforms=["cuda"]).mlir_module()) >= 1
    match = r"impl='pallas' compiles the Pallas kernel for a GPU .* lowered for cpu: pass"
    with pytest.raises(ValueError, match=match):
        jax.jit(op)(*args)
    with pytest.raises(ValueError, match=match):
        export(op, *args, platforms=["cuda", "cpu"])


def test_vmap_maps_both_paths():
    x = _arrays(((5, 6, 96), bf16), seed=1)[0]
    scale = jnp.linspace(0.5, 1.5, 96, dtype=f32)
    batched = jax.vmap(lambda x: rk.rms_norm(x, scale))
    expected = jax.vmap(lambda x: rk.rms_norm(x, scale, impl="xla"))(x)
    np.testing.assert_array_equal(np.asarray(jax.jit(batched)(x)), np.asarray(expected))
    assert gpu_calls(export(batched, x, platforms=["cuda"]).mlir_module()) == 1


def test_outside_jit_runs_the_implementation_for_the_arrays_devices():
    x, y = jnp.arange(4.0), jnp.ones(4)
    out = _platform.on_platform(lambda a, b: (a * 0,), lambda a, b: (a + b,), x, y, name="t")
    expected = np.zeros(4) if ON_GPU else np.arange(4.0) + 1
    np.testing.assert_array_equal(np.asarray(out[0]), expected)
