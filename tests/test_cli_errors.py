"""A command-line mistake prints the one-line usage and the error, not every flag (issue 29:
about 30 lines of usage text came before each error)."""

import contextlib
import io

import pytest

from examples.dpo.train import main as dpo
from examples.finetune.train import main as finetune
from examples.grpo.train import main as grpo
from examples.lm.plan import main as plan
from examples.lm.train import main as train


@pytest.mark.parametrize(
    ("main", "argv", "error"),
    [
        (train, ["--lr", "x"], "python -m examples.lm.train: error: argument --lr: expected"),
        (finetune, ["--rank", "x"], "python -m examples.finetune: error: argument --rank"),
        (plan, ["--headroom", "2"], "python -m examples.lm.plan: error: argument --headroom"),
        (dpo, ["--beta", "x"], "python -m examples.dpo: error: argument --beta"),
        (grpo, ["--num-samples", "x"], "python -m examples.grpo: error: argument --num-samples"),
    ],
    ids=["train", "finetune", "plan", "dpo", "grpo"],
)
def test_an_error_follows_one_line_of_usage(main, argv, error):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main(argv)
    lines = err.getvalue().strip().splitlines()
    assert exit_.value.code == 2
    assert len(lines) == 2, lines
    assert lines[0].startswith("usage: python -m ") and "--help lists them" in lines[0]
    assert lines[1].startswith(error), lines[1]
