"""rudax.run.initialize_distributed: alone it does nothing; half a launch is an error.

The joining itself is exercised by the multi-process program tests (tests/lm/test_processes.py)
and the launcher's (tests/run/test_launch.py); here, what is decided before jax is asked.
"""

import argparse
import threading
import time

import pytest

import rudax.run as rr
from rudax.run import _compat

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    for var in ENV + SLURM + ("OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)


def test_alone_is_single_process():
    assert rr.initialize_distributed() is False


def test_a_one_task_slurm_step_is_single_process(monkeypatch):
    # srun -n 1 (or an salloc shell): jax would detect SLURM, with one process
    for var, value in zip(SLURM, ("7", "node1", "1", "0", "0"), strict=True):
        monkeypatch.setenv(var, value)
    assert _compat.cluster_process_count() == 1
    assert rr.initialize_distributed() is False


def test_a_many_task_slurm_step_is_detected(monkeypatch):
    for var, value in zip(SLURM, ("7", "node[1-2]", "4", "1", "1"), strict=True):
        monkeypatch.setenv(var, value)
    assert _compat.cluster_process_count() == 4


@pytest.mark.parametrize(
    "env, kwargs, missing",
    [
        ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234"}, {}, ["num_processes", "process_id"]),
        ({}, {"num_processes": 2}, ["coordinator", "process_id"]),
        ({"JAX_PROCESS_ID": "1"}, {"coordinator": "h:1"}, ["num_processes"]),
    ],
)
def test_half_a_launch_names_what_is_missing(monkeypatch, env, kwargs, missing):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match="missing") as e:
        rr.initialize_distributed(**kwargs)
    for name in missing:
        assert name in str(e.value)
    for value in env.values():
        assert value in str(e.value)  # what was given is shown as given


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"coordinator": "localhost", "num_processes": 2, "process_id": 0}, "host:port"),
        ({"coordinator": "h:70000", "num_processes": 2, "process_id": 0}, "h:70000"),
        ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, "process_id=2"),
        ({"coordinator": "h:1", "num_processes": 0, "process_id": 0}, "num_processes"),
        ({"coordinator": "h:1", "num_processes": "two", "process_id": 0}, "'two'"),
        ({"coordinator": "h:1", "num_processes": 2, "process_id": True}, "process_id=True"),
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"heartbeat_timeout_s": 1.5}, "heartbeat_timeout_s=1.5"),
    ],
)
def test_bad_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rr.initialize_distributed(**kwargs)


def test_an_unreachable_coordinator_fails_within_the_timeout_naming_it(monkeypatch):
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    start = time.monotonic()
    with pytest.raises(rr.DistributedError, match=r"127\.0\.0\.1:9 could not be reached") as e:
        rr.initialize_distributed("127.0.0.1:9", timeout_s=1)
    assert time.monotonic() - start < 10
    assert "process 1 of 2" in str(e.value) and "timeout_s=1" in str(e.value)


def test_flags_parse_and_reach_initialize():
    parser = argparse.ArgumentParser()
    rr.add_distributed_flags(parser)
    args = parser.parse_args([])
    assert (args.coordinator, args.num_processes, args.process_id) == (None, None, None)
    assert (args.distributed_timeout, args.heartbeat_timeout) == (300, 60)
    assert rr.initialize_from_flags(args) is False
    for bad in (["--num-processes", "0"], ["--process-id", "-1"], ["--heartbeat-timeout", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


_FAILING = """
import os, sys, time
import jax, jax.numpy as jnp
import rudax.run as rr
rr.initialize_distributed(heartbeat_timeout_s=3)
with rr.fail_fast():
    if jax.process_index() == 1:
        raise ValueError("process 1 is broken")
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    total = jax.jit(lambda x: x.sum())
    x = jax.device_put(jnp.ones(jax.device_count()), jax.NamedSharding(mesh, jax.P("d")))
    while True:  # waits for process 1 in each sum
        total(x).block_until_ready()
"""


def test_fail_fast_ends_a_job_whose_process_raised_within_the_heartbeat(tmp_path):
    # Without it process 1 stays at jax's exit barrier, answering heartbeats, while process 0
    # waits for it in the sum until gloo gives up: 30 s after process 1's error here (at
    # worst jax's shutdown_timeout_seconds, 300). With it, process 1 is gone and process 0
    # ends after the 3 s heartbeat timeout.
    import os
    import subprocess
    import sys

    from rudax.run.launch import child_env, free_port

    port = free_port()
    script = tmp_path / "failing.py"
    script.write_text(_FAILING)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=child_env(i, processes=2, port=port, cpu_devices=1, base=dict(os.environ)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    seen: dict[str, float] = {}
    outs = ["", ""]

    def read(i: int) -> None:
        for line in procs[i].stdout:
            outs[i] += line.decode(errors="replace")
            if "process 1 is broken" in outs[i]:
                seen.setdefault("error", time.monotonic())

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for r in readers:
        r.start()
    try:
        for p in procs:
            p.wait(timeout=120)
        ended = time.monotonic()
    finally:
        for p in procs:
            p.kill()
        for r in readers:
            r.join()
    assert procs[1].returncode == 1 and "ValueError: process 1 is broken" in outs[1]
    assert procs[0].returncode != 0
    assert ended - seen["error"] < 20, ended - seen["error"]
