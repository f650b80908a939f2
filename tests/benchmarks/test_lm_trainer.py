"""benchmarks/lm_trainer.py and its parts: the references compute the trainer's model and update
(``_flax_llama.py``, ``_lm_arms.py`` driving ``_torch_llama.py``), the statistics
(``_stats.py``), the harness and its report (``lm_trainer.py``).

The benchmark's ratios mean something only if every arm trains the same model the same way:
the flax+optax reference is checked against the rudax model (loss and every gradient, by
name) and, through the harness, against the trainer's optimizer (five updates) at fp32; the
PyTorch reference against the trainer's first three updates when a Python with torch is at
hand (``RUDAX_TORCH_PYTHON``, or this interpreter), else skipped. Both in the trainer's layout
and with grouped-query heads and an untied head (a Hugging Face checkpoint's). The
t-quantile is checked against a numerical integral of Student's density. The report says which
``XLA_FLAGS`` the JAX arms ran with.
"""

import dataclasses
import doctest
import importlib.util
import json
import math
import os
import platform
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import benchmarks._lm_arms as arms
import benchmarks._stats as stats
import benchmarks.lm_trainer as bench
import rudax.models as rm
from benchmarks._flax_llama import RefLlama, flat_params, ref_mean_loss
from benchmarks._lm_arms import TorchArm, torch_spec
from benchmarks._trainer import Recipe, trainer_recipe
from rudax.models import ModelSpec, OptimizerSpec
from rudax.models import next_token_loss_sum as loss_sum

# A model smaller than the "tiny" preset: these tests check arithmetic, not speed. As a bench
# preset, with no warmup: the first update already has the peak learning rate.
PRESET = dict(
    vocab_size=64, seq_len=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    batch_size=4, optimizer_fields=dict(warmup_steps=0, learning_rate=1e-2),
)  # fmt: skip


def _recipe():
    """The recipe the bench builds from PRESET at fp32 storage (and AdamW, the references')."""
    return trainer_recipe(**PRESET, compute_dtype="float32", param_dtype="float32")


# Beside the trainer's own layout (tied, as many key/value heads as query heads): the other
# layout the references implement, for a model started from a Hugging Face checkpoint.
GQA_UNTIED = {"num_key_value_heads": 1, "tie_word_embeddings": False}


def _setup(**fields):
    recipe = _recipe()
    spec = recipe.spec
    if fields:
        spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, **fields))
    model = spec.create(0)
    rng = np.random.default_rng(0)
    shape = (recipe.batch_size, spec.seq_len + 1)
    batch = rng.integers(0, spec.config.vocab_size, shape, np.int32)
    return dataclasses.replace(recipe, spec=spec), model, batch


def _rudax_trajectory(recipe, model, batch, updates):
    """Mean losses before each of `updates` updates by the trainer's optimizer, from model."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = recipe.optimizer.build()
    loss_fn = lambda p: loss_sum(nnx.merge(graphdef, p, rest), batch)[0] / batch[:, 1:].size

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for _ in range(updates):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return losses


def test_load_refuses_other_parameters():
    spec = _recipe().spec
    arrays = flat_params(spec.create(0))
    RefLlama.from_arrays(spec.config, arrays, dtype=jnp.float32)  # all present: loads
    del arrays["model.norm.scale"]
    with pytest.raises(ValueError, match=r"missing \['model\.norm\.scale'\]"):
        RefLlama.from_arrays(spec.config, arrays, dtype=jnp.float32)


def test_references_refuse_what_they_do_not_implement(tmp_path):
    config = rm.LlamaConfig.tiny(64, hidden_size=32, num_attention_heads=2, qkv_bias=True)
    with pytest.raises(ValueError, match=r"\{'qkv_bias': True\}"):
        RefLlama(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="qkv_bias"):
        recipe = Recipe(ModelSpec(config, 16), OptimizerSpec("adamw"), batch_size=4)
        torch_spec(recipe, threads=1, workdir=tmp_path)


def _ref_and_rudax(config, batch):
    """The rudax model's (loss, gradient) and the reference's from the same fp32 weights."""
    model = rm.LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mean = lambda p: loss_sum(nnx.merge(graphdef, p, rest), batch)[0] / batch[:, 1:].size
    ours = jax.value_and_grad(mean)(params)
    ref = RefLlama.from_arrays(config, flat_params(model), dtype=jnp.float32)
    ref_def, ref_params = nnx.split(ref)
    theirs = jax.value_and_grad(lambda p: ref_mean_loss(nnx.merge(ref_def, p), batch))(ref_params)
    return ours, theirs


@pytest.mark.parametrize("fields", [{}, GQA_UNTIED], ids=["trainer", "gqa-untied"])
def test_flax_reference_is_the_rudax_model(fields):
    """Loss and every parameter's gradient, matched by name, at fp32 storage and compute."""
    config = rm.LlamaConfig.tiny(
        64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, param_dtype=jnp.float32,
        **fields,
    )  # fmt: skip
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, 17), np.int32))
    (loss, grads), (ref_loss, ref_grads) = _ref_and_rudax(config, batch)
    assert float(ref_loss) == pytest.approx(float(loss), rel=1e-6)
    ours, theirs = flat_params(grads), flat_params(ref_grads)
    assert set(ours) == set(theirs)
    assert ("lm_head.embedding" in ours) is not config.tie_word_embeddings
    for name, g in ours.items():  # fp32 summation order: ~5e-7 of each leaf's largest entry
        atol = 1e-5 * np.abs(g).max()
        np.testing.assert_allclose(theirs[name], g, rtol=1e-4, atol=atol, err_msg=name)


