"""TrainingRecord: everything a run needs to continue, gathered as one pytree.

A record holds the parts as the caller gives them: no copy is made and no optimizer or
accumulator state is created, so capturing is free and cannot change what is saved.

Caller ``state`` may mix arrays with plain Python values (a data position, a run name). The
two are stored apart: arrays (``jax.Array``, ``np.ndarray``, NumPy scalars) go to orbax like
every other part, while ``bool``/``int``/``float``/``str`` leaves go, by their pytree path, into
the checkpoint's JSON metadata item. JSON keeps them exact (Python ints of any size, strings)
and readable without rudax; converting them to arrays would give them back as arrays, not as
the ints and strings the caller put in.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from rudax.optim import GradientAccumulator

# The Python leaf types the JSON metadata item stores exactly.
PYTHON_LEAVES = (bool, int, float, str)

# Order matters: it is the order of the orbax items and of the validation messages.
PARTS = ("model", "optimizer", "accumulator", "state")


class TrainingRecord(NamedTuple):
    """The whole training state: model, optimizer, pending gradients and caller state.

    A NamedTuple, so a pytree: it goes through ``jax.jit`` and ``jax.tree.map`` as is. Build
    one with ``TrainingRecord.capture``; save and restore it with ``rudax.checkpoint.Checkpointer``.

    Attributes:
      model: the model parameters, any pytree of arrays (a nested dict, a ``flax.nnx.State``).
      optimizer: the optimizer state, e.g. ``tx.init(params)``; its update count is the
        schedule's position, so a restored run continues the learning-rate schedule.
      accumulator: a ``rudax.optim.GradientAccumulator`` (a window in progress) or None.
      state: the caller's pytree (data position, RNG key data, counters): arrays and Python
        ``bool``/``int``/``float``/``str`` leaves, or None.

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.checkpoint as rc
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.zeros(2)}
      >>> tx = ro.sgd(0.1)
      >>> record = rc.TrainingRecord.capture(
      ...     model=params, optimizer=tx.init(params), state={"epoch": 3, "name": "run-1"}
      ... )
      >>> record.state["epoch"], record.accumulator is None
      (3, True)

    References:
      orbax-checkpoint, https://orbax.readthedocs.io (the on-disk format).
    """

    model: Any  # pytree of arrays
    optimizer: Any  # pytree of arrays (an optax state)
    accumulator: GradientAccumulator | None  # the pending window, or None
    state: Any  # pytree of arrays and bool/int/float/str leaves, or None

    @classmethod
    def capture(
        cls, *, model: Any, optimizer: Any, accumulator: Any = None, state: Any = None
    ) -> TrainingRecord:
        """Gathers the parts of a run into a record, holding them as given.

        Args:
          model: the model parameters, any pytree of arrays.
          optimizer: the optimizer state.
          accumulator: a ``GradientAccumulator`` or None.
          state: caller state, a pytree of arrays and Python bool/int/float/str leaves.

        Returns:
          A ``TrainingRecord`` whose fields are the very objects passed in.
        """
        if accumulator is not None and not isinstance(accumulator, GradientAccumulator):
            raise TypeError(
                "accumulator must be a rudax.optim.GradientAccumulator or None, "
                f"got accumulator of type {type(accumulator).__name__}"
            )
        for name, part in (("model", model), ("optimizer", optimizer)):
            check_array_leaves(name, part)
        split_state(state)  # raises on a leaf that can be neither stored in orbax nor JSON
        return cls(model=model, optimizer=optimizer, accumulator=accumulator, state=state)


def is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def check_array_leaves(name: str, tree: Any) -> None:
    """TypeError naming, by its path, the first leaf of tree that is not an array."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not is_array(leaf):
            raise TypeError(
                f"{name}{jax.tree_util.keystr(path)} must be an array, "
                f"got {type(leaf).__name__}: {leaf!r}"
            )


def split_state(state: Any) -> tuple[Any, dict[str, Any]]:
    """(state with its Python leaves replaced by None, {path: Python value})."""
    python: dict[str, Any] = {}

    def take(path: Any, leaf: Any) -> Any:
        if is_array(leaf):
            return leaf
        if isinstance(leaf, PYTHON_LEAVES):
            python[jax.tree_util.keystr(path)] = leaf
            return None
        raise TypeError(
            f"state{jax.tree_util.keystr(path)} must be an array or a bool/int/float/str, "
            f"got {type(leaf).__name__}: {leaf!r}"
        )

    return jax.tree_util.tree_map_with_path(take, state), python


def merge_state(arrays: Any, template: Any, python: dict[str, Any]) -> Any:
    """The template's structure with its array leaves from arrays and the rest from python."""
    flat_arrays = jax.tree.leaves(arrays)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    it = iter(flat_arrays)
    out = [
        next(it) if is_array(leaf) else python[jax.tree_util.keystr(path)] for path, leaf in leaves
    ]
    return treedef.unflatten(out)


def describe(tree: Any) -> list[list[Any]]:
    """[path, shape, dtype] for each array leaf; [path, "python", type] for the others."""
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = jax.tree_util.keystr(path)
        if is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            rows.append([where, list(np.shape(leaf)), str(np.dtype(leaf.dtype))])
        else:
            rows.append([where, "python", type(leaf).__name__])
    return rows
