"""The benchmark's statistics: a t-interval for the geometric mean of per-round ratios.

``benchmarks.lm_trainer`` reports, for each reference arm, the per-round ratio of rudax's tokens/s
to the reference's. Rounds are the samples: the log ratios' mean and a Student t-interval on
it give the geometric mean ratio and its 95% interval. The t-quantile is computed here from
the exact CDF for integer degrees of freedom, so the benchmark needs no scipy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


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
      >>> from benchmarks._stats import t_quantile
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
      >>> from benchmarks._stats import ratio_interval
      >>> [round(x, 3) for x in ratio_interval([1.0, 1.1, 0.9, 1.05])]
      [1.01, 0.881, 1.158]
    """
    if len(ratios) < 2 or min(ratios) <= 0:
        raise ValueError(f"ratios must be >= 2 positive numbers, got {ratios=}")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = t_quantile(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
