"""rudax: a functional training library on JAX.

Subpackages (import them directly, e.g. ``import rudax.optim as ro``):

- ``rudax.optim``: optax-compatible optimizers, schedules, clipping, gradient accumulation,
  FP32 master weights and loss scaling.
- ``rudax.layers``: flax.nnx layers with explicit storage and compute dtypes.
- ``rudax.kernels``: Pallas kernels with exact XLA fallbacks.
- ``rudax.sharding``: data parallel, collectives and FSDP over ``jax.sharding`` meshes.
- ``rudax.checkpoint``: the whole training state saved and restored with orbax.
"""

__version__ = "0.1.0.dev0"

__all__ = ["__version__"]
