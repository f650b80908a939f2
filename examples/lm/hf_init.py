"""``--init-from`` a Hugging Face directory: the trainer's side of ``examples/lm/hf.py``.

    python -m examples.lm.hf export runs/base hf/base          # a run as a LlamaForCausalLM
    python -m examples.lm.train --init-from hf/base --name tuned --steps 50

A directory whose ``config.json`` names a ``model_type`` is a Hugging Face checkpoint (a run's
``config.json`` holds the trainer's flags, which have none). Its ``config.json`` decides the
model: the shape flags (``--d-model``, ``--n-layers``, ``--n-heads``, ``--mlp-hidden``) are
taken from it and may be given only with the same values, and the fields no flag covers
(grouped-query heads, an untied head, RoPE, separate q/k/v projections) are recorded in the
run's ``architecture``, so ``--resume`` rebuilds the same model without the directory.
``--param-dtype``, ``--compute-dtype`` and ``--seq-len`` stay the trainer's.

The trainer trains on its own prepared corpus, so the checkpoint's token ids must mean what
the corpus's mean: the directory's ``tokenizer.json`` must be the data folder's (as
``examples.lm.hf export`` writes it). Anything else is refused rather than trained on ids of
another vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from examples.lm.config import UsageError
from examples.lm.hf import load_hf
from examples.lm.hf_config import config_from_hf
from examples.lm.model import GPT, GPTConfig
from examples.lm.tokenizer import TOKENIZER

# The trainer's shape flags and the GPTConfig field each sets.
SHAPE_FLAGS = ("d_model", "n_layers", "n_heads", "mlp_hidden")
# The GPTConfig fields an HF checkpoint decides that no flag covers: the run's architecture.
ARCHITECTURE = (
    "n_kv_heads",
    "tie_embeddings",
    "fused_qkv",
    "qkv_bias",
    "rope_theta",
    "rope_scaling",
    "norm_eps",
)


def is_hf_dir(path: Path) -> bool:
    """Whether path holds a Hugging Face model: a config.json with a ``model_type``."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config


def take_architecture(args: Any, given: set[str], hf_dir: Path) -> None:
    """Sets the shape flags and ``args.architecture`` from hf_dir's config.json.

    Raises UsageError for a config.json load_hf refuses (naming the field), ``--moe``, or a
    shape flag given with another value than the checkpoint's.
    """
    hf = _config(hf_dir)
    if args.moe:
        raise UsageError(f"--init-from {hf_dir}: the checkpoint is a dense model; drop --moe")
    conflicts = [
        f"--{key.replace('_', '-')} {getattr(args, key)} (the checkpoint has {getattr(hf, key)})"
        for key in SHAPE_FLAGS
        if key in given and getattr(args, key) != getattr(hf, key)
    ]
    if conflicts:
        raise UsageError(
            f"--init-from {hf_dir}: the model's shape is its config.json's; flags differ: "
            + "; ".join(conflicts)
        )
    for key in SHAPE_FLAGS:
        setattr(args, key, getattr(hf, key))
    architecture = {key: getattr(hf, key) for key in ARCHITECTURE}
    if hf.rope_scaling is not None:  # JSON in the run's config.json
        architecture["rope_scaling"] = dataclasses.asdict(hf.rope_scaling)
    args.architecture = architecture


def check_tokenizer(hf_dir: Path, data_dir: Path, *, flag: str = "--init-from") -> None:
    """UsageError unless hf_dir's tokenizer.json is the data folder's (the same ids).

    ``flag`` is how the message names hf_dir: the argument the user gave it as.
    """
    theirs, ours = hf_dir / TOKENIZER, data_dir / TOKENIZER
    if not theirs.is_file():
        raise UsageError(
            f"{flag} {hf_dir}: it has no {TOKENIZER}, so nothing shows that its token "
            f"ids are those of the data in {data_dir}; the trainer fine-tunes a checkpoint "
            "only on data tokenized with its tokenizer (examples.lm.hf export writes it)"
        )
    if json.loads(theirs.read_text()) != json.loads(ours.read_text()):
        raise UsageError(
            f"{flag} {hf_dir}: its {TOKENIZER} is not the tokenizer of the data in "
            f"{data_dir}; its token ids would mean other text. Train on the data it was "
            "trained on (the --data and --vocab-size of the run it was exported from)"
        )


def load_model(hf_dir: Path, config: GPTConfig) -> GPT:
    """hf_dir's weights in the GPT of ``config`` (the flags' dtypes and sequence length)."""
    model = load_hf(hf_dir, param_dtype=config.param_dtype, dtype=config.dtype)
    # load_hf's config differs from the run's only in what the trainer's flags decide.
    own = dataclasses.replace(model.config, seq_len=config.seq_len, loss_chunk=config.loss_chunk)
    if config != own:
        raise UsageError(
            f"--init-from {hf_dir}: the checkpoint's model is {model.config}, the run's {config}"
        )
    model.config = config
    return model


def _config(hf_dir: Path) -> GPTConfig:
    try:
        return config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    except (TypeError, ValueError) as e:
        raise UsageError(f"--init-from {hf_dir}: {e}") from e
