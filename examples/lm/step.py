"""The model and the optimizer of ``examples.lm.train``, from its flags.

The recipe is the library's: ``rudax.models.ModelSpec`` and ``rudax.models.OptimizerSpec``
(their defaults the trainer's), and the steps are ``rudax.sharding.make_train_steps`` of
``rudax.models.next_token_loss_sum``: the same step trains a whole model here, adapters in
``examples.finetune``, on one device or over a mesh. This file only maps the flags onto them.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
from jax.sharding import Mesh

import rudax.layers as rl
import rudax.models as rm
import rudax.sharding as rs
from examples.lm.config import TrainConfig

# ------------------------------------------------------------------------------- model


def model_spec(flags: TrainConfig, vocab_size: int | None = None) -> rm.ModelSpec:
    """The ``ModelSpec`` of the flags; ``vocab_size`` (the tokenizer's) overrides the flag's.

    The architecture is ``LlamaConfig.tiny``'s at the flags' sizes (a Mixtral with
    ``--moe``), and ``--seq-len`` positions. The vocabulary a tokenizer ends up with can be
    smaller than ``--vocab-size`` on a tiny corpus, so the trainer passes the prepared one.
    Raises a ValueError naming the flags for ``--d-model`` not a multiple of ``--n-heads``,
    and LlamaConfig's ValueError/TypeError naming the field for another inconsistent shape.
    """
    # A run started from a Hugging Face directory records the fields the flags do not cover
    # (grouped-query heads, an untied head, RoPE, biases, positions): its config.json's.
    architecture = dict(flags.architecture or {})
    if architecture.get("rope_scaling") is not None:
        architecture["rope_scaling"] = rl.Llama3RopeScaling(**architecture["rope_scaling"])
    if flags.moe:
        architecture.update(
            model_type="mixtral",
            num_local_experts=flags.num_experts,
            num_experts_per_tok=flags.top_k,
            router_aux_loss_coef=flags.moe_aux_weight,
            output_router_logits=True,  # the balancing loss is part of the training loss
        )
    architecture.setdefault("max_position_embeddings", flags.seq_len)
    if architecture.get("head_dim") is None and flags.d_model % flags.n_heads:
        # named by the flags, not by LlamaConfig's fields (whose head_dim has no flag)
        raise ValueError(
            f"--d-model {flags.d_model} must be a multiple of --n-heads {flags.n_heads}"
        )
    config = rm.LlamaConfig.tiny(
        flags.vocab_size if vocab_size is None else vocab_size,
        hidden_size=flags.d_model,
        num_hidden_layers=flags.n_layers,
        num_attention_heads=flags.n_heads,
        intermediate_size=flags.mlp_hidden,
        param_dtype=jnp.dtype(flags.param_dtype),
        **architecture,
    )
    return rm.ModelSpec(
        config,
        seq_len=flags.seq_len,
        dtype=jnp.dtype(flags.compute_dtype),
        remat=flags.remat,
        scan_layers=flags.scan_layers,
        embedding_backward="sorted" if flags.deterministic else "scatter",
    )


# ------------------------------------------------------------------------------- optimizer


def optimizer_spec(flags: TrainConfig) -> rm.OptimizerSpec:
    """The ``rudax.models.OptimizerSpec`` of the optimizer flags (its defaults are theirs)."""
    return rm.OptimizerSpec(
        flags.optimizer,
        steps=flags.steps,
        learning_rate=flags.lr,
        muon_learning_rate=flags.muon_lr,
        warmup_steps=flags.warmup,
        min_lr_ratio=flags.min_lr_ratio,
        weight_decay=flags.weight_decay,
        b1=flags.beta1,
        b2=flags.beta2,
        eps=flags.eps,
        max_grad_norm=flags.clip,
    )


def make_optimizer(flags: TrainConfig, mesh: Mesh | None = None) -> optax.GradientTransformation:
    """The update rule of ``--optimizer`` (``rudax.models.OptimizerSpec.build``): clipping,
    fp32 masters of the bf16 storage, decay on the matrices (``rudax.models.decay_mask``);
    Muon over an ``fsdp`` mesh is ``rudax.sharding.fsdp_muon``."""
    return optimizer_spec(flags).build(mesh, stacked=flags.scan_layers)


# ------------------------------------------------------------------------------- model form


def shard(model: rm.LlamaForCausalLM, mesh: Mesh) -> rm.LlamaForCausalLM:
    """The model's FSDP form over the mesh's ``fsdp`` axis, as the trainer runs it.

    Parameters are gathered, and their gradients reduce-scattered, in fp32: the bf16
    rounding of a gradient then happens once, as on one device, not once per device.
    """
    return rm.shard(model, rs.ShardingContext(mesh, "fsdp"), compute_dtype=jnp.float32)
