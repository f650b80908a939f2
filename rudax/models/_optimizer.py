"""The optimizer a Llama-family model is pretrained with: ``OptimizerSpec`` and ``decay_mask``.

What the model's parameter names decide lives here, beside the model: which parameters weight
decay shrinks (the matrices, not the norms or the embedding) and which Muon orthogonalizes
(the blocks' 2-D matrices; the embedding, the head, the MoE router and experts go to its
AdamW). ``OptimizerSpec`` is the recipe ``examples.lm.train`` trains with, its defaults the
trainer's: a frozen record of the hyperparameters that builds the ``optax`` transformation,
plain or over an FSDP mesh (``rudax.sharding.fsdp_muon``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

import rudax.optim as ro
import rudax.sharding as rs

__all__ = ["OPTIMIZERS", "OptimizerSpec", "decay_mask"]

OPTIMIZERS = ("adamw", "muon", "fused_adamw")


def _is_sharded(x: Any) -> bool:
    return isinstance(x, rs.ShardedParameter)


def _labels(params: Any, label: Callable[[str, Any], Any]) -> Any:
    """label(path, leaf) for every parameter, a ShardedParameter counting as one leaf."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: label(jax.tree_util.keystr(path), x), params, is_leaf=_is_sharded
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
    (``scan_layers``). A ``ShardedParameter`` (FSDP) counts as one leaf, its rank its
    logical shape's: the mask is a prefix of the parameters' tree, which ``mask=`` takes as
    optax does (a bool covers its subtree).

    Args:
      params: a ``LlamaForCausalLM``'s ``nnx.Param`` state, plain, stacked or FSDP-sharded.

    Returns:
      The parameters' tree with a Python bool where each parameter (or ShardedParameter) is.

    Example:
      >>> from flax import nnx
      >>> from rudax.models import LlamaConfig, ModelSpec, decay_mask
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


def _muon_mask(params: Any) -> Any:
    """The blocks' 2-D matrices, which Muon steps; the token table and the head's (tied or
    not) and a MoE block (router, stacked experts) go to its AdamW. By path prefix: FSDP lists
    a sharded layer's variables as ['variables'][i], without their attribute names
    ("embedding"), under the layer's own path."""
    tables = ("['model']['embed_tokens']", "['lm_head']")
    return _labels(
        params,
        lambda path, x: (
            _matrix_rank(path, x) == 2
            and not path.startswith(tables)
            and "['block_sparse_moe']" not in path
        ),
    )


