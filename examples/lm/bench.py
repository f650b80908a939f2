"""Paired A/B benchmark: the rudax trainer's step against flax+optax and PyTorch, same GPT.

    python -m examples.lm.bench                                   # the trainer's default model
    python -m examples.lm.bench --config tiny --rounds 3          # a quick look
    python -m examples.lm.bench --torch-python .venv/bin/python --json bench.json

Every arm times full training steps (forward, backward, gradient clipping, AdamW update) of
the same dense GPT (``examples/lm/model.py``), from the same initial weights, on the same
batch of ``batch_size x seq_len`` random token ids (the data pipeline is not timed):

* ``rudax``: the trainer's own step, ``examples.lm.step``, with ``--optimizer adamw``:
  ``micro`` (loss sum, gradient, token-weighted ``GradientAccumulator.add``) then ``apply``
  (``pop``, then ``fp32_master(chain(clip_by_global_norm, adamw))``, weight decay on
  matrices and the embedding), parameters stored in ``--param-dtype`` (the trainer's
  default, bf16) with fp32 masters, compute in ``--compute-dtype`` (the trainer's default:
  fp32), the other hyperparameters the trainer's defaults.
* ``flax+optax``: the same model in plain ``nnx.Linear``/``nnx.Embed``/``nnx.RMSNorm``
  (``RefGPT`` below), mean cross entropy, ``optax.clip_by_global_norm`` +
  ``optax.adamw`` (same decay mask and schedule), one ``jax.jit`` step with the parameters
  and optimizer state donated. Its parameters are fp32: plain optax has no master weights,
  so fp32 storage *is* its fp32 master; the compute dtype is the same.
* ``torch`` and ``torch.compile``: ``examples/lm/torch_ref.py`` in child processes (eager, and
  the loss under ``torch.compile``), fp32 parameters, ``AdamW(fused=True)``, run by
  ``--torch-python`` (default: this interpreter if it has torch, else those arms are skipped
  with the reason). rudax does not depend on torch: ``pip install torch==2.13.0`` into any
  environment and pass its Python.

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
samples). MFU is ``tokens/s * flops_per_token(config)`` over the machine's peak, measured in
the same run as the fastest of a few fp32 2048x2048 matmuls in jax, numpy and torch (before
and after the rounds: the best of both, so a busy moment does not lower the peak).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import rudax.optim as ro
from benchmarks._timing import alternate, ratio_summary
from examples.lm.config import build_parser
from examples.lm.model import GPT, GPTConfig, flops_per_token
from examples.lm.report import format_table
from examples.lm.step import make_optimizer, make_steps, model_config

TORCH_REF = Path(__file__).with_name("torch_ref.py")
ARMS = ("rudax", "flax+optax", "torch", "torch.compile")
# Trainer flags of each preset on top of train.py's defaults ("small" is the model
# `python -m examples.lm.train` trains).
PRESETS = {
    "small": [],
    "tiny": [
        "--vocab-size=512",
        "--seq-len=64",
        "--d-model=64",
        "--n-layers=2",
        "--n-heads=2",
        "--batch-size=8",
    ],
}
# How far an arm's initial loss may be from rudax's: summation order in fp32; bf16 rounding
# of every activation under bf16 compute.
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 2e-2}
# With fp32 storage in every arm, how far an arm's last loss may be from rudax's before the
# report warns that the arms did not train alike (they agree to ~1e-5 after 20 steps).
# rudax's bf16 storage (the trainer's default) makes its trajectory drift: no check then.
FINAL_LOSS_RTOL = {"float32": 1e-3, "bfloat16": 2e-2}


# ----------------------------------------------------------------------------- config
def trainer_args(preset: str, compute_dtype: str, param_dtype: str) -> argparse.Namespace:
    """train.py's flags for a preset: the hyperparameters every arm is built from.

    ``--optimizer adamw`` is pinned, whatever the trainer's default: the references are
    clip + AdamW (Muon differs in detail between optax.contrib, torch and rudax).
    """
    flags = [*PRESETS[preset], "--optimizer=adamw", f"--compute-dtype={compute_dtype}"]
    flags += [f"--param-dtype={param_dtype}"]
    return build_parser().parse_args(flags)


def flat_params(model: nnx.Module | nnx.State) -> dict[str, np.ndarray]:
    """``{"blocks.0.attn.qkv.kernel": fp32 array, ...}``: a model's (or a gradient state's)
    parameters by dotted path."""
    state = model if isinstance(model, nnx.State) else nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    return {".".join(map(str, path)): np.asarray(v[...], np.float32) for path, v in flat}


# ----------------------------------------------------------------------------- references
def rope(x_BxTxHxK: jax.Array, theta: float) -> jax.Array:
    """Rotary positions, channel ``i`` paired with ``i + K/2``, tables in float64 NumPy."""
    t, k = x_BxTxHxK.shape[1], x_BxTxHxK.shape[-1]
    angles = np.arange(t)[:, None] * theta ** (-np.arange(0, k, 2) / k)[None, :]
    cos, sin = (jnp.asarray(f(angles)[None, :, None, :], jnp.float32) for f in (np.cos, np.sin))
    x1, x2 = jnp.split(x_BxTxHxK.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BxTxHxK.dtype)


class RefBlock(nnx.Module):
    """One pre-norm block from plain flax layers, fp32 parameters, compute in ``dtype``."""

    def __init__(self, c: GPTConfig, *, dtype: Any, rngs: nnx.Rngs):
        d, h = c.d_model, c.mlp_hidden
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        dense = lambda n_in, n_out: nnx.Linear(n_in, n_out, use_bias=False, **kw)
        self.n_heads, self.theta = c.n_heads, c.rope_theta
        self.attn_norm = nnx.RMSNorm(d, epsilon=c.norm_eps, **kw)
        self.qkv, self.out = dense(d, 3 * d), dense(d, d)
        self.mlp_norm = nnx.RMSNorm(d, epsilon=c.norm_eps, **kw)
        self.gate, self.up, self.down = dense(d, h), dense(d, h), dense(h, d)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        b, t, d = x_BxTxD.shape
        qkv = self.qkv(self.attn_norm(x_BxTxD)).reshape(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = rope(qkv[:, :, 0], self.theta), rope(qkv[:, :, 1], self.theta), qkv[:, :, 2]
        scores = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(
            np.tril(np.ones((t, t), bool)), scores / np.sqrt(d // self.n_heads), -jnp.inf
        )
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        x_BxTxD = x_BxTxD + self.out(jnp.einsum("bhts,bshk->bthk", probs, v).reshape(b, t, d))
        h = self.mlp_norm(x_BxTxD)
        return x_BxTxD + self.down(nnx.silu(self.gate(h)) * self.up(h))


class RefGPT(nnx.Module):
    """``examples/lm/model.py``'s dense GPT written with plain flax layers: the reference.

    Args:
      config: the ``GPTConfig`` (its ``param_dtype`` is ignored: parameters are fp32).
      dtype: compute dtype.
      rngs: draws the initial weights (``load`` replaces them with the rudax model's).

    Returns:
      A module; ``model(tokens_BxT)`` returns ``logits_BxTxV`` in ``dtype``.
    """

    def __init__(self, config: GPTConfig, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.embed = nnx.Embed(c.vocab_size, c.d_model, **kw)
        self.blocks = nnx.List([RefBlock(c, dtype=dtype, rngs=rngs) for _ in range(c.n_layers)])
        self.norm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, **kw)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        x = self.embed(tokens_BxT)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))

    @classmethod
    def from_arrays(cls, config: GPTConfig, arrays: dict, *, dtype: Any) -> RefGPT:
        """A ``RefGPT`` holding ``arrays`` (``flat_params`` of a rudax GPT), not drawn first."""
        ref = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)))
        ref.load(arrays)
        return ref

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Sets every parameter from the rudax model's (``flat_params``); names must match."""
        ours = {".".join(map(str, p)): p for p, _ in nnx.to_flat_state(nnx.state(self, nnx.Param))}
        theirs = {n.replace("attn.", "").replace("mlp.", ""): n for n in arrays}
        if set(ours) != set(theirs):
            raise ValueError(f"parameters differ: {sorted(set(ours) ^ set(theirs))}")
        for name, path in ours.items():
            node = self
            for key in path[:-1]:
                node = node[key] if isinstance(key, int) else getattr(node, key)
            getattr(node, path[-1]).set_value(jnp.asarray(arrays[theirs[name]], jnp.float32))


def ref_mean_loss(model: RefGPT, batch_BxT1: jax.Array) -> jax.Array:
    logits = model(batch_BxT1[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch_BxT1[:, 1:]).mean()


def ref_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """clip + AdamW in plain optax with the trainer's hyperparameters, schedule and decay mask."""
    lr = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup, args.steps, end_value=args.lr * args.min_lr_ratio
    )
    mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    adamw = optax.adamw(
        lr, args.beta1, args.beta2, args.eps, weight_decay=args.weight_decay, mask=mask
    )
    return optax.chain(optax.clip_by_global_norm(args.clip), adamw)


# ----------------------------------------------------------------------------- arms
@dataclasses.dataclass
class JaxArm:
    """A jitted step and its state: calling it runs one step (asynchronously, like training)."""

    step: Callable  # state -> (state, out): one training step, asynchronously dispatched
    state: Any
    read_loss: Callable  # out -> the step's loss (before its update) as a float; syncs
    last: Any = None  # the last step's out

    def __call__(self) -> Any:
        self.state, self.last = self.step(self.state)
        return self.last

    def warmup(self, n: int) -> dict[str, float]:
        """Runs n steps: the first one's time (compilation included) and loss, the rest's time."""
        start = time.perf_counter()
        first_loss = self.read_loss(self())
        first = time.perf_counter() - start
        for _ in range(n - 1):
            self()
        jax.block_until_ready(self.state)
        rest = time.perf_counter() - start - first
        return {"first_s": first, "rest_s": rest, "first_loss": first_loss}

    @property
    def loss(self) -> float:
        return self.read_loss(self.last)


def rudax_arm(args: argparse.Namespace, model: GPT, batch: jax.Array) -> JaxArm:
    """The trainer's step: ``examples.lm.step``'s ``micro`` then ``apply``, one window."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(args)
    steps = make_steps(graphdef, rest, tx, mesh=None)
    acc = ro.GradientAccumulator.init(params, dtype=jnp.float32)

    def step(state):
        params, opt_state, acc = state
        acc, metrics = steps.micro(params, acc, batch)
        params, opt_state, acc, _ = steps.apply(params, opt_state, acc)
        return (params, opt_state, acc), metrics

    read = lambda metrics: float(metrics["loss_sum"]) / float(metrics["tokens"])
    return JaxArm(step, (params, tx.init(params), acc), read)


def flax_arm(args: argparse.Namespace, config: GPTConfig, arrays: dict, batch: jax.Array) -> JaxArm:
    """Plain flax+optax: ``RefGPT`` with the rudax model's weights, one donated jitted step."""
    ref = RefGPT.from_arrays(config, arrays, dtype=config.dtype)
    graphdef, params = nnx.split(ref)
    tx = ref_optimizer(args)
    loss_fn = lambda p: ref_mean_loss(nnx.merge(graphdef, p), batch)

    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))

    def run(state):
        *state, loss = step(*state)
        return tuple(state), loss

    return JaxArm(run, (params, tx.init(params)), float)


