"""A child process's output as the launcher shows it: whole lines, each with the rank's prefix.

A child's stream arrives in arbitrary pieces; written as they come, two ranks' lines would be
cut into each other. ``ChildLines`` holds the unfinished line, writes whole ones, and shows a
redrawn progress line (tqdm's ``\r`` states) at most every ``PROGRESS_EVERY`` seconds.
"""

from __future__ import annotations

import math
from typing import TextIO

__all__ = ["PROGRESS_EVERY", "ChildLines", "write_bytes"]

# Seconds between two shown states of one child's redrawn (\r) line: a progress bar redraws
# ten times a second, which as whole lines would bury everything else.
PROGRESS_EVERY = 5.0
# A line longer than this without a newline is passed on in pieces (memory stays bounded).
_MAX_LINE = 1 << 16


def write_bytes(stream: TextIO, data: bytes) -> None:
    """Writes ``data`` to a text stream: as bytes where it has a binary buffer, else decoded."""
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        stream.flush()  # text written before must come first
        buffer.write(data)
        buffer.flush()
    else:
        stream.write(data.decode("utf-8", errors="replace"))
        stream.flush()


class ChildLines:
    """One child stream cut into whole lines, each written with the rank's prefix."""

    def __init__(self, prefix: bytes, out: TextIO):
        self._prefix = prefix
        self._out = out
        self._pending = b""  # the line so far: no newline in it
        self._progress_at = -math.inf  # when a redrawn state was last shown
        self._progress_shown = b""

    def feed(self, data: bytes, now: float) -> None:
        *lines, self._pending = (self._pending + data).split(b"\n")
        shown = []
        for line in lines:
            text = _as_shown(line)
            if text is not None and not (b"\r" in line and text == self._progress_shown):
                shown.append(text)
            self._progress_at, self._progress_shown = -math.inf, b""
        if b"\r" in self._pending:
            # What a terminal shows now: the text after the last \r (tqdm writes "\r" + state).
            head, _, tail = self._pending.rpartition(b"\r")
            state = (tail if tail.strip() else head.rpartition(b"\r")[2]).rstrip()
            self._pending = b"\r" + tail  # earlier states are overdrawn: forget them
            if state and now - self._progress_at >= PROGRESS_EVERY:
                shown.append(state)
                self._progress_at, self._progress_shown = now, state
        if len(self._pending) >= _MAX_LINE:
            text = _as_shown(self._pending)
            if text is not None and text != self._progress_shown:
                shown.append(text)
            self._pending = b""
        if shown:
            write_bytes(self._out, b"".join(self._prefix + s + b"\n" for s in shown))

    def close(self) -> None:
        """Writes what is left of an unfinished last line."""
        pending, self._pending = self._pending, b""
        text = _as_shown(pending) if pending else None
        if text is not None and text != self._progress_shown:
            write_bytes(self._out, self._prefix + text + b"\n")


def _as_shown(line: bytes) -> bytes | None:
    """A finished line as a terminal shows it; None for one that was drawn over to blank."""
    line = line.removesuffix(b"\r")  # \r\n line ends
    if b"\r" not in line:
        return line
    text = line.rpartition(b"\r")[2].rstrip()
    return text or None
