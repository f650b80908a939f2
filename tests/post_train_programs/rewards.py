"""Reward functions the GRPO program's tests name with ``--reward module:function``."""

from __future__ import annotations

import math


def short(completions, **kwargs):
    """Shorter completions score higher: rewards that differ within a group."""
    return [1.0 / (1 + len(c)) for c in completions]


def raises(completions, answer, **kwargs):
    """Fails on the rows whose answer says "plus 3", as a user's parser might on odd rows."""
    pairs = zip(completions, answer, strict=True)
    return [float(int("x") if "plus 3" in a else len(c)) for c, a in pairs]


def nan(completions, **kwargs):
    return [math.nan for _ in completions]
