"""rudax.run: what a training program does around its steps.

``MetricsLog`` appends each logged row to ``metrics.jsonl`` (and, optionally, TensorBoard),
and on resume first drops the rows an interrupted session logged past its checkpoint, so the
file reads as one run; ``read_metrics`` reads it back and ``plot_losses`` draws it.
``check_loss`` and ``check_finite`` raise ``TrainingHalted`` before a broken run saves
anything: a non-finite loss, or non-finite weights about to be checkpointed (named by their
pytree path). ``retain_freed_memory`` keeps XLA:CPU's per-step scratch memory mapped instead
of faulting it in again each step (``MALLOC_ENV``: the same for a child process).
``run_program`` ends a program's ``main`` the same in every program (exit statuses 2, 1,
128 + signal; a ``UsageError`` is a bad flag), ``HelpFormatter`` shows the flags' defaults
and ``given_flags`` tells the flags typed from defaults (a resumed run keeps its own).
``RunConfig`` is a program's frozen run configuration from its flags, a resumed run's own
flags with the session's on top. ``Interruptions`` turns Ctrl-C and a preemption's SIGTERM
into a request the loop answers after its current update: save, then stop as ``--stop-at``
does (agreed by every process).
``open_checkpoints`` opens a run's checkpoints for a session's saves and ``restore_latest``
restores one on ``--resume``, a damaged or foreign checkpoint a ``UsageError`` saying what to do.
``format_table`` prints a timing report's fixed-width table.

``python -m rudax.run.launch --processes N [--cpu-devices K] -- COMMAND`` runs a command as N
``jax.distributed`` processes on this machine (``rudax.run.launch.launch`` from Python), their
output prefixed by rank, one failing stopping all. It is a module of its own, not imported
here: ``-m`` imports this package before running the module, and a package that had already
imported it would make ``runpy`` warn that the module exists twice.
"""

# Public names, re-exported one per line (``from rudax.run._x import a as a``), sorted as
# isort sorts them, and listed again in __all__.
from rudax.run._cli import HelpFormatter as HelpFormatter
from rudax.run._cli import UsageError as UsageError
from rudax.run._cli import given_flags as given_flags
from rudax.run._cli import mesh_flag as mesh_flag
from rudax.run._config import RunConfig as RunConfig
from rudax.run._distributed import DistributedError as DistributedError
from rudax.run._distributed import add_distributed_flags as add_distributed_flags
from rudax.run._distributed import fail_fast as fail_fast
from rudax.run._distributed import initialize as initialize_distributed
from rudax.run._distributed import initialize_from_flags as initialize_from_flags
from rudax.run._halt import TrainingHalted as TrainingHalted
from rudax.run._halt import check_finite as check_finite
from rudax.run._halt import check_loss as check_loss
from rudax.run._host_memory import MALLOC_ENV as MALLOC_ENV
from rudax.run._host_memory import retain_freed_memory as retain_freed_memory
from rudax.run._interrupt import Interruptions as Interruptions
from rudax.run._metrics import MetricsLog as MetricsLog
from rudax.run._metrics import plot_losses as plot_losses
from rudax.run._metrics import read_metrics as read_metrics
from rudax.run._program import run_program as run_program
from rudax.run._resume import open_checkpoints as open_checkpoints
from rudax.run._resume import restore_latest as restore_latest
from rudax.run._table import format_table as format_table

__all__ = [
    "MALLOC_ENV",
    "DistributedError",
    "HelpFormatter",
    "Interruptions",
    "MetricsLog",
    "RunConfig",
    "TrainingHalted",
    "UsageError",
    "add_distributed_flags",
    "check_finite",
    "check_loss",
    "fail_fast",
    "format_table",
    "given_flags",
    "initialize_distributed",
    "initialize_from_flags",
    "mesh_flag",
    "open_checkpoints",
    "plot_losses",
    "read_metrics",
    "restore_latest",
    "retain_freed_memory",
    "run_program",
]
