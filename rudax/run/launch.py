"""Runs one command as N cooperating JAX processes on this machine: ``python -m rudax.run.launch``.

A localhost stand-in for a cluster launcher, for trying a multi-process program without a
cluster (and for tests). It is not a scheduler: on SLURM use ``srun``, on Kubernetes a JobSet;
``jax.distributed.initialize`` detects those by itself.

    python -m rudax.run.launch --processes 2 --cpu-devices 4 -- \\
        python -m examples.lm.train --mesh data=2,fsdp=4

Process ``i`` of ``N`` (its rank) gets its place through the environment:

* ``JAX_COORDINATOR_ADDRESS=127.0.0.1:<port>`` (a free port unless ``--port``), which
  ``jax.distributed.initialize`` reads itself; ``JAX_NUM_PROCESSES=N`` and ``JAX_PROCESS_ID=i``,
  which a program passes on as ``num_processes`` and ``process_id``.
* With ``--cpu-devices K``: ``K`` simulated CPU devices, as ``JAX_PLATFORMS=cpu``,
  ``JAX_NUM_CPU_DEVICES=K`` and ``--xla_force_host_platform_device_count=K`` in ``XLA_FLAGS``
  (in place of any device count there; the other flags stay), and
  ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``: without gloo, a CPU computation cannot span
  processes in jax 0.10.
* ``PYTHONUNBUFFERED=1`` unless set, so that a Python child's output streams as it is written.

Without ``--cpu-devices`` no device setting is touched: every child sees every accelerator of
the machine. That is JAX's layout for one process per host (``--processes 1``, or several
hosts through their scheduler); several processes on one GPU host would each claim every GPU
(memory preallocation, and NCCL refuses one GPU twice in a communicator). To give each process
its own GPU, let the command pick it by rank, e.g.
``-- sh -c 'CUDA_VISIBLE_DEVICES=$JAX_PROCESS_ID exec python -m examples.lm.train ...'``.

Each child's stdout and stderr come out on the launcher's, whole lines prefixed by the rank
(``[0] ...``, ``[1] ...``). A line redrawn with carriage returns (a progress bar) is shown as
what a terminal would show: its latest state, at most once every ``PROGRESS_EVERY`` seconds,
and its final state when the line ends. Children read no input (stdin is ``/dev/null``).

A multi-process JAX job cannot go on without one of its processes (the others would wait for
it in their next collective until jax's heartbeat timeout, 100 s by default), so when a child
exits non-zero or is killed by a signal, the launcher names its rank, status and command, stops
the others and exits with that child's status (``128 + signal`` for a signal, as shells do).
Stopping is SIGTERM to each child's process group (each child runs in its own, so its
subprocesses go too), then SIGKILL after ``--grace`` seconds. A process that called
``jax.distributed.initialize`` does not stop at SIGTERM: jax takes it as a preemption notice
(a program may checkpoint then, at ``multihost_utils.reached_preemption_sync_point``), so such
a process ends at the SIGKILL. Ctrl-C, SIGTERM or SIGHUP to the launcher is passed to every
process group as it is, and the launcher waits for them to exit by themselves, however long
that takes: rudax's programs (``rudax.run.Interruptions``) finish the update in flight, save
it on every process and exit. A second signal kills them at once. The launcher then exits
``128 + signal``. ``--timeout`` stops everything after that many seconds and exits 124. All
children exiting 0: exit 0. A command that cannot be started: 127 (not found) or 126 (not
executable). POSIX only (process groups).

Why ``rudax.run`` does not import this module: ``python -m rudax.run.launch`` imports the
package ``rudax.run`` first, and a package that had already imported the module it is asked to
run makes ``runpy`` warn of unpredictable behaviour (the module would exist twice). The launcher
itself imports only the standard library.

Example:
  >>> import sys
  >>> from rudax.run.launch import child_env, launch
  >>> env = child_env(1, processes=2, port=12345, cpu_devices=4, base={})
  >>> env["JAX_COORDINATOR_ADDRESS"], env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]
  ('127.0.0.1:12345', '2', '1')
  >>> env["XLA_FLAGS"]
  '--xla_force_host_platform_device_count=4'
  >>> code = "import os; print('process', os.environ['JAX_PROCESS_ID'], 'says hello')"
  >>> launch([sys.executable, "-c", code], processes=1)
  [0] process 0 says hello
  0
  >>> code = "import os, sys; sys.exit(3 * int(os.environ['JAX_PROCESS_ID']))"
  >>> launch([sys.executable, "-c", code], processes=2, stderr=sys.stdout)
  [launch] rank 1 exited with status 3... (command: ...)
  3
"""

