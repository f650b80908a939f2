"""``adapters_disabled``: a model computed with every LoRA adapter off, peft's ``disable_adapter``.

Post-training keeps a reference policy beside the one it trains: DPO's log-ratios and GRPO's
KL penalty are measured against it. With LoRA the reference is the frozen base, which the
trained model already holds: switching its adapters off gives the reference without a second
copy of the weights (peft's ``disable_adapter()``, which TRL's trainers use for the reference
of a PEFT model; tunix shares the backbone the same way).

The switch is each ``LoRALinear``'s static ``adapter_enabled`` attribute, so it is part of the
graph definition that ``nnx.split`` returns and ``nnx.jit`` keys its cache on. One jitted step
computes both policies from one set of arrays, either by calling the model inside the context
or by merging its state with two graph definitions::

    graphdef, adapters, rest = nnx.split(model, rl.LoRAParam, ...)
    with rl.adapters_disabled(model):
        reference_graphdef = nnx.graphdef(model)
    # in the step: nnx.merge(graphdef, adapters, rest), nnx.merge(reference_graphdef, ...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from flax import nnx

from rudax.layers._lora import LoRALinear

__all__ = ["adapters_disabled"]


@contextlib.contextmanager
def adapters_disabled(model: nnx.Module) -> Iterator[None]:
    """Switches off every LoRA adapter of ``model`` inside the ``with`` block; restores them after.

    Inside the block each ``rudax.layers.LoRALinear`` of the model computes its base alone::

        y = c(base(x))            instead of   y = c(base(x)) + ((c(d(x)) @ c(A)) * s) @ c(B)

    so the model is the one ``apply_lora`` started from (for QLoRA, its NF4-quantized base),
    bit for bit. The adapter branch is not traced at all: A and B get an exact zero gradient
    from what is computed inside, and adapter dropout draws no key (its RNG count does not
    advance), as peft's ``disable_adapter()`` skips the adapter and its dropout: a reference
    pass inside the step then leaves the policy pass's dropout masks as they would be without
    it.

    The switch is each layer's ``adapter_enabled``, a static attribute (see
    ``LoRALinear``): ``nnx.jit`` compiles one program per setting, and inside a jitted
    function the block may be entered on the model the function was given, so one step
    computes the policy (outside the block) and the reference (inside) on the same adapters.
    ``nnx.split`` (or ``nnx.graphdef``) inside the block returns the reference's graph
    definition, which merges with the state split outside it.

    On exit every layer gets back the setting it had on entry, also when the block raises;
    nested blocks restore in turn, and a layer switched off by hand before the block stays off.
    Layers stored stacked (``scan_layers``) are switched like the others, and so are the
    layers of a model's FSDP form (``rudax.models.shard``, ``from_pretrained(..., mesh=)``):
    each ``rudax.sharding.ShardedModule`` holds its layer's switch and passes it on to the
    layer it gathers at each call.

    Args:
      model: an ``nnx.Module`` holding at least one ``LoRALinear``. A model without one is a
        ValueError: a reference that silently equals the policy would train with a zero
        KL term (a model trained in full needs a reference copy of its own).

    Returns:
      A context manager; its ``with`` block sees the model with its adapters off.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> model = nnx.Dict(proj=rl.Linear(4, 3, rngs=nnx.Rngs(0)))
      >>> base = nnx.clone(model)
      >>> _ = rl.apply_lora(model, ["proj"], rank=2, alpha=2.0, rngs=nnx.Rngs(1))
      >>> model["proj"].lora_b[...] = jnp.ones((2, 3))  # as after training
      >>> x = jnp.ones((1, 4))
      >>> bool((model["proj"](x) == base["proj"](x)).all())
      False
      >>> with rl.adapters_disabled(model):
      ...     bool((model["proj"](x) == base["proj"](x)).all())
      True
      >>> model["proj"].adapter_enabled
      True

      One step, the policy and the reference from one split, no second copy of the weights:

      >>> graphdef, adapters, rest = nnx.split(model, rl.LoRAParam, ...)
      >>> with rl.adapters_disabled(model):
      ...     reference_graphdef = nnx.graphdef(model)
      >>> @nnx.jit
      ... def log_ratio(adapters, rest, x):
      ...     policy = nnx.merge(graphdef, adapters, rest)
      ...     reference = nnx.merge(reference_graphdef, adapters, rest)
      ...     return policy["proj"](x) - reference["proj"](x)
      >>> log_ratio(adapters, rest, x).shape
      (1, 3)

    References:
      peft's ``PeftModel.disable_adapter()``,
      https://huggingface.co/docs/peft/package_reference/peft_model; TRL's ``DPOTrainer``
      and ``GRPOTrainer`` compute the reference of a PEFT model under it (``ref_model=None``).
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}: {model!r:.200}")
    # iter_graph visits a node held at several paths once: each layer is saved and restored
    # once. A sharded layer (rudax.sharding.ShardedModule, which this module does not import:
    # sharding builds on layers) keeps its layer's switch as its own attribute and sets it on
    # the layer it rebuilds at each call.
    layers = [
        node
        for _, node in nnx.iter_graph(model)
        if isinstance(node, LoRALinear) or isinstance(getattr(node, "adapter_enabled", None), bool)
    ]
    if not layers:
        raise ValueError(
            f"adapters_disabled: the model ({type(model).__name__}) holds no "
            "rudax.layers.LoRALinear, so there is no adapter to switch off and its output "
            "would be the policy's; a model trained in full needs a reference copy of its own"
        )
    saved = [layer.adapter_enabled for layer in layers]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer, enabled in zip(layers, saved, strict=True):
            layer.adapter_enabled = enabled
