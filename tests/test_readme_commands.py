"""Every command of the README's shell blocks, run in the README's order, as a new user would.

A user copies the commands one after the other into one directory; one that fails as written,
or that needs an earlier one to have gone differently (the fine-tuner's run named like the
trainer's, a --resume-step that --keep had already deleted), is a bug in the README or in the
program. Each command runs as written, in a subprocess whose working directory is the
user's, shortened with flags only: a tiny model and corpus, a few updates (appended flags win
over the README's, as argparse takes the last). The commands that cannot run here are named
in SKIPPED with the reason.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._launch import repo_env
from tests.lm.conftest import write_corpus

ROOT = Path(__file__).resolve().parents[1]

# What a command starting so cannot do here, and why.
SKIPPED = {
    "python -m pip": "installing is .ci/run's first step, done already",
    "python -m pytest": "the test suite itself",
    "srun": "needs a SLURM cluster",
    "JAX_LOCAL_DEVICE_IDS=": "needs a SLURM cluster",
}

# A tiny model (widths multiples of 64, as NF4's blocks need), a few updates, a tiny corpus
# (written below as texts/; the README's --data wins where it names one).
LM = [
    *("--vocab-size", "300", "--seq-len", "256", "--d-model", "64", "--n-layers", "1"),
    *("--n-heads", "2", "--batch-size", "8", "--steps", "6", "--warmup", "1"),
    *("--eval-every", "3", "--eval-batches", "1", "--checkpoint-every", "2"),
]
# The README's run lengths scaled down by 25: --stop-at 100 of 150, checkpoints every 50.
LM_SCALED = {"--stop-at": "4", "--resume-step": "4"}
FINETUNE = [
    *("--steps", "2", "--warmup", "1", "--batch-size", "8", "--seq-len", "256"),
    *("--eval-every", "2", "--eval-batches", "1", "--checkpoint-every", "1"),
    *("--sample-tokens", "4"),
]
FINETUNE_SCALED = {"--stop-at": "1"}
# Two updates of the post-training programs (their held-out sets answered before and after).
POST_TRAIN = {
    "examples.grpo": [
        *("--steps", "2", "--eval-every", "2", "--checkpoint-every", "2"),
        *("--batch-size", "2", "--num-samples", "2"),
    ],
    "examples.dpo": [
        *("--steps", "2", "--eval-every", "2", "--checkpoint-every", "2", "--batch-size", "4"),
    ],
}


def readme_commands() -> list[list[str]]:
    """The README's shell commands in order: continuation lines joined, comments dropped,
    ``a && b`` as two commands."""
    text = (ROOT / "README.md").read_text()
    commands, inside = [], False
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside:
            lines.append(line)
    joined = "\n".join(lines).replace("\\\n", " ")
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:cut])
            words = words[cut + 1 :]
    return commands


def _skip_reason(command: list[str]) -> str | None:
    text = shlex.join(command)
    return next((why for start, why in SKIPPED.items() if text.startswith(start)), None)


def _shortened(command: list[str]) -> list[str]:
    """The command with the short run's flags appended to its program's arguments."""
    if "examples.lm.train" in command:
        extra = [*LM, *(["--data", "texts"] if "--data" not in command else [])]
        scaled = LM_SCALED
    elif "examples.finetune" in command:
        extra, scaled = FINETUNE, FINETUNE_SCALED
    elif command[:2] == ["python", "-m"] and command[2] in POST_TRAIN:
        extra, scaled = POST_TRAIN[command[2]], {}
    else:
        return command
    for flag, value in scaled.items():
        if flag in command:
            extra = [*extra, flag, value]
    return [*command, *extra]


def _user_directory(root: Path) -> Path:
    """A clone's working directory: the repository's files (linked, so that runs/, data/ and
    hf/ are written here, not into the repository), and the files the README's placeholders
    name, made as a user would make their own."""
    for entry in ("examples", "rudax", "benchmarks", "pyproject.toml", "README.md"):
        (root / entry).symlink_to(ROOT / entry)
    write_corpus(root / "texts")
    # --data corpus.jsonl: text records
    texts = [p.read_text() for p in sorted((root / "texts").iterdir())]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root


@pytest.mark.long(4)  # minutes: started first (tests/conftest.py)
def test_readme_commands_run_in_order_as_written(tmp_path):
    commands = readme_commands()
    assert len(commands) > 20, commands  # the parse found the README's blocks
    cwd = _user_directory(tmp_path)
    env = repo_env()
    env.pop("XLA_FLAGS", None)  # a user's shell: the programs simulate their own devices
    env["PYTHONUNBUFFERED"] = "1"
    ran, timings = [], []
    for command in commands:
        if _skip_reason(command):
            continue
        if command[:3] == ["python", "-m", "examples.finetune"] and "path/to/llama" in command:
            # the README's placeholders for your own model and data: the exported one stands in
            (cwd / "path" / "to").mkdir(parents=True, exist_ok=True)
            if not (cwd / "path" / "to" / "llama").exists():
                (cwd / "path" / "to" / "llama").symlink_to(cwd / "hf" / "base")
            for name, rows in (("train.jsonl", range(48)), ("val.jsonl", range(48, 56))):
                records = [{"prompt": f"def f{i}(x):", "completion": f" return x + {i}\n"}
                           for i in rows]  # fmt: skip
                (cwd / name).write_text("".join(json.dumps(r) + "\n" for r in records))
        argv = [sys.executable if w == "python" else w for w in _shortened(command)]
        start = time.monotonic()
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        timings.append((time.monotonic() - start, shlex.join(command)))
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"{shlex.join(command)} failed as written:\n{out[-4000:]}"
        assert "Traceback" not in out, out[-4000:]
        # orbax's notices of a read-only restore, which users read as a problem
        assert "read only" not in out and "read_only=True" not in out, out[-2000:]
        ran.append(shlex.join(command))
    print("\n".join(f"{s:6.1f} s  {c}" for s, c in timings))
    assert any("--resume-step" in c for c in ran) and any("rudax.run.launch" in c for c in ran)
    assert any("examples.grpo" in c for c in ran) and any("examples.dpo" in c for c in ran)