class TorchArm:
    """``torch_ref.py`` in a child process; calling it runs one step there and waits for it."""

    def __init__(self, python: str, spec: dict, workdir: Path, mode: str):
        self.mode = mode
        spec_path = workdir / f"spec_{mode}.json"
        spec_path.write_text(json.dumps({**spec, "mode": mode}))
        self.stderr = (workdir / f"stderr_{mode}.txt").open("w+")
        self.proc = subprocess.Popen(
            [python, "-u", str(TORCH_REF), str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.ready = self._reply("ready")
        self.loss = math.nan  # the last step's loss

    def _reply(self, event: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.stderr.seek(0)
            tail = "".join(self.stderr.readlines()[-20:])
            raise RuntimeError(
                f"the torch child ({self.mode}) exited ({self.proc.wait()}):\n{tail}"
            )
        reply = json.loads(line)
        if reply.get("event") != event:
            raise RuntimeError(f"the torch child ({self.mode}) answered {reply}, expected {event}")
        return reply

    def _ask(self, command: str, event: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self._reply(event)
        self.loss = reply["loss"]
        return reply

    def __call__(self) -> None:
        self._ask("run 1", "ran")

    def matmul_flops_per_s(self) -> float:
        """The child's best fp32 2048^3 matmul rate (torch.mm), measured now."""
        self.proc.stdin.write("matmul\n")
        self.proc.stdin.flush()
        return self._reply("matmul")["flops_per_s"]

    def warmup(self, n: int) -> dict[str, float]:
        reply = self._ask(f"warmup {n}", "warm")
        return {k: reply[k] for k in ("first_s", "rest_s", "first_loss")}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def torch_spec(
    args: argparse.Namespace, config: GPTConfig, compute_dtype: str, *, threads: int, workdir: Path
) -> dict:
    """What ``torch_ref.py`` builds: the model's shape, the trainer's hyperparameters, threads.

    The weights and batch go to ``spec["arrays"]``, an ``.npz`` the caller writes.
    """
    shape = ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_hidden")
    hparams = ("lr", "warmup", "steps", "min_lr_ratio", "weight_decay", "beta1", "beta2")
    return {
        "config": {k: getattr(config, k) for k in (*shape, "rope_theta", "norm_eps")},
        "hparams": {k: getattr(args, k) for k in (*hparams, "eps", "clip")},
        "compute_dtype": compute_dtype,
        "threads": threads,
        "arrays": str(workdir / "arrays.npz"),
    }


def torch_python(given: str | None) -> tuple[str | None, str]:
    """The interpreter for the torch arms, or None and the reason they are skipped."""
    if given is not None:
        return given, f"torch arms run by {given}"
    if importlib.util.find_spec("torch") is not None:
        return sys.executable, f"torch arms run by this interpreter ({sys.executable})"
    return None, (
        f"torch arms skipped: no torch in {sys.executable}; install it anywhere with "
        "`pip install torch==2.13.0` and pass --torch-python PATH"
    )


# ----------------------------------------------------------------------------- statistics
def _t_two_sided(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer df (Abramowitz & Stegun 26.7.3, 26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df == 1:
        return 2 * theta / math.pi
    term = total = 1.0 if df % 2 == 0 else math.cos(theta)
    for j in range(2 if df % 2 == 0 else 3, df, 2):
        term *= c2 * (j - 1) / j
        total += term
    return s * total if df % 2 == 0 else 2 / math.pi * (theta + s * total)


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom, ``0.5 <= p < 1``.

    Bisection on the exact CDF for integer df, to 1e-12: ``t_quantile(0.975, df)`` is the
    factor of a two-sided 95% interval.

    Example:
      >>> from examples.lm.bench import t_quantile
      >>> round(t_quantile(0.975, 4), 4)
      2.7764
    """
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p=}")
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be an int >= 1, got {df=}")
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, df) < 2 * p - 1:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_two_sided(mid, df) < 2 * p - 1 else (lo, mid)
    return (lo + hi) / 2


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean of per-round ratios and its 95% t-interval (on the log ratios).

    Example:
      >>> from examples.lm.bench import ratio_interval
      >>> [round(x, 3) for x in ratio_interval([1.0, 1.1, 0.9, 1.05])]
      [1.01, 0.881, 1.158]
    """
    if len(ratios) < 2 or min(ratios) <= 0:
        raise ValueError(f"ratios must be >= 2 positive numbers, got {ratios=}")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = t_quantile(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


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
        prog="python -m examples.lm.bench",
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
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="weights and batch")
    p.add_argument("--json", metavar="PATH", help="write every measurement as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the benchmark, prints its table and returns (and with ``--json`` writes) the results."""
    parser = build_bench_parser()
    opts = parser.parse_args(argv)
    if opts.torch_python is not None and not os.access(opts.torch_python, os.X_OK):
        parser.error(f"--torch-python must be an executable, got {opts.torch_python!r}")
    load_before = list(os.getloadavg())
    threads = os.cpu_count() or 1
    args = trainer_args(opts.config, opts.compute_dtype, opts.param_dtype)
    config = model_config(args)
    tokens_per_step = args.batch_size * config.seq_len
    rng = np.random.default_rng(opts.seed)
    batch_np = rng.integers(0, config.vocab_size, (args.batch_size, config.seq_len + 1), np.int32)
    batch = jnp.asarray(batch_np)
    model = GPT(config, rngs=nnx.Rngs(opts.seed))
    arrays = flat_params(model)

    python, torch_note = torch_python(opts.torch_python)
    wanted = [a for a in opts.arms if python is not None or not a.startswith("torch")]
    with contextlib.ExitStack() as stack:
        arms: dict[str, Any] = {"rudax": rudax_arm(args, model, batch)}
        if "flax+optax" in wanted:
            arms["flax+optax"] = flax_arm(args, config, arrays, batch)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        spec = torch_spec(args, config, opts.compute_dtype, threads=threads, workdir=workdir)
        np.savez(spec["arrays"], batch=batch_np, **arrays)
        for name, mode in (("torch", "eager"), ("torch.compile", "compile")):
            if name in wanted:
                arms[name] = TorchArm(python, spec, workdir, mode)
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
    fpt = flops_per_token(config)
    result: dict[str, Any] = {
        "command": "python -m examples.lm.bench "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {
            **dataclasses.asdict(config),
            "param_dtype": str(config.param_dtype),
            "dtype": str(config.dtype),
            "batch_size": args.batch_size,
        },
        "tokens_per_step": tokens_per_step,
        "flops_per_token": fpt,
        "threads": threads,
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
        f"model: d_model={c['d_model']} n_layers={c['n_layers']} n_heads={c['n_heads']} "
        f"vocab={c['vocab_size']} seq_len={c['seq_len']} batch={c['batch_size']} "
        f"({result['tokens_per_step']} tokens/step, {result['flops_per_token'] / 1e6:.2f} "
        f"MFLOP/token); compute {c['dtype']}; rudax stores {c['param_dtype']} with fp32 masters, "
        "flax+optax and torch store fp32",
        f"threads: {result['threads']} (XLA's intra-op pool: all cores, its default; "
        f"torch.set_num_threads({result['threads']})); {result['torch']}",
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
