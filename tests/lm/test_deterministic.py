"""--deterministic: a training step with no scatter for CUDA, the same gradients on the CPU,
and the flag recorded as a run flag."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from examples.lm import train
from rudax.models import LlamaConfig, ModelSpec
from rudax.models import next_token_loss_sum as loss_sum
from tests.kernels._lowering import export
from tests.lm.conftest import TINY


def _config(embedding_backward):
    llama = LlamaConfig.tiny(
        512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, param_dtype=jnp.float32,
    )  # fmt: skip
    return ModelSpec(
        llama, seq_len=32, dtype=jnp.float32, loss_chunk=32, embedding_backward=embedding_backward
    )


def _grad_fn(spec):
    graphdef, state = nnx.split(spec.create(0))

    def grads(state, batch):
        loss = lambda s: loss_sum(nnx.merge(graphdef, s), batch, chunk=spec.loss_chunk)[0]
        return jax.grad(loss)(state)

    return grads, state


def test_cuda_step_has_no_scatter():
    batch = jnp.zeros((2, 33), jnp.int32)
    counts = {}
    for backward in ("scatter", "sorted"):
        grads, state = _grad_fn(_config(backward))
        text = export(grads, state, batch).mlir_module()
        counts[backward] = text.count("stablehlo.scatter")
    assert counts["scatter"] >= 1  # the control: the default step scatters
    assert counts["sorted"] == 0


def test_gradients_equal_the_default_path():
    """Every token id distinct: each table row's sum has one term, so no summation order can
    differ and the gradients are bitwise equal (rudax/layers tests the sums of many terms)."""
    batch = jax.random.permutation(jax.random.key(1), 512)[: 2 * 33].reshape(2, 33)
    grads = {}
    for backward in ("scatter", "sorted"):
        fn, state = _grad_fn(_config(backward))
        grads[backward] = jax.jit(fn)(state, batch.astype(jnp.int32))
    leaves = jax.tree.leaves_with_path(grads["scatter"])
    other = jax.tree.leaves(grads["sorted"])
    assert len(leaves) == len(other)
    for (path, a), b in zip(leaves, other, strict=True):
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path)
        )


def test_trainer_records_the_flag_and_keeps_it_on_resume(data, tmp_path):
    run_dir = tmp_path / "det"
    flags = [*data, *TINY, "--optimizer", "adamw", "--deterministic"]
    summary = train.main([*flags, "--run-dir", str(run_dir), "--stop-at", "3"])
    assert summary["step"] == 3 and np.isfinite(summary["loss"])
    assert json.loads(Path(run_dir, "config.json").read_text())["deterministic"] is True
    # The flag is a run flag: --resume takes it from the run without its being given.
    resumed = train.main(["--resume", "--run-dir", str(run_dir)])
    assert resumed["step"] == 8
