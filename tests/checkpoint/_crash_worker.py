"""Child processes of tests/checkpoint/test_crash.py: a server that forks lives that save.

``python _crash_worker.py`` starts a zygote: it imports JAX, orbax and rudax once and then,
for each JSON line ``[directory, mode, first_step, keep]`` on stdin, forks a *life*: a fresh
process that starts JAX's CPU backend, opens a ``rudax.checkpoint.Checkpointer`` on
``directory`` (``mode`` ``"sync"`` or ``"async"``) and saves the records of ``first_step``,
``first_step + 1``, ... until the parent kills it with SIGKILL. The zygote reaps it and waits
for the next line. Forking is safe here because the zygote is single-threaded when it forks
(JAX's backend and orbax's threads start only in the life; ``OMP_NUM_THREADS=1`` keeps
NumPy's BLAS from starting a pool), and it spares each life the second or two that importing
JAX and rudax costs: the crash trials can afford twenty lives.

Lines on stdout, each flushed, tell the parent where a kill landed:

    pid P              (zygote) a life was forked as process P
    ready              (life) the checkpointer is open
    begin S            (life) about to call save(S, record)
    returned S         (life, async only) save() returned: the write goes on in the background
    end S              (life) S is committed (sync: save() returned; async: wait() returned)
    exit P STATUS      (zygote) life P is gone, with its waitpid status

Every value of a step's record is a pure function of the step (``record(step)``), so the
parent recomputes what a restored step must hold bit for bit. The parent imports this module
for ``record`` and ``KEEP``; only running it as a script starts a zygote.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import rudax.checkpoint as rc
import rudax.optim as ro

KEEP = 3
MAX_SAVES = 40  # a bound, never reached: the parent kills the child within a few saves
ROWS, COLS = 512, 512  # model["w"]: 1 MiB of fp32; with moments and sums ~4.5 MB a record


def _fill(like: jax.ShapeDtypeStruct, salt: int, step: int) -> jax.Array:
    # Distinct per leaf (salt) and per step; the cast rounds (bf16 keeps 8 bits), the same
    # way every time, so the parent's recomputation is bitwise the child's. Built in NumPy and
    # put on the device: no eager jnp op, so no compilation in a child that lives a second.
    pattern = np.arange(like.size, dtype=np.int64) % 251 + 7 * salt + step
    return jax.device_put(pattern.astype(like.dtype).reshape(like.shape))


@functools.cache
def _layout() -> tuple[Any, ...]:
    """Shapes and dtypes of (model, optimizer state, accumulator), traced, never computed."""
    params = {
        "w": jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
        "b": jax.ShapeDtypeStruct((COLS,), jnp.bfloat16),
        "table": jax.ShapeDtypeStruct((64, 32), jnp.float16),
    }
    tx = ro.fp32_master(ro.adamw(1e-3))
    acc = jax.eval_shape(lambda p: ro.GradientAccumulator.init(p, dtype=jnp.float32), params)
    return params, jax.eval_shape(tx.init, params), acc


def record(step: int) -> rc.TrainingRecord:
    """The record saved as ``step``: every array leaf, int and string derived from step."""
    leaves, treedef = jax.tree.flatten(_layout())
    filled = [_fill(x, salt, step) for salt, x in enumerate(leaves)]
    model, optimizer, accumulator = jax.tree.unflatten(treedef, filled)
    state = {
        "rng": jax.device_put(np.array([step, 0x9E3779B9 ^ step], np.uint32)),
        "data_position": 1000 * step + 17,
        "run": f"crash-step-{step}",
    }
    return rc.TrainingRecord.capture(
        model=model, optimizer=optimizer, accumulator=accumulator, state=state
    )


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def life(directory: str, mode: str, first_step: int, keep: int) -> None:
    ckpt = rc.Checkpointer(directory, keep=keep, async_save=mode == "async")
    _say("ready")
    for step in range(first_step, first_step + MAX_SAVES):
        rec = jax.block_until_ready(record(step))
        _say(f"begin {step}")
        ckpt.save(step, rec)
        if mode == "async":
            _say(f"returned {step}")
            time.sleep(0.002)  # a train step's worth of work while the write goes on
            ckpt.wait()
        _say(f"end {step}")
    ckpt.close()


def _threads() -> int:
    # Native threads too (a BLAS pool, a C++ library's workers), where /proc tells.
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def zygote() -> None:
    for line in sys.stdin:
        directory, mode, first_step, keep = json.loads(line)
        if _threads() != 1:
            raise SystemExit(f"the zygote runs {_threads()} threads: forking it is unsafe")
        sys.stdout.flush()  # a forked child must not inherit unwritten output
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                life(directory, mode, first_step, keep)
            except BaseException:
                traceback.print_exc()
                status = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)  # never return into the zygote's loop
        _say(f"pid {pid}")
        _, status = os.waitpid(pid, 0)
        _say(f"exit {pid} {status}")


if __name__ == "__main__":
    zygote()
