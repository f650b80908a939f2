"""The trainer's and data pipeline's part of the bad-input catalog (``tests/_catalog.py``).

Each case is a mistake a user makes with ``python -m examples.lm.train`` or its data: a bad
flag, data that is missing, foreign or damaged, a run directory that cannot be one, a resume
with nothing (or nothing intact) to resume, a run that diverges. A command line ends in a
one-line ``error:`` and an exit code: ``UsageExit`` for 2 (fix the command), ``HaltExit``
for 1 (the run stopped, its checkpoints as they were); their message is that line. The data
pipeline's own functions raise their own exceptions.

Most cases fail at argument or data validation, in well under a second. Two train the
tiniest model: one run of 6 updates, made once and shared by the resume cases, and the
diverging run. Every case that a fix of issue 11 made an error ran to the end, silently,
before it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

import rudax.checkpoint as rc
from examples.lm import config as cfg
from examples.lm import plan, train
from examples.lm.corpus import CorpusError
from examples.lm.data import ShardError, TokenLoader
from examples.lm.prepare import open_split
from tests._catalog import Bad, catalog
from tests.lm.conftest import TINY

HF_CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "lm" / "hf_configs"


class UsageExit(Exception):
    """The trainer exited with code 2: a bad command line; the message is its error line."""


class HaltExit(Exception):
    """The trainer exited with code 1: the run stopped; the message is its error line."""


_ENV: dict = {}  # the shared corpus and a temporary folder, set by the autouse fixture


@pytest.fixture(autouse=True, scope="module")
def _env(prepared_corpus, tmp_path_factory):
    _ENV.update(corpus=prepared_corpus[0], prepared=prepared_corpus[1], tmp=tmp_path_factory)
    yield
    _ENV.clear()
    _trained_run.cache_clear()


def _on_a_16_gib_host(call: Any, *args: Any, **kwargs: Any) -> Any:
    """call(*args, **kwargs) as on a machine of 16 GiB of memory."""
    with mock.patch.object(cfg, "host_memory_bytes", return_value=16 * 2**30):
        return call(*args, **kwargs)


def _tmp(name: str) -> Path:
    return _ENV["tmp"].mktemp(name)


def _data(prepared: Path | None = None) -> list[str]:
    return ["--data", str(_ENV["corpus"]), "--data-dir", str(prepared or _ENV["prepared"])]


def cli(*argv: str, main: Any = train.main) -> Any:
    """main(argv) (the trainer's, or the planner's); an exit becomes UsageExit/HaltExit
    carrying the error line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return main(list(argv))
    except SystemExit as e:
        text = err.getvalue()
        assert "Traceback" not in text, text
        line = text.strip().splitlines()[-1] if text.strip() else ""
        raise {2: UsageExit, 1: HaltExit}.get(e.code, AssertionError)(line) from None


def _fresh(*flags: str) -> dict:
    """A new tiny run in its own directory with the shared data."""
    return cli(*_data(), *TINY, "--run-dir", str(_tmp("run") / "run"), *flags)


# ----------------------------------------------------------------------------- data
def _copied_data() -> Path:
    copy = _tmp("data") / "prepared"
    shutil.copytree(_ENV["prepared"], copy)
    return copy


def _train_shard(folder: Path) -> tuple[Path, dict]:
    meta = json.loads((folder / "prepared.json").read_text())
    return folder / meta["splits"]["train"]["shards"][0]["file"], meta


def _edit_ids(path: Path, position: int, value: int) -> None:
    tokens = np.fromfile(path, np.uint16, offset=24)
    tokens[position] = value
    path.write_bytes(path.read_bytes()[:24] + tokens.tobytes())


def _shard_changed_in_place() -> Path:
    folder = _copied_data()
    path, _ = _train_shard(folder)
    before = int(np.fromfile(path, np.uint16, offset=24)[500])
    _edit_ids(path, 500, (before + 1) % 300)  # in range, same size: only the checksum sees it
    return folder


def _shard_with_foreign_ids() -> Path:
    """A shard holding id 65535 (vocabulary 300) and a manifest that agrees with it."""
    folder = _copied_data()
    path, meta = _train_shard(folder)
    _edit_ids(path, 777, 65535)
    meta["splits"]["train"]["shards"][0]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (folder / "prepared.json").write_text(json.dumps(meta))
    return folder


