"""The rudax version a checkpoint records, read once at import: a shadowed rudax fails here.

A folder named ``rudax`` without an ``__init__.py`` (a run directory, a checkout's parent, a
checkpoint root) is a namespace package to Python. Where the real rudax is found by a finder
that runs after the path scan (an editable install's), such a folder in the working directory
becomes ``import rudax`` while ``rudax.checkpoint`` still loads from the real tree: every
import works, and the first save failed in orbax's background thread when the meta item read
``rudax.__version__``, its traceback ending in an unrelated ``RuntimeError`` about futures. So
the version is read here, at import, and a rudax without one is an ImportError naming both
places.
"""

from __future__ import annotations

import os

import rudax


def _version() -> str:
    version = getattr(rudax, "__version__", None)
    if type(version) is str:
        return version
    real = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = [str(p) for p in getattr(rudax, "__path__", [])] or [repr(rudax)]
    raise ImportError(
        f"`import rudax` found a namespace package at {', '.join(found)} (a folder named "
        f"rudax without __init__.py, e.g. in the working directory), not rudax itself at "
        f"{real}: rename or move that folder, or run from another directory"
    )


RUDAX_VERSION = _version()
