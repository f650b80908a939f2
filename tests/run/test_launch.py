"""rudax.run.launch: N processes on localhost with the jax.distributed environment, their output
prefixed by rank, and one failing (or a timeout, or a signal to the launcher) stopping all.

The children are small ``python -c`` programs (about 50 ms each to start); one test runs a real
2-process x 2-device jax program through the launcher. Each stop is checked by the processes'
own pids: a launcher that returned the right status but left a sleeper behind fails.
"""

import io
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rudax.run.launch import child_env, launch, main

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def run(code: str, processes: int, **kwargs) -> tuple[int, str, str, float]:
    """Launches ``python -c code``; returns its status, stdout, stderr and seconds taken."""
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    status = launch(
        [PY, "-c", textwrap.dedent(code)], processes=processes, stdout=out, stderr=err, **kwargs
    )
    return status, out.getvalue(), err.getvalue(), time.monotonic() - start


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 2  # an orphaned grandchild is reaped by init, not by us
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "processes left running"


def pids_in(directory: Path) -> list[int]:
    return [int(p.read_text()) for p in directory.glob("*.pid")]


# --- the environment -------------------------------------------------------------------------


def test_child_env_follows_the_contract_and_keeps_other_xla_flags():
    flags = "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count"
    base = {"XLA_FLAGS": f"{flags}=8", "PATH": "/bin", "PYTHONUNBUFFERED": "0"}
    env = child_env(2, processes=3, port=4321, cpu_devices=4, base=base)
    assert env == {
        "PATH": "/bin",
        "PYTHONUNBUFFERED": "0",  # the user's choice stays
        "JAX_COORDINATOR_ADDRESS": "127.0.0.1:4321",
        "JAX_NUM_PROCESSES": "3",
        "JAX_PROCESS_ID": "2",
        "XLA_FLAGS": f"{flags}=4",
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "4",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
    }
    assert base["XLA_FLAGS"].endswith("=8")  # not changed in place
    # Without cpu_devices, devices are the machine's: nothing about them is set.
    env = child_env(
        0, processes=1, port=1, base={"XLA_FLAGS": "--xla_foo", "JAX_PLATFORMS": "cuda"}
    )
    assert env["XLA_FLAGS"] == "--xla_foo" and env["JAX_PLATFORMS"] == "cuda"
    assert "JAX_NUM_CPU_DEVICES" not in env and "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in env
    assert env["PYTHONUNBUFFERED"] == "1"


def test_children_see_their_rank_and_their_output_comes_back_prefixed():
    code = """
        import os, sys
        e = os.environ
        print("rank", e["JAX_PROCESS_ID"], "of", e["JAX_NUM_PROCESSES"],
              e["JAX_COORDINATOR_ADDRESS"], e["JAX_NUM_CPU_DEVICES"], e["XLA_FLAGS"])
        print("to stderr", e["JAX_PROCESS_ID"], file=sys.stderr)
    """
    status, out, err, _ = run(code, 3, cpu_devices=2, port=23456)
    assert status == 0
    flags = "--xla_force_host_platform_device_count=2"
    assert sorted(out.splitlines()) == [
        f"[{i}] rank {i} of 3 127.0.0.1:23456 2 {flags}" for i in range(3)
    ]
    assert sorted(err.splitlines()) == [f"[{i}] to stderr {i}" for i in range(3)]


