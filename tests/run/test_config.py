"""rudax.run.RunConfig: a run's flags once, and a resumed run's own flags with the session's
on top."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from rudax.run import RunConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--data")
    p.add_argument("--stop-at", type=int)
    return p


@dataclasses.dataclass(frozen=True)
class Config(RunConfig):
    PARSER = build_parser
    SESSION_FLAGS = ("stop_at",)
    PLACES = ("data",)
    lr: float
    steps: int
    data: str | None
    stop_at: int | None


def flags(*argv: str) -> Config:
    return Config.from_flags(build_parser().parse_args(list(argv)))


def test_a_resumed_run_keeps_its_flags_takes_the_sessions_and_a_moved_place():
    run = flags("--lr", "0.5", "--data", "a.jsonl", "--stop-at", "3")
    assert run.run_flags() == {"lr": 0.5, "steps": 10}
    saved = run.as_dict()
    # a new session: no flags but where to stop and where the data is now
    session = flags("--stop-at", "7", "--data", "b.jsonl")
    resumed = session.resumed(saved, given={"stop_at", "data"})
    assert resumed == Config(lr=0.5, steps=10, data="b.jsonl", stop_at=7)
    # the place not given: the run's
    assert flags().resumed(saved, given=set()).data == "a.jsonl"


def test_a_flag_that_contradicts_the_run_is_named_with_both_values():
    saved = flags("--lr", "0.5").as_dict()
    with pytest.raises(ValueError, match=r"--steps 20 \(the run has 10\)"):
        flags("--steps", "20").resumed(saved, given={"steps"})
    # the same value typed again is no contradiction
    assert flags("--lr", "0.5").resumed(saved, given={"lr"}).lr == 0.5


def test_a_flag_added_since_the_run_takes_its_default():
    saved = {k: v for k, v in flags("--lr", "0.5").as_dict().items() if k != "steps"}
    assert flags().resumed(saved, given=set()) == Config(0.5, 10, None, None)


def test_a_subclass_that_is_no_dataclass_is_named():
    class Plain(RunConfig):
        PARSER = build_parser

    with pytest.raises(TypeError, match="Plain must be a dataclass"):
        Plain.defaults()