def _manifest_without_checksums() -> Path:
    folder = _copied_data()
    _, meta = _train_shard(folder)
    for split in meta["splits"].values():
        for shard in split["shards"]:
            del shard["sha256"]
    (folder / "prepared.json").write_text(json.dumps(meta))
    return folder


def _truncated_shard() -> Path:
    folder = _copied_data()
    path, _ = _train_shard(folder)
    path.write_bytes(path.read_bytes()[:-3])
    return path


def _a_file() -> Path:
    path = _tmp("file") / "taken"
    path.write_text("not a directory\n")
    return path


def _open(folder: Path):
    return open_split(folder, "train", seq_len=16, batch_size=8, seed=0)


# ----------------------------------------------------------------------------- runs
@functools.cache
def _trained_run() -> Path:
    """A tiny run stopped at update 6 of 8 (checkpoints 3 and 6); copied before each use."""
    run_dir = _tmp("trained") / "run"
    cli(*_data(), *TINY, "--optimizer", "adamw", "--run-dir", str(run_dir), "--stop-at", "6")
    return run_dir


def _copied_run() -> Path:
    copy = _tmp("resume") / "run"
    shutil.copytree(_trained_run(), copy)
    return copy


def _damaged_latest() -> Path:
    run_dir = _copied_run()
    step = run_dir / "checkpoints" / "6"
    files = [os.path.join(p, f) for p, _, names in os.walk(step) for f in names]
    path = max(files, key=os.path.getsize)  # the array data
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return run_dir


def _resume_while_another_writer_holds(run_dir: Path) -> None:
    holder = rc.Checkpointer(run_dir / "checkpoints")
    try:
        cli("--resume", "--run-dir", str(run_dir))
    finally:
        holder.close()


def _resume_without_checkpoints() -> Path:
    run_dir = _copied_run()
    for step in ("3", "6"):
        shutil.rmtree(run_dir / "checkpoints" / step)
    return run_dir