def test_lines_come_whole_and_a_redrawn_progress_line_shows_its_last_state():
    # Two ranks write long lines in small pieces at once; a third draws a progress bar with
    # carriage returns, as tqdm does ("\r" + state), ending with a newline.
    code = """
        import os, sys, time
        rank = int(os.environ["JAX_PROCESS_ID"])
        if rank < 2:
            for n in range(20):
                for piece in range(10):
                    sys.stdout.write(f"r{rank}n{n}p{piece}-")
                    sys.stdout.flush()
                sys.stdout.write("\\n")
        else:
            for n in range(1, 101):
                sys.stderr.write(f"\\r{n:3d}/100 |{'#' * (n // 10):10}|")
                sys.stderr.flush()
                time.sleep(0.001)
            sys.stderr.write("\\nwindows line\\r\\n")
    """
    status, out, err, _ = run(code, 3)
    assert status == 0
    lines = out.splitlines()
    assert len(lines) == 40
    for line in lines:
        rank = line[1]
        assert line.startswith(f"[{rank}] r{rank}n"), line
        assert line.endswith("p9-") and line.count("-") == 10, line
    err_lines = err.splitlines()
    assert "\r" not in err
    assert err_lines[-2:] == ["[2] 100/100 |##########|", "[2] windows line"]
    assert len(err_lines) <= 3  # the first state drawn, perhaps; then at most one per 5 s


def test_a_line_without_end_is_passed_on_in_pieces():
    # 1 MB and no newline: memory stays bounded, nothing is lost.
    status, out, _, _ = run("import sys; sys.stdout.write('z' * 1_000_000)", 1)
    pieces = out.splitlines()
    assert status == 0 and len(pieces) > 1
    assert all(p.startswith("[0] ") and len(p) <= 4 + 2 * 65536 for p in pieces)
    assert "".join(p.removeprefix("[0] ") for p in pieces) == "z" * 1_000_000


# --- a real jax.distributed program --------------------------------------------------------


def test_a_two_process_jax_program_sums_across_processes(tmp_path):
    program = tmp_path / "psum.py"
    program.write_text(
        textwrap.dedent(
            """
            import os
            import jax
            import numpy as np
            from jax.sharding import NamedSharding, PartitionSpec as P

            jax.distributed.initialize(  # the coordinator's address from the environment
                num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                process_id=int(os.environ["JAX_PROCESS_ID"]),
                initialization_timeout=30,
            )
            mesh = jax.make_mesh((jax.device_count(),), ("x",))
            # Device d of the 4 holds d + 1: the sum is 1 + 2 + 3 + 4 = 10 on every device.
            local = 1.0 + jax.process_index() * jax.local_device_count() + np.arange(
                jax.local_device_count(), dtype=np.float32)
            x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
            total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh,
                                          in_specs=P("x"), out_specs=P("x")))(x)
            values = sorted({float(s.data[0]) for s in total.addressable_shards})
            print(f"process {jax.process_index()}/{jax.process_count()}:",
                  f"{jax.local_device_count()} of {jax.device_count()} devices, psum {values}")
            jax.distributed.shutdown()
            """
        )
    )
    out, err = io.StringIO(), io.StringIO()
    status = launch(
        [PY, str(program)], processes=2, cpu_devices=2, timeout=120, stdout=out, stderr=err
    )
    assert status == 0, err.getvalue()
    lines = [line for line in out.getvalue().splitlines() if "[Gloo]" not in line]  # its chatter
    assert sorted(lines) == [
        f"[{i}] process {i}/2: 2 of 4 devices, psum [10.0]" for i in range(2)
    ], err.getvalue()


# --- stopping ------------------------------------------------------------------------------------

# Every rank records its pid (and rank 0 that of a subprocess of its own) in the directory
# argv[1], then rank 1 does what FAIL says while the others sleep.
_SLEEPERS = """
    import os, signal, subprocess, sys, time
    SETUP
    rank, folder = int(os.environ["JAX_PROCESS_ID"]), sys.argv[1]
    def record(name, pid):
        with open(f"{folder}/{name}.tmp", "w") as f:
            f.write(str(pid))
        os.rename(f"{folder}/{name}.tmp", f"{folder}/{name}.pid")
    if rank == 0:
        record("sub", subprocess.Popen(["sleep", "60"]).pid)
    record(rank, os.getpid())
    if rank == 1:
        while len([n for n in os.listdir(folder) if n.endswith(".pid")]) < int(sys.argv[2]) + 1:
            time.sleep(0.01)
        print("rank 1 about to fail", flush=True)
        FAIL
    time.sleep(60)
"""


