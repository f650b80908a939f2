"""``run_program``: how a training program's ``main`` ends, the same in every program.

A program's ``main`` parses its flags and calls its body; what can happen then is the same
for the trainer, the fine-tuner and what comes after them, and users rely on it in scripts:

* a bad flag or a run that cannot start (``usage_error``): argparse's one ``error:`` line, exit
  status 2;
* a run that goes wrong (``TrainingHalted``: a non-finite loss, NaN weights): an ``error:``
  line naming the update, exit status 1;
* a run interrupted and saved (``Interruptions``; the body's summary says so under
  ``"interrupted"``): exit status 128 + the signal's number, as shells report a signal;
* any of these on one of several processes: that process leaves at once (``fail_fast``).

The body runs under ``jax.numpy_dtype_promotion("strict")``: precision in a rudax program is
explicit, never promoted behind its back.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from typing import Any

import jax

from rudax.run._cli import UsageError
from rudax.run._distributed import fail_fast
from rudax.run._halt import TrainingHalted

__all__ = ["run_program"]


def run_program(
    parser: argparse.ArgumentParser,
    body: Callable[[], dict[str, Any]],
    *,
    usage_error: type[Exception] = UsageError,
) -> dict[str, Any]:
    """Runs ``body()`` and ends as the module docstring says; returns its summary.

    Args:
      parser: the program's parser, whose ``error`` prints the usage line.
      body: the run; returns a summary dict, with ``"interrupted"`` the name of the signal
        that stopped it (``Interruptions.signal_name``) or None / absent.
      usage_error: the exception type the body raises for a bad command line
        (``rudax.run.UsageError``).

    Example:
      >>> import argparse
      >>> import rudax.run as rr
      >>> parser = argparse.ArgumentParser(prog="demo")
      >>> rr.run_program(parser, lambda: {"step": 3}, usage_error=ValueError)
      {'step': 3}
    """
    with fail_fast():  # one of several processes that fails leaves at once
        try:
            with jax.numpy_dtype_promotion("strict"):
                summary = body()
        except usage_error as e:
            parser.error(str(e))
        except TrainingHalted as e:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            raise SystemExit(1) from None
    name = summary.get("interrupted")
    if name:  # saved; the status says it did not finish (another process's notice: SIGTERM)
        raise SystemExit(128 + getattr(signal, name, signal.SIGTERM))
    return summary
