"""Resume: N updates straight equal k updates, save, restore in a fresh process, N - k more.

Two child interpreters run ``_resume_worker.py``. The first trains straight through, then
trains the first part of two interrupted runs from the same start and saves each: one at an
update boundary (sync save), one in the middle of an accumulation window with gradients of
two microbatches pending (async save). It exits; a second, fresh interpreter restores each
checkpoint into a freshly initialized template and trains to the end. Parameters, the whole
optimizer state (fp32 masters, moments, counts, the clip norm), the accumulator, the caller
state (RNG key, data position) and every microbatch's loss must equal the straight run's,
byte for byte: on CPU the same program on the same inputs gives the same bits, so any
difference is state the checkpoint lost or changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.checkpoint import _resume_worker as worker

WORKER = Path(worker.__file__).resolve()
TIMEOUT = 120.0  # seconds per child: JAX start-up and two compilations on a busy machine


def _child_env() -> dict[str, str]:
    # As tests/sharding/_multiprocess.py: one CPU device, strict promotion, the repo importable.
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=1"])
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"
    env.setdefault("OMP_NUM_THREADS", "1")
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    return env


def _run_child(*args: str) -> None:
    cmd = [sys.executable, str(WORKER), *args]
    try:
        done = subprocess.run(
            cmd, env=_child_env(), capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(args)}: timed out after {TIMEOUT:g} s\n{e.stderr}")
    if done.returncode != 0:
        pytest.fail(f"{' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}")


def _load(out: Path, name: str) -> tuple[dict, dict]:
    """{leaf path: (dtype, shape, raw bytes) or the Python value}, and the child's info."""
    meta = json.loads((out / f"{name}.json").read_text())
    with np.load(out / f"{name}.npz") as raw:
        leaves = {
            key: tuple(v[1:]) if v[0] == "python" else (v[0], tuple(v[1]), raw[key].tobytes())
            for key, v in meta["layout"].items()
        }
    return leaves, meta["info"]


def _split(leaves: dict) -> tuple[dict, list]:
    """(the record's leaves, the losses in microbatch order)."""
    record = {k: v for k, v in leaves.items() if k.startswith("['record']")}
    count = sum(k.startswith("['losses']") for k in leaves)
    return record, [leaves[f"['losses'][{i}]"] for i in range(count)]


def test_resume_in_a_fresh_process_is_bitwise(tmp_path):
    _run_child("first", str(tmp_path))
    _run_child("resume", str(tmp_path), *worker.CUTS)  # a new interpreter: nothing carried over

    straight, straight_losses = _split(_load(tmp_path, "straight")[0])
    assert len(straight_losses) == worker.UPDATES * worker.K
    assert len({loss[2] for loss in straight_losses}) == len(straight_losses)  # a real run
    for cut, stop in worker.CUTS.items():
        _, first_losses = _split(_load(tmp_path, f"first_{cut}")[0])
        leaves, info = _load(tmp_path, f"resumed_{cut}")
        resumed, resumed_losses = _split(leaves)
        # The checkpoint held the cut's position, schedule count and pending window.
        pending = stop % worker.K
        assert info == {
            "step": stop,
            "microbatch": stop,
            "pending": pending,
            "updates": stop // worker.K,
        }, cut
        assert cut != "mid_window" or pending > 0
        assert resumed.keys() == straight.keys(), cut
        for key, value in straight.items():
            assert resumed[key] == value, f"{cut}: {key} differs from the straight run"
        assert first_losses + resumed_losses == straight_losses, f"{cut}: losses differ"


def test_checkpoint_benchmark_runs(tmp_path, capsys):
    # A smoke run of benchmarks/checkpoint.py on a 2 MB state: every arm timed, the table and
    # the JSON written, its scratch directory removed.
    from benchmarks import checkpoint as bench

    out = tmp_path / "result.json"
    bench.main(["--gb", "0.002", "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)])
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    arms = [row["arm"] for row in result["rows"]]
    assert arms == [
        "raw write+fsync",
        "orbax save (sync)",
        "orbax save (async)",
        "save (sync)",
        "save (async)",
        "raw read (warm)",
        "orbax restore (warm)",
        "restore (warm)",
        "raw read (cold)",
        "orbax restore (cold)",
        "restore (cold)",
        "restore (template freed)",
        "fresh memory",
        "step 0 save",
        "step 0 restore",
        "step 0 zeros_as_metadata save",
        "step 0 zeros_as_metadata restore",
        "params only save",
        "params only restore",
        "orbax save (async) blocking",
        "save (async) blocking",
    ]
    assert all(row["median_s"] > 0 for row in result["rows"])
    # rudax's arms are compared with plain orbax's of the same kind.
    by_arm = {row["arm"]: row for row in result["rows"]}
    for arm in ("save (sync)", "save (async)", "restore (warm)", "restore (cold)"):
        assert len(by_arm[arm]["vs_orbax"]) == 3 and len(by_arm[arm]["vs_raw"]) == 3, arm
    assert len(by_arm["save (async) blocking"]["blocking_vs_orbax"]) == 3
    assert len(by_arm["restore (template freed)"]["vs_restore"]) == 3
    for arm in ("step 0", "step 0 zeros_as_metadata"):  # against the parameters alone
        assert len(by_arm[f"{arm} save"]["vs_params"]) == 3
        assert len(by_arm[f"{arm} restore"]["vs_params"]) == 3
    (round0,) = result["rounds"]
    assert round0["cold"] in ("drop_caches", "posix_fadvise(DONTNEED)")
    assert sorted(round0["step 0 disk"]) == sorted(bench.STEP0)
    assert all(arm in table for arm in arms)
    assert os.listdir(tmp_path) == ["result.json"]
