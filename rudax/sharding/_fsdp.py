"""FSDP: rudax.layers modules whose parameters live as ShardedParameters, gathered when called.

A sharded module keeps the original layer's ``nnx.GraphDef`` (its code and static settings)
and, for each of its variables, a variable of the same type (``nnx.Param``,
``rudax.layers.Frozen`` or ``rudax.layers.Quantized``) holding a ``ShardedParameter``. Calling
it inside ``shard_map`` gathers every parameter, rebuilds the layer with ``nnx.merge`` and
calls it: the arithmetic is the layer's own (kernels, dtypes, checks), never a second copy.

Tied parameters: the context remembers which sharded variable it made for each original
variable, so a variable shared by two layers (``TiedProjection`` and its ``Embedding``) becomes
one sharded variable shared by both sharded layers; ``nnx.split`` of a model holding them then
has one leaf for it and ``jax.grad`` sums both uses into it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike, DTypeLike

import rudax.layers as rl
from rudax._validation import float_dtype
from rudax.sharding._sharded_parameter import ShardedParameter, _axis_size

_SHARDABLE = (nnx.Param, rl.Frozen, rl.Quantized)


class ShardedModule(nnx.Module):
    """A layer whose parameters are sharded; calling it inside ``shard_map`` gathers them.

    ``y = layer(x)`` with every parameter replaced by ``p.gather(compute_dtype)`` (a
    ``rudax.layers.Quantized`` one by ``p.gather()``: its bits are the weight, never cast):
    built by ``ShardingContext``, not directly.

    A layer's RNG state (an ``nnx.Dropout``'s ``RngKey`` and ``RngCount``, as a
    ``LoRALinear`` with ``dropout > 0`` holds) is kept whole, not sharded: pass it into
    ``shard_map`` replicated (``P()``) and take it back out the same way. Each call draws
    with the key folded with the rank (``jax.lax.axis_index(axis_name)``), so every rank's
    rows get masks of their own, and advances the one count, the same on every rank.

    Args:
      graphdef: the original layer's graph definition.
      paths: each variable's path in the layer's state, in the order of ``variables``.
      variables: the sharded variables (values are ``ShardedParameter``).
      compute_dtype: dtype the floating Params and Frozen are cast to before the gather; None
        keeps storage.
      rng_paths: each RNG variable's path, in the order of ``rng_variables``.
      rng_variables: the layer's own ``nnx.RngState`` variables, unchanged.
      axis_name: the mesh axis the ranks are numbered along (needed with RNG state).
      deterministic: the layer's dropout mode, kept as this module's own attribute so that
        ``model.eval()`` and ``model.train()`` (nnx's ``set_attributes``, which visit every
        module that has it) reach the layer rebuilt at each call; None if it has none.
      adapter_enabled: the layer's LoRA switch (``rudax.layers.LoRALinear``'s), kept here
        for the same reason: ``rudax.layers.adapters_disabled`` reaches a sharded model's
        adapters through it; None if the layer has no adapter.

    Returns:
      A module; ``module(*args, **kwargs)`` returns what the layer returns.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        paths: tuple[tuple[Any, ...], ...],
        variables: list[nnx.Variable],
        compute_dtype: DTypeLike | None = None,
        rng_paths: tuple[tuple[Any, ...], ...] = (),
        rng_variables: list[nnx.Variable] | None = None,
        axis_name: Any = None,
        deterministic: bool | None = None,
        adapter_enabled: bool | None = None,
    ):
        self.graphdef = graphdef
        self.paths = paths
        self.variables = nnx.List(variables)
        self.compute_dtype = compute_dtype
        self.rng_paths = rng_paths
        self.rng_variables = nnx.List(rng_variables or [])
        self.axis_name = axis_name
        self.deterministic = deterministic
        self.adapter_enabled = adapter_enabled

    def gathered(self) -> nnx.Module:
        """The original layer with its logical parameter values (inside ``shard_map``)."""
        flat = [
            (path, type(var)(var.get_value().gather(_gather_dtype(var, self.compute_dtype))))
            for path, var in zip(self.paths, self.variables, strict=True)
        ]
        for path, var in zip(self.rng_paths, self.rng_variables, strict=True):
            if isinstance(var, nnx.RngKey):
                # A key of this rank's own; the count stays the shared variable itself, so
                # nnx.merge hands the layer that object and the draw advances it.
                rank = jax.lax.axis_index(self.axis_name)
                var = var.replace(jax.random.fold_in(var.get_value(), rank))
            flat.append((path, var))
        layer = nnx.merge(self.graphdef, nnx.from_flat_state(flat))
        if self.deterministic is not None:
            layer.set_attributes(deterministic=self.deterministic, raise_if_not_found=False)
        if self.adapter_enabled is not None:
            layer.set_attributes(adapter_enabled=self.adapter_enabled, raise_if_not_found=False)
        return layer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.gathered()(*args, **kwargs)


