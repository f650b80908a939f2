"""A training run as a Hugging Face checkpoint folder: ``python -m examples.lm.export``.

    python -m examples.lm.export runs/base hf/base

writes the run's latest checkpoint weights with ``rudax.models.save_pretrained``
(``config.json``, ``model.safetensors``, ``generation_config.json``), the data folder's
``tokenizer.json``, and a ``tokenizer_config.json`` naming ``<|endoftext|>`` as the end of
text, so ``transformers.AutoModelForCausalLM`` and ``AutoTokenizer`` load the folder and
``generate`` stops where the trained documents ended. The run is only read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rudax.checkpoint as rc
import rudax.models as rm
import rudax.sharding as rs
from examples.lm.config import UsageError
from examples.lm.tokenizer import EOT, TOKENIZER

TOKENIZER_CONFIG = "tokenizer_config.json"


def export(run_dir: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Any]:
    """A training run's latest checkpoint weights and tokenizer, as a Hugging Face folder.

    The run's ``config.json`` gives the model (``examples.lm.step.model_spec``), its data
    directory the vocabulary, the end-of-text id and ``tokenizer.json``
    (``examples.lm.prepare``), its latest checkpoint the weights (the model part only). A
    run trained with FSDP stores its parameters sharded; they are read back onto one device
    and written whole. A relative ``--data-dir`` is taken from the current directory, as
    training took it. Nothing is written before everything has been read.

    Args:
      run_dir: ``runs/<name>``, a directory ``examples.lm.train`` wrote.
      out_dir: the folder to write (created if need be).

    Returns:
      ``{"out_dir", "step", "config"}``: the output folder, the checkpoint's update and the
      ``LlamaConfig`` written.

    Raises:
      UsageError: the run, its checkpoints or its data directory are missing or unusable.
    """
    # Imported here: the trainer's setup and its imports (the data pipeline) only for the CLI.
    from examples.lm import config as cfg
    from examples.lm import setup
    from examples.lm.prepare import read_prepared
    from examples.lm.step import model_spec, shard

    run_dir = Path(run_dir)
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"{run_dir} holds no run (no config.json)") from None
    if saved.get("model") != cfg.MODEL:
        raise UsageError(
            f"{run_dir} was trained by an earlier examples.lm.train (a GPT): export it with "
            "the rudax version that wrote it"
        )
    flags = cfg.TrainConfig.of_run(saved)
    data_dir = Path(flags.data_dir or setup.default_data_dir(flags.data))
    try:
        meta = read_prepared(data_dir)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"the run's data directory {data_dir}: {e}") from e
    tokenizer = data_dir / TOKENIZER
    if not tokenizer.is_file():
        raise UsageError(f"the run's data directory {data_dir} has no {TOKENIZER}")
    spec = model_spec(flags, meta["vocab_size"])
    root = run_dir / "checkpoints"
    if not root.is_dir():
        raise UsageError(f"{run_dir} has no checkpoints/ directory")
    model = spec.create(flags.seed)  # the structure; every weight is read from the checkpoint
    template: Any = model
    if "fsdp" in (flags.mesh or {}):
        # The checkpoint holds FSDP's flat shards; a one-device context reads them whole.
        template = shard(model, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",)))
    graphdef, params, rest = nnx.split(template, nnx.Param, ...)
    checkpointer = rc.Checkpointer(root, read_only=True)  # the run is never written
    like = rc.TrainingRecord(model=params, optimizer=None, accumulator=None, state=None)
    try:
        step = checkpointer.latest_step()
        if step is None:
            raise UsageError(f"{root} holds no committed checkpoint")
        # strict=False: the model part only, whatever optimizer the run trained with.
        restored = checkpointer.restore(like, step=step, strict=False).model
    except ValueError as e:
        raise UsageError(f"{root}: checkpoint {step}: {e}") from e
    finally:
        checkpointer.close()
    restored_model = nnx.merge(graphdef, restored, rest)
    if template is not model:
        _unshard_into(model, restored_model)
    else:
        model = restored_model
    model.scan_layers = False  # the file is the same either way; per layer is plainer
    # The documents of the corpus end in <|endoftext|>: generation stops there.
    model.config = dataclasses.replace(spec.config, eos_token_id=meta.get("eot_id"))
    rm.save_pretrained(model, out_dir, tokenizer=data_dir)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOT,
        "model_max_length": spec.config.max_position_embeddings,
    }
    (Path(out_dir) / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return {"out_dir": str(out_dir), "step": step, "config": model.config}


def _unshard_into(model: Any, sharded: Any) -> None:
    """Sets each of model's parameters to the whole value of sharded's ShardedParameter."""
    full = {}
    for prefix, node in nnx.iter_graph(sharded):
        if isinstance(node, rs.ShardedModule):
            for path, var in zip(node.paths, node.variables, strict=True):
                full[(*prefix, *path)] = var.get_value().unshard()
    for path, var in nnx.to_flat_state(nnx.state(model)):
        var.set_value(jnp.asarray(full[path], var.get_value().dtype))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.lm.export",
        usage="%(prog)s RUN_DIR OUT_DIR",
        description="Writes RUN_DIR's latest checkpoint weights and its tokenizer into OUT_DIR "
        "as a Hugging Face checkpoint folder, which transformers' AutoModelForCausalLM and "
        "AutoTokenizer load. The run is only read.",
    )
    p.add_argument("run_dir", help="the run directory, e.g. runs/<name>")
    p.add_argument("out_dir", help="the folder to write (created if need be)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The CLI; a bad run directory ends in argparse's ``error:`` line and exit code 2."""
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        with jax.numpy_dtype_promotion("strict"):
            result = export(args.run_dir, args.out_dir)
    except (UsageError, ValueError, TypeError) as e:
        parser.error(str(e))
    c = result["config"]
    print(
        f"exported {args.run_dir} (update {result['step']}, a {c.num_hidden_layers}x"
        f"{c.hidden_size} {c.model_type}, vocabulary {c.vocab_size}) to {args.out_dir}"
    )
    return result


if __name__ == "__main__":
    main()
