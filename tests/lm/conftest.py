"""Fixtures shared by the examples/lm trainer tests: one tiny corpus, prepared once.

Each ``train.main`` call compiles its own steps (a few seconds on 2 cores), so the tests
train the tiniest model that still learns (``TINY``) and share what they can.
"""

import random
import shutil
from pathlib import Path

import pytest

from examples.lm.prepare import prepare

# Small enough to compile in seconds: 1 block, width 32, 16-token windows of 8 rows.
TINY = [
    *("--vocab-size", "300", "--seq-len", "16", "--d-model", "32", "--n-layers", "1"),
    *("--n-heads", "2", "--batch-size", "8", "--steps", "8", "--warmup", "1", "--lr", "1e-2"),
    *("--log-every", "1", "--eval-every", "4", "--eval-batches", "2", "--checkpoint-every", "3"),
]

NAMES = ["alpha", "beta", "gamma", "delta", "value", "total", "index", "item"]


def write_corpus(root: Path) -> None:
    """40 small Python-like files: patterned enough that a tiny model learns in a few steps."""
    rng = random.Random(0)
    root.mkdir()
    for i in range(40):
        lines = []
        for j in range(40):
            a, b = rng.choice(NAMES), rng.choice(NAMES)
            lines.append(f"def {a}_{j}({b}, n={j}):\n    return {b} * n + {rng.randint(0, 9)}\n")
        (root / f"m{i:02d}.py").write_text("".join(lines))


@pytest.fixture(scope="session")
def prepared_corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus folder, prepared folder) of the tiny corpus, vocabulary 300; never modify it."""
    root = tmp_path_factory.mktemp("lm")
    write_corpus(root / "corpus")
    prepare(root / "corpus", root / "prepared", vocab_size=300, verbose=False)
    return root / "corpus", root / "prepared"


@pytest.fixture(scope="session")
def data(prepared_corpus) -> list[str]:
    """The --data/--data-dir flags of the shared prepared corpus."""
    corpus, prepared = prepared_corpus
    return ["--data", str(corpus), "--data-dir", str(prepared)]


@pytest.fixture
def own_data(prepared_corpus, tmp_path) -> tuple[list[str], Path]:
    """A private copy of the prepared corpus for a test that damages it: (flags, folder)."""
    corpus, prepared = prepared_corpus
    copy = tmp_path / "prepared"
    shutil.copytree(prepared, copy)
    return ["--data", str(corpus), "--data-dir", str(copy)], copy


@pytest.fixture(scope="session")
def exported_run(data, tmp_path_factory) -> tuple[dict, Path]:
    """(summary of an 8-update TINY adamw run, its ``examples.lm.export``); never modify
    either. Shared by the tests that start from a Hugging Face directory."""
    from examples.lm import export, train  # the trainer only for the tests that need it

    root = tmp_path_factory.mktemp("exported")
    summary = train.main([*data, *TINY, "--optimizer", "adamw", "--run-dir", str(root / "src")])
    export.main([summary["run_dir"], str(root / "hf")])
    return summary, root / "hf"
