"""A benchmark of several sections, each a subcommand: ``python -m benchmarks.X [--json F]
SECTION [flags]`` runs one section, prints its table and writes its results as JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

# A section adds its subcommand to the parser it is given, with ``set_defaults(run=...)``:
# ``run(args)`` returns (results, printed table).
Section = Callable[[Any], None]


def run_sections(
    description: str, sections: Sequence[Section], argv: Sequence[str] | None
) -> dict[str, Any]:
    """Parses ``argv`` (None: the command line), runs the section it names, prints its table,
    writes ``--json``; returns the results."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", help="write the results to this file")
    subcommands = p.add_subparsers(dest="section", required=True)
    for add in sections:
        add(subcommands)
    args = p.parse_args(argv)
    r, table = args.run(args)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return r
