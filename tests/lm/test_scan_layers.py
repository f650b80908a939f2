"""--scan-layers: the GPT's blocks as one lax.scan give the unrolled loop's loss bit for bit and
its gradients to fp32 rounding, compile one block instead of n_layers, and let remat lower
XLA's temporary bytes.

Why not bitwise gradients: inside the scan's loop body XLA:CPU lays the weight-gradient
matmuls out differently from the unrolled program, which changes their summation order (the
forward's are unchanged: the loss is bitwise). The bound used is 16 fp32 ulps of each leaf's
largest element; the largest difference seen was 4.5e-7 of it (about 4 ulps).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
from examples.lm import train
from examples.lm.model import GPT, GPTConfig, loss_sum
from tests.lm.conftest import TINY
from tests.lm.test_train import _losses

CONFIG = GPTConfig(
    vocab_size=256, seq_len=32, d_model=64, n_layers=3, n_heads=4, loss_chunk=32,
    param_dtype=jnp.float32, dtype=jnp.float32,
)  # fmt: skip
CONFIGS = {
    "dense": CONFIG,
    "moe": dataclasses.replace(CONFIG, num_experts=4, top_k=2),
    # The Hugging Face Llama form: grouped-query heads, separate q/k/v, an untied head.
    "llama": dataclasses.replace(CONFIG, n_kv_heads=2, fused_qkv=False, tie_embeddings=False),
}


def _step(config, model=None):
    model = GPT(config, rngs=nnx.Rngs(0)) if model is None else model
    graphdef, state = nnx.split(model)

    def value_and_grad(state, batch):
        return jax.value_and_grad(lambda s: loss_sum(nnx.merge(graphdef, s), batch)[0])(state)

    return jax.jit(value_and_grad), state


ULPS = 16 * float(jnp.finfo(jnp.float32).eps)


def _assert_rounding_close(got, want):
    leaves = jax.tree.leaves_with_path(want)
    assert len(leaves) == len(jax.tree.leaves(got))
    for (path, w), g in zip(leaves, jax.tree.leaves(got), strict=True):
        w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
        bound = ULPS * np.max(np.abs(w))
        assert np.max(np.abs(g - w)) <= bound, (jax.tree_util.keystr(path), bound)


def _bits(tree):
    return [
        (jax.tree_util.keystr(p), np.asarray(x).tobytes())
        for p, x in jax.tree.leaves_with_path(tree)
    ]


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_loss_is_bitwise_and_the_gradients_within_rounding(name, remat):
    base = dataclasses.replace(CONFIGS[name], remat=remat)
    batch = jax.random.randint(jax.random.key(1), (2, 33), 0, base.vocab_size)
    unrolled, state = _step(base)
    scanned, same = _step(dataclasses.replace(base, scan_layers=True))
    assert _bits(same) == _bits(state)  # stored as before: the same parameters, paths and all
    (loss, grads), (want_loss, want) = scanned(state, batch), unrolled(state, batch)
    assert np.asarray(loss).tobytes() == np.asarray(want_loss).tobytes()
    _assert_rounding_close(grads, want)


def _compiled(config, batch):
    step, state = _step(config)
    return step.lower(state, batch).compile()


def test_one_block_is_compiled_and_remat_lowers_temporary_memory():
    deep = dataclasses.replace(CONFIG, n_layers=8, seq_len=128)
    batch = jnp.zeros((4, 129), jnp.int32)
    programs = {
        (scan, remat): _compiled(dataclasses.replace(deep, scan_layers=scan, remat=remat), batch)
        for scan in (False, True)
        for remat in ("none", "full")
    }
    dots = {k: len(re.findall(r" dot\(", c.as_text())) for k, c in programs.items()}
    # The unrolled program holds every block's matmuls; the scanned one a loop body's worth.
    assert dots[(True, "none")] * 4 < dots[(False, "none")], dots
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in programs.items()}
    assert temp[(True, "full")] < 0.5 * temp[(True, "none")], temp


def test_blocks_with_rng_state_or_another_structure_are_refused():
    batch = jnp.zeros((2, 33), jnp.int32)
    config = dataclasses.replace(CONFIG, scan_layers=True)
    dropout = GPT(config, rngs=nnx.Rngs(0))
    rl.apply_lora(dropout, ["qkv"], rank=2, alpha=4.0, dropout=0.1, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"layers\[0\] holds RNG state \(dropout\)"):
        loss_sum(dropout, batch)
    one = GPT(config, rngs=nnx.Rngs(0))
    rl.apply_lora(one.blocks[0], ["qkv"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))  # block 0 alone
    with pytest.raises(ValueError, match=r"layers\[1\] differs in structure from layers\[0\]"):
        loss_sum(one, batch)


def test_the_trainer_trains_the_same_run_scanned_on_a_mesh(data, tmp_path):
    flags = [*data, *TINY, "--n-layers", "2", "--optimizer", "adamw", "--mesh", "data=2,fsdp=4"]
    plain = train.main([*flags, "--run-dir", str(tmp_path / "plain")])
    run_dir = str(tmp_path / "scanned")
    first = train.main([*flags, "--scan-layers", "--run-dir", run_dir, "--stop-at", "3"])
    assert first["step"] == 3
    # Stored as before: a scanned run resumes unrolled (and with remat).
    session = ("--log-every", "1", "--eval-every", "4", "--remat", "full")
    resumed = train.main(["--resume", "--run-dir", run_dir, *session])
    got, want = _losses(resumed["metrics"]), _losses(plain["metrics"])
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    first = next(i for i, r in enumerate(want) if r["kind"] == "train")
    assert got[first]["loss"] == want[first]["loss"]  # the first update's: forward bitwise
    for g, w in zip(got, want, strict=True):  # then rounding, carried through 8 updates
        for key in ("loss", "val_loss"):
            if key in w:
                assert abs(g[key] - w[key]) <= 1e-5 * abs(w[key]), (g, w)
