"""rudax.layers.remat: the same gradients under every policy, and less memory where it should be.

The reference is the same stack of blocks with no checkpointing. Gradients must agree bitwise
where XLA keeps every sum's order (fp32 on the CPU, checked for each policy here), and the
policies must do what their names say, read from XLA's own accounting
(``compiled.memory_analysis().temp_size_in_bytes``) and from the saved residuals JAX reports.
"""

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
from rudax.layers import _remat

POLICIES = rl.REMAT_POLICIES
D, H, B, T, DEPTH = 32, 64, 4, 16, 4


class Block(nnx.Module):
    """Pre-norm residual block over rudax layers: RMSNorm, a projection, a gated MLP."""

    def __init__(self, *, impl, rngs):
        kernels = {"impl": "pallas", "interpret": True} if impl == "interpret" else {"impl": impl}
        self.norm = rl.RMSNorm(D, dtype=jnp.float32, **kernels)
        self.proj = rl.Linear(D, D, rngs=rngs)
        self.mlp = rl.GatedMLP(D, H, rngs=rngs, **kernels)

    def __call__(self, x, *, scale=None):
        h = self.proj(self.norm(x))
        if scale is not None:
            h = h * scale
        # Batched matmuls, as attention has: kept by dots_saveable, not by no_batch_dims.
        scores = jnp.einsum("btd,bsd->bts", h, h) / D
        h = h + jnp.einsum("bts,bsd->btd", scores, h) / T
        return x + self.mlp(h)


class Stack(nnx.Module):
    def __init__(self, *, impl="xla", rngs):
        self.blocks = nnx.List([Block(impl=impl, rngs=rngs) for _ in range(DEPTH)])

    def __call__(self, x, policy, scale=None):
        for block in self.blocks:
            x = rl.remat(block, policy=policy)(x, scale=scale)
        return x


def _loss(model, x, policy, scale=None):
    return jnp.sum(jnp.tanh(model(x, policy, scale)))


def _grads(policy, impl="xla"):
    model = Stack(impl=impl, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32)
    step = nnx.jit(nnx.value_and_grad(_loss), static_argnums=2)
    loss, grads = step(model, x, policy)
    return loss, nnx.state(grads, nnx.Param)


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_equal_the_plain_ones_bitwise(policy):
    loss, grads = _grads(policy)
    want_loss, want = _grads("none")
    assert np.asarray(loss).tobytes() == np.asarray(want_loss).tobytes()
    assert _bits(grads) == _bits(want)


@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_the_kernels_custom_vjps_under_remat(impl):
    # RMSNorm and GatedMLP's silu_mul run their custom_vjp (Pallas in interpret mode, or
    # the XLA path) inside the checkpoint: recomputed in the backward, same gradients.
    _, full = _grads("full", impl)
    _, plain = _grads("none", impl)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _saved(policy, capsys):
    """The residuals the backward keeps from one block's forward: [(shape, what)], from
    ``jax.ad_checkpoint.print_saved_residuals`` (one line each: ``f32[4,16,32] from ...``)."""
    block = Block(impl="xla", rngs=nnx.Rngs(0))
    graph, params = nnx.split(block)
    x = jnp.ones((B, T, D))

    def f(params, x):
        return jnp.sum(rl.remat(nnx.merge(graph, params), policy=policy)(x))

    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(f, params, x)
    lines = capsys.readouterr().out.strip().splitlines()
    return [(line.split(" ", 1)[0], line.split(" ", 1)[1]) for line in lines]


def test_the_policies_keep_what_their_names_say(capsys):
    saved = {policy: _saved(policy, capsys) for policy in POLICIES if policy != "offload"}

    def from_dots(policy):  # residuals that are matmul outputs
        return [shape for shape, what in saved[policy] if "dot_general" in what]

    # full: only the arguments, the parameters and x.
    assert saved["full"] and all("argument" in what for _, what in saved["full"]), saved["full"]
    assert len(from_dots("dots_saveable")) > len(from_dots("dots_with_no_batch_dims")) > 0
    batched = f"f32[{B},{T},{T}]"  # the scores: a matmul with batch dimension b
    assert batched in from_dots("dots_saveable")
    assert batched not in from_dots("dots_with_no_batch_dims")
    assert len(saved["none"]) > len(saved["dots_saveable"]) > len(saved["full"])


def _compiled(policy, *, scanned):
    """The compiled gradient of DEPTH blocks, unrolled or under lax.scan."""
    block = Block(impl="xla", rngs=nnx.Rngs(0))
    graph, state = nnx.split(block)
    stacked = jax.tree.map(lambda a: jnp.stack([a] * DEPTH), state)
    x = jnp.ones((B, 4 * T, D))

    def run(s, x):
        return rl.remat(nnx.merge(graph, s), policy=policy, prevent_cse=not scanned)(x)

    def loss(stacked, x):
        if scanned:
            x, _ = jax.lax.scan(lambda x, s: (run(s, x), None), x, stacked)
        else:
            for i in range(DEPTH):
                x = run(jax.tree.map(lambda a, i=i: a[i], stacked), x)
        return jnp.sum(jnp.tanh(x))

    return jax.jit(jax.grad(loss)).lower(stacked, x)


def _temp_bytes(policy, *, scanned):
    return _compiled(policy, scanned=scanned).compile().memory_analysis().temp_size_in_bytes


def test_full_remat_under_scan_needs_less_temporary_memory():
    none, full = _temp_bytes("none", scanned=True), _temp_bytes("full", scanned=True)
    assert full < 0.6 * none, (full, none)


def test_unrolled_remat_on_the_cpu_is_compiled_away():
    # What rudax/layers/_remat.py warns about: XLA:CPU drops the optimization barriers that
    # keep the recomputation apart (prevent_cse) and merges it into the forward, so an
    # unrolled loop saves next to nothing. If a JAX release changes that, this test fails
    # and the docstring, the CHANGELOG and the trainer's help change with it.
    if jax.default_backend() != "cpu":
        pytest.skip("a statement about XLA:CPU")
    lowered = _compiled("full", scanned=False)
    assert "optimization_barrier" in lowered.as_text()  # what JAX asked for
    assert "opt-barrier" not in lowered.compile().as_text()  # what XLA:CPU kept
    assert _temp_bytes("full", scanned=False) > 0.85 * _temp_bytes("none", scanned=False)


def test_keyword_arguments_and_functions():
    block = Block(impl="xla", rngs=nnx.Rngs(0))
    x, scale = jnp.ones((B, T, D)), jnp.float32(0.5)
    np.testing.assert_array_equal(
        np.asarray(rl.remat(block)(x, scale=scale)), np.asarray(block(x, scale=scale))
    )
    f = rl.remat(lambda m, x, n: m(x) * n, static_argnums=(2,))
    np.testing.assert_array_equal(np.asarray(f(block, x, 3)), np.asarray(block(x) * 3))
    assert rl.remat(block, policy="none") is block


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match=r"policy must be one of .*'full'.*got policy='al'"):
        rl.remat(lambda x: x, policy="al")


def test_offload_without_pinned_host_memory_says_what_to_use(monkeypatch):
    class Memory:
        def __init__(self, kind):
            self.kind = kind

    class Device:
        def addressable_memories(self):
            return [Memory("device")]

    monkeypatch.setattr(_remat.jax, "local_devices", lambda: [Device()])
    with pytest.raises(ValueError, match=r'offload.*pinned host memory.*\["device"\]|device'):
        rl.remat(lambda x: x, policy="offload")
