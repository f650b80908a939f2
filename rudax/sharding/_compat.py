"""The one place where rudax.sharding meets JAX-version differences.

shard_map tracks, per value, the mesh axes it varies over (``check_vma=True``, the default):
a replicated parameter's gradient then arrives already summed over the ranks, and summing it
again would count it N times. Collectives and ``DataParallel.reduce`` ask ``varying_axes``
whether a value still varies before they sum. Where JAX keeps that set moved between
releases: ``aval.manual_axis_type.varying`` on jax 0.10 and 0.11, ``aval.vma`` before it (read in
``rudax/kernels/_compat.py``).
"""

from __future__ import annotations

from rudax.kernels._compat import vary_like, vary_over_mesh, varying_axes

# The kernels need the same reading of shard_map's tracking for their custom_vjp rules, and
# rudax.kernels imports nothing from rudax.sharding, so the one definition lives there.
__all__ = ["vary_like", "vary_over_mesh", "varying_axes"]
