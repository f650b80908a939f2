"""A GPT (dense or mixture of experts) built from rudax.layers, its loss, FLOPs and FSDP form.

Pre-norm decoder blocks, LLaMA-style: RMSNorm -> causal self-attention with rotary positions
-> residual -> RMSNorm -> SwiGLU MLP (or ``MoE``) -> residual; a final RMSNorm and logits
through the token embedding's own table (``TiedProjection``). No biases, no dropout.

The defaults are the README's main job. The other fields of ``GPTConfig`` make the same
model a Llama (or Qwen2) checkpoint's (``examples/lm/hf.py``): grouped-query attention
(``n_kv_heads``), an untied output head (``tie_embeddings=False``), separate q/k/v
projections (``fused_qkv=False``), q/k/v biases (``qkv_bias``) and Llama 3's RoPE
(``rope_scaling``).

Read top to bottom: ``GPTConfig``, ``Block``, ``GPT`` (attention is
``rudax.layers.Attention``, the experts ``rudax.layers.MoE``), then what a trainer
needs: ``loss_sum`` (the contract with token-weighted gradient accumulation),
``flops_per_token`` (for MFU) and ``shard`` (the same model for FSDP over ``rudax.sharding``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rudax.kernels as rk
import rudax.layers as rl
import rudax.sharding as rs
from rudax._validation import (
    STORAGE_DTYPES,
    check_bool,
    check_int,
    check_non_negative,
    check_positive,
    check_positive_int,
)

# GPT-2's initialization: N(0, 0.02) everywhere, and the projections that write into the
# residual stream scaled by 1/sqrt(2 * n_layers) so the stream's variance does not grow with
# depth (each block adds two such writes).
INIT_STD = 0.02


def _round_up(n: float, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The shape and precision of a ``GPT``; every field is checked when it is built.

    The defaults are a small model for a few minutes of training on a 2-core CPU: 3.2M
    parameters outside the 2.1M of the tied embedding; a training step of 16 x 256 tokens
    took 0.8 s there with fp32 compute (bf16 compute about 20% slower).

    Attributes:
      vocab_size: V, the tokenizer's vocabulary size.
      seq_len: T, the longest input the model is trained on (RoPE needs no table of it, but
        ``flops_per_token`` and the input check use it).
      d_model: width of the residual stream, a multiple of ``n_heads``.
      n_layers: number of blocks.
      n_heads: attention (query) heads; ``d_model // n_heads`` must be even (RoPE rotates
        pairs).
      n_kv_heads: key/value heads of grouped-query attention, dividing ``n_heads``; None for
        ``n_heads`` (multi-head attention). Filled in by ``__post_init__``, as ``mlp_hidden``.
      mlp_hidden: hidden size of each (expert) MLP; None for SwiGLU's ``8/3 * d_model``
        rounded up to a multiple of 64, which keeps the MLP's parameter count that of a
        4x GELU MLP. Filled in by ``__post_init__``, so it is always an int (and
        ``dataclasses.replace(config, d_model=...)`` keeps it: pass ``mlp_hidden=None`` too).
      rope_theta: RoPE's base wavelength.
      rope_scaling: None, or a ``Llama3RopeScaling`` (Llama 3.1's rewrite of the
        frequencies).
      norm_eps: RMSNorm's epsilon.
      tie_embeddings: True: the logits are made with the token embedding's table; False: with
        a table of their own, ``[vocab_size, d_model]`` as Hugging Face's ``lm_head.weight``
        (a second ``Embedding``-shaped table in a ``TiedProjection``, so the fused loss and
        FSDP treat both alike).
      fused_qkv: True: one ``qkv`` projection (faster); False: separate ``q``, ``k``, ``v``
        projections, in which LoRA on one of them alone is exact (the form ``load_hf`` builds).
      qkv_bias: whether q, k and v have biases (Qwen2's layout).
      param_dtype: storage dtype of every parameter (bf16, fp16 or fp32). Train bf16 storage
        with ``rudax.optim.fp32_master``.
      dtype: compute dtype of the activations and logits (bf16, fp16 or fp32); the loss is
        fp32 whatever this is.
      num_experts: 0 for dense MLPs; E >= 1 for a ``MoE`` layer in every block.
      top_k: experts per token, in ``[1, num_experts]``; unused when dense.
      moe_aux_weight: coefficient of the load-balancing loss in ``loss_sum``, >= 0.
      moe_impl: ``"auto"``, ``"ragged"`` or ``"dense"``, see ``rudax.layers.MoE``.
      loss_chunk: tokens per chunk of ``loss_sum``'s fused head and cross entropy
        (``rudax.kernels.linear_cross_entropy``), which never holds the whole ``[B, T, V]``
        logits; None computes the full logits and differentiates them plainly. The loss is
        the same up to float summation order.
      embedding_backward: how the input embedding's gradient is summed, ``"scatter"`` or
        ``"sorted"`` (no scatter-add atomics on a GPU: ``rudax.layers.Embedding``).
      remat: each block's activation checkpointing policy, one of
        ``rudax.layers.REMAT_POLICIES`` (``"none"``: keep every activation for the
        backward; ``"full"``: keep each block's input only and recompute the rest). It
        changes memory and time, not the gradients (``tests/lm/test_remat.py``).
      scan_layers: run the blocks as one ``lax.scan`` over their parameters stacked on a
        leading axis, instead of a Python loop: XLA compiles one block instead of
        ``n_layers``, and remat then lowers memory on every backend (XLA:CPU compiles an
        unrolled loop's remat away: ``rudax/layers/_remat.py``). The blocks are stored as
        before, one module each, so checkpoints, Hugging Face files, LoRA and ``shard`` see
        no difference; the stacking is done inside the step (one copy of the blocks'
        parameters, and of their gradients, per step). Blocks that hold RNG state (dropout)
        are refused: a scan would give every block the same draws.

    Example:
      >>> from examples.lm.model import GPTConfig
      >>> GPTConfig(d_model=256).mlp_hidden
      704
      >>> GPTConfig(n_heads=3)
      Traceback (most recent call last):
      ...
      ValueError: d_model must be a multiple of n_heads=3, got d_model=256
    """

    vocab_size: int = 8192
    seq_len: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    param_dtype: Any = jnp.bfloat16
    dtype: Any = jnp.bfloat16
    num_experts: int = 0
    top_k: int = 2
    moe_aux_weight: float = 0.01
    moe_impl: str = "auto"
    loss_chunk: int | None = 1024
    n_kv_heads: int | None = None
    tie_embeddings: bool = True
    fused_qkv: bool = True
    qkv_bias: bool = False
    rope_scaling: rl.Llama3RopeScaling | None = None
    embedding_backward: str = "scatter"
    remat: str = "none"
    scan_layers: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            check_positive_int(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model must be a multiple of n_heads={self.n_heads}, got d_model={self.d_model}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"d_model // n_heads must be even for RoPE, got d_model={self.d_model}, "
                f"n_heads={self.n_heads} (head_dim={self.head_dim})"
            )
        if self.mlp_hidden is None:
            object.__setattr__(self, "mlp_hidden", _round_up(8 * self.d_model / 3, 64))
        check_positive_int("mlp_hidden", self.mlp_hidden)
        n_kv_heads = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        object.__setattr__(self, "n_kv_heads", n_kv_heads)
        check_positive_int("n_kv_heads", n_kv_heads)
        if self.n_heads % n_kv_heads:
            raise ValueError(
                f"n_kv_heads must divide n_heads={self.n_heads}, got n_kv_heads={n_kv_heads}"
            )
        for name in ("tie_embeddings", "fused_qkv", "qkv_bias", "scan_layers"):
            check_bool(name, getattr(self, name))
        if self.embedding_backward not in ("scatter", "sorted"):
            raise ValueError(
                f'embedding_backward must be "scatter" or "sorted", got '
                f"embedding_backward={self.embedding_backward!r}"
            )
        if self.remat not in rl.REMAT_POLICIES:
            raise ValueError(f"remat must be one of {rl.REMAT_POLICIES}, got remat={self.remat!r}")
        if self.rope_scaling is not None and not isinstance(
            self.rope_scaling, rl.Llama3RopeScaling
        ):
            raise TypeError(
                f"rope_scaling must be None or a Llama3RopeScaling, got "
                f"rope_scaling={self.rope_scaling!r}"
            )
        check_positive("rope_theta", self.rope_theta, accept="static")
        check_positive("norm_eps", self.norm_eps, accept="static")
        for name in ("param_dtype", "dtype"):
            value = getattr(self, name)
            try:
                dt = np.dtype(value)
            except TypeError as e:
                raise TypeError(
                    f"{name} must be bfloat16, float16 or float32, got {name}={value!r}"
                ) from e
            if dt not in STORAGE_DTYPES:
                raise TypeError(
                    f"{name} must be bfloat16, float16 or float32, got {name}={value!r}"
                )
            # One spelling (np.dtype) so equal configs compare and hash equal.
            object.__setattr__(self, name, dt)
        check_int("num_experts", self.num_experts)
        if self.num_experts < 0:
            raise ValueError(
                f"num_experts must be >= 0 (0: dense), got num_experts={self.num_experts}"
            )
        check_positive_int("top_k", self.top_k)
        if self.num_experts and self.top_k > self.num_experts:
            raise ValueError(
                f"top_k must be <= num_experts={self.num_experts}, got top_k={self.top_k}"
            )
        check_non_negative("moe_aux_weight", self.moe_aux_weight, accept="static")
        if self.moe_impl not in rl.MoE.IMPLS:
            raise ValueError(
                f"moe_impl must be one of {rl.MoE.IMPLS}, got moe_impl={self.moe_impl!r}"
            )
        if self.loss_chunk is not None:
            check_positive_int("loss_chunk", self.loss_chunk)

    @property
    def head_dim(self) -> int:
        """``d_model // n_heads``."""
        return self.d_model // self.n_heads