def sleeper_code(fail: str, setup: str = "") -> str:
    return textwrap.dedent(_SLEEPERS).replace("FAIL", fail).replace("SETUP", setup)


def sleepers(
    tmp_path: Path, processes: int, fail: str, setup: str = "", **kwargs
) -> tuple[int, str, str, float]:
    code = sleeper_code(fail, setup)
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    status = launch(
        [PY, "-c", code, str(tmp_path), str(processes)],
        processes=processes,
        stdout=out,
        stderr=err,
        **kwargs,
    )
    return status, out.getvalue(), err.getvalue(), time.monotonic() - start


def test_one_failing_process_stops_the_others_and_its_status_is_the_launchers(tmp_path):
    status, out, err, seconds = sleepers(tmp_path, 3, "sys.exit(7)", grace=2)
    assert status == 7
    assert seconds < 4, seconds  # the sleepers die at SIGTERM, without the grace period
    assert "[1] rank 1 about to fail" in out
    report = [line for line in err.splitlines() if line.startswith("[launch]")]
    assert len(report) == 1, report
    # One line naming the rank, its status and the command (a multi-line `-c` program: cut short)
    assert report[0].startswith(
        f"[launch] rank 1 exited with status 7; stopping ranks 0, 2 (command: {PY} -c '\\nimport"
    ), report
    assert_gone(pids_in(tmp_path))  # ranks 0 and 2, and rank 0's subprocess


def test_a_process_killed_by_a_signal_gives_128_plus_the_signal(tmp_path):
    status, _, err, seconds = sleepers(tmp_path, 2, "os.kill(os.getpid(), signal.SIGKILL)")
    assert status == 128 + signal.SIGKILL
    assert "[launch] rank 1 was killed by signal 9 (SIGKILL); stopping rank 0 (command: " in err
    assert seconds < 4, seconds
    assert_gone(pids_in(tmp_path))


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    # As a jax.distributed process does: its preemption notifier catches SIGTERM.
    setup = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"  # inherited by `sleep` too
    status, _, err, seconds = sleepers(tmp_path, 2, "sys.exit(1)", setup, grace=0.5)
    assert status == 1
    assert 0.5 <= seconds < 4, seconds
    assert "[launch] rank 0 still running 0.5 s after SIGTERM: killed" in err
    assert_gone(pids_in(tmp_path))


def test_timeout_stops_everything_with_status_124(tmp_path):
    status, _, err, seconds = sleepers(tmp_path, 2, "time.sleep(60)", timeout=1.0, grace=1)
    assert status == 124
    assert "[launch] timed out after 1 s; stopping ranks 0, 1" in err
    assert seconds < 4, seconds
    assert_gone(pids_in(tmp_path))


def _launcher_of_sleepers(tmp_path: Path, code: str, grace: str) -> subprocess.Popen:
    """`python -m rudax.run.launch` of 2 sleepers, returned once every process has started."""
    launch = [PY, "-m", "rudax.run.launch", "--processes", "2", "--grace", grace, "--"]
    launcher = subprocess.Popen(
        [*launch, PY, "-c", code, str(tmp_path), "2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30  # every process started (the launcher imports jax first)
    while len(pids_in(tmp_path)) < 3 and launcher.poll() is None:
        if time.monotonic() > deadline:
            launcher.kill()
            raise AssertionError("the processes did not start")
        time.sleep(0.05)
    return launcher


def _ctrl_c(tmp_path: Path, setup: str = "", *, again: bool = False) -> tuple[str, str]:
    """Ctrl-C to a launcher of 2 sleepers with --grace 0.5 (and a second one, past the grace,
    ``again``): their (stdout, stderr), once it has exited 130, every process gone."""
    # Rank 1 marks when its line is printed: a SIGINT in the middle of `print` would run the
    # handler between the text and its newline, and glue the handler's line onto it.
    ready = "open(f'{folder}/printed', 'w').close(); time.sleep(60)"
    launcher = _launcher_of_sleepers(tmp_path, sleeper_code(ready, setup), "0.5")
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "printed").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        launcher.send_signal(signal.SIGINT)
        if again:
            time.sleep(1)  # past --grace: still waiting
            assert launcher.poll() is None
            launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=20)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGINT
    assert_gone(pids_in(tmp_path))
    return out, err


