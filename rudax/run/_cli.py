"""A program's command line: ``UsageError``, the ``--help`` formatter, and the flags typed.

Every rudax program (the trainer, the fine-tuner, the post-training programs) reports a bad
command line the same way (argparse's one ``error:`` line and exit status 2, through
``run_program``), shows each flag's default in ``--help`` the same way, and resumes a run
from the run's own flags except those typed again on the command line, which it needs to
tell from defaults: these three pieces, once.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rudax.sharding import parse_mesh

__all__ = ["HelpFormatter", "UsageError", "given_flags", "mesh_flag"]


class UsageError(Exception):
    """A flag value that only the machine or the disk can refute (a run directory that holds
    another program's run, a base without a tokenizer): ``run_program`` reports it as a bad
    flag, argparse's ``error:`` line and exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after a flag's help, unless the default is None or False (the help
    says what happens then) or the help names its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # `is`, not `in (None, False)`: 0 == False, and a default of 0 is worth showing.
        quiet = action.default is None or action.default is False or "(default:" in text
        if quiet:
            return text
        return super()._get_help_string(action) or text


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every flag that appears in ``argv``.

    A flag is its exact text or its text then ``=``: the parser must be built with
    ``allow_abbrev=False``, as a program that resumes runs is (``--lr`` must not be read as
    ``--lr-ratio``'s prefix).

    Example:
      >>> import argparse
      >>> from rudax.run import given_flags
      >>> parser = argparse.ArgumentParser(allow_abbrev=False)
      >>> _ = parser.add_argument("--steps", type=int, default=10)
      >>> _ = parser.add_argument("--lr", type=float, default=0.1)
      >>> sorted(given_flags(parser, ["--lr=0.5"]))
      ['lr']
    """
    typed = lambda option: any(a == option or a.startswith(option + "=") for a in argv)
    return {a.dest for a in parser._actions if any(map(typed, a.option_strings))}


def mesh_flag(text: str) -> dict[str, int]:
    """``--mesh``'s argparse ``type``: ``rudax.sharding.parse_mesh``, its ValueError as
    argparse's error (so the message, not "invalid value", reaches the user).

    Example:
      >>> import argparse
      >>> from rudax.run import mesh_flag
      >>> parser = argparse.ArgumentParser()
      >>> _ = parser.add_argument("--mesh", type=mesh_flag)
      >>> parser.parse_args(["--mesh", "fsdp=4,data=2"]).mesh
      {'data': 2, 'fsdp': 4}
    """
    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