from __future__ import annotations

import argparse
import math
import os
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import TextIO

from rudax.run._child_output import PROGRESS_EVERY, ChildLines, write_bytes

__all__ = [
    "PROGRESS_EVERY",
    "TIMEOUT_STATUS",
    "build_parser",
    "child_env",
    "free_port",
    "launch",
    "main",
]

# The exit status of a run stopped by --timeout (that of coreutils' `timeout`).
TIMEOUT_STATUS = 124
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# After a child exits, how long its last output may take to arrive before it is reported.
_DRAIN_SECONDS = 1.0
# The command is named in a report up to this many characters.
_MAX_SHOWN = 500
_LAUNCHER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(
    rank: int,
    *,
    processes: int,
    port: int,
    cpu_devices: int | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process ``rank`` of ``processes``: ``base`` plus the launch contract.

    Args:
      rank: this process's id, ``0 <= rank < processes`` (``JAX_PROCESS_ID``).
      processes: how many processes (``JAX_NUM_PROCESSES``).
      port: the coordinator's port on 127.0.0.1 (``JAX_COORDINATOR_ADDRESS``).
      cpu_devices: simulated CPU devices per process, or None to leave devices alone.
      base: the environment to extend (default: this process's ``os.environ``).

    Returns:
      A new dict; ``base`` is not changed.
    """
    if not 0 <= rank < processes:
        raise ValueError(f"rank must be in [0, processes), got {rank=}, {processes=}")
    env = dict(os.environ if base is None else base)
    env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
    env["JAX_NUM_PROCESSES"] = str(processes)
    env["JAX_PROCESS_ID"] = str(rank)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cpu_devices is not None:
        flags = [
            f for f in env.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] != _DEVICE_COUNT_FLAG
        ]
        flags.append(f"{_DEVICE_COUNT_FLAG}={cpu_devices}")
        env["XLA_FLAGS"] = " ".join(flags)
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
        env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    return env


def _describe(returncode: int) -> tuple[str, int]:
    """How a child ended, in words, and the launcher's exit status for it."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-returncode} ({name})", 128 - returncode
    return f"exited with status {returncode}", returncode


class _Child:
    """One started process: its rank, its output streams and how it ended."""

    def __init__(
        self, rank: int, proc: subprocess.Popen[bytes], prefix: bytes, out: TextIO, err: TextIO
    ):
        assert proc.stdout is not None and proc.stderr is not None  # both are pipes
        self.rank = rank
        self.proc = proc
        self.streams = (proc.stdout, proc.stderr)
        self.lines = {
            proc.stdout.fileno(): ChildLines(prefix, out),
            proc.stderr.fileno(): ChildLines(prefix, err),
        }
        self.open = 2  # streams not yet at end of file

    def signal_group(self, sig: int) -> None:
        # The group, not the process: a shell or a data loader's workers go too. A group whose
        # leader has exited still holds whatever subprocesses it left.
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {name}={value!r}")


def _check_seconds(name: str, value: object, *, positive: bool) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number of seconds, got {name}={value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be finite and {bound}, got {name}={value!r}")


def launch(
    command: Sequence[str],
    *,
    processes: int,
    cpu_devices: int | None = None,
    port: int | None = None,
    timeout: float | None = None,
    grace: float = 5.0,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Runs ``command`` as ranks ``0..processes-1`` of one job and waits for all of them.

    Args:
      command: the program and its arguments, run as is (no shell) once per rank.
      processes: how many processes, >= 1.
      cpu_devices: simulated CPU devices per process (>= 1), or None for the machine's own.
      port: the coordinator's port on 127.0.0.1, or None for a free one.
      timeout: seconds after which every process is stopped (exit status 124), or None.
      grace: seconds between SIGTERM and SIGKILL when processes are stopped.
      env: the environment each child's is made from (default: ``os.environ``).
      stdout: where the children's prefixed stdout lines go (default: ``sys.stdout``).
      stderr: where their stderr lines and the launcher's own reports go (``sys.stderr``).

    Returns:
      0 when every process exited 0; else the first failure's exit status (``128 + signal`` for
      one killed by a signal), 124 on timeout, ``128 + signal`` when the launcher was
      interrupted, 127/126 when the command could not be started.
    """
    command = list(command)
    if not command or not all(isinstance(a, str) for a in command):
        raise ValueError(f"command must be a non-empty list of strings, got {command=}")
    _check_int("processes", processes, 1)
    if cpu_devices is not None:
        _check_int("cpu_devices", cpu_devices, 1)
    if port is not None:
        _check_int("port", port, 1, 65535)
    if timeout is not None:
        _check_seconds("timeout", timeout, positive=True)
    _check_seconds("grace", grace, positive=False)
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    port = free_port() if port is None else port
    # One line, however the command was written (a `python -c` program has newlines in it).
    shown_command = shlex.join(command).replace("\n", "\\n")
    if len(shown_command) > _MAX_SHOWN:
        shown_command = shown_command[: _MAX_SHOWN - 3] + "..."

    def report(message: str) -> None:
        write_bytes(err, f"[launch] {message}\n".encode())

    received: list[int] = []
    restore = _catch_signals(received.append)
    selector = selectors.DefaultSelector()
    children: list[_Child] = []

    def pump(seconds: float) -> None:
        """Passes on the output that arrives within ``seconds`` (or until some does)."""
        now = time.monotonic()
        for key, _ in selector.select(timeout=seconds):
            child: _Child = key.data
            data = os.read(key.fd, 1 << 16)
            if data:
                child.lines[key.fd].feed(data, now)
            else:
                selector.unregister(key.fileobj)
                child.lines[key.fd].close()
                child.open -= 1

    def drain(which: Sequence[_Child], seconds: float) -> None:
        """Passes on output until ``which`` have closed their streams or ``seconds`` pass."""
        deadline = time.monotonic() + seconds
        while any(c.open for c in which) and (left := deadline - time.monotonic()) > 0:
            pump(min(left, 0.05))

    def stop(sig: int, why: str, *, name_command: bool = False, patient: bool = False) -> None:
        """Signals every process group, waits up to ``grace`` seconds (``patient``: until they
        exit by themselves or another signal comes), then kills them."""
        running = [c for c in children if c.proc.poll() is None]
        name = signal.Signals(sig).name
        if running:
            ranks = f"rank{'s' if len(running) > 1 else ''} " + ", ".join(
                str(c.rank) for c in running
            )
            if patient:  # a training program finishes its update and saves first
                why += f"; passed to {ranks}, waiting for them to exit ({name} again stops them)"
            else:
                why += f"; stopping {ranks}"
        report(f"{why} (command: {shown_command})" if name_command else why)
        for c in children:
            c.signal_group(sig)
        asked, deadline = len(received), time.monotonic() + grace
        while any(c.proc.poll() is None for c in children) and (
            patient or time.monotonic() < deadline
        ):
            if len(received) > asked:  # a signal while stopping: kill at once
                break
            pump(0.05)
        late = [c for c in children if c.proc.poll() is None]
        for c in children:
            c.signal_group(signal.SIGKILL)
        if late:
            ranks = ", ".join(str(c.rank) for c in late)
            after = "at a second signal" if patient else f"{grace:g} s after {name}"
            report(f"rank{'s' if len(late) > 1 else ''} {ranks} still running {after}: killed")
        for c in children:
            c.proc.wait()
        drain(children, _DRAIN_SECONDS)  # what they wrote before they went

    try:
        width = len(str(processes - 1))
        for rank in range(processes):
            try:
                proc = subprocess.Popen(
                    command,
                    env=child_env(
                        rank, processes=processes, port=port, cpu_devices=cpu_devices, base=env
                    ),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # its own process group, stopped as one
                )
            except OSError as e:
                status = 127 if isinstance(e, FileNotFoundError) else 126
                stop(signal.SIGTERM, f"cannot start rank {rank}: {e}", name_command=True)
                return status
            child = _Child(rank, proc, f"[{rank:>{width}}] ".encode(), out, err)
            children.append(child)
            for stream in child.streams:
                selector.register(stream, selectors.EVENT_READ, child)

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pump(0.1)
            ended = [c for c in children if c.proc.poll() is not None]
            failed = [c for c in ended if c.proc.returncode != 0]
            if failed:
                first = failed[0]
                drain([first], _DRAIN_SECONDS)  # its last words before the report
                how, status = _describe(first.proc.returncode)
                stop(signal.SIGTERM, f"rank {first.rank} {how}", name_command=True)
                return status
            if len(ended) == len(children):
                drain(children, _DRAIN_SECONDS)
                return 0
            if received:
                sig = received[0]
                stop(sig, f"received {signal.Signals(sig).name}", patient=True)
                return 128 + sig
            if deadline is not None and time.monotonic() >= deadline:
                stop(signal.SIGTERM, f"timed out after {timeout:g} s")
                return TIMEOUT_STATUS
    finally:
        for c in children:
            if c.proc.poll() is None:  # only after an unexpected error: never leave one behind
                c.signal_group(signal.SIGKILL)
                c.proc.wait()
            for stream in c.streams:
                if not stream.closed:
                    c.lines[stream.fileno()].close()
                    stream.close()
        selector.close()
        restore()


def _catch_signals(record: Callable[[int], None]) -> Callable[[], None]:
    """Makes SIGINT, SIGTERM and SIGHUP call ``record``; returns what puts the old handlers back.

    Only the main thread may set handlers; elsewhere nothing is caught.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: FrameType | None) -> None:
        record(signum)

    old = {sig: signal.signal(sig, handler) for sig in _LAUNCHER_SIGNALS}

    def restore() -> None:
        for sig, previous in old.items():
            signal.signal(sig, previous)

    return restore


def _int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _seconds(positive: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(
                f"must be finite and {'> 0' if positive else '>= 0'}, got {text}"
            )
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (the command itself follows ``--`` and is not parsed)."""
    p = argparse.ArgumentParser(
        prog="python -m rudax.run.launch",
        # one line above an error, not every flag: --help lists them
        usage="%(prog)s --processes N [options] -- COMMAND [ARG ...]  (--help lists them)",
        description="Run COMMAND as N jax.distributed processes on this machine (ranks 0..N-1), "
        "their output prefixed by rank; one failing stops all.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--processes", type=_int_at_least(1), required=True, metavar="N", help="how many processes"
    )
    p.add_argument(
        "--cpu-devices",
        type=_int_at_least(1),
        metavar="K",
        help="simulated CPU devices per process (JAX_PLATFORMS=cpu); default: the "
        "machine's own devices, untouched",
    )
    p.add_argument(
        "--port",
        type=_int_at_least(1, 65535),
        metavar="P",
        help="the coordinator's port on 127.0.0.1 (default: a free one)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds(positive=True),
        metavar="S",
        help="stop every process after S seconds and exit 124",
    )
    p.add_argument(
        "--grace",
        type=_seconds(positive=False),
        default=5.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping (default: 5)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: parses ``argv`` (default ``sys.argv[1:]``), returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    split = argv.index("--") if "--" in argv else len(argv)
    args, unknown = parser.parse_known_args(argv[:split])
    command = argv[split + 1 :]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (the command goes after --)")
    if not command:
        parser.error("no command to run: give it after --, e.g. -- python -m examples.lm.train")
    return launch(
        command,
        processes=args.processes,
        cpu_devices=args.cpu_devices,
        port=args.port,
        timeout=args.timeout,
        grace=args.grace,
    )


if __name__ == "__main__":
    sys.exit(main())