class ShardingContext:
    """Converts loaded ``rudax.layers`` modules to FSDP modules sharded over one mesh axis.

    Every floating ``nnx.Param`` and ``rudax.layers.Frozen`` of a converted layer, and every
    ``rudax.layers.Quantized`` array (an ``NF4Linear``'s uint8 codes, fp32 absmax and scalar
    offset: FSDP-QLoRA's packed base), becomes a ``ShardedParameter`` (flat, padded, 1/N per
    device) inside a variable of the same type, so ``nnx.split(model, nnx.Param, ...)`` still
    separates trainable from frozen parameters. A train step runs the model inside
    ``jax.shard_map`` with ``in_specs=P(axis_name)`` for the parameter state (every leaf is a
    flat vector split on its only axis); the gradients that come out are already the
    reduce-scattered gradients of the sum of the ranks' local losses, sharded like the
    parameters, ready for an elementwise ``rudax.optim`` optimizer.

    ``compute_dtype`` (keyword on every method) casts parameters before the gather, so the
    all-gather and the gradient's reduce-scatter run in that dtype; storage is unchanged and
    the layer computes as it would with parameters stored in that dtype. ``Quantized`` storage
    is gathered as it is stored, whatever ``compute_dtype`` says: its bits are the weight.

    Ties are recognised by identity, so the context keeps a reference to every variable it
    converted: drop it (and the original modules) once the model is built, to free the full
    values.

    Args:
      mesh: a ``jax.sharding.Mesh`` (Auto or Explicit axes).
      axis_name: the mesh axis to shard over.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jax.sharding import PartitionSpec as P
      >>> import rudax.layers as rl, rudax.sharding as rs
      >>> mesh = jax.sharding.Mesh(jax.devices(), ("fsdp",))
      >>> ctx = rs.ShardingContext(mesh)
      >>> lin = ctx.linear(rl.Linear(3, 5, rngs=nnx.Rngs(0)))
      >>> graphdef, params = nnx.split(lin)
      >>> f = lambda p, x: nnx.merge(graphdef, p)(x)
      >>> y = jax.shard_map(f, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P("fsdp"))(
      ...     params, jnp.ones((jax.device_count(), 3)))
      >>> y.shape
      (8, 5)

    References:
      Zhao et al., `PyTorch FSDP <https://arxiv.org/abs/2304.11277>`_, 2023.
    """

    def __init__(self, mesh: Mesh, axis_name: str = "fsdp"):
        self.num_shards = _axis_size(mesh, axis_name)
        self.mesh = mesh
        self.axis_name = axis_name
        # id(original variable) -> (original, sharded variable); the original is kept alive so
        # its id cannot be reused by another object.
        self._converted: dict[int, tuple[nnx.Variable, nnx.Variable]] = {}

    def parameter(self, p: nnx.Variable, *, stacked: bool = False) -> nnx.Variable:
        """p's value as a ``ShardedParameter`` in a variable of p's type; one per p (ties kept).

        A ``Param`` or ``Frozen`` must hold a floating array; a ``Quantized`` one any array
        (its codes are uint8). ``stacked``: p holds a stack of layers' parameters on its
        leading axis (``rudax.layers.stack_layers``), each split on its own
        (``ShardedParameter.from_full``).
        """
        if not isinstance(p, _SHARDABLE):
            raise TypeError(
                f"p must be an nnx.Param, rudax.layers.Frozen or rudax.layers.Quantized, got {p!r}"
            )
        value = p.get_value()
        if not isinstance(value, jax.Array | np.ndarray) or not (
            isinstance(p, rl.Quantized) or jnp.issubdtype(value.dtype, jnp.floating)
        ):
            raise TypeError(f"p must hold a floating array, got {type(p).__name__}({value!r})")
        seen = self._converted.get(id(p))
        if seen is not None:
            sharded = seen[1]
            held = sharded.get_value()
            whole = (*held.local.shape[:-1], *held.logical_shape)
            if whole != value.shape or held.dtype != value.dtype:
                raise ValueError(
                    f"tied parameter reused with a different value: first converted with "
                    f"shape={whole}, dtype={held.dtype}; now shape={value.shape}, "
                    f"dtype={value.dtype}"
                )
            if type(sharded) is not type(p):
                raise ValueError(
                    f"tied parameter reused with a different trainability: first "
                    f"{type(sharded).__name__}, now {type(p).__name__}"
                )
            return sharded
        sharded = type(p)(
            ShardedParameter.from_full(value, self.mesh, self.axis_name, stacked=stacked)
        )
        self._converted[id(p)] = (p, sharded)
        return sharded

    def module(
        self, layer: nnx.Module, *, compute_dtype: DTypeLike | None = None, stacked: bool = False
    ) -> ShardedModule:
        """Any ``nnx.Module`` whose variables are all floating Params or Frozen, or Quantized.

        An ``NF4Linear``, or a ``LoRALinear`` over one (QLoRA), included. RNG state (a
        ``LoRALinear``'s dropout key and count) is kept whole; see ``ShardedModule``.
        ``stacked``: the layer is part of layers stored stacked (``rudax.layers.stack_layers``):
        each variable's leading axis indexes the layers, each layer's slice is sharded on its
        own, and the module is called one layer at a time inside ``rudax.layers.scan_layers``
        (which slices the leading axis away).
        """
        if not isinstance(layer, nnx.Module):
            raise TypeError(f"layer must be an nnx.Module, got {type(layer).__name__}")
        compute_dtype = float_dtype("compute_dtype", compute_dtype)
        modes = {
            mode
            for _, m in nnx.iter_graph(layer)
            if isinstance(m, nnx.Module)
            and isinstance(mode := getattr(m, "deterministic", None), bool)
        }
        switches = {
            enabled
            for _, m in nnx.iter_graph(layer)
            if isinstance(m, nnx.Module)
            and isinstance(enabled := getattr(m, "adapter_enabled", None), bool)
        }
        graphdef, state = nnx.split(layer)
        paths, variables, rng_paths = [], [], []
        rng_variables: list[nnx.Variable] = []
        for path, _ in nnx.to_flat_state(state):
            var = _variable_at(layer, path)
            if isinstance(var, nnx.RngState):  # a dropout's key and count: kept whole
                rng_paths.append(path)
                rng_variables.append(var)
                continue
            if not isinstance(var, _SHARDABLE):
                raise ValueError(
                    f"{type(layer).__name__}: variable {_keystr(path)} is a "
                    f"{type(var).__name__}; only nnx.Param and rudax.layers.Frozen are sharded "
                    "(and an NF4Linear's rudax.layers.Quantized storage; RNG state is kept)"
                )
            paths.append(path)
            variables.append(self.parameter(var, stacked=stacked))
        return ShardedModule(
            graphdef,
            tuple(paths),
            variables,
            compute_dtype,
            rng_paths=tuple(rng_paths),
            rng_variables=rng_variables,
            axis_name=self.axis_name,
            deterministic=modes.pop() if len(modes) == 1 else None,
            adapter_enabled=switches.pop() if len(switches) == 1 else None,
        )

    def _typed(
        self, name: str, layer: Any, cls: type[nnx.Module], compute_dtype: DTypeLike | None
    ) -> ShardedModule:
        if not isinstance(layer, cls):
            raise TypeError(f"{name} must be a rudax.layers.{cls.__name__}, got {layer!r}")
        return self.module(layer, compute_dtype=compute_dtype)

    def linear(self, l: rl.Linear, *, compute_dtype: DTypeLike | None = None) -> ShardedModule:  # noqa: E741
        """A sharded ``rudax.layers.Linear``."""
        return self._typed("l", l, rl.Linear, compute_dtype)

    def embedding(
        self, e: rl.Embedding, *, compute_dtype: DTypeLike | None = None
    ) -> ShardedModule:
        """A sharded ``rudax.layers.Embedding``."""
        return self._typed("e", e, rl.Embedding, compute_dtype)

    def tied_projection(
        self,
        embedding: rl.Embedding,
        bias: ArrayLike | nnx.Variable | None = None,
        *,
        compute_dtype: DTypeLike | None = None,
    ) -> ShardedModule:
        """A sharded ``rudax.layers.TiedProjection(embedding, bias=bias)``, sharing the table."""
        if not isinstance(embedding, rl.Embedding):
            raise TypeError(f"embedding must be a rudax.layers.Embedding, got {embedding!r}")
        return self.module(rl.TiedProjection(embedding, bias=bias), compute_dtype=compute_dtype)

    def rms_norm(self, n: rl.RMSNorm, *, compute_dtype: DTypeLike | None = None) -> ShardedModule:
        """A sharded ``rudax.layers.RMSNorm``."""
        return self._typed("n", n, rl.RMSNorm, compute_dtype)

    def layer_norm(
        self, n: rl.LayerNorm, *, compute_dtype: DTypeLike | None = None
    ) -> ShardedModule:
        """A sharded ``rudax.layers.LayerNorm``."""
        return self._typed("n", n, rl.LayerNorm, compute_dtype)

    def gated_mlp(self, m: rl.GatedMLP, *, compute_dtype: DTypeLike | None = None) -> ShardedModule:
        """A sharded ``rudax.layers.GatedMLP`` (gate, up and down each sharded)."""
        return self._typed("m", m, rl.GatedMLP, compute_dtype)

    def lora(
        self, lora_linear: rl.LoRALinear, *, compute_dtype: DTypeLike | None = None
    ) -> ShardedModule:
        """A sharded ``rudax.layers.LoRALinear``: frozen base and trainable adapter both sharded.

        The base may be an ``NF4Linear`` (QLoRA): its packed storage is sharded as it is.
        """
        return self._typed("lora_linear", lora_linear, rl.LoRALinear, compute_dtype)


