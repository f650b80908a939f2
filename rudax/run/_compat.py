"""The one place where rudax.run meets a JAX internal: its cluster detection.

``jax.distributed.initialize()`` without arguments asks each cluster environment it knows
(SLURM, Open MPI, Kubernetes, Cloud TPU) whether the process runs under it; jax offers no
public way to ask that question without joining. ``rudax.run.initialize_distributed`` needs
the answer to stay single-process when launched alone, so it reads jax's own list of
environments here, and behaves as if none were present where that list has moved.
"""

from __future__ import annotations

__all__ = ["cluster_process_count"]


def cluster_process_count() -> int | None:
    """The process count of the cluster jax would detect (None: none detected)."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # moved in a later jax: no automatic detection, flags or env only
        return None
    for env in getattr(ClusterEnv, "_cluster_types", []):
        if getattr(env, "opt_in_only_method", False):
            continue  # mpi4py: only when asked for by name, as jax does
        try:
            if env.is_env_present():
                return int(env.get_process_count())
        except Exception:  # a half-set environment: leave it to jax's own error, if asked
            continue
    return None