class Block(nnx.Module):
    """One pre-norm decoder block: ``x += attn(norm(x)); x += mlp(norm(x))``.

    Args:
      config: the model's ``GPTConfig``; ``num_experts > 0`` makes the MLP a ``MoE``.
      rngs: the ``nnx.Rngs`` whose ``params`` stream draws the kernels.

    Returns:
      A module; calling it on ``x[B, T, d_model]`` returns ``(x, aux)``: the new residual
      stream and the MoE load-balancing loss (a fp32 zero for a dense block).
      ``segment_ids`` and ``positions`` go to the attention (``rudax.layers.Attention``).
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        c = config
        norm = lambda: rl.RMSNorm(
            c.d_model, epsilon=c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype
        )
        out_init = nnx.initializers.normal(INIT_STD / math.sqrt(2 * c.n_layers))
        self.attn_norm = norm()
        self.attn = rl.Attention(
            c.d_model,
            c.n_heads,
            num_kv_heads=c.n_kv_heads,
            fused_qkv=c.fused_qkv,
            qkv_bias=c.qkv_bias,
            rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling,
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            kernel_init=nnx.initializers.normal(INIT_STD),
            out_init=out_init,
            rngs=rngs,
        )
        self.mlp_norm = norm()
        self.is_moe = c.num_experts > 0
        if self.is_moe:
            self.mlp = rl.MoE(
                c.d_model,
                c.mlp_hidden,
                c.num_experts,
                top_k=c.top_k,
                impl=c.moe_impl,
                dtype=c.dtype,
                param_dtype=c.param_dtype,
                kernel_init=nnx.initializers.normal(INIT_STD),
                out_init=out_init,
                rngs=rngs,
            )
        else:
            self.mlp = rl.GatedMLP(
                c.d_model,
                c.mlp_hidden,
                dtype=c.dtype,
                param_dtype=c.param_dtype,
                kernel_init=nnx.initializers.normal(INIT_STD),
                rngs=rngs,
            )
            # GatedMLP draws its three kernels from one initializer; redraw the one that
            # writes into the residual stream at GPT-2's scaled std.
            kernel = self.mlp.down.kernel
            kernel.set_value(out_init(rngs.params(), kernel.shape, kernel.dtype))

    def __call__(
        self,
        x_BxTxD: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        x_BxTxD = x_BxTxD + self.attn(
            self.attn_norm(x_BxTxD), segment_ids=segment_ids, positions=positions
        )
        if self.is_moe:
            h, aux = self.mlp(self.mlp_norm(x_BxTxD))
        else:
            h, aux = self.mlp(self.mlp_norm(x_BxTxD)), jnp.zeros((), jnp.float32)
        return x_BxTxD + h, aux


class GPT(nnx.Module):
    """A decoder-only transformer language model: ``tokens -> (logits, aux_loss)``.

    ::

        x = embed(tokens)                              (compute dtype)
        for block in blocks: x, aux_l = block(x, segment_ids, positions)
        logits = norm(x) @ table.T                     (table: the embedding's, tied, or
                                                        the head's own [V, d] one)
        aux_loss = mean_l(aux_l)                       (0 for a dense model)

    The sublayers are called, never read into (no ``self.embed.embedding[...]``): ``shard``
    swaps them for ``rudax.sharding.ShardedModule``s, which gather their parameters only when
    called.

    Args:
      config: a ``GPTConfig``.
      rngs: the ``nnx.Rngs`` whose ``params`` stream draws the weights.

    Packed rows: ``model(tokens, segment_ids=..., positions=...)``, both integer ``[B, T]``
    like ``tokens``, runs several examples in each row as if each were alone: token ``t``
    attends to token ``s`` only if ``s <= t`` and ``segment_ids[b, s] == segment_ids[b, t]``,
    and RoPE rotates it by ``positions[b, t]`` (its place in its own example, in
    ``[0, T)``). Padding (segment 0) attends only to padding; its outputs are finite and
    meaningless. Without them (None, the default) every row is one sequence at positions
    ``0 .. T-1``: the same program as before they existed.

    Returns:
      A module; ``model(tokens_BxT)`` (integer ids, ``T <= config.seq_len``) returns
      ``(logits_BxTxV, aux_loss)``: logits in ``config.dtype`` and the fp32 load-balancing
      loss averaged over the blocks (1 when perfectly balanced; a fp32 zero when dense).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from examples.lm.model import GPT, GPTConfig
      >>> config = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=1, n_heads=2)
      >>> logits, aux = GPT(config, rngs=nnx.Rngs(0))(jnp.ones((2, 8), jnp.int32))
      >>> logits.shape, logits.dtype, aux
      ((2, 8, 64), dtype(bfloat16), Array(0., dtype=float32))
      >>> seg = jnp.array([[1, 1, 1, 2, 2, 2, 0, 0]] * 2)  # two examples and padding per row
      >>> pos = jnp.array([[0, 1, 2, 0, 1, 2, 0, 0]] * 2)
      >>> model = GPT(config, rngs=nnx.Rngs(0))
      >>> logits, _ = model(jnp.ones((2, 8), jnp.int32), segment_ids=seg, positions=pos)
      >>> bool(jnp.allclose(logits[:, 0:3], logits[:, 3:6], atol=1e-2))  # the same example
      True

    References:
      Radford et al., `Language Models are Unsupervised Multitask Learners
      <https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf>`_,
      2019 (GPT-2); Touvron et al., `LLaMA <https://arxiv.org/abs/2302.13971>`_, 2023
      (pre-norm RMSNorm, SwiGLU, RoPE).
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}: {config=}")
        c = config
        self.config = c
        table = lambda: rl.Embedding(
            c.vocab_size,
            c.d_model,
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            embedding_init=nnx.initializers.normal(INIT_STD),
            rngs=rngs,
        )
        self.embed = table()
        self.embed.backward = c.embedding_backward  # the head's table is never looked up
        self.blocks = nnx.List([Block(c, rngs=rngs) for _ in range(c.n_layers)])
        self.norm = rl.RMSNorm(
            c.d_model, epsilon=c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype
        )
        # An untied head is a table of its own, in an Embedding that only the head holds: the
        # same [V, d] layout, so loss_sum's fused loss and shard() need no second code path.
        self.head = rl.TiedProjection(self.embed if c.tie_embeddings else table(), dtype=c.dtype)

    def __call__(
        self,
        tokens_BxT: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        h_BxTxD, aux = self.features(tokens_BxT, segment_ids=segment_ids, positions=positions)
        return self.head(h_BxTxD), aux

    def features(
        self,
        tokens_BxT: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """``(norm(x), aux_loss)``: what the head projects to logits, and the balancing loss.

        ``segment_ids`` and ``positions`` as in ``__call__``.
        """
        tokens_BxT = jnp.asarray(tokens_BxT)
        _check_tokens("tokens_BxT", tokens_BxT, self.config.seq_len)
        for name, value in (("segment_ids", segment_ids), ("positions", positions)):
            if value is not None:
                _check_like_tokens(name, value, tokens_BxT.shape)
        x_BxTxD = self.embed(tokens_BxT)
        context = {"segment_ids": segment_ids, "positions": positions}
        if self.config.scan_layers:
            x_BxTxD, aux_L = rl.scan_layers(
                self.blocks, x_BxTxD, remat_policy=self.config.remat, **context
            )
            return self.norm(x_BxTxD), jnp.mean(aux_L)
        aux = []
        for block in self.blocks:
            run = rl.remat(block, policy=self.config.remat)  # "none": the block itself
            x_BxTxD, aux_l = run(x_BxTxD, **context)
            aux.append(aux_l)
        return self.norm(x_BxTxD), jnp.mean(jnp.stack(aux))


def _check_tokens(name: str, tokens: jax.Array, max_len: int) -> None:
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer token ids, got {name}.dtype={tokens.dtype}")
    if tokens.ndim != 2 or not 1 <= tokens.shape[1] <= max_len:
        raise ValueError(
            f"{name} must be [batch, time] with 1 <= time <= seq_len={max_len}, got "
            f"{name}.shape={tokens.shape}"
        )


def _check_like_tokens(name: str, value: Any, shape: tuple[int, ...]) -> None:
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers, got {name}.dtype={value.dtype}")
    if value.shape != tuple(shape):
        raise ValueError(
            f"{name} must have the tokens' shape [batch, time] = {tuple(shape)}, got "
            f"{name}.shape={value.shape}"
        )


def loss_sum(model: GPT, batch_BxT1: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy SUMMED over the batch's targets, plus the MoE balancing term.

    With ``inputs = batch[:, :-1]``, ``targets = batch[:, 1:]`` and ``n = B * T`` targets::

        logits, aux = model(inputs)
        ce_sum = sum_{b,t} logsumexp(logits[b, t]) - logits[b, t, targets[b, t]]   (fp32)
        loss_sum = ce_sum + moe_aux_weight * aux * n

    With ``config.loss_chunk`` set (the default) ``ce_sum`` is computed ``loss_chunk``
    tokens at a time by ``rudax.kernels.linear_cross_entropy``, which never holds
    all the logits; the value and its gradient are the same up to float summation order.

    The contract a trainer relies on: the loss is a *sum* over tokens, so for microbatches
    ``i`` of ``n_i`` tokens, ``acc.add(grad(loss_sum_i), weight=n_i)`` and then
    ``acc.pop(normalize=True)`` (``rudax.optim.GradientAccumulator``) give the gradient of
    ``sum_i ce_sum_i / sum_i n_i + moe_aux_weight * (sum_i n_i aux_i) / sum_i n_i``: the mean
    cross entropy over every token of the window plus the token-weighted mean balancing loss,
    whatever the microbatch sizes. Under FSDP each rank's ``loss_sum`` is of its own tokens
    and the sum over ranks is the same quantity (the balancing loss is then per rank's batch).

    Args:
      model: a ``GPT`` (or its ``shard``ed form, inside ``shard_map``).
      batch_BxT1: integer token ids ``[B, T + 1]`` with ``1 <= T <= config.seq_len``.

    Returns:
      ``(loss_sum, metrics)``: a fp32 scalar and ``{"tokens": n (int32), "ce_sum": ce_sum
      (fp32), "aux_loss": aux (fp32, 0 for a dense model)}``; the mean cross entropy of the
      batch is ``ce_sum / tokens``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from examples.lm.model import GPT, GPTConfig, loss_sum
      >>> config = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=1, n_heads=2)
      >>> loss, metrics = loss_sum(GPT(config, rngs=nnx.Rngs(0)), jnp.ones((2, 9), jnp.int32))
      >>> int(metrics["tokens"]), loss.dtype, bool(loss == metrics["ce_sum"])  # dense: no aux
      (16, dtype('float32'), True)
    """
    batch_BxT1 = jnp.asarray(batch_BxT1)
    if batch_BxT1.ndim != 2 or batch_BxT1.shape[1] < 2:
        raise ValueError(
            f"batch_BxT1 must be [batch, time + 1] with time >= 1, got "
            f"batch_BxT1.shape={batch_BxT1.shape}"
        )
    inputs_BxT, targets_BxT = batch_BxT1[:, :-1], batch_BxT1[:, 1:]
    if model.config.loss_chunk is None:
        logits_BxTxV, aux = model(inputs_BxT)
        logits_BxTxV = logits_BxTxV.astype(jnp.float32)
        lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
        target_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
        ce_sum = jnp.sum(lse_BxT - target_BxT)
    else:
        h_BxTxD, aux = model.features(inputs_BxT)
        # Every target counts (no ignore_index label here), so the count is n_tokens.
        ce_sum, _ = _fused_loss(model, h_BxTxD, targets_BxT, chunk=model.config.loss_chunk)
    n = targets_BxT.size
    total = ce_sum + model.config.moe_aux_weight * float(n) * aux
    return total, {"tokens": jnp.asarray(n, jnp.int32), "ce_sum": ce_sum, "aux_loss": aux}


def _fused_loss(
    model: GPT, h_BxTxD: jax.Array, labels_BxT: jax.Array, *, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """``linear_cross_entropy`` of the features against the head's table (-100 not counted)."""
    # The fused loss needs the head's table itself; a sharded head gathers it here, as
    # calling it would.
    head = model.head
    if isinstance(head, rs.ShardedModule):
        head = head.gathered()
    n_tokens, d = labels_BxT.size, h_BxTxD.shape[-1]
    return rk.linear_cross_entropy(
        h_BxTxD.reshape(n_tokens, d),
        head.embedding[...],
        labels_BxT.reshape(n_tokens),
        ignore_index=-100,
        dtype=head.dtype,
        chunk=chunk,
    )


def flops_per_token(config: GPTConfig) -> float:
    """Training FLOPs per token (forward and backward) of the model's matmuls, for MFU.

    ``6 N`` for the ``N`` matmul parameters a token actually uses (2 FLOPs per multiply-add,
    forward, plus twice that backward), attention's score and value products, and the head::

        N     = n_layers * (2 d^2 + 2 d G K + 3 d h * k + d E)
                    (G K = n_kv_heads * head_dim, d without GQA; k = top_k and E experts,
                     or 1 and 0)
        flops = 6 N + 6 n_layers seq_len d + 6 d V

    q and out are ``d x d``, k and v ``d x G K``. The attention term is PaLM's
    ``12 n_layers n_heads head_dim seq_len`` (appendix B) halved, counting only the causal
    half of the score matrix; grouped-query attention does not change it (every query head
    still scores every key). The embedding lookup is not a matmul and counts nothing; the
    head counts once, as a matmul, tied or not (an untied head's table is read by the
    matmul only). Biases are not matmuls. For an MoE model this is the model's FLOPs, not
    the hardware's: ``moe_impl="dense"`` computes all E experts.

    Args:
      config: a ``GPTConfig``.

    Returns:
      FLOPs per trained token, a float.

    Example:
      >>> from examples.lm.model import GPTConfig, flops_per_token
      >>> round(flops_per_token(GPTConfig()) / 1e6, 2)  # the default model: MFLOPs per token
      33.42

    References:
      Chowdhery et al., `PaLM <https://arxiv.org/abs/2204.02311>`_, 2022, appendix B;
      Kaplan et al., `Scaling Laws for Neural Language Models
      <https://arxiv.org/abs/2001.08361>`_, 2020 (the 6N rule).
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}: {config=}")
    c = config
    d, h, kv = c.d_model, c.mlp_hidden, c.n_kv_heads * c.head_dim
    experts, k = (c.num_experts, c.top_k) if c.num_experts else (0, 1)
    n = c.n_layers * (2 * d * d + 2 * d * kv + 3 * d * h * k + d * experts)
    return float(6 * n + 6 * c.n_layers * c.seq_len * d + 6 * d * c.vocab_size)


def shard(model: GPT, ctx: rs.ShardingContext, *, compute_dtype: Any = None) -> GPT:
    """The same GPT with every layer in its FSDP form (``rudax.sharding``), ties kept.

    Each module at the model's places (the embedding, the norms, each attention projection
    in either layout, the MLP or ``MoE``, the head) becomes a ``ShardedModule`` whose
    parameters are ``ShardedParameter``s split over ``ctx``'s axis, whatever sits there: a
    ``Linear``, or the ``LoRALinear`` that ``rudax.layers.apply_lora`` put in its place (its
    frozen base and trainable adapter both sharded). A tied head and the embedding share one
    sharded table, so its gradient sums both uses; an untied head shards its own.
    ``model`` is not modified (the result is built on a structural copy that shares its
    arrays). Run the result inside ``jax.shard_map`` with the parameter state split
    ``P(ctx.axis_name)`` and each rank's own batch; ``jax.grad`` of the ranks' summed
    ``loss_sum`` returns gradients already reduce-scattered onto the shards.

    Args:
      model: a ``GPT``.
      ctx: the ``rudax.sharding.ShardingContext`` of the mesh axis to shard over.
      compute_dtype: the dtype parameters are cast to before their all-gather (halving its
        bytes for bf16); None gathers them in their storage dtype.

    Returns:
      A new ``GPT`` whose layers are ``ShardedModule``s.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.sharding as rs
      >>> from examples.lm.model import GPT, GPTConfig, shard
      >>> config = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=1, n_heads=2)
      >>> ctx = rs.ShardingContext(jax.sharding.Mesh(jax.devices(), ("fsdp",)))
      >>> sharded = shard(GPT(config, rngs=nnx.Rngs(0)), ctx)
      >>> type(sharded.blocks[0].attn.qkv).__name__
      'ShardedModule'

    References:
      Zhao et al., `PyTorch FSDP <https://arxiv.org/abs/2304.11277>`_, 2023.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a GPT, got {type(model).__name__}")
    if not isinstance(ctx, rs.ShardingContext):
        raise TypeError(f"ctx must be a rudax.sharding.ShardingContext, got {ctx!r}")
    sharded = nnx.merge(*nnx.split(model))
    kw = dict(compute_dtype=compute_dtype)
    # ctx.module at every place, not ctx.linear and its kin: it takes whatever module sits
    # there (a Linear, or a LoRALinear that apply_lora put in its place) and shards exactly
    # what the typed methods would for the plain layers.
    sharded.embed = ctx.module(sharded.embed, **kw)
    for block in sharded.blocks:
        block.attn_norm = ctx.module(block.attn_norm, **kw)
        for name in block.attn.projections:
            setattr(block.attn, name, ctx.module(getattr(block.attn, name), **kw))
        block.mlp_norm = ctx.module(block.mlp_norm, **kw)
        block.mlp = ctx.module(block.mlp, **kw)
    sharded.norm = ctx.module(sharded.norm, **kw)
    # ctx.module, not ctx.tied_projection: it keeps the head's compute dtype, and a tied
    # head's table is the embedding's variable, which the context has already sharded once.
    sharded.head = ctx.module(sharded.head, **kw)
    return sharded