def _gather_dtype(var: nnx.Variable, compute_dtype: DTypeLike | None) -> DTypeLike | None:
    """The dtype a variable is gathered in: quantized storage never takes the compute dtype."""
    return None if isinstance(var, rl.Quantized) else compute_dtype


def _keystr(path: tuple[Any, ...]) -> str:
    """An nnx state path as the attribute access it stands for: ``.gate.kernel``, ``[0]``."""
    keys = [
        jax.tree_util.SequenceKey(k) if isinstance(k, int) else jax.tree_util.GetAttrKey(k)
        for k in path
    ]
    return jax.tree_util.keystr(tuple(keys))


def _variable_at(module: nnx.Module, path: tuple[Any, ...]) -> Any:
    node: Any = module  # a module, then whatever its attributes and items are: lists, dicts
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def shard_specs(tree: Any, axis_name: str = "fsdp") -> Any:
    """The ``PartitionSpec`` of each leaf of an FSDP state, for ``shard_map``'s ``in_specs``
    and for placing the state (``NamedSharding``).

    A ``ShardedParameter``'s flat storage ``(N*k,)`` is split over ``axis_name``; a stack of
    them ``(L, N*k)`` (layers stored stacked) over its last axis; a scalar (a step count) is
    replicated. So are the optimizer states and accumulators that mirror the parameters.

    Args:
      tree: a pytree of arrays, tracers or ``ShapeDtypeStruct``s (``ShardedParameter``s
        count by their storage, their only leaf).
      axis_name: the mesh axis the parameters are sharded over.

    Returns:
      The tree with a ``PartitionSpec`` at each leaf (a ``ShardedParameter`` node holds its
      storage's), which ``shard_map`` takes as ``in_specs``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from rudax.sharding import shard_specs
      >>> specs = shard_specs({"w": jnp.zeros(8), "stack": jnp.zeros((3, 8)), "n": jnp.zeros(())})
      >>> specs == {"w": P("fsdp"), "stack": P(None, "fsdp"), "n": P()}
      True
    """

    def spec(x: Any) -> P:
        ndim = len(x.shape)
        if ndim > 2:
            raise ValueError(
                f"shard_specs: a leaf of shape {tuple(x.shape)} is neither a ShardedParameter's "
                "storage nor a stack of them"
            )
        return P(*([None] * (ndim - 1)), axis_name) if ndim else P()

    return jax.tree.map(spec, tree)
