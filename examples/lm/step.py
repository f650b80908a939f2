"""The model spec and the optimizer of ``examples.lm.train``, from its flags.

The steps themselves are the library's (``rudax.sharding.make_train_steps`` with
``examples.lm.spec.loss_sum``): the same step trains a whole model here, adapters in
``examples.finetune``, on one device or over a mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

import rudax.layers as rl
import rudax.models as rm
import rudax.optim as ro
import rudax.sharding as rs
from examples.lm.config import TrainConfig
from examples.lm.spec import ModelSpec

# ------------------------------------------------------------------------------- model


def model_spec(flags: TrainConfig, vocab_size: int | None = None) -> ModelSpec:
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
    return ModelSpec(
        config,
        seq_len=flags.seq_len,
        dtype=jnp.dtype(flags.compute_dtype),
        remat=flags.remat,
        scan_layers=flags.scan_layers,
        embedding_backward="sorted" if flags.deterministic else "scatter",
    )


# ------------------------------------------------------------------------------- optimizer


def _is_sharded(x: Any) -> bool:
    return isinstance(x, rs.ShardedParameter)


def _labels(params: Any, label: Callable[[str, Any], Any]) -> Any:
    """label(path, leaf) for every parameter, a ShardedParameter counting as one leaf."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: label(jax.tree_util.keystr(path), x), params, is_leaf=_is_sharded
    )


def make_schedule(flags: TrainConfig, peak: float) -> optax.Schedule:
    """Linear warmup to ``peak`` over ``--warmup`` updates, cosine to ``peak * --min-lr-ratio``."""
    return ro.warmup_cosine_decay_schedule(
        0.0, peak, flags.warmup, flags.steps, end_value=peak * flags.min_lr_ratio
    )


def decay_mask(params: Any) -> Any:
    """Which parameters weight decay shrinks: the weight matrices, not norms, biases or embedding.

    True for every weight matrix: the attention and MLP projections, a Mixtral's router and
    stacked experts, an untied output head's own table (``lm_head.embedding``, a matrix as
    minGPT's ``lm_head.weight``) and LoRA adapters' A and B. False for norm scales and
    biases (Qwen2's q/k/v biases too) and for the token embedding, which is also the tied
    output head: torch's parameter group with ``weight_decay=0``, as minGPT, modded-nanogpt
    and OLMo 2 leave them. Decay there shrinks per-channel gains and the logits' scale
    rather than limiting how the matrices fit.

    A matrix is a leaf of rank >= 2, not counting the layer axis of layers stored stacked
    (``--scan-layers``). A ``ShardedParameter`` (FSDP) counts as one leaf, its rank its
    logical shape's: the mask is a prefix of the parameters' tree, which ``mask=`` takes as
    optax does (a bool covers its subtree).

    Args:
      params: the model's ``nnx.Param`` state, plain, stacked or FSDP-sharded.

    Returns:
      The parameters' tree with a Python bool where each parameter (or ShardedParameter) is.

    Example:
      >>> from flax import nnx
      >>> from examples.lm.spec import ModelSpec
      >>> from rudax.models import LlamaConfig
      >>> spec = ModelSpec(LlamaConfig.tiny(64, hidden_size=16, num_hidden_layers=1), 8)
      >>> mask = decay_mask(nnx.state(spec.create(0), nnx.Param))
      >>> mask["lm_head"]["embedding"].get_value()  # the tied embedding, listed as the head
      False
      >>> mask["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
      True
    """
    paths = jax.tree.leaves(_labels(params, lambda path, x: path))
    # A tied head's table is the embedding's one Param, which nnx lists under lm_head (the
    # first path in sorted order): without an embed_tokens leaf, lm_head is the embedding.
    tied = not any(p.startswith("['model']['embed_tokens']") for p in paths)
    spared = ("['model']['embed_tokens']", *(("['lm_head']",) if tied else ()))
    return _labels(
        params, lambda path, x: _matrix_rank(path, x) >= 2 and not path.startswith(spared)
    )


def _matrix_rank(path: str, leaf: Any) -> int:
    """A parameter's rank without the layer axis of stacked layers (``model.layers.<name>``,
    no layer index: ``rudax.layers.stack_layers``); a ShardedParameter's logical shape is
    one layer's already."""
    if isinstance(leaf, rs.ShardedParameter):
        return len(leaf.logical_shape)
    return jnp.ndim(leaf) - path.startswith("['model']['layers']['")


def make_optimizer(flags: TrainConfig, mesh: Mesh | None = None) -> optax.GradientTransformation:
    """The update rule of ``--optimizer``, with clipping and fp32 masters of the bf16 storage.

    Decoupled weight decay (``--weight-decay``) shrinks only what :func:`decay_mask` selects,
    whichever optimizer steps it: the attention and MLP matrices, the MoE router and experts;
    norm scales and the embedding (the tied head) get their step without decay.

    * ``adamw``: ``fp32_master(chain(clip_by_global_norm, adamw(mask=decay_mask)))``.
    * ``muon``: Muon on the blocks' 2-D matrices (attention, MLP), AdamW on the rest
      (embedding/tied head, norms, MoE router and the stacked 3-D experts), as Keller
      Jordan's modded-nanogpt splits them; both decay by ``decay_mask``. On the dense model
      AdamW's leaves are the embedding and the norms, so it decays nothing, as modded-nanogpt's
      Adam; with ``--moe`` the router and the experts decay as the dense MLP's matrices do.
      Over a ``mesh`` with an ``fsdp`` axis it is ``rudax.sharding.fsdp_muon``: the same
      update on the sharded parameters, each matrix orthogonalized on one device.
    * ``fused_adamw``: ``rudax.optim.fused_adamw(mask=decay_mask)``, clipping and masters
      built in.
    """
    lr = make_schedule(flags, flags.lr)
    adam = dict(b1=flags.beta1, b2=flags.beta2, eps=flags.eps)
    if flags.optimizer == "fused_adamw":
        return ro.fused_adamw(
            lr, weight_decay=flags.weight_decay, max_grad_norm=flags.clip, mask=decay_mask, **adam
        )
    if flags.optimizer == "adamw":
        inner = ro.adamw(lr, weight_decay=flags.weight_decay, mask=decay_mask, **adam)
    else:
        # the token table and the head's (tied or not), and a router, go to AdamW. By path
        # prefix: FSDP lists a sharded layer's variables as ['variables'][i], without their
        # attribute names ("embedding"), under the layer's own path.
        tables = ("['model']['embed_tokens']", "['lm_head']")
        matrices = lambda params: _labels(
            params,
            lambda path, x: (
                _matrix_rank(path, x) == 2
                and not path.startswith(tables)
                and "['block_sparse_moe']" not in path
            ),
        )
        sharded = mesh is not None and "fsdp" in mesh.axis_names
        muon = functools.partial(rs.fsdp_muon, mesh=mesh, axis_name="fsdp") if sharded else ro.muon
        inner = muon(
            make_schedule(flags, flags.muon_lr),
            weight_decay=flags.weight_decay,
            muon_mask=matrices,
            adamw_learning_rate=lr,
            adamw_b1=flags.beta1,
            adamw_b2=flags.beta2,
            adamw_eps=flags.eps,
            adamw_weight_decay=flags.weight_decay,
            mask=decay_mask,
            # scanned layers are stored stacked: each [L, in, out] kernel is L matrices
            stacked=flags.scan_layers,
        )
    return ro.fp32_master(optax.chain(ro.clip_by_global_norm(flags.clip), inner))
