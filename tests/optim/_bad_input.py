"""One shape for the bad-input tables: a factory called with one bad argument must raise.

The catalog of user mistakes across a package (``tests/*/test_bad_inputs.py``), where a case is
any call rather than one factory's arguments, has its shape in ``tests/_catalog.py``.

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
