"""Ctrl-C and a preemption's SIGTERM: finish the update, save, say how to resume.

A training loop that dies at the signal loses every update since its last checkpoint (up to
``checkpoint_every - 1`` of them) and prints a traceback. ``Interruptions`` instead records
the signal, lets the loop finish the update it is in, and answers ``stop_after(step)`` with
True, so the loop saves a checkpoint and ends the way ``--stop-at`` ends it.

Without ``jax.distributed``: SIGINT and SIGTERM each set the request. A second SIGINT is
Python's own ``KeyboardInterrupt`` again (for a loop stuck in something that never finishes).

Under ``jax.distributed`` (one process or several): every process must stop after the same
update, or the ones still training wait for the others in their next collective. jax agrees on
that step for a preemption: SIGTERM is its preemption notice, spread to every process through
the coordination service, and ``multihost_utils.reached_preemption_sync_point(step)`` is True
on all of them at the same step (the largest step any process had reached, plus one).
``stop_after`` asks it, and SIGINT is turned into that notice (the process sends itself
SIGTERM), so a Ctrl-C forwarded by ``python -m rudax.run.launch`` stops every process
cleanly too. SIGTERM's handler is jax's own there; this module leaves it in place.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

import jax
from jax.experimental import multihost_utils

__all__ = ["Interruptions"]


class Interruptions:
    """A context in which SIGINT and SIGTERM ask the training loop to stop after an update.

    Call ``stop_after(step)`` once after every update (every process, every update, from
    the same first step, as jax's preemption sync asks): True means save a checkpoint of
    ``step`` and leave the loop. ``signal_name`` then names what was received ("SIGINT",
    "SIGTERM"; "a preemption notice" when another process received it).

    The handlers are put in on entry and the old ones back on exit; outside the main thread
    (where Python allows no handlers) nothing is caught and, without ``jax.distributed``,
    ``stop_after`` is always False.

    Example:
      >>> import os, signal
      >>> from rudax.run import Interruptions
      >>> with Interruptions() as interrupt:
      ...     for step in range(1, 100):
      ...         if step == 3:
      ...             os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during update 3
      ...         if interrupt.stop_after(step):
      ...             break  # save checkpoint `step` here
      >>> step, interrupt.signal_name
      (3, 'SIGINT')
    """

    def __init__(self) -> None:
        self._received: int | None = None
        self._old: dict[int, Any] = {}  # the handlers to put back
        self._multi = False

    @property
    def signal_name(self) -> str | None:
        """The signal that asked the loop to stop, or None while none has."""
        if self._received is None:
            return None
        if self._received < 0:
            return "a preemption notice"
        return signal.Signals(self._received).name

    def stop_after(self, step: int) -> bool:
        """Whether the loop should save checkpoint ``step`` and stop (see the class doc)."""
        if self._multi:
            if multihost_utils.reached_preemption_sync_point(step):
                if self._received is None:
                    self._received = -1  # the notice came from another process
                return True
            return False
        return self._received is not None

    def __enter__(self) -> Interruptions:
        if threading.current_thread() is not threading.main_thread():
            return self
        # jax.distributed (one process or several): SIGTERM is its preemption notice, its
        # handler installed by jax.distributed.initialize, and the sync point answers.
        self._multi = jax.distributed.is_initialized()
        # With several processes SIGTERM stays jax's preemption notice. A handler installed
        # outside Python (getsignal None) could not be put back: it is left alone.
        for sig in (signal.SIGINT,) if self._multi else (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not None:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._received == signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self._received = signum
        if self._multi:
            os.kill(os.getpid(), signal.SIGTERM)  # jax's notice, which every process learns
