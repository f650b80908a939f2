"""Rewards for GRPO: user functions called as TRL calls them, their answers checked.

A reward function is TRL's: called with keywords ``prompts``, ``completions`` and
``completion_ids`` (one entry per completion, a prompt repeated for each of its G
completions) and every other field of the data rows as a list aligned with them (a row's
``answer`` as ``answer=[...]``), it returns one float per completion, or None where it does
not apply (a math reward on a code task). A function written for TRL's ``GRPOTrainer`` runs
here unchanged, as long as it does not read TRL's own ``trainer_state``, ``log_extra`` or
``log_metric``.

Where TRL converts and moves on, ``compute_rewards`` stops with a ``RewardError`` naming the
function and the completion: a function that raises (called again one completion at a time
to find which), returns the wrong count or a non-number, NaN or infinity; and a completion
that no function scores (every one returned None), whose advantage would be undefined.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import numpy as np

__all__ = [
    "RewardError",
    "Rewards",
    "compute_rewards",
    "exact_match_reward",
    "format_reward",
    "load_reward",
]

RewardFunction = Callable[..., Sequence[float | None]]


class RewardError(ValueError):
    """A reward function failed or answered wrongly; the message names it and the completion."""


class Rewards(NamedTuple):
    """What ``compute_rewards`` returns.

    Attributes:
      total: ``[N]`` float32, each completion's weighted sum over the functions that scored
        it (TRL's ``nansum(rewards_per_func * weights)``).
      per_function: ``[N, R]`` float32, each function's reward, NaN where it returned None.
      names: the R functions' names, in order.
    """

    total: np.ndarray
    per_function: np.ndarray
    names: tuple[str, ...]


def compute_rewards(
    reward_funcs: Sequence[RewardFunction],
    *,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]] | None = None,
    columns: Mapping[str, Sequence[Any]] | None = None,
    weights: Sequence[float] | None = None,
) -> Rewards:
    """Calls each reward function on the N completions and checks what it returns.

    Args:
      reward_funcs: R >= 1 callables, TRL's reward functions (see the module docstring).
      prompts: ``[N]`` each completion's prompt (text, or TRL's chat messages).
      completions: ``[N]`` the completions (text, or chat messages).
      completion_ids: ``[N]`` their token ids, or None.
      columns: the data rows' other fields, each a length-N sequence (``{"answer": [...]}``).
      weights: R reward weights (TRL's ``reward_weights``); None for 1 each.

    Returns:
      ``Rewards``: the weighted total per completion and each function's rewards.

    Raises:
      RewardError: a function raised, returned something other than N numbers or None, a
        NaN or an infinity; or no function scored some completion. The message names the
        function, the completion's index and its prompt and completion (shortened).
      ValueError: the arguments' lengths disagree, or there are no functions.

    Example:
      >>> from rudax.post_train import compute_rewards, exact_match_reward
      >>> out = compute_rewards([exact_match_reward], prompts=["2+2=", "2+2="],
      ...                       completions=[" 4", "5"], columns={"answer": ["4", "4"]})
      >>> out.total.tolist(), out.names
      ([1.0, 0.0], ('exact_match_reward',))
    """
    funcs = list(reward_funcs)
    if not funcs:
        raise ValueError("reward_funcs is empty: give at least one reward function")
    for f in funcs:
        if not callable(f):
            raise TypeError(f"reward_funcs holds {f!r}, which is not callable")
    n = len(completions)
    lengths = {"prompts": len(prompts)}
    if completion_ids is not None:
        lengths["completion_ids"] = len(completion_ids)
    cols = dict(columns or {})
    lengths |= {f"columns[{k!r}]": len(v) for k, v in cols.items()}
    for name, length in lengths.items():
        if length != n:
            raise ValueError(
                f"{name} has {length} entries, completions has {n}: one per completion"
            )
    reserved = {"prompts", "completions", "completion_ids"} & cols.keys()
    if reserved:
        raise ValueError(f"columns may not be named {sorted(reserved)}: the call's own keywords")
    w = np.ones(len(funcs)) if weights is None else np.asarray(weights, np.float64)
    if w.shape != (len(funcs),) or not np.isfinite(w).all():
        raise ValueError(
            f"weights must be {len(funcs)} finite numbers, one per function, got {weights!r}"
        )

    names = tuple(_name(f) for f in funcs)
    kwargs = {"prompts": list(prompts), "completions": list(completions), **cols}
    kwargs["completion_ids"] = None if completion_ids is None else list(completion_ids)
    per_function = np.full((n, len(funcs)), np.nan)
    for j, (f, name) in enumerate(zip(funcs, names, strict=True)):
        try:
            out = f(**kwargs)
        except Exception as e:
            raise _which_row_raises(f, name, kwargs, n, e) from e
        if isinstance(out, str | bytes) or not isinstance(out, Sequence | np.ndarray):
            raise RewardError(
                f"reward function {name!r} returned {_short(out)}, not a list of {n} rewards "
                "(one float or None per completion)"
            )
        if len(out) != n:
            raise RewardError(
                f"reward function {name!r} returned {len(out)} rewards for {n} completions: "
                "one per completion (a prompt's G completions each get their own)"
            )
        for i, value in enumerate(out):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise RewardError(
                    f"reward function {name!r} returned {_short(value)} for completion {i} "
                    f"{_where(kwargs, i)}: a reward is a float, or None where it does not apply"
                )
            if not math.isfinite(value):
                raise RewardError(
                    f"reward function {name!r} returned {value} for completion {i} "
                    f"{_where(kwargs, i)}: return a finite reward, or None where it does not apply"
                )
            per_function[i, j] = float(value)
    unscored = np.isnan(per_function).all(axis=1)
    if unscored.any():
        i = int(np.flatnonzero(unscored)[0])
        raise RewardError(
            f"no reward function scored completion {i} {_where(kwargs, i)} (each of "
            f"{list(names)} returned None): its group's advantages would be undefined; make one "
            "of them return a reward for it"
        )
    total = np.nansum(per_function * w, axis=1)
    return Rewards(total.astype(np.float32), per_function.astype(np.float32), names)


def exact_match_reward(
    completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any
) -> list[float]:
    """1.0 where a completion, stripped of surrounding whitespace, is the row's ``answer``
    (as text, stripped), else 0.0. A chat completion's first message's content is read.

    Example:
      >>> exact_match_reward([" 12\\n", "13"], answer=[12, 12])
      [1.0, 0.0]
    """
    return [
        float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)
    ]


def format_reward(pattern: str) -> RewardFunction:
    """A reward function: 1.0 where the whole completion matches ``pattern`` (``re.fullmatch``,
    ``.`` matching newlines too), else 0.0.

    Example:
      >>> reward = format_reward(r"<answer>\\d+</answer>")
      >>> reward(completions=["<answer>12</answer>", "12"])
      [1.0, 0.0]
    """
    regex = re.compile(pattern, re.DOTALL)

    def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return [float(regex.fullmatch(_text(c)) is not None) for c in completions]

    return format_reward


def load_reward(spec: str) -> RewardFunction:
    """The reward function a command line names: ``"package.module:function"``.

    Raises:
      ValueError: ``spec`` is not ``module:function``, the module cannot be imported, it has
        no such attribute, or the attribute is not callable; the message says which.

    Example:
      >>> load_reward("rudax.post_train:exact_match_reward").__name__
      'exact_match_reward'
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"a reward is named as module:function (e.g. my_rewards:correct), got {spec!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import {module_name!r} ({e})") from e
    try:
        f = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no {attr!r}") from None
    if not callable(f):
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(f).__name__}, not a function")
    return cast(RewardFunction, f)  # what it returns is checked when it is called


def _which_row_raises(
    f: RewardFunction, name: str, kwargs: dict[str, Any], n: int, error: Exception
) -> RewardError:
    """The error to raise for a function that raised on the batch: it is called again on one
    completion at a time, and the first that raises is named."""
    for i in range(n):
        one = {k: None if v is None else v[i : i + 1] for k, v in kwargs.items()}
        try:
            f(**one)
        except Exception as e:
            return RewardError(
                f"reward function {name!r} raised {type(e).__name__}: {e} on completion {i} "
                f"{_where(kwargs, i)}"
            )
    return RewardError(
        f"reward function {name!r} raised {type(error).__name__}: {error} on the batch of {n} "
        "completions (on no single one of them)"
    )


def _name(f: Any) -> str:
    """TRL's name for a reward function: its ``__name__`` (a callable object's class name)."""
    return getattr(f, "__name__", None) or type(f).__name__


def _text(completion: Any) -> str:
    """A completion's text: itself, or a chat completion's first message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[0], Mapping):
        return str(completion[0].get("content", ""))
    return str(completion)


def _where(kwargs: dict[str, Any], i: int) -> str:
    return f"(prompt {_short(kwargs['prompts'][i])}, completion {_short(kwargs['completions'][i])})"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
