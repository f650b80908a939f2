"""Attention benchmark: ``rudax.kernels.flash_attention`` against what it replaces, in one run.

Three modes, each printing a table of paired ratios (arms alternated round by round, see
``benchmarks/_timing.py``) or of XLA's own figures:

* time (default): forward and forward + backward of causal self-attention per shape, the
  kernel (``impl="auto"``: the XLA path on a CPU, the Pallas kernels on a GPU) against the
  blocked XLA attention the trainer's model ran before (``benchmarks/_blocked_attention.py``, O(T^2)
  scores) and ``jax.nn.dot_product_attention(implementation="xla")``; with each arm's XLA
  temporary bytes.
* ``--memory``: XLA's temporary bytes (``memory_analysis``) and compile seconds of a forward
  + backward over T = 1k .. 8k: O(T) for the kernel, O(T^2) for the others.
* ``--gpu``: on a GPU, TFLOP/s of the Pallas kernels against cuDNN
  (``jax.nn.dot_product_attention(implementation="cudnn")``) at batch 2, 32 heads, T = 4096,
  head_dim 128, causal, bf16; and a packed row (``--segments`` examples per row) against
  cuDNN with the equivalent explicit mask.
* ``--trainer``: the LM trainer's default model (``benchmarks._trainer.trainer_recipe``:
  ``examples.lm.train``'s default flags, a ``rudax.models.LlamaForCausalLM``), one forward +
  backward of its loss, with the kernel against the same model over the blocked attention
  (paired).

    python -m benchmarks.attention                     # CPU: the time table
    python -m benchmarks.attention --memory            # CPU: O(T) vs O(T^2)
    python -m benchmarks.attention --trainer           # CPU: the trainer's step, before and after
    python -m benchmarks.attention --gpu --json out.json   # GPU (benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import rudax.kernels as rk
from benchmarks._blocked_attention import causal_attention as blocked_attention
from benchmarks._timing import alternate, ratio_summary

Attention = Callable[..., jax.Array]


def attention_fns(*, segment_ids: jax.Array | None = None) -> dict[str, Attention]:
    """The CPU arms: causal self-attention ``f(q, k, v)`` each."""
    return {
        "flash": lambda q, k, v: rk.flash_attention(q, k, v, causal=True, segment_ids=segment_ids),
        "blocked": lambda q, k, v: blocked_attention(q, k, v, segment_ids=segment_ids),
        "dot_product_attention": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla"
        ),
    }


def _inputs(b: int, t: int, h: int, g: int, k: int, dtype: Any) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, k), jnp.float32).astype(dtype)
    kk, v = (jax.random.normal(x, (b, t, g, k), jnp.float32).astype(dtype) for x in keys[1:3])
    d_out = jax.random.normal(keys[3], (b, t, h, k), jnp.float32).astype(dtype)
    return q, kk, v, d_out


def _forward(fn: Attention) -> Callable[..., Any]:
    return jax.jit(lambda q, k, v, d_out: fn(q, k, v))


def _forward_backward(fn: Attention) -> Callable[..., Any]:
    def step(q, k, v, d_out):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    return jax.jit(step)


def _temp_bytes(step: Callable[..., Any], *args: Any) -> tuple[int, float]:
    """XLA's temporary bytes of ``step`` compiled for ``args``, and the compile seconds."""
    start = time.perf_counter()
    compiled = step.lower(*args).compile()
    seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    return (-1 if analysis is None else int(analysis.temp_size_in_bytes)), seconds


def causal_flops(b: int, t: int, h: int, k: int) -> float:
    """Useful FLOPs of causal attention's forward: two T x T x K matmuls per head, halved.

    FlashAttention-2's count; a forward + backward counts 3.5 times this (the backward's
    five matmuls are 2.5 forwards), whatever a kernel recomputes.
    """
    return 4.0 * b * h * t * t * k / 2


# --- the modes ------------------------------------------------------------------------------


