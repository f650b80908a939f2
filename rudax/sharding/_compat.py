"""The one place where rudax.sharding meets JAX-version differences.

shard_map tracks, per value, the mesh axes it varies over (``check_vma=True``, the default):
a replicated parameter's gradient then arrives already summed over the ranks, and summing it
again would count it N times. Collectives and ``DataParallel.reduce`` ask ``varying_axes``
whether a value still varies before they sum. Where JAX keeps that set moved between
releases: ``aval.mat.varying`` on jax 0.10, ``aval.vma`` before it.
"""

from __future__ import annotations

from typing import Any

import jax


def varying_axes(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map``; empty without ``check_vma``."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))
