"""One shape for the bad-input tables: a factory called with one bad argument must raise.

``rejects`` builds a table over one factory's arguments; ``catalog`` builds the issue-11
catalog of user mistakes across a package (``tests/optim/test_bad_inputs.py``), where each case
is any call: ``bad(id, trigger, error, match)`` must raise, ``holds(id, check)`` must run and
its assertions hold (a mistake rudax now handles instead of refusing, such as weights loaded
after ``tx.init``).

A test module lists its own cases and builds its test from them::

    test_bad_hyperparameters = rejects(
        ro.sgd, [({"momentum": 1.0}, ValueError, r"momentum=1\\.0")], learning_rate=0.1
    )

Each case is ``(kwargs, error, match)``: ``factory(**{**defaults, **kwargs})`` must raise
``error`` with a message that ``match`` (a regular expression) finds, which for rudax names the
argument and shows its value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

Case = tuple[dict[str, Any], type[Exception], str]


def _show(value: Any) -> str:
    """A short name for a value, the same in every process (xdist compares test ids)."""
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, tuple | list):
        return "(" + ",".join(_show(v) for v in value) + ")"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"array{tuple(value.shape)}"
    return getattr(value, "__name__", type(value).__name__)


def _case_id(kwargs: dict[str, Any]) -> str:
    text = ",".join(f"{k}={_show(v)}" for k, v in kwargs.items())
    return text if len(text) <= 60 else text[:57] + "..."


def rejects(
    factories: Callable[..., Any] | Sequence[Callable[..., Any]],
    cases: Sequence[Case],
    **defaults: Any,
) -> Callable[..., None]:
    """A test, parametrized over factories and cases, that each bad call raises as expected."""
    if callable(factories):
        factories = [factories]

    @pytest.mark.parametrize("factory", factories, ids=lambda f: f.__name__)
    @pytest.mark.parametrize(
        "kwargs, error, match", [pytest.param(*case, id=_case_id(case[0])) for case in cases]
    )
    def test(factory: Callable[..., Any], kwargs: dict, error: type[Exception], match: str):
        with pytest.raises(error, match=match):
            factory(**{**defaults, **kwargs})

    return test


def bad(case_id: str, trigger: Callable[[], Any], error: type[Exception], match: str) -> Any:
    """A catalog case: ``trigger()`` raises ``error`` with a message that ``match`` finds."""
    return pytest.param(trigger, error, match, id=case_id)


def holds(case_id: str, check: Callable[[], Any]) -> Any:
    """A catalog case: ``check()`` runs without an error and its own assertions hold."""
    return pytest.param(check, None, None, id=case_id)


def catalog(cases: Sequence[Any]) -> Callable[..., None]:
    """A test parametrized over ``bad`` and ``holds`` cases (ids must be unique)."""
    ids = [case.id for case in cases]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"catalog case ids must be unique, repeated: {duplicates}")

    @pytest.mark.parametrize("trigger, error, match", cases)
    def test(trigger: Callable[[], Any], error: type[Exception] | None, match: str | None):
        if error is None:
            trigger()
        else:
            with pytest.raises(error, match=match):
                trigger()

    return test
