"""Joining a multi-process run: ``jax.distributed.initialize`` when the program is one of many.

A training program calls ``initialize`` first thing, before any JAX computation, and is then
the same program whether it runs alone or as one of N processes: alone nothing happens; as one
of N it joins the others through ``jax.distributed``, after which ``jax.devices()`` lists every
process's devices and a mesh of them spans the processes.

Where the N processes come from is the launcher's business, not the program's; ``initialize``
reads, in this order:

1. its arguments (a program's ``--coordinator``, ``--num-processes``, ``--process-id``);
2. the environment variables ``JAX_COORDINATOR_ADDRESS`` (which jax itself reads too),
   ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, as ``python -m rudax.run.launch`` sets them
   on one machine and as a Kubernetes manifest or a shell script can on many;
3. a cluster jax detects by itself (SLURM's ``srun``, Open MPI's ``mpirun``, a Kubernetes
   JobSet), when it reports more than one process.

The three values come together: a coordinator without a process count (a typo in a launch
script) is an error, not a silent single-process run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Protocol

import jax

from rudax.run import _compat

__all__ = [
    "DistributedError",
    "add_distributed_flags",
    "fail_fast",
    "initialize",
    "initialize_from_flags",
]

# The variables a launcher sets (JAX_COORDINATOR_ADDRESS is jax's own).
ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


class DistributedFlags(Protocol):
    """What ``initialize_from_flags`` reads: ``add_distributed_flags``' flags, as attributes
    of the parsed ``argparse.Namespace`` or of a program's configuration built from it."""

    # read-only: a frozen dataclass's fields satisfy them
    @property
    def coordinator(self) -> str | None: ...
    @property
    def num_processes(self) -> int | None: ...
    @property
    def process_id(self) -> int | None: ...
    @property
    def distributed_timeout(self) -> int: ...
    @property
    def heartbeat_timeout(self) -> int: ...


class DistributedError(RuntimeError):
    """This process could not join the run's other processes."""


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 300,
    heartbeat_timeout_s: int = 100,
) -> bool:
    """Joins this process to a multi-process JAX run if it was launched as one.

    Must run before JAX starts a backend (any computation, ``jax.devices()``); a program that
    is launched alone gets ``False`` and nothing changes.

    Args:
      coordinator: ``host:port`` of process 0's coordination service, or None to read
        ``JAX_COORDINATOR_ADDRESS`` (then the cluster's).
      num_processes: the number of processes, or None to read ``JAX_NUM_PROCESSES``.
      process_id: this process's index in ``[0, num_processes)``, or None to read
        ``JAX_PROCESS_ID``.
      timeout_s: how long to wait for every process to join, in seconds; a coordinator that
        cannot be reached fails after it, naming its address.
      heartbeat_timeout_s: how long the coordination service waits for a process that stops
        answering (killed, its machine gone) before it ends the others, in seconds. A
        process that fails with a Python error is still answering: ``fail_fast`` makes it
        leave.

    Returns:
      True if this process joined a multi-process run (or had already), False if it runs
      alone.

    Raises:
      ValueError: some but not all of the three values are given, or one is malformed; the
        message names the argument or variable.
      DistributedError: the processes did not all join within ``timeout_s``.

    Example:
      >>> import rudax.run as rr
      >>> rr.initialize_distributed()  # launched alone: no coordinator, no cluster
      False
    """
    for name, value in (("timeout_s", timeout_s), ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int (seconds), got {name}={value!r}")
    if jax.distributed.is_initialized():
        return True
    given = {
        "coordinator": (coordinator, ENV[0]),
        "num_processes": (num_processes, ENV[1]),
        "process_id": (process_id, ENV[2]),
    }
    values = {
        name: value if value is not None else os.environ.get(var) or None
        for name, (value, var) in given.items()
    }
    if all(v is None for v in values.values()):
        processes = _compat.cluster_process_count()
        if processes is None or processes < 2:
            return False
        # the cluster (SLURM, Open MPI, Kubernetes) supplies all three
        _join(None, None, None, timeout_s, heartbeat_timeout_s)
        return True
    missing = [f"{name} (or {given[name][1]})" for name, v in values.items() if v is None]
    if missing:
        present = ", ".join(f"{name}={v!r}" for name, v in values.items() if v is not None)
        raise ValueError(
            f"a multi-process run needs the coordinator, the process count and this process's "
            f"id together; got {present}, missing {', '.join(missing)}"
        )
    address = _address(str(values["coordinator"]))
    n = _int("num_processes", values["num_processes"], ENV[1], low=1)
    i = _int("process_id", values["process_id"], ENV[2], low=0)
    if i >= n:
        raise ValueError(f"process_id must be in [0, num_processes={n}), got process_id={i}")
    _join(address, n, i, timeout_s, heartbeat_timeout_s)
    return True


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """Adds a program's multi-process flags, as a group of ``parser``.

    ``--coordinator HOST:PORT``, ``--num-processes N``, ``--process-id I`` (each defaulting
    to its environment variable, then to the cluster's), ``--distributed-timeout S`` (300)
    and ``--heartbeat-timeout S`` (60): the arguments of ``initialize``, read back by
    ``initialize_from_flags``. Every program that runs on several processes takes the same
    flags, so that a launch script works for each.

    Example:
      >>> import argparse
      >>> import rudax.run as rr
      >>> parser = argparse.ArgumentParser()
      >>> rr.add_distributed_flags(parser)
      >>> args = parser.parse_args(["--num-processes", "2", "--process-id", "1"])
      >>> args.num_processes, args.process_id, args.distributed_timeout
      (2, 1, 300)
    """
    group = parser.add_argument_group(
        "processes (one of several: jax.distributed; launched alone, leave them out)"
    )
    group.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help=f"process 0's address (default: ${ENV[0]}, else the cluster's: SLURM, Open MPI, "
        "Kubernetes)",
    )
    group.add_argument(
        "--num-processes", type=_flag_int(1), metavar="N", help=f"default: ${ENV[1]}"
    )
    group.add_argument("--process-id", type=_flag_int(0), metavar="I", help=f"default: ${ENV[2]}")
    group.add_argument(
        "--distributed-timeout",
        type=_flag_int(1),
        default=300,
        metavar="S",
        help="seconds to wait for every process to join",
    )
    group.add_argument(
        "--heartbeat-timeout",
        type=_flag_int(1),
        default=60,
        metavar="S",
        help="seconds after which a process that stopped answering (killed, its machine "
        "gone) ends the others",
    )


