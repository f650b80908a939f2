"""``Held``: how an adapter program holds its base (``--quantize``, ``--param-dtype``,
``--dtype``, ``--absmax-rounding``) and the adapters it puts on it (``--targets``, ``--rank``,
``--alpha``, ``--dropout``, ``--seed``), for each model a run loads: the trained one, one
read onto a mesh, the merged one ``examples.finetune --merged`` writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flax import nnx

import rudax.layers as rl
import rudax.models as rm
from examples.policy.config import DTYPES, PolicyConfig
from rudax.run import UsageError

# rudax_base.json's keys, beside a PEFT adapter: how to load the base the adapter was trained
# on (a QLoRA adapter on the unquantized base computes another function); peft reads only its
# own two files.
HOW_HELD = ("quantize", "param_dtype", "dtype", "absmax_rounding")


class Held:
    """How the base is held and the adapters added to it (see the module docstring)."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.quantized = config.quantize != "none"
        self.load_kw: dict[str, Any] = dict(
            param_dtype=DTYPES[config.param_dtype],
            dtype=DTYPES[config.dtype],
            quantize=config.quantize if self.quantized else None,
            absmax_rounding=config.absmax_rounding,
        )
        self.adapted: list[str] = []  # the module paths adapted, once a model has been

    def add_adapters(self, model: rm.LlamaForCausalLM) -> None:
        """``rudax.layers.apply_lora`` of the flags on ``model``, in place; flags that match
        no dense layer are a ``UsageError`` naming ``--targets``."""
        config = self.config
        try:
            self.adapted[:] = rl.apply_lora(
                model,
                config.targets,
                rank=config.rank,
                alpha=config.alpha,
                dropout=config.dropout,
                rngs=nnx.Rngs(config.seed),
            )
        except (TypeError, ValueError) as e:  # no match, or a match that is not a dense layer
            raise UsageError(f"--targets {','.join(config.targets)}: {e}") from e

    def write_beside(self, adapter_dir: Path) -> None:
        """Writes ``rudax_base.json`` into the adapter's directory, for ``examples.generate
        --adapter`` to load the base as it was held."""
        how = {k: getattr(self.config, k) for k in HOW_HELD}
        (adapter_dir / "rudax_base.json").write_text(json.dumps(how, indent=1) + "\n")