def test_ctrl_c_to_the_launcher_stops_every_process(tmp_path):
    _, err = _ctrl_c(tmp_path)
    assert "[launch] received SIGINT; passed to ranks 0, 1, waiting for them to exit" in err


def test_processes_interrupted_take_the_time_they_need_to_save(tmp_path):
    # As rudax's programs do at Ctrl-C: finish the update and save (here 2 s, past --grace).
    setup = (
        "signal.signal(signal.SIGINT, lambda *a: (time.sleep(2), print('saved', flush=True), "
        "os._exit(130)))"
    )
    out, err = _ctrl_c(tmp_path, setup)
    saved = sorted(line for line in out.splitlines() if "saved" in line)
    assert saved == ["[0] saved", "[1] saved"], (out, err)
    assert "killed" not in err


def test_a_second_ctrl_c_kills_processes_that_do_not_stop(tmp_path):
    setup = "signal.signal(signal.SIGINT, signal.SIG_IGN)"  # inherited by `sleep` too
    _, err = _ctrl_c(tmp_path, setup, again=True)
    assert "[launch] ranks 0, 1 still running at a second signal: killed" in err


def test_all_processes_succeeding_is_status_0_and_a_missing_command_127(tmp_path):
    status, out, err, _ = run("print('ok')", 2)
    assert (status, sorted(out.splitlines()), err) == (0, ["[0] ok", "[1] ok"], "")
    err = io.StringIO()
    assert launch([str(tmp_path / "missing")], processes=2, stderr=err) == 127
    assert err.getvalue().startswith("[launch] cannot start rank 0: [Errno 2]")


# --- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--processes", "0", "--", "true"], "argument --processes: must be >= 1, got 0"),
        (["--processes", "two", "--", "true"], "argument --processes: expected an integer"),
        (["--processes", "2", "--cpu-devices", "0", "--", "true"], "argument --cpu-devices: must"),
        (["--processes", "2", "--port", "70000", "--", "true"], "must be in [1, 65535], got 70000"),
        (["--processes", "2", "--timeout", "0", "--", "true"], "--timeout: must be finite and > 0"),
        (["--processes", "2", "--timeout", "nan", "--", "true"], "--timeout: must be finite"),
        (["--processes", "2"], "no command to run: give it after --"),
        (["--processes", "2", "--"], "no command to run: give it after --"),
        (["--processes", "2", "python", "x.py"], "unrecognized arguments: python x.py (the comm"),
        (["--", "true"], "the following arguments are required: --processes"),
    ],
)
def test_bad_arguments_print_one_line_of_usage_and_the_error(argv, error, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("usage: python -m rudax.run.launch --processes N [options] -- ")
    assert lines[1].startswith("python -m rudax.run.launch: error: "), lines
    assert error in lines[1], lines


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"command": []}, "command must be a non-empty list of strings"),
        ({"processes": 0}, "processes must be >= 1, got processes=0"),
        ({"processes": 2.0}, "processes must be an int, got processes=2.0"),
        ({"cpu_devices": 0}, "cpu_devices must be >= 1, got cpu_devices=0"),
        ({"port": 0}, r"port must be in \[1, 65535\], got port=0"),
        ({"timeout": -1.0}, "timeout must be finite and > 0, got timeout=-1.0"),
        ({"grace": float("inf")}, "grace must be finite and >= 0, got grace=inf"),
    ],
)
def test_bad_arguments_to_launch_name_the_argument(kwargs, error):
    args = {"command": ["true"], "processes": 1, **kwargs}
    exc = TypeError if isinstance(kwargs.get("processes"), float) else ValueError
    with pytest.raises(exc, match=error):
        launch(**args)
