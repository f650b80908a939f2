"""The bad-input catalog's one shape: a named call that must raise a named, explained error.

Each package's ``test_bad_inputs.py`` lists its cases and builds its test from them::

    CASES = [
        Bad("linear-in-features-0", lambda: rl.Linear(0, 3, rngs=nnx.Rngs(0)),
            ValueError, r"in_features must be a positive int, got in_features=0"),
    ]
    test_bad_input = catalog(CASES)

``call()`` must raise ``error`` with a message that ``match`` (a regular expression) finds:
for rudax that is the argument's name, the pytree path and the value, so the message alone
tells the user what to fix. A ``Holds`` case is a mistake rudax now handles instead of refusing
(weights loaded after ``tx.init``): ``check()`` must run and its own assertions hold. A fault
that needs a fixture (a second process, a full disk) is a test of its own beside the table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pytest


class Bad(NamedTuple):
    """One catalog case."""

    id: str  # the test id: what the user did wrong, in a few words
    call: Callable[[], Any]  # makes the mistake
    error: type[Exception]  # the exception type it must raise
    match: str  # a regular expression the message must contain (re.search)
    marks: Any = ()  # pytest marks of this case, e.g. pytest.mark.slow


class Holds(NamedTuple):
    """One catalog case that must not raise: the mistake is handled, and check() asserts how."""

    id: str  # the test id: what the user did, in a few words
    check: Callable[[], Any]  # makes the mistake and asserts the right result
    marks: Any = ()  # pytest marks of this case, e.g. pytest.mark.slow


def catalog(cases: Sequence[Bad | Holds]) -> Callable[[Bad | Holds], None]:
    """A test parametrized over ``cases``; the ids must be unique (xdist compares them)."""
    ids = [case.id for case in cases]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise ValueError(f"catalog ids must be unique, got duplicates {duplicated}")

    params = [pytest.param(case, id=case.id, marks=case.marks) for case in cases]

    @pytest.mark.parametrize("case", params)
    def test(case: Bad | Holds) -> None:
        if isinstance(case, Holds):
            case.check()
            return
        with pytest.raises(case.error, match=case.match):
            case.call()

    return test