def _matrix_rank(path: str, leaf: Any) -> int:
    """A parameter's rank without the layer axis of stacked layers (``model.layers.<name>``,
    no layer index: ``rudax.layers.stack_layers``); a ShardedParameter's logical shape is
    one layer's already."""
    if isinstance(leaf, rs.ShardedParameter):
        return len(leaf.logical_shape)
    return jnp.ndim(leaf) - path.startswith("['model']['layers']['")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """A Llama-family model's update rule: clipping, fp32 masters and decay on the matrices.

    The learning rate warms up linearly from 0 over ``warmup_steps`` updates, then decays
    along a cosine to ``min_lr_ratio`` of its peak at ``steps`` (:meth:`schedule`). Weight
    decay is decoupled and shrinks only what :func:`decay_mask` selects, whichever optimizer
    steps it. :meth:`build` returns, by ``name``:

    * ``"adamw"``: ``fp32_master(chain(clip_by_global_norm, adamw(mask=decay_mask)))``.
    * ``"muon"``: Muon on the blocks' 2-D matrices (attention, MLP) at
      ``muon_learning_rate``, AdamW on the rest (embedding and head, norms, MoE router and
      stacked experts), as Keller Jordan's modded-nanogpt splits them; both decay by
      ``decay_mask``, and the whole is clipped and kept in fp32 masters as above. Over a
      mesh with an ``fsdp`` axis it is ``rudax.sharding.fsdp_muon``: the same update on the
      sharded parameters, each matrix orthogonalized on one device.
    * ``"fused_adamw"``: ``rudax.optim.fused_adamw(mask=decay_mask)``, clipping and masters
      built in.

    The defaults are ``python -m examples.lm.train``'s.

    Attributes:
      name: ``"adamw"``, ``"muon"`` or ``"fused_adamw"``.
      steps: the updates of the run (the cosine's end).
      learning_rate: AdamW's peak learning rate (Muon's AdamW part too).
      muon_learning_rate: Muon's peak learning rate, for the matrices.
      warmup_steps: updates of linear warmup from 0.
      min_lr_ratio: the learning rate at ``steps`` over its peak.
      weight_decay: the decoupled decay coefficient (times the learning rate).
      b1, b2, eps: Adam's.
      max_grad_norm: the global gradient norm clipped to.

    Example:
      >>> from flax import nnx
      >>> from rudax.models import LlamaConfig, ModelSpec, OptimizerSpec
      >>> spec = ModelSpec(LlamaConfig.tiny(64, hidden_size=16, num_hidden_layers=1), 8)
      >>> params = nnx.state(spec.create(0), nnx.Param)
      >>> opt = OptimizerSpec("adamw", steps=100, learning_rate=1e-3, warmup_steps=10)
      >>> opt_state = opt.build().init(params)
      >>> [round(float(opt.schedule(1e-3)(s)), 6) for s in (0, 10, 100)]  # warmup, peak, end
      [0.0, 0.001, 0.0001]
    """

    name: str = "muon"
    steps: int = 150
    learning_rate: float = 3e-3
    muon_learning_rate: float = 0.02
    warmup_steps: int = 15
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"name must be one of {OPTIMIZERS}, got name={self.name!r}")
        for field in ("steps", "warmup_steps"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field} must be a non-negative int, got {field}={value!r}")
        if self.steps < 1:
            raise ValueError(f"steps must be positive, got steps={self.steps}")

    def schedule(self, peak: float) -> optax.Schedule:
        """Linear warmup to ``peak`` over ``warmup_steps``, cosine to ``peak * min_lr_ratio``
        at ``steps``; the learning rate of update ``s`` (counted from 1) is ``schedule(s - 1)``."""
        return ro.warmup_cosine_decay_schedule(
            0.0, peak, self.warmup_steps, self.steps, end_value=peak * self.min_lr_ratio
        )

    def build(
        self, mesh: Mesh | None = None, *, stacked: bool = False
    ) -> optax.GradientTransformation:
        """The transformation, for parameters plain or (``mesh`` with an ``fsdp`` axis)
        FSDP-sharded; ``stacked``: the layers stored stacked (``scan_layers``), so each
        ``[L, in, out]`` kernel is ``L`` matrices to Muon."""
        lr = self.schedule(self.learning_rate)
        b1, b2, eps, wd = self.b1, self.b2, self.eps, self.weight_decay
        if self.name == "fused_adamw":
            return ro.fused_adamw(
                lr, b1, b2, eps, weight_decay=wd, max_grad_norm=self.max_grad_norm, mask=decay_mask
            )
        if self.name == "adamw":
            inner = ro.adamw(lr, b1, b2, eps, weight_decay=wd, mask=decay_mask)
        else:
            if mesh is not None and "fsdp" in mesh.axis_names:
                muon = functools.partial(rs.fsdp_muon, mesh=mesh, axis_name="fsdp")
            else:
                muon = ro.muon
            inner = muon(
                self.schedule(self.muon_learning_rate),
                weight_decay=self.weight_decay,
                muon_mask=_muon_mask,
                adamw_learning_rate=lr,
                adamw_b1=self.b1,
                adamw_b2=self.b2,
                adamw_eps=self.eps,
                adamw_weight_decay=self.weight_decay,
                mask=decay_mask,
                stacked=stacked,
            )
        return ro.fp32_master(optax.chain(ro.clip_by_global_norm(self.max_grad_norm), inner))
