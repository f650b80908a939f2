"""orbax's log lines that are not news to a rudax user, dropped where they are logged."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["without_read_only_notice"]


class _ReadOnlyNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only")


@contextlib.contextmanager
def without_read_only_notice() -> Iterator[None]:
    """Drops orbax's ``WARNING:absl:Given directory is read only=...``, logged by every
    read-only CheckpointManager: asked for, it is what a restore is, and users read the
    warning as a problem. absl logs through the ``absl`` logger; nothing else is dropped."""
    logger, notice = logging.getLogger("absl"), _ReadOnlyNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)
