"""examples/lm/step.py: the trainer's flags mapped onto the library's recipe.

The recipe itself is tested in tests/models (test_spec.py, test_optimizer.py); here: the
flags make the config the trainer records, the optimizer flags become the ``OptimizerSpec``
field for field, and the flags' defaults are the library's (one source: the benchmarks build
the trainer's optimizer from ``OptimizerSpec()``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples.lm.config import build_parser
from examples.lm.step import make_optimizer, model_spec, optimizer_spec
from rudax.models import LlamaConfig, OptimizerSpec


def test_the_flags_make_the_tiny_preset_and_a_mixtral():
    args = build_parser().parse_args(["--vocab-size", "300", "--d-model", "64"])
    spec = model_spec(args, vocab_size=290)  # the tokenizer's vocabulary wins
    assert spec.config == LlamaConfig.tiny(290, hidden_size=64, max_position_embeddings=256)
    assert (spec.seq_len, spec.dtype, spec.remat, spec.scan_layers) == (
        256,
        np.dtype(jnp.float32),
        "none",
        False,
    )
    moe = model_spec(build_parser().parse_args(["--moe", "--top-k", "1"]))
    c = moe.config
    assert (c.model_type, c.num_local_experts, c.num_experts_per_tok) == ("mixtral", 4, 1)
    assert (c.router_aux_loss_coef, c.output_router_logits) == (0.01, True)
    assert hash(moe) == hash(model_spec(build_parser().parse_args(["--moe", "--top-k", "1"])))
    with pytest.raises(ValueError, match="--d-model 30 must be a multiple of --n-heads 4"):
        model_spec(build_parser().parse_args(["--d-model", "30", "--n-heads", "4"]))


def test_the_optimizer_flags_are_the_spec_field_for_field():
    assert optimizer_spec(build_parser().parse_args([])) == OptimizerSpec()
    flags = ["--optimizer=adamw", "--steps=40", "--lr=1e-3", "--muon-lr=0.03", "--warmup=4"]
    flags += ["--min-lr-ratio=0.2", "--weight-decay=0.05", "--beta1=0.8", "--beta2=0.9"]
    flags += ["--eps=1e-6", "--clip=0.5"]
    got = optimizer_spec(build_parser().parse_args(flags))
    want = OptimizerSpec(
        "adamw",
        steps=40,
        learning_rate=1e-3,
        muon_learning_rate=0.03,
        warmup_steps=4,
        min_lr_ratio=0.2,
        weight_decay=0.05,
        b1=0.8,
        b2=0.9,
        eps=1e-6,
        max_grad_norm=0.5,
    )
    assert got == want
    # every field set by a flag: none left at its default by the test above
    assert all(getattr(got, f.name) != f.default for f in dataclasses.fields(OptimizerSpec))


def test_scanned_layers_reach_muon_as_stacked_matrices():
    """--scan-layers stores each kernel as [L, in, out]: Muon must orthogonalize L matrices,
    so make_optimizer passes stacked=True (with stacked=False Muon refuses the 3-D kernels)."""
    flags = ["--vocab-size=64", "--seq-len=8", "--d-model=16", "--n-layers=2", "--n-heads=2"]
    args = build_parser().parse_args([*flags, "--scan-layers", "--warmup=0"])
    params = nnx.state(model_spec(args).create(0), nnx.Param)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-2, p.dtype), params)
    kernel = lambda tree: tree["model"]["layers"]["self_attn"]["q_proj"]["kernel"].get_value()

    def first_update(tx):
        return np.asarray(kernel(tx.update(grads, tx.init(params), params)[0]), np.float32)

    got = first_update(make_optimizer(args))
    want = first_update(optimizer_spec(args).build(stacked=True))
    np.testing.assert_array_equal(got, want)
    assert np.abs(got).max() > 0
    with pytest.raises(ValueError, match=r"\['layers'\].* has shape \(2, \d+, \d+\).*stacked=True"):
        first_update(optimizer_spec(args).build(stacked=False))
