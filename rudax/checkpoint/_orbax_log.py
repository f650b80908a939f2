"""orbax's log lines that are not news to a rudax user, dropped where they are logged."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["without_read_only_notice"]


# What orbax logs for a read-only manager: its directory, and its options.
_NOTICES = ("Given directory is read only", "CheckpointManagerOptions.read_only=True")


class _ReadOnlyNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_NOTICES)


@contextlib.contextmanager
def without_read_only_notice() -> Iterator[None]:
    """Drops orbax's ``WARNING:absl:Given directory is read only=...`` and
    ``WARNING:absl:CheckpointManagerOptions.read_only=True, setting save_interval_steps=0.``,
    logged for every read-only CheckpointManager and its options: asked for, that is what a
    restore is, and users read the warnings as a problem. absl logs through the ``absl``
    logger; nothing else is dropped."""
    logger, notice = logging.getLogger("absl"), _ReadOnlyNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)
