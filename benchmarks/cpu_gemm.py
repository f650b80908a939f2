"""The trainer step's matrix products, XLA against torch, one by one on this CPU.

    python -m benchmarks.cpu_gemm                       # the main job's model, 5 rounds
    python -m benchmarks.cpu_gemm --rounds 3 --json gemm.json

``benchmarks.lm_trainer`` times whole steps; this file asks where the difference between
rudax's step and torch.compile's lies on a CPU. Every matrix product of one training step of
the main job's model (``benchmarks/_trainer.py``: 4 layers, hidden 256, MLP 704, vocabulary
8192, 16 x 256 tokens, the loss 1024 tokens at a time) is listed with how often the step runs
it: the forward's (``NN``: activations times a ``[in, out]`` kernel; the head ``NT``), the
input gradients' (``NT``) and the weight gradients' (``TN``: a contraction over the tokens,
the leading axis of both operands). Each is timed in fp32, as the step computes, in a jitted
jax function and in torch (``torch.set_num_threads(os.cpu_count())``, as the benchmark's torch
arms), alternated round by round; the report gives each product's GFLOP/s in both and their
ratio, then the step's products summed by their counts: the matmul time each library needs
for one step of the same model.

torch is not a dependency of rudax: without it only the jax column is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import alternate
from benchmarks._trainer import trainer_recipe


@dataclasses.dataclass(frozen=True)
class Product:
    """``[m, k] x [k, n]`` in a layout, run ``count`` times per step, in one part of it."""

    part: str  # "forward", "dx" (input gradients) or "dW" (weight gradients)
    name: str
    m: int
    k: int
    n: int
    layout: str  # "NN", "NT" (the right operand stored [n, k]), "TN" (the left stored [k, m])
    count: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


def step_products(
    *, tokens: int, hidden: int, mlp: int, vocab: int, layers: int, chunk: int, kv_width: int
) -> list[Product]:
    """Every matrix product of one step of a Llama with a tied head (attention's own
    score and value products left out: they are batched per head, a different kernel)."""
    chunks = -(-tokens // chunk)
    d, f, n = hidden, mlp, tokens
    return [
        Product("forward", "q, o projections", n, d, d, "NN", 2 * layers),
        Product("forward", "k, v projections", n, d, kv_width, "NN", 2 * layers),
        Product("forward", "gate, up", n, d, f, "NN", 2 * layers),
        Product("forward", "down", n, f, d, "NN", layers),
        Product("forward", "head logits", chunk, d, vocab, "NT", chunks),
        Product("dx", "q, o", n, d, d, "NT", 2 * layers),
        Product("dx", "k, v", n, kv_width, d, "NT", 2 * layers),
        Product("dx", "gate, up", n, f, d, "NT", 2 * layers),
        Product("dx", "down", n, d, f, "NT", layers),
        Product("dx", "head", chunk, vocab, d, "NN", chunks),
        Product("dW", "q, o", d, n, d, "TN", 2 * layers),
        Product("dW", "k, v", d, n, kv_width, "TN", 2 * layers),
        Product("dW", "gate, up", d, n, f, "TN", 2 * layers),
        Product("dW", "down", f, n, d, "TN", layers),
        Product("dW", "head", vocab, chunk, d, "TN", chunks),
    ]


def recipe_products(recipe: Any) -> list[Product]:
    """``step_products`` of a ``benchmarks._trainer`` recipe: its model, tokens and chunk."""
    c = recipe.spec.config
    return step_products(
        tokens=recipe.batch_size * recipe.spec.seq_len,
        hidden=c.hidden_size,
        mlp=c.intermediate_size,
        vocab=c.vocab_size,
        layers=c.num_hidden_layers,
        chunk=recipe.spec.loss_chunk,
        kv_width=c.num_key_value_heads * c.head_dim,
    )


def _operands(p: Product, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    left = (p.k, p.m) if p.layout == "TN" else (p.m, p.k)
    right = (p.n, p.k) if p.layout == "NT" else (p.k, p.n)
    return (
        rng.standard_normal(left, dtype=np.float32),
        rng.standard_normal(right, dtype=np.float32),
    )


def jax_arm(p: Product, a: np.ndarray, b: np.ndarray) -> Callable[[], object]:
    dims = {"NN": ((1,), (0,)), "NT": ((1,), (1,)), "TN": ((0,), (0,))}[p.layout]
    f = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (dims, ((), ()))))
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    return lambda: f(ja, jb)


def torch_arm(p: Product, a: np.ndarray, b: np.ndarray) -> Callable[[], object]:
    import torch

    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    if p.layout == "NN":
        return lambda: ta @ tb
    if p.layout == "NT":
        return lambda: ta @ tb.T
    return lambda: ta.T @ tb


def _have_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    torch.set_num_threads(os.cpu_count() or 1)
    return True


def measure(products: list[Product], *, rounds: int, iters: int) -> list[dict]:
    rng = np.random.default_rng(0)
    torch_too = _have_torch()
    rows = []
    for p in products:
        a, b = _operands(p, rng)
        arms = {"jax": jax_arm(p, a, b)}
        if torch_too:
            arms["torch"] = torch_arm(p, a, b)
        times = alternate(arms, rounds=rounds, iters=iters)
        row = dataclasses.asdict(p) | {
            arm: statistics.median(ts) * 1e3 for arm, ts in times.items()
        }  # ms
        if torch_too:
            ratios = [t / j for j, t in zip(times["jax"], times["torch"], strict=True)]
            row["jax_speed_vs_torch"] = [statistics.median(ratios), min(ratios), max(ratios)]
        rows.append(row)
    return rows


def report(rows: list[dict]) -> str:
    torch_too = "torch" in rows[0]
    head = f"{'part':<7} {'product':<16} {'m x k x n':>17} {'layout':>6} {'count':>5}"
    head += f" {'jax GFLOP/s':>11}"
    if torch_too:
        head += f" {'torch GFLOP/s':>13} {'jax speed vs torch [min, max]':>30}"
    lines = [head, "-" * len(head)]
    for r in rows:
        gflop = 2 * r["m"] * r["k"] * r["n"] / 1e9
        shape = f"{r['m']}x{r['k']}x{r['n']}"
        line = f"{r['part']:<7} {r['name']:<16} {shape:>17} {r['layout']:>6} {r['count']:>5} "
        line += f"{gflop / r['jax'] * 1e3:>11.0f}"
        if torch_too:
            s = r["jax_speed_vs_torch"]
            line += f" {gflop / r['torch'] * 1e3:>13.0f} {s[0]:>12.3f}x [{s[1]:.3f}, {s[2]:.3f}]"
        lines.append(line)
    lines.append("")
    for part in ("forward", "dx", "dW", None):
        these = [r for r in rows if part is None or r["part"] == part]
        if not these:
            continue
        flops = sum(r["count"] * 2 * r["m"] * r["k"] * r["n"] for r in these)
        times = {a: sum(r["count"] * r[a] for r in these) for a in ("jax", "torch") if a in rows[0]}
        text = ", ".join(
            f"{a} {t:.1f} ms ({flops / t / 1e6:.0f} GFLOP/s)" for a, t in times.items()
        )
        lines.append(f"{'one step' if part is None else part + ' products'}: {text}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    products = recipe_products(trainer_recipe())
    rows = measure(products, rounds=args.rounds, iters=args.iters)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} cores, "
          f"fp32; {args.rounds} alternating rounds x {args.iters} calls")  # fmt: skip
    print(report(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
