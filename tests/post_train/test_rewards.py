"""rudax.post_train.compute_rewards: TRL's reward-function convention (keywords, the rows'
columns, None where a function does not apply, weights, nansum) against the sum written
plainly; each bad answer a RewardError naming the function and the completion (a raising
function's failing completion found); the built-in rewards; load_reward's errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rudax.post_train import (
    RewardError,
    compute_rewards,
    exact_match_reward,
    format_reward,
    load_reward,
)

PROMPTS = ["1+1=", "1+1=", "2+3=", "2+3="]
COMPLETIONS = [" 2", "3", "<a>5</a>", " 5 "]
ANSWERS = ["2", "2", "5", "5"]


def length_penalty(completions, **kwargs):
    """A TRL-style function that takes only what it needs and ignores the rest."""
    return [-0.1 * len(c) for c in completions]


def only_second_task(prompts, completions, task, **kwargs):
    """None where it does not apply (TRL's multi-task convention)."""
    return [1.0 if t == "b" else None for t in task]


def test_the_weighted_nansum_of_trls_convention():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, task):
        seen.update(prompts=prompts, ids=completion_ids, answer=answer, task=task)
        return [0.5] * len(completions)

    ids = [[1], [2, 3], [4], [5, 6]]
    funcs = [exact_match_reward, length_penalty, only_second_task, spy]
    weights = [1.0, 0.5, 2.0, -1.0]
    columns = {"answer": ANSWERS, "task": ["a", "a", "b", "b"]}
    out = compute_rewards(
        funcs, prompts=PROMPTS, completions=COMPLETIONS, completion_ids=ids, columns=columns,
        weights=weights,
    )  # fmt: skip
    assert seen == {"prompts": PROMPTS, "ids": ids, "answer": ANSWERS, "task": columns["task"]}
    assert out.names == ("exact_match_reward", "length_penalty", "only_second_task", "spy")
    table = [
        [1.0, -0.1 * 2, math.nan, 0.5],
        [0.0, -0.1 * 1, math.nan, 0.5],
        [0.0, -0.1 * 8, 1.0, 0.5],
        [1.0, -0.1 * 3, 1.0, 0.5],
    ]
    np.testing.assert_allclose(out.per_function, np.float32(table))
    want = [sum(w * r for w, r in zip(weights, row, strict=True) if not math.isnan(r))
            for row in table]  # fmt: skip
    np.testing.assert_allclose(out.total, np.float32(want), rtol=1e-6)
    assert out.total.dtype == np.float32


def _raises_on_three(completions, **kwargs):
    return [1.0 / (c.strip() != "5") if c.startswith(" ") else 0.0 for c in completions]


@pytest.mark.parametrize(
    ("func", "message"),
    [
        (_raises_on_three, r"'_raises_on_three' raised ZeroDivisionError: .* on completion 3 "
                           r"\(prompt '2\+3=', completion ' 5 '\)"),
        (lambda completions, **k: [1.0] * 3, r"'<lambda>' returned 3 rewards for 4 completions"),
        (lambda completions, **k: "1.0", r"returned '1.0', not a list of 4 rewards"),
        (lambda completions, **k: [1.0, float("nan"), 1.0, 1.0],
         r"returned nan for completion 1 \(prompt '1\+1=', completion '3'\)"),
        (lambda completions, **k: [1.0, 1.0, math.inf, 1.0], r"returned inf for completion 2"),
        (lambda completions, **k: [1.0, True, 1.0, 1.0], r"returned True for completion 1"),
        (lambda completions, **k: [1.0, 1.0, 1.0, "1"], r"returned '1' for completion 3"),
        (lambda completions, **k: [1.0, None, 1.0, 1.0],
         r"no reward function scored completion 1 \(prompt '1\+1=', completion '3'\)"),
    ],
)  # fmt: skip
def test_each_bad_answer_names_the_function_and_the_completion(func, message):
    with pytest.raises(RewardError, match=message):
        compute_rewards([func], prompts=PROMPTS, completions=COMPLETIONS)


def test_bad_arguments():
    with pytest.raises(ValueError, match="reward_funcs is empty"):
        compute_rewards([], prompts=PROMPTS, completions=COMPLETIONS)
    with pytest.raises(TypeError, match="not callable"):
        compute_rewards(["exact"], prompts=PROMPTS, completions=COMPLETIONS)
    with pytest.raises(ValueError, match=r"columns\['answer'\] has 2 entries, completions has 4"):
        compute_rewards(
            [exact_match_reward], prompts=PROMPTS, completions=COMPLETIONS,
            columns={"answer": ["2", "2"]},
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"columns may not be named \['prompts'\]"):
        compute_rewards(
            [length_penalty], prompts=PROMPTS, completions=COMPLETIONS, columns={"prompts": PROMPTS}
        )
    with pytest.raises(ValueError, match="weights must be 1 finite numbers"):
        compute_rewards([length_penalty], prompts=PROMPTS, completions=COMPLETIONS, weights=[1, 2])


def test_built_in_rewards_read_text_and_chat_completions():
    chats = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    for completions in (COMPLETIONS, chats):
        assert exact_match_reward(completions, answer=ANSWERS) == [1.0, 0.0, 0.0, 1.0]
        tagged = format_reward(r"<a>\d+</a>")
        assert tagged(completions=completions) == [0.0, 0.0, 1.0, 0.0]
    assert format_reward(r"a.b")(completions=["a\nb"]) == [1.0]  # . matches a newline
    assert format_reward(r"x").__name__ == "format_reward"


def test_load_reward_names_what_is_wrong():
    assert load_reward("rudax.post_train:exact_match_reward") is exact_match_reward
    assert load_reward(f"{__name__}:length_penalty") is length_penalty
    for spec, message in [
        ("exact_match_reward", "named as module:function"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("rudax.post_train:nothing", "has no 'nothing'"),
        ("rudax.post_train:IGNORE_INDEX", "'IGNORE_INDEX' is a int, not a function"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_reward(spec)
