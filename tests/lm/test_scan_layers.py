"""--scan-layers: the decoder layers stored stacked and run as one lax.scan give the unrolled
loop's loss bit for bit and its gradients to fp32 rounding, compile one layer instead of
num_hidden_layers, and let remat lower XLA's temporary bytes.

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

from examples.lm import config as cfg
from examples.lm import train
from rudax.models import LlamaConfig, ModelSpec
from rudax.models import next_token_loss_sum as loss_sum
from tests.lm.conftest import TINY
from tests.lm.test_train import _losses

LLAMA = LlamaConfig.tiny(
    256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    max_position_embeddings=128, param_dtype=jnp.float32,
)  # fmt: skip
CONFIG = ModelSpec(LLAMA, seq_len=32, dtype=jnp.float32, loss_chunk=32)
CONFIGS = {
    "dense": CONFIG,
    "moe": dataclasses.replace(
        CONFIG,
        config=dataclasses.replace(
            LLAMA, model_type="mixtral", num_local_experts=4, output_router_logits=True
        ),
    ),
    # A Llama checkpoint's form: grouped-query heads, an untied head.
    "llama": dataclasses.replace(
        CONFIG,
        config=dataclasses.replace(LLAMA, num_key_value_heads=2, tie_word_embeddings=False),
    ),
}


def _step(spec):
    model = spec.create(0)
    graphdef, state = nnx.split(model)

    def value_and_grad(state, batch):
        loss = lambda s: loss_sum(nnx.merge(graphdef, s), batch, chunk=spec.loss_chunk)[0]
        return jax.value_and_grad(loss)(state)

    return jax.jit(value_and_grad), graphdef, state


def _per_layer(graphdef, tree):
    """A scanned model's state (or gradients) as the unrolled model's: stacked layers split."""
    model = nnx.merge(graphdef, tree, copy=True)  # unstacking releases what it converts
    model.scan_layers = False
    return nnx.state(model)


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


FAST_VARIANTS = {("llama", "full"), ("moe", "none")}


@pytest.mark.parametrize(
    "name,remat",
    [
        # every model kind with and without remat: two in CI, the rest behind -m slow
        pytest.param(n, r, id=f"{n}-{r}", marks=() if (n, r) in FAST_VARIANTS else pytest.mark.slow)
        for n in CONFIGS
        for r in ("none", "full")
    ],
)
def test_the_loss_is_bitwise_and_the_gradients_within_rounding(name, remat):
    base = dataclasses.replace(CONFIGS[name], remat=remat)
    batch = jax.random.randint(jax.random.key(1), (2, 33), 0, base.config.vocab_size)
    unrolled, _, state = _step(base)
    scanned, graphdef, stacked = _step(dataclasses.replace(base, scan_layers=True))
    # stored stacked: layer i of each variable is slice i, the initial weights the same
    q = nnx.merge(graphdef, stacked).model.layers.self_attn.q_proj.kernel
    assert q.shape == (3, 64, 64)
    assert _bits(_per_layer(graphdef, stacked)) == _bits(state)
    (loss, grads), (want_loss, want) = scanned(stacked, batch), unrolled(state, batch)
    assert np.asarray(loss).tobytes() == np.asarray(want_loss).tobytes()
    _assert_rounding_close(_per_layer(graphdef, grads), want)


def _compiled(spec, batch):
    step, _, state = _step(spec)
    return step.lower(state, batch).compile()


def test_one_layer_is_compiled_and_remat_lowers_temporary_memory():
    deep = dataclasses.replace(
        CONFIG, seq_len=128, config=dataclasses.replace(LLAMA, num_hidden_layers=8)
    )
    batch = jnp.zeros((4, 129), jnp.int32)
    programs = {
        (scan, remat): _compiled(dataclasses.replace(deep, scan_layers=scan, remat=remat), batch)
        for scan in (False, True)
        for remat in ("none", "full")
    }
    dots = {k: len(re.findall(r" dot\(", c.as_text())) for k, c in programs.items()}
    # The unrolled program holds every layer's matmuls; the scanned one a loop body's worth.
    assert dots[(True, "none")] * 4 < dots[(False, "none")], dots
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in programs.items()}
    assert temp[(True, "full")] < 0.5 * temp[(True, "none")], temp


def test_the_trainer_trains_the_same_run_scanned_and_resumes_it(data, tmp_path):
    # FSDP over the stacked layers: each layer's slice of each variable sharded on its own
    flags = [*data, *TINY, "--n-layers", "2", "--optimizer", "adamw", "--mesh", "data=2,fsdp=4"]
    plain = train.main([*flags, "--run-dir", str(tmp_path / "plain")])
    run_dir = str(tmp_path / "scanned")
    first = train.main([*flags, "--scan-layers", "--run-dir", run_dir, "--stop-at", "3"])
    assert first["step"] == 3
    assert "scan_layers" in cfg.RUN_KEYS  # its checkpoints hold the layers stacked
    # The run's flag is kept on --resume; remat is the session's to change.
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


def test_muon_steps_the_stacked_matrices_as_the_per_layer_ones(data, tmp_path):
    """--optimizer muon on stacked layers orthogonalizes each layer's matrix of each stacked
    kernel (``rudax.optim.muon(stacked=True)``), as it does the per-layer kernels."""
    flags = [*data, *TINY, "--n-layers", "2", "--optimizer", "muon"]
    plain = train.main([*flags, "--run-dir", str(tmp_path / "plain")])
    scanned = train.main([*flags, "--scan-layers", "--run-dir", str(tmp_path / "scanned")])
    got, want = _losses(scanned["metrics"]), _losses(plain["metrics"])
    first = next(i for i, r in enumerate(want) if r["kind"] == "train")
    assert got[first]["loss"] == want[first]["loss"]  # the forward: bitwise
    # The scan's gradients differ in rounding (above); bf16 weights and a bf16 Newton-Schulz
    # turn that into bf16 ulps of the updates, which compound: measured 2.3e-5 relative at
    # most over the 8 updates, against about 0.6 nats of learning.
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "val_loss"):
            if key in w:
                assert abs(g[key] - w[key]) <= 1e-4 * abs(w[key]), (g, w)


def test_a_run_resumes_with_its_own_layout_only(data, tmp_path, capsys):
    def fails(argv):
        with pytest.raises(SystemExit) as e:
            train.main(argv)
        assert e.value.code == 2
        return capsys.readouterr().err

    flags = [*data, *TINY, "--optimizer", "adamw"]
    run_dir = str(tmp_path / "b")
    train.main([*flags, "--run-dir", run_dir, "--stop-at", "1"])
    err = fails(["--resume", "--run-dir", run_dir, "--scan-layers"])
    assert "--resume: flags differ from the run's: --scan-layers True (the run has False)" in err
