"""``--init-from`` a Hugging Face directory: a checkpoint the trainer continues training.

    python -m examples.lm.export runs/base hf/base       # a run as a LlamaForCausalLM folder
    python -m examples.lm.train --init-from hf/base --name tuned --steps 50

A directory whose ``config.json`` names a ``model_type`` is a Hugging Face checkpoint (a run's
``config.json`` holds the trainer's flags, which have none). Its ``config.json`` decides the
model (``rudax.models.LlamaConfig.from_hf``): the shape flags (``--d-model``, ``--n-layers``,
``--n-heads``, ``--mlp-hidden``) are taken from it and may be given only with the same
values, and the fields no flag covers (grouped-query heads, an untied head, RoPE, biases,
positions, experts, token ids) are recorded in the run's ``architecture``, so ``--resume``
rebuilds the same model without the directory. ``--param-dtype``, ``--compute-dtype`` and
``--seq-len`` (at most the checkpoint's positions) stay the trainer's.

The trainer trains on its own prepared corpus, so the checkpoint's token ids must mean what
the corpus's mean: the directory's ``tokenizer.json`` must be the data folder's (as
``examples.lm.export`` writes it). Anything else is refused rather than trained on ids of
another vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

import rudax.models as rm
from examples.lm.config import TrainConfig, UsageError
from examples.lm.tokenizer import TOKENIZER

# The trainer's shape flags and the LlamaConfig field each sets.
SHAPE_FLAGS = {
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "mlp_hidden": "intermediate_size",
}
# The LlamaConfig fields that are not the run's architecture: the flags' and the data's.
NOT_ARCHITECTURE = ("vocab_size", "param_dtype", *SHAPE_FLAGS.values())


def is_hf_dir(path: Path) -> bool:
    """Whether path holds a Hugging Face model: a config.json with a ``model_type``."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config


def take_architecture(flags: TrainConfig, given: set[str], hf_dir: Path) -> TrainConfig:
    """The flags with the shape and ``architecture`` of hf_dir's config.json (a new record).

    Raises UsageError for a config.json ``LlamaConfig.from_hf`` refuses (naming the field),
    ``--moe`` (the checkpoint decides whether it has experts), a shape flag given with another
    value than the checkpoint's, or a ``--seq-len`` past its positions.
    """
    hf = _config(hf_dir)
    if flags.moe:
        raise UsageError(
            f"--init-from {hf_dir}: the checkpoint's config.json decides whether the model has "
            "experts; drop --moe"
        )
    conflicts = [
        f"--{flag.replace('_', '-')} {getattr(flags, flag)} (the checkpoint has "
        f"{getattr(hf, field)})"
        for flag, field in SHAPE_FLAGS.items()
        if flag in given and getattr(flags, flag) != getattr(hf, field)
    ]
    if conflicts:
        raise UsageError(
            f"--init-from {hf_dir}: the model's shape is its config.json's; flags differ: "
            + "; ".join(conflicts)
        )
    if flags.seq_len > hf.max_position_embeddings:
        raise UsageError(
            f"--seq-len {flags.seq_len} is more than the {hf.max_position_embeddings} positions "
            f"of --init-from {hf_dir} (max_position_embeddings)"
        )
    shape = {flag: getattr(hf, field) for flag, field in SHAPE_FLAGS.items()}
    architecture = {
        f.name: getattr(hf, f.name)
        for f in dataclasses.fields(hf)
        if f.name not in NOT_ARCHITECTURE
    }
    if hf.rope_scaling is not None:  # JSON in the run's config.json
        architecture["rope_scaling"] = dataclasses.asdict(hf.rope_scaling)
    return dataclasses.replace(flags, **shape, architecture=architecture)


def check_tokenizer(hf_dir: Path, data_dir: Path, *, flag: str = "--init-from") -> None:
    """UsageError unless hf_dir's tokenizer.json is the data folder's (the same ids).

    ``flag`` is how the message names hf_dir: the argument the user gave it as.
    """
    theirs, ours = hf_dir / TOKENIZER, data_dir / TOKENIZER
    if not theirs.is_file():
        raise UsageError(
            f"{flag} {hf_dir}: it has no {TOKENIZER}, so nothing shows that its token "
            f"ids are those of the data in {data_dir}; the trainer fine-tunes a checkpoint "
            "only on data tokenized with its tokenizer (examples.lm.export writes it)"
        )
    if json.loads(theirs.read_text()) != json.loads(ours.read_text()):
        raise UsageError(
            f"{flag} {hf_dir}: its {TOKENIZER} is not the tokenizer of the data in "
            f"{data_dir}; its token ids would mean other text. Train on the data it was "
            "trained on (the --data and --vocab-size of the run it was exported from)"
        )


def load_model(
    hf_dir: Path, spec: rm.ModelSpec, *, mesh: jax.sharding.Mesh | None = None
) -> rm.LlamaForCausalLM:
    """hf_dir's weights in the model of ``spec`` (the flags' dtypes, remat and layout); with
    a ``mesh`` (an ``fsdp`` axis), already in the trainer's FSDP form (``spec.shard``'s),
    each process reading only its devices' shards."""
    config = _config(hf_dir)
    if dataclasses.replace(config, param_dtype=spec.config.param_dtype) != spec.config:
        raise UsageError(
            f"--init-from {hf_dir}: the checkpoint's model is {config}, the run's {spec.config}"
        )
    try:
        return rm.from_pretrained(
            hf_dir,
            param_dtype=spec.config.param_dtype,
            dtype=spec.dtype,
            prepare=spec.adopt,
            scan_layers=spec.scan_layers,
            mesh=mesh,
            gather_dtype=None if mesh is None else jnp.float32,  # as spec.shard gathers
        )
    except (TypeError, ValueError) as e:
        raise UsageError(f"--init-from {hf_dir}: {e}") from e


def _config(hf_dir: Path) -> rm.LlamaConfig:
    try:
        return rm.LlamaConfig.from_hf(json.loads((hf_dir / "config.json").read_text()))
    except (TypeError, ValueError) as e:
        raise UsageError(f"--init-from {hf_dir}: {e}") from e
