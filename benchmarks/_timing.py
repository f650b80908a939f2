"""Paired timing: arms measured in alternating rounds inside one process, reported as ratios.

On a shared machine a single absolute time says little: another process can take a core for
a second. Alternating the arms round by round exposes them to the same noise, and the ratio
of each round's times cancels most of it. The table gives each arm's median time and each
ratio's median with its spread (min-max over rounds).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def time_once(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of fn, over iters calls, waiting for the device at the end."""
    jax.block_until_ready(fn())  # one untimed call: settles caches after the previous arm
    start = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def alternate(arms: dict[str, Callable[[], object]], *, rounds: int, iters: int) -> dict:
    """Times each arm once per round, in rotating order; returns {name: [seconds per call]}."""
    names = list(arms)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(time_once(arms[name], iters))
    return times


def ratio_summary(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Median, min and max over rounds of num[i] / den[i]."""
    ratios = [n / d for n, d in zip(num, den, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)
