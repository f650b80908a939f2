"""One writer per checkpoint directory: an OS file lock held from open to close.

Two Checkpointers saving into one directory race inside orbax: saves fail with orbax's
internals, and a step one "saved" is deleted by the other's retention or shadowed by its
newer steps. So a writing Checkpointer holds ``<root>/rudax.lock`` locked with
``fcntl.flock(LOCK_EX | LOCK_NB)`` until ``close()``, and writes into the file who holds it
(pid, host, start time, command line). A second writer, in this process or another, gets
``CheckpointLockedError`` naming the holder at once, instead of waiting. The kernel releases
the lock when the holder's file descriptor closes: on ``close()``, and on the process's
death by any signal, so a crash never leaves a directory locked. A lock is per open file
description: a child made by ``os.fork`` shares it (``subprocess`` children do not, the
descriptor is not inheritable). ``flock`` works on local filesystems and, on Linux, over NFS
(as a POSIX lock); a filesystem without locks fails loudly at open.

The file is removed on release, so a closed directory holds no stale name. Removing a lock
file races with a process that opened it just before: after locking, the holder checks that
the path still names the file it locked, and otherwise locks the new one.

In a multi-process run only the primary process (0) locks; it tells the others through the
``jax.distributed`` key-value store whether it did, so that all raise the same error instead
of the others waiting at orbax's first barrier.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import itertools
import json
import os
import socket
import sys
from collections.abc import Callable

import jax

LOCK = "rudax.lock"

# Each Checkpointer opening is numbered; every process of a run opens the same ones in order.
_OPENS = itertools.count()
_TIMEOUT_MS = 300 * 1000


class CheckpointLockedError(RuntimeError):
    """Another Checkpointer holds the checkpoint directory; the message names it.

    Raised by ``Checkpointer(directory)`` while another writer (in this process or another)
    has the directory open. Close that one, wait for its process to end, or open this one
    with ``read_only=True`` to restore without writing.

    Example:
      >>> import rudax.checkpoint as rc
      >>> issubclass(rc.CheckpointLockedError, RuntimeError)
      True
    """


class DirectoryLock:
    """The held lock of one checkpoint directory; ``release()`` once done."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, LOCK)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise CheckpointLockedError(self._held_by(root)) from None
                raise
            try:  # the holder before us may have removed the file we opened: lock the new one
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd: int | None = fd
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:500],
        }
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder) + "\n").encode())

    def _held_by(self, root: str) -> str:
        try:
            with open(self.path) as f:
                holder = json.loads(f.read())
            who = (
                f"pid {holder['pid']} on host {holder['host']}, since {holder['since']}"
                + (" (this process)" if holder["pid"] == os.getpid() else "")
                + f", running {holder.get('command', '?')!r}"
            )
        except (OSError, ValueError, KeyError, TypeError):
            who = "a process that has not written its name yet (it is just opening)"
        return (
            f"{root} is in use by another Checkpointer: {who}. Two writers would race in "
            "orbax and lose saves: close the other one or wait for it to end, use another "
            "directory, or open with read_only=True to restore only"
        )

    def release(self) -> None:
        """Removes the lock file and unlocks it; a second call does nothing."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)  # while still locked: no one else holds this file
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)  # closing the last descriptor releases the lock


def _client():
    from rudax.checkpoint._meta_handler import _client

    return _client()


def hold(root: str, prepare: Callable[[], None]) -> DirectoryLock | None:
    """Locks root on the primary process and runs prepare there while holding it.

    Returns the lock on the primary process, None on the others. Raises
    ``CheckpointLockedError`` (on every process of a multi-process run) if another
    Checkpointer holds root, or what prepare raised.
    """
    many = jax.process_count() > 1
    key = f"rudax_checkpoint/open_{next(_OPENS)}"
    if jax.process_index() != 0:
        verdict = _client().blocking_key_value_get(key, _TIMEOUT_MS)
        if verdict != "ok":
            raise CheckpointLockedError(f"process 0 could not open {root}: {verdict}")
        return None
    try:
        os.makedirs(root, exist_ok=True)
        lock = DirectoryLock(root)
        try:
            prepare()
        except BaseException:
            lock.release()
            raise
    except BaseException as e:
        if many:
            _client().key_value_set(key, f"{type(e).__name__}: {e}")
        raise
    if many:
        _client().key_value_set(key, "ok")
    return lock
