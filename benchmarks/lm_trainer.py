"""Paired A/B benchmark: the rudax trainer's step against flax+optax and PyTorch, same Llama.

    python -m benchmarks.lm_trainer                                   # the trainer's default model
    python -m benchmarks.lm_trainer --config tiny --rounds 3          # a quick look
    python -m benchmarks.lm_trainer --torch-python .venv/bin/python --json bench.json

Every arm times full training steps (forward, backward, gradient clipping, AdamW update) of
the same model, the trainer's ``rudax.models.LlamaForCausalLM`` (``benchmarks/_trainer.py``: tied
embeddings, separate q/k/v projections, SwiGLU, RMSNorm, RoPE), from the same initial
weights, on the same batch of ``batch_size x seq_len`` random token ids (the data pipeline is
not timed):

* ``rudax``: the trainer's own step (``rudax.models.OptimizerSpec`` and
  ``next_token_loss_sum`` through ``rudax.sharding.make_train_steps``) with ``adamw``:
  ``micro`` (loss sum, gradient, token-weighted ``GradientAccumulator.add``) then ``apply``
  (``pop``, then ``fp32_master(chain(clip_by_global_norm, adamw))``, weight decay on the
  matrices, not the norms or the embedding), parameters stored in ``--param-dtype`` (the trainer's
  default, bf16) with fp32 masters, compute in ``--compute-dtype`` (the trainer's default:
  fp32), the other hyperparameters the trainer's defaults.
* ``flax+optax``: the same model in plain ``nnx.Linear``/``nnx.Embed``/``nnx.RMSNorm``
  (``RefLlama`` in ``benchmarks/_flax_llama.py``), mean cross entropy over the full logits,
  ``optax.clip_by_global_norm`` + ``optax.adamw`` (same decay mask and schedule), one
  ``jax.jit`` step with the parameters and optimizer state donated. Its parameters are fp32:
  plain optax has no master weights, so fp32 storage *is* its fp32 master; the compute dtype
  is the same.
* ``torch`` and ``torch.compile``: ``benchmarks/_torch_llama.py`` in child processes (eager, and
  the loss under ``torch.compile``), fp32 parameters, ``AdamW(fused=True)``, run by
  ``--torch-python`` (default: this interpreter if it has torch, else those arms are skipped
  with the reason) and driven by ``TorchArm`` (``benchmarks/_lm_arms.py``). rudax does not
  depend on torch: ``pip install torch==2.13.0`` into any environment and pass its Python.

Each arm first runs ``--warmup`` steps; its first step (compilation included) is reported
apart, and its loss, at the shared initial weights, must agree with rudax's (the arms compute
the same function) or the run stops. Then ``--rounds`` rounds: each arm, in
an order rotated every round, runs one untimed step and ``--steps-per-round`` timed steps
(``benchmarks._timing.alternate``; the torch arms answer "run 1" over a pipe, one step per
call, so the parent times every arm the same way). All arms use every core: XLA's intra-op
pool is all cores by default, torch gets ``set_num_threads(os.cpu_count())``.

Every arm runs the same number of steps on the one batch, so the last losses compare the
training itself: with ``--param-dtype float32`` all arms must agree closely (a warning if
not); with rudax's bf16 storage its loss drifts from the references' (the rounding of the
stored weights, not a different update: at fp32 storage the trajectories agree).

Reported: tokens/s per round per arm, each arm's mean and sample standard deviation, and for
each reference the per-round paired ratio of rudax's tokens/s to its own: median [min, max]
and the geometric mean with a 95% Student t-interval on the log ratios (rounds are the
samples; ``benchmarks/_stats.py``). MFU is ``tokens/s * rudax.models.flops_per_token`` over the
machine's peak, measured in the same run as the fastest of a few fp32 2048x2048 matmuls in
jax, numpy and torch (before and after the rounds: the best of both, so a busy moment does not
lower the peak). The environment's ``XLA_FLAGS`` are recorded and printed with the table: XLA's
CPU flags change the JAX arms' speed, so a table says what ran.

Every arm, unless ``--system-malloc``, keeps the memory it frees for reuse
(``rudax.run.retain_freed_memory``; the trainer does the same): glibc's default hands a large
block back to the system on ``free``, and the next step faults it in again page by page. On
the 2-core VM this was a fifth of a rudax step and a tenth of a torch step.

This file is the harness: presets, the rudax arm, the peak, the command line and the report.
The arms' machinery lives in ``benchmarks/_lm_arms.py`` (``JaxArm``, ``TorchArm``), the
references in ``benchmarks/_flax_llama.py`` and ``benchmarks/_torch_llama.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rudax.models as rm
import rudax.optim as ro
import rudax.sharding as rs
from benchmarks._flax_llama import flat_params, flax_arm
from benchmarks._lm_arms import JaxArm, TorchArm, torch_python, torch_spec
from benchmarks._stats import ratio_interval
from benchmarks._timing import alternate, ratio_summary
from benchmarks._trainer import Recipe, trainer_recipe
from rudax.run import MALLOC_ENV, format_table, retain_freed_memory

ARMS = ("rudax", "flax+optax", "torch", "torch.compile")
# Each preset's changes to the trainer's recipe (benchmarks._trainer.trainer_recipe; "small"
# is the model `python -m examples.lm.train` trains).
PRESETS: dict[str, dict[str, Any]] = {
    "small": {},
    "tiny": dict(
        vocab_size=512, seq_len=64, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, batch_size=8,
    ),
}  # fmt: skip
# How far an arm's initial loss may be from rudax's: summation order in fp32; bf16 rounding
# of every activation under bf16 compute.
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 2e-2}
# With fp32 storage in every arm, how far an arm's last loss may be from rudax's before the
# report warns that the arms did not train alike (they agree to ~1e-5 after 20 steps).
# rudax's bf16 storage (the trainer's default) makes its trajectory drift: no check then.
FINAL_LOSS_RTOL = {"float32": 1e-3, "bfloat16": 2e-2}


# ----------------------------------------------------------------------------- config
def preset_recipe(preset: str, compute_dtype: str, param_dtype: str) -> Recipe:
    """The trainer's recipe for a preset: the model and hyperparameters every arm is built from.

    The optimizer is AdamW, whatever the trainer's default: the references are clip + AdamW
    (Muon differs in detail between optax.contrib, torch and rudax).

    Example:
      >>> from benchmarks.lm_trainer import preset_recipe
      >>> recipe = preset_recipe("tiny", "float32", "bfloat16")
      >>> recipe.optimizer.name, recipe.spec.config.hidden_size, recipe.spec.config.param_dtype
      ('adamw', 64, dtype(bfloat16))
    """
    fields = dict(PRESETS[preset], compute_dtype=compute_dtype, param_dtype=param_dtype)
    return trainer_recipe(optimizer="adamw", **fields)


# ----------------------------------------------------------------------------- arms
def rudax_arm(recipe: Recipe, model: rm.LlamaForCausalLM, batch: jax.Array) -> JaxArm:
    """The trainer's step: ``rudax.sharding.make_train_steps``' ``micro`` then ``apply`` of the
    trainer's loss, one window."""
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    tx = recipe.optimizer.build()
    loss = functools.partial(rm.next_token_loss_sum, chunk=recipe.spec.loss_chunk)
    steps = rs.make_train_steps(graphdef, tx, loss, donate=True)
    acc = ro.GradientAccumulator.init(params, dtype=jnp.float32)

    def step(state):
        params, opt_state, acc = state
        acc, _, metrics = steps.micro(params, rngs, acc, rest, batch)
        params, opt_state, acc, _ = steps.apply(params, opt_state, acc)
        return (params, opt_state, acc), metrics

    read = lambda metrics: float(metrics["loss_sum"]) / float(metrics["tokens"])
    return JaxArm(step, (params, tx.init(params), acc), read)


