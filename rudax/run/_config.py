"""``RunConfig``: a program's frozen, typed run configuration, built once from its flags, and
a resumed run's: its own flags with this session's on top.

A program's configuration is a frozen dataclass subclassing ``RunConfig`` with a field per
flag, and three class attributes: ``PARSER`` (its ``build_parser``), ``SESSION_FLAGS`` (the
flags of one session, which a resumed run may change) and ``PLACES`` (where its inputs are:
the run's by content, so a resumed run may find them elsewhere). Every other flag is the
run's: stored in its config.json, and a resumed run refuses a command line that contradicts
it. ``examples.finetune`` and the post-training programs build theirs on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Self

from rudax.run._cli import given_flags
from rudax.run._program import run_program

__all__ = ["RunConfig"]


class RunConfig:
    """The methods of a program's configuration dataclass (see the module docstring).

    Example:
      >>> import argparse, dataclasses
      >>> from rudax.run import RunConfig
      >>> def build_parser():
      ...     p = argparse.ArgumentParser()
      ...     p.add_argument("--lr", type=float, default=0.1)
      ...     p.add_argument("--stop-at", type=int)
      ...     return p
      >>> @dataclasses.dataclass(frozen=True)
      ... class Config(RunConfig):
      ...     PARSER = build_parser
      ...     SESSION_FLAGS = ("stop_at",)
      ...     lr: float
      ...     stop_at: int | None
      >>> run = Config.from_flags(build_parser().parse_args(["--lr", "0.5", "--stop-at", "3"]))
      >>> run.run_flags()  # what config.json holds as the run's
      {'lr': 0.5}
      >>> Config.defaults().resumed(run.as_dict(), given=set())  # --resume: the run's lr
      Config(lr=0.5, stop_at=None)
      >>> Config.defaults().resumed(run.as_dict(), given={"lr"})
      Traceback (most recent call last):
      ValueError: --resume: flags differ from the run's: --lr 0.1 (the run has 0.5)
    """

    # the program's build_parser: a function of no arguments returning its parser (Any: a
    # plain function stored on a class would read to a type checker as a method)
    PARSER: ClassVar[Any]
    SESSION_FLAGS: ClassVar[tuple[str, ...]] = ()
    PLACES: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def main(
        cls,
        body: Callable[[Self, set[str]], dict[str, Any]],
        argv: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """A program's ``main``: parses ``argv`` (None: ``sys.argv[1:]``) with ``PARSER`` and
        runs ``body(config, given)`` under ``rudax.run.run_program`` (exit statuses, fail
        fast, strict dtype promotion), ``given`` the flags typed on the command line
        (``rudax.run.given_flags``: what a resumed run checks against its own). Returns the
        body's summary.

        Example:
          >>> import argparse, dataclasses
          >>> from rudax.run import RunConfig
          >>> def build_parser():
          ...     p = argparse.ArgumentParser(prog="demo", allow_abbrev=False)
          ...     p.add_argument("--lr", type=float, default=0.1)
          ...     return p
          >>> @dataclasses.dataclass(frozen=True)
          ... class Config(RunConfig):
          ...     PARSER = build_parser
          ...     lr: float
          >>> Config.main(lambda config, given: {"lr": config.lr, "given": given}, ["--lr", "1"])
          {'lr': 1.0, 'given': {'lr'}}
        """
        parser = cls.PARSER()
        argv = sys.argv[1:] if argv is None else list(argv)
        config = cls.from_flags(parser.parse_args(argv))
        return run_program(parser, lambda: body(config, given_flags(parser, argv)))

    @classmethod
    def from_flags(cls, flags: argparse.Namespace | dict[str, Any]) -> Self:
        """The configuration of parsed flags (or of a run's saved ones, a dict)."""
        values = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags)
        return cls(**{f.name: values[f.name] for f in _fields(cls)})

    @classmethod
    def defaults(cls) -> Self:
        """Every flag at its default."""
        return cls.from_flags(cls.PARSER().parse_args([]))

    def as_dict(self) -> dict[str, Any]:
        """The flags as a JSON-able dict (config.json's)."""
        return {f.name: getattr(self, f.name) for f in _fields(type(self))}

    def run_flags(self) -> dict[str, Any]:
        """The flags that make the run what it is: neither a session's nor a place."""
        ours = self.SESSION_FLAGS + self.PLACES
        return {k: v for k, v in self.as_dict().items() if k not in ours}

    def resumed(self, saved: dict[str, Any], given: set[str]) -> Self:
        """--resume: the run's flags (``saved``, its config.json), with this session's flags
        and the places given on this command line on top. A flag ``given`` here that
        contradicts the run is a ValueError naming it and both values."""
        ours = self.SESSION_FLAGS + self.PLACES
        conflicts = [
            f"--{k.replace('_', '-')} {getattr(self, k)!r} (the run has {saved.get(k)!r})"
            for k in sorted(given)
            if k not in ours and k in saved and saved[k] != getattr(self, k)
        ]
        if conflicts:
            raise ValueError("--resume: flags differ from the run's: " + "; ".join(conflicts))
        merged = {k: saved.get(k, v) for k, v in self.defaults().as_dict().items()}
        merged |= {k: getattr(self, k) for k in self.SESSION_FLAGS}
        merged |= {k: getattr(self, k) for k in self.PLACES if k in given}
        return self.from_flags(merged)


def _fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass to be a RunConfig (@dataclass)")
    return dataclasses.fields(cls)
