"""examples.finetune's configuration: one typed record of every flag, built once."""

import dataclasses

import pytest

from examples.finetune.config import PLACES, SESSION_FLAGS, FinetuneConfig, build_parser


def test_the_config_has_a_typed_field_for_every_flag_and_nothing_else():
    dests = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert {f.name for f in dataclasses.fields(FinetuneConfig)} == dests
    assert set(SESSION_FLAGS + PLACES) <= dests


def test_it_is_frozen_and_a_resumed_run_gets_a_new_one():
    config = FinetuneConfig.from_flags(build_parser().parse_args(["--rank", "4", "--stop-at", "3"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rank = 8  # type: ignore[misc]
    saved = FinetuneConfig.from_flags(build_parser().parse_args(["--rank", "4", "--lr", "0.5"]))
    resumed = config.resumed(saved.as_dict(), given={"stop_at"})
    # the run's flags (its lr), this session's (stop_at); the command line's record unchanged
    assert (resumed.lr, resumed.rank, resumed.stop_at) == (0.5, 4, 3)
    assert config.lr == FinetuneConfig.defaults().lr


def test_a_resumed_run_refuses_a_flag_that_contradicts_it():
    config = FinetuneConfig.from_flags(build_parser().parse_args(["--rank", "16"]))
    saved = FinetuneConfig.defaults().as_dict()
    with pytest.raises(ValueError, match=r"--rank 16 \(the run has 8\)"):
        config.resumed(saved, given={"rank"})
    # a place given again is this session's (the base may have moved); not given: the run's
    moved = FinetuneConfig.from_flags(build_parser().parse_args(["--base", "elsewhere"]))
    assert moved.resumed({**saved, "base": "hf/x"}, given={"base"}).base == "elsewhere"
    assert moved.resumed({**saved, "base": "hf/x"}, given=set()).base == "hf/x"