def _t_cdf_by_integration(q, df):
    """P(0 <= T <= q) by Simpson's rule on Student's density, the test's own reference."""
    t = np.linspace(0.0, q, 200_001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    f = np.exp(log_c - (df + 1) / 2 * np.log1p(t * t / df))
    h = t[1] - t[0]
    return h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 8, 9, 30, 101])
def test_t_quantile_against_the_integrated_density(df):
    q = stats.t_quantile(0.975, df)
    assert _t_cdf_by_integration(q, df) == pytest.approx(0.475, abs=1e-7)


def test_t_quantile_table_values_and_bad_input():
    # Two-sided 95% factors as printed in every t table.
    for df, value in [(1, 12.706), (4, 2.776), (10, 2.228), (30, 2.042)]:
        assert round(stats.t_quantile(0.975, df), 3) == value
    assert stats.t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-11)
    for p, df in [(0.4, 3), (1.0, 3), (0.975, 0), (0.975, 2.0), (0.975, True)]:
        with pytest.raises(ValueError, match=r"(p|df) must"):
            stats.t_quantile(p, df)


def test_ratio_interval_is_a_t_interval_on_log_ratios():
    ratios = [0.91, 1.02, 0.97, 1.10, 0.95]
    logs = np.log(ratios)
    half = 2.7764451051977987 * logs.std(ddof=1) / np.sqrt(5)  # t_{0.975, 4}
    expected = np.exp([logs.mean(), logs.mean() - half, logs.mean() + half])
    np.testing.assert_allclose(stats.ratio_interval(ratios), expected, rtol=1e-9)
    for bad in ([1.0], [1.0, 0.0], [1.0, -2.0]):
        with pytest.raises(ValueError, match="ratios must"):
            stats.ratio_interval(bad)


@pytest.mark.parametrize("module", [bench, stats, arms], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted and result.failed == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds=1"], "must be >= 2"),
        (["--arms=flax+optax"], "rudax included"),
        (["--arms=rudax,jax"], "rudax included"),
        (["--config=huge"], "invalid choice"),
        (["--torch-python=/nonexistent/python"], "must be an executable"),
    ],
)
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.standard_promotion  # the flax+optax arm runs optax.adamw
def test_flax_arm_trains_the_trainers_model_the_same_way(tmp_path, monkeypatch, capsys):
    """The harness end to end, with fp32 storage so that the two arms' losses must agree."""
    # A fixed peak and the smallest model: this test checks the arithmetic, not the machine.
    monkeypatch.setattr(bench, "matmul_flops_per_s", lambda: {"jax": 1e9})
    monkeypatch.setitem(bench.PRESETS, "tiny", PRESET)
    out = tmp_path / "bench.json"
    argv = ["--config=tiny", "--arms=rudax,flax+optax", "--rounds=2", "--steps-per-round=1"]
    result = bench.main([*argv, "--warmup=1", "--param-dtype=float32", f"--json={out}"])
    assert json.loads(out.read_text()) == result
    assert set(result["arms"]) == {"rudax", "flax+optax"}
    rudax, flax = result["arms"]["rudax"], result["arms"]["flax+optax"]

    # Same function at the same weights, then the same 5 updates (1 + 2 x (1 + 1) steps).
    assert flax["initial_loss"] == pytest.approx(rudax["initial_loss"], rel=1e-6)
    assert flax["final_loss"] == pytest.approx(rudax["final_loss"], rel=1e-5)
    assert rudax["final_loss"] < rudax["initial_loss"] - 0.1
    assert result["warnings"] == []  # the bench's own check of the same

    assert len(rudax["tokens_per_s"]) == 2
    assert rudax["mean"] == statistics.fmean(rudax["tokens_per_s"])
    assert rudax["tokens_per_s"][0] == result["tokens_per_step"] / rudax["seconds_per_step"][0]
    assert rudax["mfu"] == pytest.approx(rudax["mean"] * result["flops_per_token"] / 1e9)
    ratio = result["ratios"]["flax+optax"]
    assert ratio["per_round"] == pytest.approx(
        [r / f for r, f in zip(rudax["tokens_per_s"], flax["tokens_per_s"], strict=True)]
    )
    printed = capsys.readouterr().out
    assert "rudax / flax+optax" in printed
    # tests/conftest.py sets XLA_FLAGS (the simulated devices): never empty here.
    assert result["xla_flags"] == os.environ["XLA_FLAGS"] != ""
    assert result["retain_freed_memory"] is (platform.libc_ver()[0] == "glibc")
    assert f"XLA_FLAGS: {os.environ['XLA_FLAGS']}" in printed.splitlines()


