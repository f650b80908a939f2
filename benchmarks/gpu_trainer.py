"""The examples/lm trainer's step at a GPU size: tokens/s, and MFU against a bf16 matmul peak.

    python -m benchmarks.gpu_trainer                       # ~125M parameters, bf16, one GPU
    python -m benchmarks.gpu_trainer --preset tiny --steps 2 --json out.json   # a CPU check
    python -m benchmarks.gpu_trainer --deterministic --json out.json

It runs the trainer's own ``micro`` and ``apply`` (``rudax.sharding.make_train_steps`` of the
trainer's recipe, ``benchmarks._trainer``: loss sum, gradient, token-weighted accumulation,
clip + AdamW with fp32 masters) on random token ids
of the trainer's shape; the data pipeline is not timed. The peak is the best of a few bf16
``[n, n] @ [n, n]`` products measured in the same process, before and after the steps.
MFU is ``tokens/s * flops_per_token(config) / peak``.

The JSON also holds every update's loss as an exact hex float (``losses_hex``), which
``benchmarks.gpu_determinism`` compares across fresh processes. ``--deterministic`` is the
trainer's flag: XLA's deterministic GPU ops (set before JAX starts) and the sorted embedding
backward.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

# Each preset's trainer recipe (benchmarks._trainer.trainer_recipe, the trainer's defaults
# otherwise). "gpu": GPT-2 small's shape (width 768, 12 layers of 12 heads, 50304 tokens; a
# Llama with a SwiGLU MLP of 2048, so 124M parameters), bf16 storage and compute, 32 x 1024
# tokens per update; "mid" a quarter of it, for checks that start several processes; "1b" a
# 1B-class Llama (Llama 3.2 1B's blocks: width 2048, 16 layers of 32 query and 8 key/value
# heads, MLP 8192, tied embeddings; a 32768-token vocabulary), 8 x 2048 tokens per update,
# its layers scanned (one layer compiled: the budget of one GPU call is minutes).
PRESETS: dict[str, dict[str, Any]] = {
    "gpu": dict(
        vocab_size=50304, seq_len=1024, hidden_size=768, num_hidden_layers=12,
        num_attention_heads=12, batch_size=32, compute_dtype="bfloat16",
    ),
    "mid": dict(
        vocab_size=32768, seq_len=512, hidden_size=512, num_hidden_layers=4,
        num_attention_heads=8, batch_size=16, compute_dtype="bfloat16",
    ),
    "1b": dict(
        vocab_size=32768, seq_len=2048, hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192, batch_size=8,
        compute_dtype="bfloat16", scan_layers=True,
    ),
    "tiny": dict(
        vocab_size=512, seq_len=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        batch_size=4,
    ),
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    p.add_argument("--steps", type=int, default=20, help="timed updates (after 2 warm-up)")
    p.add_argument("--peak-size", type=int, default=8192, help="n of the bf16 peak matmul")
    p.add_argument("--deterministic", action="store_true", help="the trainer's --deterministic")
    p.add_argument("--json", help="write the results to this file")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.deterministic:  # before anything starts a JAX backend
        import rudax.kernels as rk

        rk.enable_deterministic_gpu()
    import jax

    recipe = _recipe(args)
    run = _Run(recipe)
    peak_before = bf16_matmul_flops_per_s(args.peak_size)
    seconds = run.time(args.steps)
    peak = max(peak_before, bf16_matmul_flops_per_s(args.peak_size))
    tokens = recipe.batch_size * recipe.spec.seq_len
    tokens_per_s = tokens / seconds
    results = {
        "preset": args.preset,
        "deterministic": args.deterministic,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "parameters": run.parameters,
        "tokens_per_update": tokens,
        "step_ms": seconds * 1e3,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": run.flops_per_token,
        "bf16_matmul_peak_tflops": peak / 1e12,
        "mfu": tokens_per_s * run.flops_per_token / peak,
        "first_step_s": run.first_step_s,
        "losses_hex": [float(loss).hex() for loss in run.losses],
    }
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def _recipe(args: argparse.Namespace) -> Any:
    """The preset's ``benchmarks._trainer.Recipe`` (imported here: JAX starts after
    ``--deterministic`` is set)."""
    from benchmarks._trainer import trainer_recipe

    return trainer_recipe(deterministic=args.deterministic, **PRESETS[args.preset])


class _Run:
    """The trainer's model, optimizer and steps on one fixed random batch."""

    def __init__(self, recipe: Any):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        import rudax.models as rm
        import rudax.optim as ro
        import rudax.sharding as rs

        spec = recipe.spec
        config = spec.config
        model = spec.create(0)  # the trainer's --seed
        graphdef, params, self.rngs, self.rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        tx = recipe.optimizer.build()
        loss = functools.partial(rm.next_token_loss_sum, chunk=spec.loss_chunk)
        self.steps = rs.make_train_steps(graphdef, tx, loss, donate=True)
        acc = ro.GradientAccumulator.init(params, dtype=jnp.float32)
        self.state = (params, tx.init(params), acc)
        shape = (recipe.batch_size, spec.seq_len + 1)
        self.batch = jax.random.randint(jax.random.key(1), shape, 0, config.vocab_size)
        self.parameters = sum(x.size for x in jax.tree.leaves(params))
        self.flops_per_token = rm.flops_per_token(config, spec.seq_len)
        self.first_step_s = math.nan
        self.losses: list[Any] = []  # every update's loss, a device scalar

    def step(self) -> Any:
        params, opt_state, acc = self.state
        acc, _, metrics = self.steps.micro(params, self.rngs, acc, self.rest, self.batch)
        params, opt_state, acc, _ = self.steps.apply(params, opt_state, acc)
        self.state = (params, opt_state, acc)
        self.losses.append(
            metrics["loss_sum"] / metrics["tokens"].astype(metrics["loss_sum"].dtype)
        )
        return self.losses[-1]

    def time(self, steps: int) -> float:
        import jax

        start = time.perf_counter()
        jax.block_until_ready(self.step())
        self.first_step_s = time.perf_counter() - start
        jax.block_until_ready(self.step())
        start = time.perf_counter()
        out = None
        for _ in range(steps):
            out = self.step()
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / steps


def bf16_matmul_flops_per_s(n: int, repeats: int = 5) -> float:
    """Best of ``repeats`` jitted bf16 ``[n, n] @ [n, n]`` products (fp32 accumulation)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(jnp.bfloat16)
    mm = jax.jit(jnp.matmul)
    jax.block_until_ready(mm(a, a))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(mm(a, a))
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


if __name__ == "__main__":
    main(sys.argv[1:])
