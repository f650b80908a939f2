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
(``tests/finetune/test_mesh.py``). The adapters come back whole for the adapter file through
``rudax.models.gather_adapters``. What is left here: sharding the model as the step holds it.
"""

from __future__ import annotations

from jax.sharding import Mesh

import rudax.models as rm
import rudax.sharding as rs


def shard(model: rm.LlamaForCausalLM, mesh: Mesh) -> rm.LlamaForCausalLM:
    """The model as the step holds it: FSDP over ``fsdp`` if the mesh has it, else ``model``."""
    if "fsdp" not in mesh.axis_names:
        return model
    return rm.shard(model, rs.ShardingContext(mesh, "fsdp"))
