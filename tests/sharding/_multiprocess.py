"""Runs a worker as N JAX processes on localhost, each with its own simulated CPU devices.

``run_processes(worker, ...)`` starts ``num_processes`` fresh Python interpreters. Each runs
this file as a script: it sets up its own environment (the test process already fixed its
device count to 8 in ``tests/conftest.py``; a child must get its own), joins the others with
``jax.distributed.initialize`` over gloo CPU collectives, calls ``worker.main(*args)`` and
writes the returned JSON-able value to a file the parent reads back.

A hung or failed process must fail the test, not the CI job: every child runs in its own
process group, and on timeout, or as soon as one child exits with an error (the others would
wait for it in a collective forever), every group is killed and the error shows each
process's exit status and output tail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_TAIL_CHARS = 3000


class MultiprocessError(AssertionError):
    """A multi-process run failed: a timeout or a non-zero exit, with every process's output."""


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it for a socket bound to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(devices_per_process: int) -> dict[str, str]:
    env = dict(os.environ)
    # Drop the parent's --xla_force_host_platform_device_count=8, keep any other XLA flag.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    # gloo is jax 0.10's default for CPU; set it so a changed default cannot turn the
    # cross-process collectives off (without it, CPU computations cannot span processes).
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    # As in the test process (tests/conftest.py): rudax code runs under strict promotion.
    env["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"
    # Each child is one of 2-4 processes sharing a small CI machine: one compute thread each.
    env.setdefault("OMP_NUM_THREADS", "1")
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    return env


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-_TAIL_CHARS:] if len(text) > _TAIL_CHARS else text


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def run_processes(
    worker: str | os.PathLike,
    num_processes: int = 2,
    devices_per_process: int = 2,
    *,
    timeout: float = 60.0,
    args: Sequence[Any] = (),
) -> list[Any]:
    """Runs ``worker.main(*args)`` in ``num_processes`` JAX processes joined on localhost.

    Args:
      worker: path of a Python file defining ``main(*args)``, called after
        ``jax.distributed.initialize``; it returns a JSON-serialisable value.
      num_processes: how many processes (ranks of ``jax.distributed``).
      devices_per_process: simulated CPU devices in each process.
      timeout: seconds for the whole run, JAX start-up included.
      args: JSON-serialisable arguments passed to every process's ``main``.

    Returns:
      The value each process's ``main`` returned, in process order. Raises
      ``MultiprocessError`` on a timeout or a failed process, with every process's output.
    """
    worker = Path(worker).resolve()
    if not worker.is_file():
        raise ValueError(f"worker must be a Python file, got {worker=}")
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(f"need at least one of each, got {num_processes=}, {devices_per_process=}")
    coordinator = f"127.0.0.1:{free_port()}"
    env = _child_env(devices_per_process)
    with tempfile.TemporaryDirectory(prefix="rudax_mp_") as tmp:
        tmp = Path(tmp)
        procs, logs, results = [], [], []
        try:
            for i in range(num_processes):
                logs.append(tmp / f"process_{i}.log")
                results.append(tmp / f"process_{i}.json")
                spec = {
                    "worker": str(worker),
                    "coordinator": coordinator,
                    "num_processes": num_processes,
                    "process_id": i,
                    "args": list(args),
                    "result": str(results[i]),
                }
                with open(logs[i], "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, __file__, json.dumps(spec)],
                            env=env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,  # its own process group, killed as one
                        )
                    )
            failure = _wait(procs, time.monotonic() + timeout, timeout)
        finally:
            _kill(procs)
        if failure is not None:
            report = "\n".join(
                f"--- process {i} (exit {p.returncode}) output tail:\n{_tail(logs[i])}"
                for i, p in enumerate(procs)
            )
            raise MultiprocessError(f"{worker.name} x{num_processes}: {failure}\n{report}")
        return [json.loads(r.read_text()) for r in results]


def _wait(procs: Sequence[subprocess.Popen], deadline: float, timeout: float) -> str | None:
    """None once every process exited 0; else why not. Stops at the first failure."""
    while True:
        codes = [p.poll() for p in procs]
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            return f"process {bad[0]} exited with status {codes[bad[0]]}; killed the others"
        if all(c == 0 for c in codes):
            return None
        if time.monotonic() > deadline:
            hung = [i for i, c in enumerate(codes) if c is None]
            return f"timed out after {timeout:g} s; processes {hung} still running, killed"
        time.sleep(0.05)


def _child(spec: dict[str, Any]) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        spec["coordinator"],
        num_processes=spec["num_processes"],
        process_id=spec["process_id"],
        initialization_timeout=60,
    )
    module_spec = importlib.util.spec_from_file_location("_rudax_mp_worker", spec["worker"])
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    try:
        result = module.main(*spec["args"])
    except BaseException:
        # A plain exit would run jax.distributed's atexit shutdown, which waits at a barrier
        # for peers that may never come: report and leave at once.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    Path(spec["result"]).write_text(json.dumps(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
