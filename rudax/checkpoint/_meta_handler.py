"""The meta item's orbax handler: the checksums are taken inside orbax's background commit.

A save's meta item (``_meta.py``) holds a checksum of every array saved, so it can be
written only once every array is hashed. Hashing takes a while (~0.6 s per GB on 2 CPU
cores); done before handing the step to orbax, it kept an async save's caller waiting. orbax's
``AsyncCheckpointHandler`` contract has room for it. A handler's ``async_save`` runs on the
caller's thread and returns *commit futures*; orbax runs them in the background and waits for
every item's futures before it renames the step's temporary directory to its final name
(orbax-checkpoint 0.12.8: ``AsyncCheckpointer._save`` gathers them,
``_background_wait_for_commit_futures`` waits for them, then ``on_commit_callback``
renames). So ``MetaHandler``:

* ``async_save``, on the caller's thread: takes the host copy of every array
  (``_integrity.host_copies``: the device-to-host copy, which on an accelerator is the very
  transfer orbax's array handler then reuses, and on CPU a view that keeps the buffer from
  being donated or freed) and returns one commit future;
* the future, in orbax's background: once the caller's ``save`` has returned
  (``MetaSave.released``), hashes the copies, adds up the processes' sums, builds the meta
  JSON (its digest included) and writes it, as ``JsonCheckpointHandler`` would.

A crash before the future ends leaves an uncommitted temporary directory, never a step; an
error inside it fails orbax's commit and reaches the caller at the next ``save``, ``wait`` or
``close``. orbax does not hand out the host copies it makes (``ArrayHandler.serialize`` keeps
its replica slices in a closure; its ``SerializationStatusCallback`` gets key paths only), but
both read ``np.asarray`` of the same ``shard.data`` objects. The exception: a replicated array
that orbax splits across its replicas (``use_replica_parallel``, on by default) is copied by
orbax slice by slice and here as replica 0's whole shard.

Processes: each hashes the shards it holds. The primary (process 0), which alone writes the
item, adds up the others' sums, which they publish in the ``jax.distributed`` key-value store,
a few integers each: not a collective, since one issued from a background thread could
interleave with the train step's collectives on another process and deadlock. A process whose
hashing failed publishes the error, so that the primary fails at once instead of waiting out
the timeout.

Synchronous saves use the same handler: orbax's synchronous ``Checkpointer`` runs
``async_save`` and waits for its futures before committing, so the files are the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future as orbax_future

from rudax.checkpoint._integrity import (
    HostCopy,
    as_hex,
    combine_sums,
    host_copies,
    local_sums,
)
from rudax.checkpoint._meta import build_meta

# orbax JsonCheckpointHandler's default file name, which plain orbax reads.
FILENAME = "metadata"

# How long the primary process waits for another's sums: orbax's own deadline for an async
# save's commit (``AsyncOptions.timeout_secs``).
_TIMEOUT_MS = 1200 * 1000

# Numbers this process's saves, in order. Every process of a run makes the same saves in the
# same order (orbax's barriers require it), so the n-th save has the same number everywhere.
_SAVES = itertools.count()


def exchange_key(step: int) -> str:
    """A key-value store prefix unique to this save and the same in every process."""
    return f"rudax_checkpoint/save_{next(_SAVES)}/step_{step}"


@dataclasses.dataclass
class MetaSave(ocp.args.CheckpointArgs):
    """What the meta item of one save is made of.

    Attributes:
      fields: ``build_meta``'s keyword arguments, all but ``checksums``: JSON data that no
        one changes once ``save`` returns.
      parts: {part name: tree} of the record parts whose arrays the checksums are of.
      key: ``exchange_key(step)``, under which the processes publish their sums.
      released: set once the caller's ``save`` has returned; the hashing waits for it. An
        async save's background hashing otherwise takes a core (CRC-32C runs at memory
        speed: 0.1 s per GB) while orbax is still setting the step up on the caller's
        thread, which doubled to quintupled its blocking time on a 2-core machine. A
        synchronous save sets it first: orbax waits for the hashing inside ``save``.
    """

    fields: dict[str, Any]
    parts: dict[str, Any]
    key: str
    released: threading.Event


@dataclasses.dataclass
class MetaRestore(ocp.args.CheckpointArgs):
    """Restore arguments of the meta item: none, it is read whole."""


class MetaHandler(ocp.handlers.JsonCheckpointHandler):
    """``JsonCheckpointHandler`` whose item gets its checksums in orbax's commit future.

    Reading is ``JsonCheckpointHandler``'s. Used through a ``CheckpointHandlerRegistry``
    entry for ``MetaSave``/``MetaRestore``, not orbax's global registry: see ``typestr``.
    """

    def __init__(self) -> None:
        super().__init__(FILENAME)

    @classmethod
    def typestr(cls) -> str:
        # orbax records this in the step's metadata as the handler that reads the item, and
        # the file is JsonCheckpointHandler's: so plain orbax, without rudax, restores the
        # item even without arguments. (Registering this class globally would collide with
        # JsonCheckpointHandler's entry; nothing needs it to be.)
        return ocp.handlers.JsonCheckpointHandler.typestr()

    async def async_save(
        self,
        directory: epath.Path,
        item: Any = None,
        args: ocp.args.CheckpointArgs | None = None,
    ) -> list[Any]:
        """Takes the host copies now; returns the future that hashes them and writes."""
        if not isinstance(args, MetaSave):
            raise TypeError(f"MetaHandler saves MetaSave arguments, got {type(args).__name__}")
        copies = {part: host_copies(t, copy_numpy=True) for part, t in args.parts.items()}
        return [
            orbax_future.CommitFutureAwaitingContractedSignals(
                self._commit(directory, args, copies), name="rudax_meta"
            )
        ]

    async def _commit(
        self, directory: epath.Path, args: MetaSave, copies: dict[str, dict[str, HostCopy]]
    ) -> None:
        try:
            await asyncio.to_thread(args.released.wait)
            checksums = _checksums(copies, args.key, args.fields["checksum_algorithm"])
            if jax.process_index() == 0:
                meta = build_meta(**args.fields, checksums=checksums)
                (directory / FILENAME).write_text(json.dumps(meta))
        except BaseException as e:
            e.add_note(
                f"rudax: checkpoint step {args.fields['step']} was not committed: hashing its "
                "arrays or writing its meta item failed"
            )
            raise


def _checksums(
    copies: dict[str, dict[str, HostCopy]], key: str, algorithm: str
) -> dict[str, dict[str, str]]:
    """{part: {path: 8 hex digits}} of the copies, every process's shards combined."""
    flat = [copy for table in copies.values() for copy in table.values()]
    if jax.process_count() == 1:
        sums = local_sums(flat, algorithm)
    else:
        sums = _add_over_processes(flat, key, algorithm)
    out, start = {}, 0
    for part, table in copies.items():
        out[part] = as_hex(list(table), sums[start : start + len(table)])
        start += len(table)
    return out


def _client() -> Any:
    # jax.distributed's client has no public accessor; orbax reaches it the same way
    # (``multihost.get_jax_distributed_client``).
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("a multi-process checkpoint needs jax.distributed.initialize()")
    return client


def _add_over_processes(flat: list[HostCopy], key: str, algorithm: str) -> np.ndarray:
    """This process's sums; on the primary, every process's combined."""
    client, me = _client(), jax.process_index()
    try:
        sums = local_sums(flat, algorithm)
    except BaseException as e:
        if me != 0:
            client.key_value_set(f"{key}/{me}", f"error: {type(e).__name__}: {e}")
        raise
    if me != 0:
        client.key_value_set(f"{key}/{me}", json.dumps([int(s) for s in sums]))
        return sums
    others = []
    for process in range(1, jax.process_count()):
        text = client.blocking_key_value_get(f"{key}/{process}", _TIMEOUT_MS)
        client.key_value_delete(f"{key}/{process}")
        if text.startswith("error: "):
            raise RuntimeError(f"process {process} failed to hash its shards: {text[7:]}")
        others.append(np.array(json.loads(text), np.uint64))
    return combine_sums(sums, others, np.array([c.spread for c in flat], bool), algorithm)
