"""The command line's own plumbing: ``UsageError``, the help formatter, and which flags a
user typed (a resumed run takes the run's flags, save those given again)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


class UsageError(Exception):
    """A flag value that only the machine or the disk can refute; reported like a bad flag."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after a flag's help, unless the default is None or False (the help
    says what happens then) or the help names its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # `is`, not `in (None, False)`: 0 == False, and a default of 0 is worth showing.
        quiet = action.default is None or action.default is False or "(default:" in text
        return text if quiet else super()._get_help_string(action)


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every flag that appears in ``argv`` (the parser allows no
    abbreviations, so a flag is its exact text, or its text then ``=``)."""
    typed = lambda option: any(a == option or a.startswith(option + "=") for a in argv)
    return {a.dest for a in parser._actions if any(map(typed, a.option_strings))}