# ----------------------------------------------------------------------------- peak
def measure_peaks(arms: dict[str, Any]) -> dict[str, float]:
    """The machine's fp32 matmul rate now, by jax, numpy and each torch child: FLOP/s."""
    peaks = matmul_flops_per_s()
    for name, arm in arms.items():
        if isinstance(arm, TorchArm):
            peaks[name] = arm.matmul_flops_per_s()
    return peaks


def matmul_flops_per_s(n: int = 2048, repeats: int = 5) -> dict[str, float]:
    """Best of ``repeats`` fp32 ``[n, n] @ [n, n]`` products in jax (jitted) and numpy."""
    a = np.random.default_rng(0).standard_normal((n, n), np.float32)
    mm, x = jax.jit(jnp.matmul), jnp.asarray(a)
    out = {}
    for name, run in (("jax", lambda: mm(x, x).block_until_ready()), ("numpy", lambda: a @ a)):
        run()
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        out[name] = 2 * n**3 / best
    return out


# ----------------------------------------------------------------------------- main
def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _arm_list(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",")]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or "rudax" not in arms or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(
            f"expected distinct arms from {ARMS}, rudax included, got {text!r}"
        )
    return [a for a in ARMS if a in arms]


def build_bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.lm_trainer",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--config",
        choices=sorted(PRESETS),
        default="small",
        help="model and batch: small is what `python -m examples.lm.train` trains",
    )
    p.add_argument(
        "--compute-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="activation/matmul dtype of every arm (torch: autocast)",
    )
    p.add_argument(
        "--param-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="rudax's parameter storage (the references store fp32); float32 makes every "
        "arm's precision the same and their losses comparable step by step",
    )
    p.add_argument("--rounds", type=_int_at_least(2), default=5, help="alternating rounds")
    p.add_argument(
        "--steps-per-round",
        type=_int_at_least(1),
        default=2,
        help="timed steps per arm per round (after one untimed step)",
    )
    p.add_argument(
        "--warmup",
        type=_int_at_least(1),
        default=2,
        help="steps per arm before the rounds; the first one compiles",
    )
    p.add_argument("--arms", type=_arm_list, default=",".join(ARMS), help="comma-separated arms")
    p.add_argument(
        "--torch-python",
        metavar="PATH",
        help="Python with torch for the torch arms; unset: this one if it has torch, else "
        "those arms are skipped",
    )
    p.add_argument(
        "--system-malloc",
        action="store_true",
        help="leave the C library's malloc at its defaults in every arm; by default every arm "
        "keeps freed memory for reuse (rudax.run.retain_freed_memory)",
    )
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="weights and batch")
    p.add_argument("--json", metavar="PATH", help="write every measurement as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the benchmark, prints its table and returns (and with ``--json`` writes) the results."""
    parser = build_bench_parser()
    opts = parser.parse_args(argv)
    if opts.torch_python is not None and not os.access(opts.torch_python, os.X_OK):
        parser.error(f"--torch-python must be an executable, got {opts.torch_python!r}")
    # XLA reads XLA_FLAGS once, when its backend starts: the environment still holds them.
    xla_flags = os.environ.get("XLA_FLAGS", "")
    # Every arm alike: this process before JAX's CPU client starts, the torch children from
    # their start (the environment glibc reads).
    kept = False if opts.system_malloc else retain_freed_memory()
    load_before = list(os.getloadavg())
    threads = os.cpu_count() or 1
    recipe = preset_recipe(opts.config, opts.compute_dtype, opts.param_dtype)
    spec, batch_size = recipe.spec, recipe.batch_size
    config = spec.config
    tokens_per_step = batch_size * spec.seq_len
    rng = np.random.default_rng(opts.seed)
    batch_np = rng.integers(0, config.vocab_size, (batch_size, spec.seq_len + 1), np.int32)
    batch = jnp.asarray(batch_np)
    model = spec.create(opts.seed)
    arrays = flat_params(model)

    python, torch_note = torch_python(opts.torch_python)
    wanted = [a for a in opts.arms if python is not None or not a.startswith("torch")]
    with contextlib.ExitStack() as stack:
        arms: dict[str, Any] = {"rudax": rudax_arm(recipe, model, batch)}
        if "flax+optax" in wanted:
            arms["flax+optax"] = flax_arm(recipe, arrays, batch)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        child = torch_spec(recipe, threads=threads, workdir=workdir)
        np.savez(child["arrays"], batch=batch_np, **arrays)
        for name, mode in (("torch", "eager"), ("torch.compile", "compile")):
            if name in wanted:
                arms[name] = TorchArm(
                    python, child, workdir, mode, env=MALLOC_ENV if kept else None
                )
                stack.callback(arms[name].close)

        peaks = measure_peaks(arms)
        warm = {name: arm.warmup(opts.warmup) for name, arm in arms.items()}
        # Every arm computes the same function: the same loss at the same initial weights.
        base = warm["rudax"]["first_loss"]
        for name, w in warm.items():
            if not abs(w["first_loss"] - base) <= LOSS_RTOL[opts.compute_dtype] * abs(base):
                raise SystemExit(f"{name}'s initial loss {w['first_loss']} != rudax's {base}")
        times = alternate(arms, rounds=opts.rounds, iters=opts.steps_per_round)
        # Measured again after the rounds: another process may have held a core the first time.
        peaks = {k: max(v, peaks[k]) for k, v in measure_peaks(arms).items()}
        peak = max(peaks.values())
        torch_versions = {n: a.ready["torch"] for n, a in arms.items() if isinstance(a, TorchArm)}
    load_after = list(os.getloadavg())

    # ------------------------------------------------------------------------- report
    fpt = rm.flops_per_token(config, spec.seq_len)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.lm_trainer "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {
            **dataclasses.asdict(config),
            "param_dtype": str(config.param_dtype),
            "dtype": str(spec.dtype),
            "seq_len": spec.seq_len,
            "batch_size": batch_size,
        },
        "tokens_per_step": tokens_per_step,
        "flops_per_token": fpt,
        "threads": threads,
        "xla_flags": xla_flags,
        "retain_freed_memory": kept,
        "torch": torch_note,
        "torch_versions": torch_versions,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "matmul_peak_flops_per_s": peaks,
        "peak_flops_per_s": peak,
        "rounds": opts.rounds,
        "steps_per_round": opts.steps_per_round,
        "arms": {},
        "ratios": {},
    }
    for name, arm in arms.items():
        tps = [tokens_per_step / s for s in times[name]]
        result["arms"][name] = {
            "seconds_per_step": times[name],
            "tokens_per_s": tps,
            "mean": statistics.fmean(tps),
            "sd": statistics.stdev(tps),
            "mfu": statistics.fmean(tps) * fpt / peak,
            "first_step_s": warm[name]["first_s"],
            "initial_loss": warm[name]["first_loss"],
            "final_loss": arm.loss,
        }
    for name in arms:
        if name != "rudax":
            ratios = [r / s for r, s in zip(times[name], times["rudax"], strict=True)]
            median, low, high = ratio_summary(times[name], times["rudax"])
            geo, ci_low, ci_high = ratio_interval(ratios)
            result["ratios"][name] = {
                "per_round": ratios,
                "median": median,
                "min": low,
                "max": high,
                "geometric_mean": geo,
                "ci95": [ci_low, ci_high],
                "method": "Student t-interval on the log of the per-round ratios",
            }
    rudax_loss = result["arms"]["rudax"]["final_loss"]
    result["warnings"] = [
        f"{name}'s last loss {a['final_loss']:.4f} is far from rudax's {rudax_loss:.4f}: "
        "the arms did not train alike"
        for name, a in result["arms"].items()
        if opts.param_dtype == "float32"
        and not abs(a["final_loss"] - rudax_loss)
        <= FINAL_LOSS_RTOL[opts.compute_dtype] * abs(rudax_loss)
    ]
    print(report(result))
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {opts.json}")
    return result