def initialize_from_flags(args: DistributedFlags) -> bool:
    """``initialize`` with the flags of ``add_distributed_flags``; its result."""
    return initialize(
        args.coordinator,
        args.num_processes,
        args.process_id,
        timeout_s=args.distributed_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
    )


def _flag_int(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected int, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    return parse


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """Around a multi-process program's body: a process that fails leaves at once.

    A process that ends on an exception (a ``SystemExit`` with a non-zero code included) would
    otherwise wait at jax's exit barrier for the others, answering the coordinator's
    heartbeats, while they wait for it in their next collective: all of them hang for jax's
    ``shutdown_timeout_seconds`` (300). Here it prints the error, flushes its output and ends
    with ``os._exit``: it stops answering, and the others end after the heartbeat timeout (at
    once if it was process 0). Alone (no ``jax.distributed``) the error is raised as usual.

    Example:
      >>> import rudax.run as rr
      >>> with rr.fail_fast():  # launched alone: exceptions propagate as usual
      ...     pass
    """
    try:
        yield
    except SystemExit as e:
        if jax.distributed.is_initialized() and e.code not in (0, None):
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            _leave(e.code if isinstance(e.code, int) else 1)
        raise
    except BaseException:
        if jax.distributed.is_initialized():
            traceback.print_exc()
            _leave(1)
        raise


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _join(
    address: str | None, n: int | None, i: int | None, timeout_s: int, heartbeat_timeout_s: int
) -> None:
    if address is not None and i != 0:
        # jax's client aborts the whole process (a C++ fatal error, no Python exception) when
        # it cannot reach the coordinator in time: find out first, and say where it looked.
        _wait_for(address, timeout_s, f"process {i} of {n}")
    try:
        jax.distributed.initialize(
            address,
            n,
            i,
            initialization_timeout=timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    except Exception as e:  # jax raises its runtime's error types; say what was tried
        who = "the cluster's coordinator" if address is None else f"the coordinator at {address}"
        role = "" if i is None else f" as process {i} of {n}"
        raise DistributedError(
            f"could not join {who}{role} within timeout_s={timeout_s}: {e}"
        ) from e


def _wait_for(address: str, timeout_s: int, role: str) -> None:
    """Returns once ``address`` accepts a TCP connection; DistributedError after timeout_s."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"{role}: the coordinator at {address} could not be reached within "
                    f"timeout_s={timeout_s} ({e}); is process 0 running, and is the address "
                    "right?"
                ) from e
            time.sleep(0.25)


def _address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator must be host:port (port in [1, 65535]), got coordinator={text!r}"
        )
    return text


def _int(name: str, value: object, var: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{name} must be an int >= {low}, got {name}={value!r}")
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < low:
        raise ValueError(f"{name} (or {var}) must be an int >= {low}, got {value!r}")
    return number