CASES = [
    # ------------------------------------------------------------------ flags
    Bad("mesh-unknown-axis", lambda: cli("--mesh", "gpu=2"), UsageExit,
        r"argument --mesh: expected axis=size pairs with axes \('data', 'fsdp'\).*'gpu=2'"),
    Bad("mesh-axis-given-twice", lambda: cli("--mesh", "data=2,data=4"), UsageExit,
        r"argument --mesh: axis 'data' given twice in 'data=2,data=4'"),
    Bad("mesh-size-zero", lambda: cli("--mesh", "data=0"), UsageExit,
        r"argument --mesh: data size must be >= 1, got 'data=0'"),
    Bad("mesh-size-not-an-int", lambda: cli("--mesh", "fsdp=two"), UsageExit,
        r"argument --mesh: fsdp size must be an int, got 'fsdp=two'"),
    Bad("lr-overflows-float32", lambda: cli("--lr", "1e39"), UsageExit,
        r"argument --lr: must be at most 3\.402823e\+38 \(float32's largest\), got 1e39"),
    Bad("stop-at-beyond-steps", lambda: cli("--steps", "10", "--warmup", "1", "--stop-at", "11"),
        UsageExit, r"--stop-at must be <= --steps, got --stop-at 11, --steps 10"),
    Bad("max-skipped-updates-zero", lambda: cli("--max-skipped-updates", "0"), UsageExit,
        r"argument --max-skipped-updates: must be >= 1, got 0"),
    Bad("resume-step-without-resume", lambda: cli("--resume-step", "3"), UsageExit,
        r"--resume-step N picks the checkpoint of --resume: add --resume"),
    Bad("d-model-not-a-multiple-of-heads",
        lambda: cli(*_data(), "--d-model", "30", "--n-heads", "4"), UsageExit,
        r"model: --d-model 30 must be a multiple of --n-heads 4"),
    # ------------------------------------------------------------------ data
    Bad("data-path-missing", lambda: cli("--data", "/nonexistent/corpus.txt"), UsageExit,
        r"data: data path does not exist: data='/nonexistent/corpus\.txt'"),
    Bad("data-folder-empty",
        lambda: cli("--data", str(_tmp("empty")), "--data-dir", str(_tmp("out") / "p")),
        UsageExit, r"data: the data folder \S*empty\S* holds no files"),
    Bad("data-dir-is-a-file", lambda: cli(*_data(_a_file()), *TINY), UsageExit,
        r"data: \S*taken is a file, not a folder"),
    Bad("data-dir-of-other-settings", lambda: cli(*_data(), *TINY, "--vocab-size", "280"),
        UsageExit, r"--data-dir \S+ holds a preparation with other settings \(vocab_size: 300 "
        r"there, 280 asked\): choose another --data-dir, or rebuild it with: python -m "
        r"examples\.lm\.prepare --data \S+ --out \S+ --vocab-size 280 --force"),
    # issue 39: --seq-len 1000000000 allocated 238 GiB (the RoPE table) before failing; the
    # machine's memory set to 16 GiB, so that the case does not depend on the host's
    Bad("seq-len-whose-rope-table-exceeds-the-memory",
        lambda: _on_a_16_gib_host(cli, *_data(), *TINY, "--seq-len", "1000000000"), UsageExit,
        r"--seq-len 1000000000: the RoPE table of a row is built on the host, at least 8 x "
        r"head_dim = 128 bytes a position \(float64 angles and their cosines, head_dim 16\): "
        r"119\.2 GiB, more than this machine's 16\.0 GiB; the table alone caps --seq-len at "
        r"134,217,728 here"),
    Bad("plan-seq-len-whose-rope-table-exceeds-the-memory",
        lambda: _on_a_16_gib_host(cli, *TINY, "--seq-len", "1000000000", main=plan.main),
        UsageExit, r"--seq-len 1000000000: the RoPE table of a row is built on the host"),
    Bad("seq-len-past-int32", lambda: cli(*_data(), *TINY, "--seq-len", str(2**31)),
        UsageExit, r"--seq-len 2147483648: positions are int32, so at most 2,147,483,646"),
    Bad("seq-len-longer-than-the-data", lambda: cli(*_data(), *TINY, "--seq-len", "100000"),
        UsageExit, r"data: seq_len=100000 needs windows of 100001 tokens, but the shards hold"),
    Bad("shard-changed-in-place", lambda: cli(*_data(_shard_changed_in_place()), *TINY),
        UsageExit, r"data: \S+train_000\.bin: its SHA-256 is [0-9a-f]{64}, but [0-9a-f]{64} was "
        r"recorded .*prepare it again with: python -m examples\.lm\.prepare"),
    Bad("shard-ids-outside-the-vocabulary", lambda: cli(*_data(_shard_with_foreign_ids()), *TINY),
        UsageExit, r"data: \S+train_000\.bin: token id 65535 at position 777 is outside the "
        r"vocabulary of 300 ids"),
    Bad("loader-shard-ids-outside-the-vocabulary",
        lambda: TokenLoader([_train_shard(_shard_with_foreign_ids())[0]], seq_len=8,
                            batch_size=2, seed=0, vocab_size=300),
        ShardError, r"train_000\.bin: token id 65535 at position 777 is outside the vocabulary"),
    Bad("open-split-manifest-without-checksums", lambda: _open(_manifest_without_checksums()),
        CorpusError, r"prepared\.json records no checksum for train_000\.bin: it was prepared "
        r"by an older version"),
    Bad("loader-truncated-shard",
        lambda: TokenLoader([_truncated_shard()], seq_len=8, batch_size=2, seed=0),
        ShardError, r"train_000\.bin: truncated or corrupted: expected \d+ bytes"),
    # ------------------------------------------------------------------ run directories
    Bad("run-dir-is-a-file", lambda: cli(*_data(), *TINY, "--run-dir", str(_a_file())),
        UsageExit,
        r"--run-dir \S+taken: \S+taken is a file, not a directory"),
    Bad("runs-dir-is-a-file",
        lambda: cli(*_data(), *TINY, "--runs-dir", str(_a_file()), "--name", "a"), UsageExit,
        r"--runs-dir \S+taken: \S+taken is a file, not a directory"),
    Bad("new-run-in-an-existing-run", lambda: cli(*_data(), "--run-dir", str(_copied_run())),
        UsageExit, r"\S+run already holds a run: continue it with --resume"),
    Bad("resume-nothing-there", lambda: cli("--resume", "--run-dir", str(_tmp("none"))),
        UsageExit, r"--resume: \S+none\S* holds no run \(no config\.json\)"),
    Bad("resume-no-checkpoint-left",
        lambda: cli("--resume", "--run-dir", str(_resume_without_checkpoints())), UsageExit,
        r"--resume: no checkpoint in \S+checkpoints"),
    Bad("resume-damaged-latest",
        lambda: cli("--resume", "--run-dir", str(_damaged_latest())), UsageExit,
        r"--resume: checkpoint 6 in \S+ is damaged; intact: 3; continue from one with "
        r"--resume-step 3"),
    Bad("resume-step-not-saved",
        lambda: cli("--resume", "--run-dir", str(_copied_run()), "--resume-step", "4"),
        UsageExit, r"--resume-step 4: no checkpoint 4 in \S+checkpoints; saved: \[3, 6\]"),
    Bad("resume-with-contradicting-flags",
        lambda: cli("--resume", "--run-dir", str(_copied_run()), "--d-model", "64"), UsageExit,
        r"--resume: flags differ from the run's: --d-model 64 \(the run has 32\)"),
    Bad("resume-while-another-writer-holds-it",
        lambda: _resume_while_another_writer_holds(_copied_run()), UsageExit,
        r"--run-dir \S+run: its checkpoints are in use: \S+checkpoints is in use by another "
        r"Checkpointer: pid \d+"),
    Bad("init-from-nothing", lambda: cli(*_data(), "--init-from", str(_tmp("nothing"))),
        UsageExit, r"--init-from: no checkpoint in \S+nothing"),
    Bad("init-from-another-model",
        lambda: _fresh("--d-model", "64", "--init-from", str(_copied_run())), UsageExit,
        r"--init-from: restore: record\.model\['lm_head'\]\['embedding'\]\S*: saved shape "
        r"\(300, 32\) dtype bfloat16, template shape \(300, 64\)"),
    # ---------------------------------------------- the planner (issue 29: "fits" on nonsense)
    Bad("plan-negative-headroom",
        lambda: cli("--device-memory", "2", "--headroom", "-0.1", main=plan.main), UsageExit,
        r"--headroom: must be >= 0 and < 1, got -0\.1"),
    Bad("plan-headroom-above-1", lambda: cli("--headroom", "1.5", main=plan.main), UsageExit,
        r"--headroom: must be >= 0 and < 1, got 1\.5"),
    Bad("plan-headroom-nan", lambda: cli("--headroom", "nan", main=plan.main), UsageExit,
        r"--headroom: must be >= 0 and < 1, got nan"),
    Bad("plan-negative-device-memory", lambda: cli("--device-memory", "-5", main=plan.main),
        UsageExit, r"--device-memory: must be > 0, got -5"),
    Bad("plan-device-memory-nan", lambda: cli("--device-memory", "nan", main=plan.main),
        UsageExit, r"--device-memory: must be > 0, got nan"),
    Bad("plan-dropout-1", lambda: cli("--finetune", "qlora", "--dropout", "1", main=plan.main),
        UsageExit, r"--dropout: must be >= 0 and < 1, got 1"),
    Bad("plan-seq-len-past-the-positions",
        lambda: cli("--hf-config", str(HF_CONFIGS / "llama-2-7b.json"), "--finetune", "qlora",
                    "--seq-len", "100000", main=plan.main),
        UsageExit, r"--seq-len 100000 is more than the 4096 positions of \S+llama-2-7b\.json"),
    # ------------------------------------------------------------------ runs that go wrong
    Bad("lr-that-diverges", lambda: _fresh("--optimizer", "adamw", "--lr", "1e30"), HaltExit,
        r"update \d: (the training loss is nan|parameter params\[.*\] is not finite)"),
]  # fmt: skip

test_bad_input = catalog(CASES)
