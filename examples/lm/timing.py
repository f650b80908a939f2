"""``--profile``: how long the forward, backward and optimizer phases of one update take.

Each phase is its own jitted function (``rudax.sharding.TrainSteps``), compiled and run once
before timing (warm-up), then run ``repeats`` times with ``block_until_ready`` around each
call; the table shows medians, per call and per update (the forward and backward phases run
once per microbatch). The backward phase is not separable from the forward one in a jitted
gradient, so it is reported as ``forward+backward - forward``; the sum of the phases next to
the measured whole update shows what separate dispatch costs. ``--trace DIR``
additionally records a ``jax.profiler`` trace of a few whole updates (open it with
TensorBoard's profile plugin or Perfetto).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

import rudax.run as rr


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())  # warm-up: compile and first run
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile(
    steps: Any,
    model_state: tuple[Any, Any, Any],
    opt_state: Any,
    acc: Any,
    batches: list[Any],
    *,
    flops_per_token: float,
    repeats: int = 5,
    trace_dir: str | None = None,
) -> str:
    """Times one update's phases; returns the table (and writes a trace if asked).

    Args:
      steps: the run's ``rudax.sharding.TrainSteps``.
      model_state: ``(params, rngs, rest)``, the model's split state.
      opt_state: the optimizer state; acc: an empty accumulator.
      batches: the update's microbatches, placed as the run places them.
      flops_per_token: the model's training FLOPs per token, for the achieved FLOP/s.
      repeats: timed runs of each phase after the warm-up.
      trace_dir: if given, a ``jax.profiler`` trace of three whole updates is written there.

    Returns:
      The table as text.
    """
    batch = batches[0]
    tokens = batch.shape[0] * (batch.shape[1] - 1)
    params, rngs, rest = model_state
    full_acc, _, _ = steps.micro(params, rngs, acc, rest, batch)

    def update():
        window = acc
        for b in batches:
            window, _, _ = steps.micro(params, rngs, window, rest, b)
        return steps.apply(params, opt_state, window)

    forward = _median_seconds(lambda: steps.forward(params, rngs, rest, batch), repeats)
    forward_backward = _median_seconds(lambda: steps.gradients(params, rngs, rest, batch), repeats)
    optimizer = _median_seconds(lambda: steps.apply(params, opt_state, full_acc), repeats)
    whole = _median_seconds(update, repeats)
    if trace_dir is not None:
        with jax.profiler.trace(trace_dir):
            for _ in range(3):
                jax.block_until_ready(update())

    a = len(batches)
    backward = forward_backward - forward
    ms = lambda s: f"{1e3 * s:.1f}"
    rows = [
        ["forward", ms(forward), ms(a * forward)],
        ["backward (forward+backward - forward)", ms(backward), ms(a * backward)],
        ["optimizer (pop, clip, update)", ms(optimizer), ms(optimizer)],
        ["sum of the phases", "", ms(a * forward_backward + optimizer)],
        ["whole update, measured", "", ms(whole)],
    ]
    rate = a * tokens / whole
    per_update = f"ms per update ({a} microbatch{'es' if a > 1 else ''})"
    table = rr.format_table(["phase", "ms per call", per_update], rows)
    return (
        f"{table}\n{rate:,.0f} tokens/s, {rate * flops_per_token / 1e9:.1f} GFLOP/s of model "
        f"matmuls (medians of {repeats} timed runs each, after a warm-up)"
    )
