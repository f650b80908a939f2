"""A run's configuration (optimizer hyperparameters, schedule) as JSON data, checked on restore.

An optax transformation keeps its hyperparameters in closures, so a checkpoint cannot read them
off the optimizer state: a record carries them explicitly as ``config``, a nested dict/list of
``bool``/``int``/``float``/``str``/None. It is written into the checkpoint's JSON metadata item
and compared, path by path, with the template's config on restore.

JSON holds every such value exactly: a float is written as its shortest ``repr``, which reads
back to the same double, and a Python int of any size is written in full. NaN and infinities
are refused, since standard JSON has no spelling for them. Tuples are refused too (JSON would
give them back as lists), as are dict keys that are not strings and subclasses such as NumPy
scalars or ``IntEnum`` members, whose JSON text is not their value's.

Two values are equal when their JSON text is: ``1`` and ``1.0`` differ, as do ``True`` and
``1``, so a changed type is reported, not waved through.
"""

from __future__ import annotations

import json
import math
from typing import Any

_SCALARS = (bool, int, float, str)


def check_config(config: Any, *, name: str = "config") -> dict[str, Any] | None:
    """A deep copy of config after checking that it is JSON data; None passes.

    Raises a TypeError naming ``config<path>`` and the value for anything but a dict at the
    top, dicts with str keys, lists, and exact ``bool``/``int``/``float``/``str``/None leaves;
    a ValueError for a NaN or infinite float.
    """
    if config is None:
        return None
    if type(config) is not dict:
        raise TypeError(
            f"{name} must be a dict of JSON data (or None), got {type(config).__name__}: "
            f"{name}={config!r}"
        )
    return _copy(config, name)


def _copy(value: Any, where: str) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        if not math.isfinite(value):
            raise ValueError(
                f"{where} must be a finite float (JSON has no NaN or inf), got {value!r}"
            )
        return value
    if kind is dict:
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(
                    f"{where} has a key that is not a str: {key!r} ({type(key).__name__}); "
                    "JSON object keys are strings"
                )
            out[key] = _copy(item, f"{where}[{key!r}]")
        return out
    if kind is list:
        return [_copy(item, f"{where}[{i}]") for i, item in enumerate(value)]
    hint = " (use a list)" if kind is tuple else ""
    raise TypeError(
        f"{where} must be a dict, list, bool, int, float, str or None{hint}, "
        f"got {kind.__name__}: {value!r}"
    )


def config_difference(saved: Any, template: Any, where: str = "config") -> str | None:
    """The first place where two configs differ, as a message naming the path; None if equal.

    Dict keys are visited in the saved config's order, then the template's extra keys; a key
    present on one side only is named with the value it has there.
    """
    if type(saved) is dict and type(template) is dict:
        for key, value in saved.items():
            if key not in template:
                return f"{where}[{key!r}] is only in the saved config (saved {value!r})"
            found = config_difference(value, template[key], f"{where}[{key!r}]")
            if found:
                return found
        for key, value in template.items():
            if key not in saved:
                return f"{where}[{key!r}] is only in the template's config (template {value!r})"
        return None
    if type(saved) is list and type(template) is list:
        for i, (s, t) in enumerate(zip(saved, template, strict=False)):
            found = config_difference(s, t, f"{where}[{i}]")
            if found:
                return found
        if len(saved) != len(template):
            n = min(len(saved), len(template))
            side, extra = ("saved", saved) if len(saved) > n else ("template's", template)
            return (
                f"{where}[{n}] is only in the {side} config ({extra[n]!r}; "
                f"{len(saved)} saved items, {len(template)} in the template)"
            )
        return None
    if _text(saved) != _text(template):
        return f"{where}: saved {saved!r}, template {template!r}"
    return None


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=False)