def report(result: dict) -> str:
    """The printed table of ``main``'s result."""
    c = result["config"]
    lines = [
        f"model: Llama hidden={c['hidden_size']} layers={c['num_hidden_layers']} "
        f"heads={c['num_attention_heads']} (kv {c['num_key_value_heads']}) "
        f"mlp={c['intermediate_size']} vocab={c['vocab_size']} seq_len={c['seq_len']} "
        f"batch={c['batch_size']} "
        f"({result['tokens_per_step']} tokens/step, {result['flops_per_token'] / 1e6:.2f} "
        f"MFLOP/token); compute {c['dtype']}; rudax stores {c['param_dtype']} with fp32 masters, "
        "flax+optax and torch store fp32",
        f"threads: {result['threads']} (XLA's intra-op pool: all cores, its default; "
        f"torch.set_num_threads({result['threads']})); {result['torch']}",
        # Flags such as --xla_cpu_* change the JAX arms' speed: the table says what ran.
        *([f"XLA_FLAGS: {result['xla_flags']}"] if result["xla_flags"] else []),
        "host memory: "
        + (
            "freed memory kept for reuse in every arm (rudax.run.retain_freed_memory)"
            if result["retain_freed_memory"]
            else "the C library's malloc defaults"
        ),
        "peak fp32 matmul (2048^3, best of 5 before and 5 after the rounds): "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in result["matmul_peak_flops_per_s"].items())
        + f" GFLOP/s -> peak {result['peak_flops_per_s'] / 1e9:.1f} GFLOP/s",
        "load average (1, 5, 15 min): before "
        + " ".join(f"{x:.2f}" for x in result["load_average_before"])
        + ", after "
        + " ".join(f"{x:.2f}" for x in result["load_average_after"]),
        f"{result['rounds']} rounds x {result['steps_per_round']} timed steps per arm, order "
        "rotated each round",
        "",
    ]
    rows = []
    for name, a in result["arms"].items():
        rows.append(
            [
                name,
                *(f"{x:.0f}" for x in a["tokens_per_s"]),
                f"{a['mean']:.0f}",
                f"{a['sd']:.0f}",
                f"{100 * a['mfu']:.1f}%",
                f"{a['first_step_s']:.1f}",
                f"{a['initial_loss']:.4f}",
                f"{a['final_loss']:.4f}",
            ]
        )
    header = [
        "tokens/s",
        *(f"r{i + 1}" for i in range(result["rounds"])),
        "mean",
        "sd",
        "MFU",
        "first step s",
        "loss at init",
        "last loss",
    ]
    lines.append(format_table(header, rows))
    lines.append("")
    rows = [
        [
            f"rudax / {name}",
            f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]",
            f"{r['geometric_mean']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]",
        ]
        for name, r in result["ratios"].items()
    ]
    if rows:
        lines.append(
            format_table(
                ["tokens/s ratio", "median [min, max]", "geo. mean [95% t-interval]"], rows
            )
        )
    lines += [f"WARNING: {w}" for w in result["warnings"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
