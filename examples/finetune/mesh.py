"""``examples.finetune --mesh data=D,fsdp=F``: the fine-tuning step over a mesh of devices, of
one process or of several (``jax.distributed``).

- ``data``: the batch's rows are split over it; every device holds the whole model.
- ``fsdp``: the rows are split over it too, and the model is stored sharded
  (``rudax.models.shard``'s form), read straight onto the mesh
  (``rudax.models.from_pretrained(..., mesh=)``: no process holds the whole base): each device
  holds ``1/F`` of every base weight (the NF4 codes and scales of a QLoRA base), of the
  adapters and of their AdamW moments, and gathers one layer's weights at a time inside the
  step; the gradients come back reduce-scattered onto the shards. Samples are generated over
  the mesh too (``rudax.models.generate``), and the adapters gathered for the adapter file.

The step is ``rudax.sharding.make_train_steps`` over the mesh: each device computes the
summed loss of its rows, the sums are added across the mesh and their gradient divided by
the counted tokens of the whole window (``rudax.optim.GradientAccumulator``), so the update
is the one-device update of the same global batch, up to the order of the float sums.
Dropout masks are drawn per device (the adapters' RNG key folded with the device's place in
the mesh): with ``--dropout 0`` a run over a mesh trains the one-device run's losses
(``tests/finetune/test_mesh.py``). What is left here is the model's side: sharding it, this
process's rows, and gathering the adapters back.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

import rudax.layers as rl
import rudax.models as rm
import rudax.sharding as rs


def parse_mesh(text: str) -> dict[str, int]:
    """``--mesh``'s type: ``rudax.sharding.parse_mesh``, its error argparse's."""
    try:
        return rs.parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def shard(model: rm.LlamaForCausalLM, mesh: Mesh) -> rm.LlamaForCausalLM:
    """The model as the step holds it: FSDP over ``fsdp`` if the mesh has it, else ``model``."""
    if "fsdp" not in mesh.axis_names:
        return model
    return rm.shard(model, rs.ShardingContext(mesh, "fsdp"))


def own_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's rows of a whole batch (rows ``[p * b, (p + 1) * b)``, ``b`` the rows
    per process), as ``FinetuneData.batch(i, shard=p, num_shards=n)`` reads them itself."""
    p, n = jax.process_index(), jax.process_count()
    return {key: rows[p * len(rows) // n : (p + 1) * len(rows) // n] for key, rows in batch.items()}


def gather_into(model: rm.LlamaForCausalLM, sharded: rm.LlamaForCausalLM) -> None:
    """Writes the adapters of ``sharded`` (``shard(model, mesh)``, trained) back into
    ``model``, whole, on every process: for saving them and for generating with the model on
    one process. On a data-only mesh (``sharded is model``) the adapters and RNG state were
    replaced by replicated arrays of the whole mesh; each becomes this process's copy on one
    device, so that generating a sample runs once, not replicated on every device."""
    if sharded is model:
        state = nnx.state(model)
        local = jax.tree.map(
            lambda x: (
                x.addressable_data(0)
                if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1
                else x
            ),
            state,
        )
        nnx.update(model, local)
        return
    for path, node in nnx.iter_graph(sharded):
        if not isinstance(node, rs.ShardedModule):
            continue
        layer: Any = model
        for key in path:
            layer = layer[key] if isinstance(key, int) else getattr(layer, key)
        flat = dict(nnx.to_flat_state(nnx.state(layer, rl.LoRAParam)))
        for var_path, var in zip(node.paths, node.variables, strict=True):
            if var_path in flat:  # else a base weight: never trained
                _set(flat[var_path], _gathered(var), (*path, *var_path))


def whole_adapters(
    sharded: rm.LlamaForCausalLM, prepare: Callable[[Any], Any]
) -> rm.LlamaForCausalLM:
    """A model held whole, on every process, with the adapters of ``sharded`` (read straight
    onto the mesh, then trained) and no base weights (shapes only): what
    ``rudax.layers.save_adapter`` reads. ``prepare`` put the adapters on ``sharded``; it
    puts them on this model too. Its layers are one module each, as peft names them: a
    stacked adapter is split into the layers'."""
    model = nnx.eval_shape(lambda: _prepared(sharded.config, prepare))
    targets = dict(nnx.to_flat_state(nnx.state(model, rl.LoRAParam)))
    for path, node in nnx.iter_graph(sharded):
        if not isinstance(node, rs.ShardedModule):
            continue
        for var_path, var in zip(node.paths, node.variables, strict=True):
            if not isinstance(var, rl.LoRAParam):
                continue
            value, where = _gathered(var), (*path, *var_path)
            if not sharded.scan_layers:
                _set(targets[where], value, where)
                continue
            for i, layer in enumerate(value):  # (model, layers, *rest) -> (model, layers, i, *rest)
                each = (*where[:2], i, *where[2:])
                _set(targets[each], layer, each)
    return model


def _prepared(config: rm.LlamaConfig, prepare: Callable[[Any], Any]) -> rm.LlamaForCausalLM:
    model = rm.LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    prepare(model)
    return model


def _gathered(var: nnx.Variable) -> np.ndarray:
    """A ``ShardedParameter``'s logical value, whole, on every process (a stack: (L, ...))."""
    held = var.get_value()
    storage = multihost_utils.process_allgather(held.local, tiled=True)
    whole = np.asarray(storage)[..., : held.size]
    return whole.reshape(*whole.shape[:-1], *held.logical_shape)


def _set(target: nnx.Variable, value: np.ndarray, path: tuple[Any, ...]) -> None:
    want = target.get_value()
    if tuple(want.shape) != value.shape:
        raise ValueError(f"{path}: a gathered adapter of shape {value.shape}, not {want.shape}")
    target.set_value(jnp.asarray(value, want.dtype))