def time_table(shapes, dtype, rounds: int, iters: int) -> list[dict[str, Any]]:
    rows = []
    for b, t, h, g, k in shapes:
        args = _inputs(b, t, h, g, k, dtype)
        fns = attention_fns()
        for kind, wrap in (("fwd", _forward), ("fwd+bwd", _forward_backward)):
            steps = {name: wrap(fn) for name, fn in fns.items()}
            temp = {name: _temp_bytes(step, *args)[0] for name, step in steps.items()}
            times = alternate(
                {name: (lambda s=s, a=args: s(*a)) for name, s in steps.items()},
                rounds=rounds,
                iters=iters,
            )
            for name in steps:
                speed = ratio_summary(times["blocked"], times[name])
                rows.append(
                    dict(
                        shape=f"B={b} T={t} H={h} G={g} K={k}",
                        kind=kind,
                        arm=name,
                        ms=1e3 * statistics.median(times[name]),
                        speed_vs_blocked=speed,
                        temp_mb=temp[name] / 2**20,
                    )
                )
                print(_time_row(rows[-1]), flush=True)
    return rows


def _time_row(r: dict[str, Any]) -> str:
    s = r["speed_vs_blocked"]
    return (
        f"| {r['shape']} | {r['kind']} | {r['arm']} | {r['ms']:.2f} | "
        f"{s[0]:.2f}x [{s[1]:.2f}, {s[2]:.2f}] | {r['temp_mb']:.1f} |"
    )


def memory_table(lengths, b: int, h: int, k: int, dtype, max_quadratic: int) -> list[dict]:
    rows = []
    for t in lengths:
        args = _inputs(b, t, h, h, k, dtype)
        for name, fn in attention_fns().items():
            if name != "flash" and t > max_quadratic:
                continue  # compiling the O(T^2) arms' programs past this takes minutes
            temp, seconds = _temp_bytes(_forward_backward(fn), *args)
            rows.append(dict(t=t, arm=name, temp_mb=temp / 2**20, compile_s=seconds))
            print(f"| {t} | {name} | {temp / 2**20:.1f} | {seconds:.1f} |", flush=True)
    return rows


def gpu_table(b, t, h, k, segments, rounds, iters) -> list[dict[str, Any]]:
    dtype = jnp.bfloat16
    q, kk, v, d_out = _inputs(b, t, h, h, k, dtype)
    per = t // segments
    seg = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) // per, (b, t))
    causal = jnp.tril(jnp.ones((t, t), bool))
    packed_mask = (seg[:, :, None] == seg[:, None, :]) & causal  # [B, T, T]
    arms = {
        "causal": {
            "pallas": lambda q, k, v: rk.flash_attention(q, k, v, causal=True, impl="pallas"),
            "cudnn": lambda q, k, v: rk.flash_attention(q, k, v, causal=True, impl="cudnn"),
        },
        f"packed x{segments}": {
            "pallas": lambda q, k, v: rk.flash_attention(
                q, k, v, causal=True, segment_ids=seg, impl="pallas"
            ),
            "cudnn+mask": lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, mask=packed_mask[:, None], implementation="cudnn"
            ),
        },
    }
    flops = causal_flops(b, t, h, k)
    rows = []
    for case, fns in arms.items():
        for kind, wrap, work in (
            ("fwd", _forward, flops),
            ("fwd+bwd", _forward_backward, 3.5 * flops),
        ):
            steps = {name: wrap(fn) for name, fn in fns.items()}
            times = alternate(
                {n: (lambda s=s: s(q, kk, v, d_out)) for n, s in steps.items()},
                rounds=rounds,
                iters=iters,
            )
            base = next(n for n in steps if n != "pallas")
            for name in steps:
                ms = 1e3 * statistics.median(times[name])
                rows.append(
                    dict(
                        case=case,
                        kind=kind,
                        arm=name,
                        ms=ms,
                        tflops=work / (ms * 1e-3) / 1e12,
                        speed_vs_cudnn=ratio_summary(times[base], times[name]),
                    )
                )
                s = rows[-1]["speed_vs_cudnn"]
                print(f"| {case} | {kind} | {name} | {ms:.3f} | {rows[-1]['tflops']:.0f} | "
                      f"{s[0]:.2f}x [{s[1]:.2f}, {s[2]:.2f}] |", flush=True)  # fmt: skip
    return rows


