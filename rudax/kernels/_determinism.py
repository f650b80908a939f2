"""Run-to-run deterministic GPU computation: XLA's flags, set before JAX starts a backend.

A GPU run is bit-identical to itself only if no reduction's order depends on thread timing.
Two things decide that in a rudax training step:

* XLA's own ops: with ``--xla_gpu_deterministic_ops`` XLA lowers scatter, select-and-scatter
  and sort deterministically (a scatter-add in a fixed order instead of with atomics) and
  autotunes only deterministic algorithms (``--xla_gpu_exclude_nondeterministic_ops``).
* the embedding's backward: a scatter-add that a deterministic XLA runs in a fixed but slow
  order; ``rudax.layers.Embedding(backward="sorted")`` replaces it with a sorted segment sum
  that has no scatter at all.

XLA reads ``XLA_FLAGS`` once, when JAX initializes its first backend, so
``enable_deterministic_gpu`` must run before anything touches a device. The flags are XLA
debug options that every jaxlib build registers, so setting them on a CPU-only machine is
harmless (checked on jax 0.10.2).
"""

from __future__ import annotations

import os

from rudax.kernels import _target

DETERMINISTIC_XLA_FLAGS: tuple[str, ...] = (
    "--xla_gpu_deterministic_ops=true",
    "--xla_gpu_exclude_nondeterministic_ops=true",
)


def enable_deterministic_gpu() -> str:
    """Adds XLA's deterministic-GPU flags to ``XLA_FLAGS``; call it before JAX uses a device.

    Flags already in ``XLA_FLAGS`` are kept; each of these replaces an earlier value of the
    same flag.

    Returns:
      The new ``XLA_FLAGS``. A RuntimeError if a JAX backend is already initialized (the
      flags would be ignored without a word).

    Example:
      At the top of a training program, before any array is made::

          import rudax.kernels as rk
          rk.enable_deterministic_gpu()

      >>> import rudax.kernels as rk
      >>> rk.DETERMINISTIC_XLA_FLAGS[0]
      '--xla_gpu_deterministic_ops=true'
    """
    if _target.backends_are_initialized():
        raise RuntimeError(
            "enable_deterministic_gpu() must run before JAX initializes a backend (before "
            "the first array, device query or jit call): XLA reads XLA_FLAGS once. Call it "
            "at the top of the program, or set XLA_FLAGS="
            f"{' '.join(DETERMINISTIC_XLA_FLAGS)!r} in the environment"
        )
    names = {flag.split("=")[0] for flag in DETERMINISTIC_XLA_FLAGS}
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join([*kept, *DETERMINISTIC_XLA_FLAGS])
    return os.environ["XLA_FLAGS"]
