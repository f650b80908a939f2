"""The trained adapters of an FSDP model, whole on every process: to save them, or to sample.

A LoRA or QLoRA run over a mesh with an ``fsdp`` axis holds its model in ``rudax.models
.shard``'s form (``from_pretrained(..., mesh=)`` reads it so): each adapter is a
``ShardedParameter`` whose flat storage is split over the devices of every process. What is
written at the end (``rudax.layers.save_adapter``: one ``lora_A``/``lora_B`` per layer, as
peft names them) needs each adapter whole. ``gather_adapters`` all-gathers them across the
processes into a model built abstractly (``nnx.eval_shape``: no base weights) with the same
adapters put on, so no process ever holds the whole base. ``gather_adapters_into`` writes them
into a model a process holds whole instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import rudax.layers as rl
import rudax.sharding as rs
from rudax.models._llama import LlamaForCausalLM
from rudax.models._llama_config import LlamaConfig

__all__ = ["gather_adapters", "gather_adapters_into"]


def gather_adapters(
    sharded: LlamaForCausalLM, prepare: Callable[[LlamaForCausalLM], Any]
) -> LlamaForCausalLM:
    """A model on every process with the adapters of ``sharded``, whole, and no base weights.

    Args:
      sharded: a ``LlamaForCausalLM`` in ``rudax.models.shard``'s form (FSDP), its adapters
        trained; stacked layers (``scan_layers``) too.
      prepare: what put the adapters on ``sharded`` (``from_pretrained``'s ``prepare``, e.g.
        ``lambda m: rl.apply_lora(m, targets, rank=8, ...)``): it puts the same adapters on
        the model built here.

    Returns:
      A ``LlamaForCausalLM`` of ``sharded``'s config, built abstractly (its base weights are
      ``ShapeDtypeStruct``s), layers unstacked, with every ``LoRAParam`` set to the gathered
      value: what ``rudax.layers.save_adapter`` reads. Every process must call it (the
      adapters are all-gathered across processes).

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> import rudax.layers as rl, rudax.models as rm, rudax.sharding as rs
      >>> config = rm.LlamaConfig.tiny(64, hidden_size=32, num_hidden_layers=1)
      >>> prepare = lambda m: rl.apply_lora(m, ["q_proj"], rank=2, alpha=4.0, rngs=nnx.Rngs(0))
      >>> model = rm.LlamaForCausalLM(config, rngs=nnx.Rngs(0))
      >>> _ = prepare(model)
      >>> mesh = rs.make_mesh({"fsdp": jax.device_count()})
      >>> whole = rm.gather_adapters(rm.shard(model, rs.ShardingContext(mesh, "fsdp")), prepare)
      >>> whole.model.layers[0].self_attn.q_proj.lora_a.shape
      (32, 2)
    """
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


def gather_adapters_into(model: LlamaForCausalLM, sharded: LlamaForCausalLM) -> None:
    """Writes the adapters of ``sharded`` (``model`` sharded and trained) into ``model``,
    whole, on every process, in place.

    On a data-only mesh (``sharded is model``: nothing was sharded) the adapters and RNG
    state were replaced by arrays replicated over the whole mesh; each becomes this process's
    copy on one device, so that sampling from the model runs once, not on every device.

    Args:
      model: the model a process holds whole, with the same adapters put on.
      sharded: ``rudax.models.shard(model, ...)`` after training, or ``model`` itself.
    """
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
            layer = layer[key] if isinstance(key, int) else getattr(layer, str(key))
        flat = dict(nnx.to_flat_state(nnx.state(layer, rl.LoRAParam)))
        for var_path, var in zip(node.paths, node.variables, strict=True):
            if var_path in flat:  # else a base weight: never trained
                _set(flat[var_path], _gathered(var), (*path, *var_path))


def _prepared(config: LlamaConfig, prepare: Callable[[LlamaForCausalLM], Any]) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
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
