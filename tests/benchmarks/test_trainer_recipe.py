"""benchmarks/_trainer.py builds, from the library alone, what the trainer's flags build.

The benchmarks measure ``examples.lm.train``'s step without importing it; this checks that
the recipe they build is the trainer's, default and non-default, so the two cannot drift.
"""

import dataclasses
import doctest

import pytest

from benchmarks import _trainer
from benchmarks._trainer import trainer_recipe
from examples.lm.config import build_parser
from examples.lm.step import model_spec, optimizer_spec

EVERY_FLAG = ["--vocab-size=512", "--seq-len=64", "--d-model=64", "--n-layers=2", "--n-heads=2"]
EVERY_FLAG += ["--batch-size=8", "--compute-dtype=bfloat16", "--param-dtype=float32"]
EVERY_FLAG += ["--remat=full", "--scan-layers", "--deterministic"]


@pytest.mark.parametrize(
    "flags, fields",
    [
        ([], {}),
        (
            EVERY_FLAG,
            dict(
                vocab_size=512, seq_len=64, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=2, batch_size=8, compute_dtype="bfloat16",
                param_dtype="float32", remat="full", scan_layers=True, deterministic=True,
            ),
        ),
    ],
    ids=["defaults", "every-flag"],
)  # fmt: skip
def test_the_recipe_is_the_trainers(flags, fields):
    args = build_parser().parse_args([*flags, "--optimizer=adamw"])
    recipe = trainer_recipe(**fields)
    assert recipe.spec == model_spec(args)
    assert recipe.optimizer == optimizer_spec(args)
    assert recipe.batch_size == args.batch_size


def test_another_optimizer_keeps_the_trainers_hyperparameters():
    args = build_parser().parse_args(["--optimizer=muon"])
    assert trainer_recipe(optimizer="muon").optimizer == optimizer_spec(args)
    assert dataclasses.replace(trainer_recipe().optimizer, name="muon") == optimizer_spec(args)


def test_docstring_example():
    assert doctest.testmod(_trainer, raise_on_error=True).attempted > 0
