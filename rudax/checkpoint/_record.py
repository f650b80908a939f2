"""TrainingRecord: everything a run needs to continue, gathered as one pytree.

A record holds the parts as the caller gives them: no copy is made and no optimizer or
accumulator state is created, so capturing is free and cannot change what is saved.

Caller ``state`` may mix arrays with plain Python values (a data position, a run name). The
two are stored apart: arrays (``jax.Array``, ``np.ndarray``, NumPy scalars) go to orbax like
every other part, while ``bool``/``int``/``float``/``str`` leaves go, by their pytree path, into
the checkpoint's JSON metadata item. JSON keeps them exact (Python ints of any size, strings)
and readable without rudax; converting them to arrays would give them back as arrays, not as
the ints and strings the caller put in.

Two fields are not pytree leaves but static data of the record's tree node, so that
``jax.tree.map`` and ``jax.jit`` see only arrays: ``config``, the run's configuration
(optimizer hyperparameters, schedule) as JSON data that restore compares with the template's
(see ``_config.py``), and ``dtypes``, the storage dtype of each floating leaf, set by
``capture_with_dtypes`` and used by ``Checkpointer.restore_with_dtypes``. Both are compared and
hashed through their canonical JSON text, so two records with equal configs share one compiled
program.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rudax.checkpoint._config import check_config
from rudax.checkpoint._keys import KEY_IMPLS, check_key, dtype_name
from rudax.checkpoint._sharded import is_sharded_parameter, layout_row
from rudax.optim import GradientAccumulator

# The Python leaf types the JSON metadata item stores exactly.
PYTHON_LEAVES = (bool, int, float, str)

# Order matters: it is the order of the orbax items and of the validation messages.
PARTS = ("model", "optimizer", "accumulator", "state")

# The dtypes a record's arrays may have: those orbax stores and reads back bit for bit, and
# typed PRNG keys of JAX's built-in impls (stored as their key data: ``_keys.py``). Object
# arrays and 4-bit types are not among them.
FLOAT_DTYPE_NAMES = frozenset(
    "bfloat16 float16 float32 float64 "
    "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e4m3b11fnuz".split()
)
DTYPE_NAMES = (
    FLOAT_DTYPE_NAMES
    | frozenset(
        "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 complex64 complex128".split()
    )
    | frozenset(KEY_IMPLS)
)


class TrainingRecord(NamedTuple):
    """The whole training state: model, optimizer, pending gradients and caller state.

    A NamedTuple and a pytree whose leaves are the arrays of its four parts: it goes through
    ``jax.jit`` and ``jax.tree.map`` as is. ``config`` and ``dtypes`` are static data of the
    record's tree node, never leaves (a dict of floats would otherwise become traced values):
    they ride along unchanged, and records with equal configs share one compiled program.
    Build one with ``TrainingRecord.capture``; save and restore it with
    ``rudax.checkpoint.Checkpointer``.

    Attributes:
      model: the model parameters, any pytree of arrays (a nested dict, a ``flax.nnx.State``).
      optimizer: the optimizer state, e.g. ``tx.init(params)``; its update count is the
        schedule's position, so a restored run continues the learning-rate schedule.
      accumulator: a ``rudax.optim.GradientAccumulator`` (a window in progress) or None.
      state: the caller's pytree (data position, RNG keys, counters): arrays and Python
        ``bool``/``int``/``float``/``str`` leaves, or None. Typed PRNG keys
        (``jax.random.key``, the keys of a flax ``nnx.Rngs``) may be in any part: they are
        stored as their key data and restored as keys of the same impl, bit for bit.
      config: the run's configuration as JSON data, a dict (optimizer hyperparameters,
        schedule), or None. An optax optimizer does not expose its hyperparameters, so they
        are recorded here; restore refuses a template whose config differs. Treat it as
        read-only: records made from this one by ``jax.tree.map`` share it.
      dtypes: {path: dtype name} of every floating array leaf, e.g. ``{"model['w']":
        "bfloat16"}``, set by ``capture_with_dtypes``; None from ``capture``.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import rudax.checkpoint as rc
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.zeros(2)}
      >>> tx = ro.sgd(0.1)
      >>> record = rc.TrainingRecord.capture(
      ...     model=params,
      ...     optimizer=tx.init(params),
      ...     state={"epoch": 3, "name": "run-1"},
      ...     config={"optimizer": {"name": "sgd", "lr": 0.1}},
      ... )
      >>> record.state["epoch"], record.accumulator is None, record.config["optimizer"]["lr"]
      (3, True, 0.1)
      >>> jax.tree.leaves(record)  # the config is not among the leaves
      [Array([0., 0.], dtype=float32), Array(0, dtype=int32), 3, 'run-1']

    References:
      orbax-checkpoint, https://orbax.readthedocs.io (the on-disk format).
    """

    model: Any  # pytree of arrays
    optimizer: Any  # pytree of arrays (an optax state)
    accumulator: GradientAccumulator | None  # the pending window, or None
    state: Any  # pytree of arrays and bool/int/float/str leaves, or None
    config: dict[str, Any] | None = None  # static JSON data, compared on restore
    dtypes: dict[str, str] | None = None  # static {leaf path: storage dtype name}

    @classmethod
    def capture(
        cls,
        *,
        model: Any,
        optimizer: Any,
        accumulator: GradientAccumulator | None = None,
        state: Any = None,
        config: dict[str, Any] | None = None,
    ) -> TrainingRecord:
        """Gathers the parts of a run into a record, holding them as given.

        Nothing is copied or created: the record's parts are the very objects passed in, so
        capturing builds no optimizer or accumulator state and cannot change what is saved.
        Only ``config`` is copied (after checking that it is JSON data), so that changing the
        caller's dict later cannot change the record.

        Args:
          model: the model parameters, any pytree of arrays.
          optimizer: the optimizer state.
          accumulator: a ``GradientAccumulator`` or None.
          state: caller state, a pytree of arrays and Python bool/int/float/str leaves.
          config: the run's configuration, a dict of JSON data: nested dicts with str keys,
            lists, and ``bool``/``int``/``float``/``str``/None leaves; finite floats only.

        Returns:
          A ``TrainingRecord`` whose array parts are the very objects passed in.
        """
        if accumulator is not None and not isinstance(accumulator, GradientAccumulator):
            raise TypeError(
                "accumulator must be a rudax.optim.GradientAccumulator or None, "
                f"got accumulator of type {type(accumulator).__name__}"
            )
        parts = {"model": model, "optimizer": optimizer, "accumulator": accumulator}
        for name, part in parts.items():
            check_array_leaves(name, part)
        split_state(state)  # raises on a leaf that can be neither stored in orbax nor JSON
        config = check_config(config)
        return cls(model, optimizer, accumulator, state, config)

    @classmethod
    def capture_with_dtypes(
        cls,
        *,
        model: Any,
        optimizer: Any,
        accumulator: GradientAccumulator | None = None,
        state: Any = None,
        config: dict[str, Any] | None = None,
    ) -> TrainingRecord:
        """``capture``, plus the storage dtype of every floating leaf, kept in ``dtypes``.

        The dtypes are written into the checkpoint, so that
        ``Checkpointer.restore_with_dtypes`` can restore a run that stores, say, bf16 and
        fp16 parameters with fp32 masters from a template whose dtypes differ (an all-fp32
        ``jax.eval_shape`` of the model), each leaf coming back in its recorded dtype.
        Saving is always at full precision: every leaf is written in its own dtype, never
        cast, and saving a record whose leaves no longer have the dtypes it recorded is an
        error.

        Args:
          model: the model parameters, any pytree of arrays.
          optimizer: the optimizer state.
          accumulator: a ``GradientAccumulator`` or None.
          state: caller state, a pytree of arrays and Python bool/int/float/str leaves.
          config: the run's configuration, a dict of JSON data (see ``capture``).

        Returns:
          A ``TrainingRecord`` as ``capture`` gives, with ``dtypes`` mapping the path of each
          floating array leaf (``"model['w']"``, ``"optimizer[0].mu['w']"``) to its dtype name.

        Example:
          >>> import jax.numpy as jnp
          >>> import rudax.checkpoint as rc
          >>> params = {"w": jnp.zeros(2, jnp.bfloat16), "step": jnp.zeros((), jnp.int32)}
          >>> record = rc.TrainingRecord.capture_with_dtypes(model=params, optimizer=())
          >>> record.dtypes
          {"model['w']": 'bfloat16'}
        """
        record = cls.capture(
            model=model, optimizer=optimizer, accumulator=accumulator, state=state, config=config
        )
        return record._replace(dtypes=floating_dtypes(record))


class _Static:
    """A record's config or dtypes as pytree node data: hashed and compared by its JSON text."""

    __slots__ = ("_text", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._text: str | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            try:
                self._text = json.dumps(self.value, sort_keys=True, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    "TrainingRecord.config and .dtypes must be JSON data (build records with "
                    f"TrainingRecord.capture), got {self.value!r}"
                ) from e
        return self._text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self.text == other.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return repr(self.value)


def _flatten_with_keys(record: TrainingRecord) -> tuple[Any, Any]:
    children = tuple((jax.tree_util.GetAttrKey(p), getattr(record, p)) for p in PARTS)
    return children, (_Static(record.config), _Static(record.dtypes))


def _flatten(record: TrainingRecord) -> tuple[Any, Any]:
    return tuple(record[:4]), (_Static(record.config), _Static(record.dtypes))


def _unflatten(static: Any, children: Any) -> TrainingRecord:
    config, dtypes = static
    model, optimizer, accumulator, state = children
    return TrainingRecord(model, optimizer, accumulator, state, config.value, dtypes.value)


jax.tree_util.register_pytree_with_keys(
    TrainingRecord, _flatten_with_keys, _unflatten, flatten_func=_flatten
)


def floating_dtypes(record: TrainingRecord) -> dict[str, str]:
    """{part + keystr path: dtype name} of each floating array leaf of record's parts."""
    out = {}
    for part in PARTS:
        tree = getattr(record, part)
        if part == "state":
            tree, _ = split_state(tree)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name = dtype_name(leaf.dtype)
            if name in FLOAT_DTYPE_NAMES:
                out[f"{part}{jax.tree_util.keystr(path)}"] = name
    return out


def is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def is_array_like(leaf: Any) -> bool:
    """An array, or a ``jax.ShapeDtypeStruct`` standing for one in a template."""
    return is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def check_dtype(where: str, leaf: Any) -> None:
    """TypeError naming where unless leaf's dtype is one a checkpoint stores exactly."""
    dtype = leaf.dtype
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        check_key(where, leaf)
        return
    if str(np.dtype(dtype)) not in DTYPE_NAMES:
        raise TypeError(
            f"{where} has dtype={dtype}, which a checkpoint cannot store exactly; "
            f"supported: {sorted(DTYPE_NAMES)}"
        )


def check_array_leaves(name: str, tree: Any) -> None:
    """TypeError naming, by its path, the first leaf of tree that is not a storable array."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not is_array(leaf):
            raise TypeError(
                f"{name}{jax.tree_util.keystr(path)} must be an array, "
                f"got {type(leaf).__name__}: {leaf!r}"
            )
        check_dtype(f"{name}{jax.tree_util.keystr(path)}", leaf)


def split_state(state: Any, *, template: bool = False) -> tuple[Any, dict[str, Any]]:
    """(state with its Python leaves replaced by None, {path: Python value}).

    A TypeError names the first leaf that is neither a storable array nor a Python
    bool/int/float/str; ``template=True`` accepts ``jax.ShapeDtypeStruct`` leaves as arrays.
    """
    python: dict[str, Any] = {}

    def take(path: Any, leaf: Any) -> Any:
        if is_array(leaf):
            check_dtype(f"state{jax.tree_util.keystr(path)}", leaf)
            return leaf
        if template and isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        # Exact types: a subclass (an IntEnum member) would come back from JSON as its base.
        if type(leaf) in PYTHON_LEAVES:
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
        next(it) if is_array_like(leaf) else python[jax.tree_util.keystr(path)]
        for path, leaf in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def describe(tree: Any) -> list[list[Any]]:
    """[path, shape, dtype] for each array leaf; [path, "python", type] for the others."""
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded_parameter)[0]:
        where = jax.tree_util.keystr(path)
        if is_sharded_parameter(leaf):  # by its logical shape: see _sharded.py
            rows.append(layout_row(path, leaf))
        elif is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            rows.append([where, list(np.shape(leaf)), dtype_name(leaf.dtype)])
        else:
            rows.append([where, "python", type(leaf).__name__])
    return rows
