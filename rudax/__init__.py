"""rudax: a functional training library on JAX.

Subpackages (``import rudax.optim as ro``, or ``import rudax`` and then ``rudax.optim``):

- ``rudax.optim``: optax-compatible optimizers, schedules, clipping, gradient accumulation,
  FP32 master weights and loss scaling.
- ``rudax.layers``: flax.nnx layers with explicit storage and compute dtypes.
- ``rudax.kernels``: Pallas kernels with exact XLA fallbacks.
- ``rudax.sharding``: data parallel, collectives and FSDP over ``jax.sharding`` meshes.
- ``rudax.checkpoint``: the whole training state saved and restored with orbax.
- ``rudax.models``: Llama-family models read from and written to Hugging Face checkpoints,
  their training loss and generation with a KV cache.
- ``rudax.post_train``: DPO and GRPO losses (TRL's definitions) over per-token log-probs.
- ``rudax.run``: what a training program does around its steps: a metrics log that agrees
  with the checkpoints on resume, halting on a non-finite loss or weights, host memory.

``import rudax`` imports none of them: each is imported the first time it is named as an
attribute (PEP 562), so ``import rudax`` alone loads no jax.
"""

from __future__ import annotations

# Not ``from typing import TYPE_CHECKING``: typing (and re, which it imports) would be most of
# what ``import rudax`` costs where nothing else loaded them. pyright and mypy read a module's
# own ``TYPE_CHECKING = False`` as ``typing.TYPE_CHECKING`` (PEP 781).
TYPE_CHECKING = False

__version__ = "0.1.0.dev0"

# Imported on first use: each subpackage pulls in jax (and flax, optax or orbax), seconds on a
# cold start, and ``import rudax`` must stay cheap for what needs only the package itself
# (``rudax.__version__``, rudax.checkpoint's check that ``rudax`` is the real package).
_SUBPACKAGES = (
    "checkpoint",
    "kernels",
    "layers",
    "models",
    "optim",
    "post_train",
    "run",
    "sharding",
)

if TYPE_CHECKING:  # type checkers and IDEs see the subpackages as attributes
    from types import ModuleType

    from rudax import checkpoint as checkpoint
    from rudax import kernels as kernels
    from rudax import layers as layers
    from rudax import models as models
    from rudax import optim as optim
    from rudax import post_train as post_train
    from rudax import run as run
    from rudax import sharding as sharding

__all__ = [
    "__version__",
    "checkpoint",
    "kernels",
    "layers",
    "models",
    "optim",
    "post_train",
    "run",
    "sharding",
]


# Hidden from type checkers: they read a module __getattr__ as accepting every name, so
# ``rudax.optimm`` would pass; they see the subpackages through the imports above instead.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> ModuleType:
        """The subpackage ``name``, imported now; the import binds it, so this runs once."""
        if name in _SUBPACKAGES:
            import importlib

            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(
            f"module 'rudax' has no attribute {name!r}; "
            f"its subpackages are {', '.join(_SUBPACKAGES)}"
        )


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBPACKAGES})
