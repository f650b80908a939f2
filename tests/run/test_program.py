"""rudax.run.run_program: how every program's main ends (exit statuses 2, 1, 128 + signal)."""

import argparse

import jax.numpy as jnp
import pytest

import rudax.run as rr


class Usage(Exception):
    pass


def _parser():
    return argparse.ArgumentParser(prog="demo")


def test_a_summary_is_returned_under_strict_promotion():
    assert rr.run_program(_parser(), lambda: {"step": 3}, usage_error=Usage) == {"step": 3}

    def promotes():  # int32 + float32 under strict promotion raises
        jnp.ones(2, jnp.int32) + jnp.ones(2, jnp.float32)
        return {}

    with pytest.raises(Exception, match="promot"):
        rr.run_program(_parser(), promotes, usage_error=Usage)


def test_a_usage_error_is_one_error_line_and_status_2(capsys):
    def body():
        raise Usage("--steps must be positive, got 0")

    with pytest.raises(SystemExit) as e:
        rr.run_program(_parser(), body, usage_error=Usage)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "demo: error: --steps must be positive, got 0"
    )


def test_a_halted_run_is_status_1(capsys):
    def body():
        raise rr.TrainingHalted("update 4: the training loss is nan")

    with pytest.raises(SystemExit) as e:
        rr.run_program(_parser(), body, usage_error=Usage)
    assert e.value.code == 1
    assert capsys.readouterr().err == "demo: error: update 4: the training loss is nan\n"


@pytest.mark.parametrize(
    ("name", "status"), [("SIGINT", 130), ("SIGTERM", 143), ("a preemption notice", 143)]
)
def test_an_interrupted_run_is_128_plus_its_signal(name, status):
    with pytest.raises(SystemExit) as e:
        rr.run_program(_parser(), lambda: {"interrupted": name}, usage_error=Usage)
    assert e.value.code == status
