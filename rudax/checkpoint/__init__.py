"""rudax.checkpoint: the whole training state saved and restored with orbax."""

from rudax.checkpoint._checkpointer import Checkpointer as Checkpointer
from rudax.checkpoint._integrity import CheckpointCorruptedError as CheckpointCorruptedError
from rudax.checkpoint._lock import CheckpointLockedError as CheckpointLockedError
from rudax.checkpoint._record import TrainingRecord as TrainingRecord

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointLockedError",
    "Checkpointer",
    "TrainingRecord",
]
