"""The LM trainer's model and optimizer, from the library, as ``examples.lm.train`` builds them.

``python -m examples.lm.train`` trains a ``rudax.models.ModelSpec`` of ``LlamaConfig.tiny``
at its flags' sizes with a ``rudax.models.OptimizerSpec``, and its flags' defaults are the
library's (``LlamaConfig.tiny``'s and ``OptimizerSpec()``'s). The benchmarks that measure
the trainer's step build the same recipe here, from the library alone (a benchmark never
imports an example's internals); ``tests/benchmarks/test_trainer_recipe.py`` checks that it
equals what the trainer's own flags build.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

import rudax.models as rm

# python -m examples.lm.train's --seq-len and --batch-size (rows per microbatch)
SEQ_LEN = 256
BATCH_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What the trainer's step is made of: the model, the update rule, the rows per batch."""

    spec: rm.ModelSpec
    optimizer: rm.OptimizerSpec
    batch_size: int


def trainer_recipe(
    *,
    seq_len: int = SEQ_LEN,
    batch_size: int = BATCH_SIZE,
    compute_dtype: Any = "float32",
    remat: str = "none",
    scan_layers: bool = False,
    deterministic: bool = False,
    optimizer: str = "adamw",
    optimizer_fields: Mapping[str, Any] | None = None,
    **config_fields: Any,
) -> Recipe:
    """The trainer's model at ``config_fields`` (``LlamaConfig.tiny``'s arguments:
    ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``param_dtype``...) and its
    optimizer (``--optimizer adamw`` by default: the benchmarks' references are AdamW),
    ``optimizer_fields`` (``OptimizerSpec``'s: ``learning_rate``...) changed from the trainer's.

    Example:
      >>> from benchmarks._trainer import trainer_recipe
      >>> r = trainer_recipe(vocab_size=512, hidden_size=64, seq_len=64)
      >>> r.spec.config.hidden_size, r.spec.seq_len, r.optimizer.name, r.batch_size
      (64, 64, 'adamw', 16)
    """
    if "param_dtype" in config_fields:
        config_fields["param_dtype"] = jnp.dtype(config_fields["param_dtype"])
    config = rm.LlamaConfig.tiny(max_position_embeddings=seq_len, **config_fields)
    spec = rm.ModelSpec(
        config,
        seq_len,
        dtype=jnp.dtype(compute_dtype),
        remat=remat,
        scan_layers=scan_layers,
        embedding_backward="sorted" if deterministic else "scatter",
    )
    return Recipe(spec, rm.OptimizerSpec(optimizer, **(optimizer_fields or {})), batch_size)