def trainer_table(rounds: int, iters: int) -> list[dict[str, Any]]:
    """The trainer's default model's loss forward + backward, with the kernel and with blocked
    attention."""
    from flax import nnx

    import rudax.models as rm
    from benchmarks._trainer import trainer_recipe

    recipe = trainer_recipe()  # python -m examples.lm.train's defaults
    spec = recipe.spec
    graphdef, params, rest = nnx.split(spec.create(0), nnx.Param, ...)
    shape = (recipe.batch_size, spec.seq_len + 1)
    tokens = jax.random.randint(jax.random.key(1), shape, 0, spec.config.vocab_size)

    def grad_step():
        def f(params, tokens):
            model = nnx.merge(graphdef, params, rest)
            return rm.next_token_loss_sum(model, tokens, chunk=spec.loss_chunk)

        return jax.jit(jax.value_and_grad(f, has_aux=True))

    kernel = rk.flash_attention

    def blocked(q, k, v, *, causal, segment_ids=None, window=None, **_):
        assert causal and window is None  # the trainer's model: causal, no sliding window
        return blocked_attention(q, k, v, segment_ids=segment_ids)

    steps = {}
    for name, fn in (("flash", kernel), ("blocked", blocked)):
        # rudax.layers.Attention calls rudax.kernels.flash_attention by its module attribute:
        # traced now, the step keeps this attention
        rk.flash_attention = fn
        try:
            step = grad_step()
            jax.block_until_ready(step(params, tokens))
        finally:
            rk.flash_attention = kernel
        steps[name] = step
    times = alternate(
        {n: (lambda s=s: s(params, tokens)) for n, s in steps.items()}, rounds=rounds, iters=iters
    )
    rows = []
    for name in steps:
        speed = ratio_summary(times["blocked"], times[name])
        rows.append(dict(arm=name, ms=1e3 * statistics.median(times[name]), speed_vs_blocked=speed))
        print(f"| {name} | {rows[-1]['ms']:.1f} | {speed[0]:.3f}x [{speed[1]:.3f}, "
              f"{speed[2]:.3f}] |", flush=True)  # fmt: skip
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--memory", action="store_true", help="temp bytes and compile time over T")
    mode.add_argument("--gpu", action="store_true", help="Pallas vs cuDNN on a GPU")
    mode.add_argument(
        "--trainer", action="store_true", help="the trainer's model's step, before and after"
    )
    p.add_argument("--lengths", default="256,1024,2048", help="T of the time table")
    p.add_argument("--heads", default="4:4,8:2", help="H:G pairs of the time table")
    p.add_argument("--batch", type=int, default=None, help="default: 16 at T=256, 2 above")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--memory-lengths", default="1024,2048,4096,8192")
    p.add_argument("--max-quadratic", type=int, default=4096, help="longest T of O(T^2) arms")
    p.add_argument("--segments", type=int, default=8, help="--gpu: examples per packed row")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    if args.memory:
        print("| T | arm | fwd+bwd temp MB | compile s |\n|---|---|---|---|")
        rows = memory_table(
            [int(x) for x in args.memory_lengths.split(",")], 1, 8, args.head_dim, dtype,
            args.max_quadratic,
        )  # fmt: skip
    elif args.gpu:
        print("| case | pass | arm | ms | TFLOP/s | speed vs cuDNN [min, max] |\n"
              "|---|---|---|---|---|---|")  # fmt: skip
        rows = gpu_table(2, 4096, 32, 128, args.segments, args.rounds, args.iters)
    elif args.trainer:
        print("| attention | ms per loss fwd+bwd | speed vs blocked [min, max] |\n|---|---|---|")
        rows = trainer_table(args.rounds, args.iters)
    else:
        shapes = []
        for t in (int(x) for x in args.lengths.split(",")):
            for pair in args.heads.split(","):
                h, g = (int(x) for x in pair.split(":"))
                b = args.batch or (16 if t <= 256 else 2)
                shapes.append((b, t, h, g, args.head_dim))
        print("| shape | pass | arm | ms | speed vs blocked [min, max] | temp MB |\n"
              "|---|---|---|---|---|---|")  # fmt: skip
        rows = time_table(shapes, dtype, args.rounds, args.iters)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