def _result(xla_flags, retain_freed_memory=True):
    """A result as ``bench.main`` returns it, small: rudax alone (no ratios), two rounds."""
    config = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    config |= {"num_key_value_heads": 2, "intermediate_size": 128}
    config |= {"vocab_size": 64, "seq_len": 16}
    config |= {"batch_size": 4, "dtype": "float32", "param_dtype": "float32"}
    arm = {"tokens_per_s": [1000.0, 1100.0], "mean": 1050.0, "sd": 70.7, "mfu": 0.01}
    arm |= {"first_step_s": 1.5, "initial_loss": 4.2, "final_loss": 4.0}
    return {
        "config": config,
        "tokens_per_step": 64,
        "flops_per_token": 1e6,
        "threads": 2,
        "xla_flags": xla_flags,
        "retain_freed_memory": retain_freed_memory,
        "torch": "torch arms skipped",
        "matmul_peak_flops_per_s": {"jax": 1e10},
        "peak_flops_per_s": 1e10,
        "load_average_before": [0.5, 0.5, 0.5],
        "load_average_after": [0.6, 0.5, 0.5],
        "rounds": 2,
        "steps_per_round": 1,
        "arms": {"rudax": arm},
        "ratios": {},
        "warnings": [],
    }


def test_report_names_the_xla_flags_it_ran_with_when_there_are_any():
    flags = "--xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=2"
    with_flags = bench.report(_result(flags)).splitlines()
    without = bench.report(_result("")).splitlines()
    assert f"XLA_FLAGS: {flags}" in with_flags
    assert not any("XLA_FLAGS" in line for line in without)
    # The flags add that one line and change nothing else.
    assert [line for line in with_flags if not line.startswith("XLA_FLAGS: ")] == without


def test_report_says_how_host_memory_was_managed():
    kept = bench.report(_result("")).splitlines()
    system = bench.report(_result("", retain_freed_memory=False)).splitlines()
    assert "host memory: freed memory kept for reuse in every arm" in "\n".join(kept)
    assert "host memory: the C library's malloc defaults" in system
    assert sum(a != b for a, b in zip(kept, system, strict=True)) == 1


def _torch_python():
    python = os.environ.get("RUDAX_TORCH_PYTHON")
    if python:
        return python
    return sys.executable if importlib.util.find_spec("torch") else None


@pytest.mark.skipif(
    _torch_python() is None,
    reason="no torch here: set RUDAX_TORCH_PYTHON to a Python with torch (pip install "
    "torch==2.13.0) to check the PyTorch reference",
)
@pytest.mark.parametrize("fields", [{}, GQA_UNTIED], ids=["trainer", "gqa-untied"])
def test_torch_reference_is_the_trainers_model_and_update(tmp_path, fields):
    recipe, model, batch = _setup(**fields)
    child = torch_spec(recipe, threads=1, workdir=tmp_path)
    np.savez(child["arrays"], batch=batch, **flat_params(model))
    arm = TorchArm(_torch_python(), child, tmp_path, "eager")
    try:
        first = arm.warmup(1)["first_loss"]
        losses = [first, *(arm() or arm.loss for _ in range(2))]
    finally:
        arm.close()
    np.testing.assert_allclose(losses, _rudax_trajectory(recipe, model, batch, 3), rtol=1e-5)
