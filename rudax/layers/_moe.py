"""Mixture of experts: a top-k router over E gated MLPs, dropless, with a load-balancing loss.

Every token goes to its ``top_k`` experts, none is dropped for lack of capacity. Two ways to
run the experts compute the same function:

* ``"ragged"``: sort the (token, slot) assignments by expert and run each expert on its own
  contiguous group with ``jax.lax.ragged_dot``, then un-sort. With a grouped matmul the work
  is what the model needs.
* ``"dense"``: every expert on every token, combined with a gate that is zero for the experts a
  token did not pick. ``E / top_k`` times the model's FLOPs, but plain dense matmuls.

jax 0.10.2 on CPU lowers ``ragged_dot`` to one dense matmul over a masked ``[E, N*top_k, d]``
copy of its input, so nothing is saved there. Measured on a 2-core CPU (d=256, h=704, 4096
tokens, E=4, top_k=2, forward and backward, wall time): "ragged" 1.74 s vs "dense" 1.70 s in
fp32, 1.74 s vs 0.95 s in bf16; with E=8, 3.9 vs 3.5 s and 4.2 vs 2.2 s. So ``impl="auto"``
takes "dense" on CPU and "ragged" elsewhere: for GPU and TPU jax emits a ``chlo.ragged_dot``
composite that XLA can lower to a grouped matmul (not measured here: no GPU on this machine).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from rudax._validation import check_positive_int, float_dtype
from rudax.kernels import silu_mul
from rudax.layers._linear import Linear

__all__ = ["IMPLS", "MoE", "MoEExperts", "load_balancing_loss", "routed_experts"]

IMPLS = ("auto", "ragged", "dense")

# GPT-2's initializer, N(0, 0.02), for every weight unless the caller scales the output one.
DEFAULT_INIT = nnx.initializers.normal(0.02)


def load_balancing_loss(probs_NxE: jax.Array, experts_NxK: jax.Array) -> jax.Array:
    """Switch Transformer's auxiliary loss, ``E * sum_e f_e * P_e``, in fp32.

    ``f_e`` is the fraction of the ``N * K`` (token, slot) assignments routed to expert ``e``
    (so ``sum_e f_e = 1`` for any ``K``) and ``P_e`` the mean router probability of ``e`` over
    the ``N`` tokens. It is 1 when both are uniform, ``E * P_0`` when every assignment goes to
    expert 0. ``f`` is a count and carries no gradient; the router learns through ``P``.

    Args:
      probs_NxE: router probabilities (softmax over the last axis), floating.
      experts_NxK: the experts each token was routed to, integers in ``[0, E)``.

    Returns:
      A fp32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> from rudax.layers import load_balancing_loss
      >>> load_balancing_loss(jnp.full((4, 2), 0.5), jnp.array([[0], [1], [0], [1]]))
      Array(1., dtype=float32)

    References:
      Fedus et al., `Switch Transformers <https://arxiv.org/abs/2101.03961>`_, 2021, eq. 4.
    """
    num_experts = probs_NxE.shape[-1]
    counts_E = jnp.zeros((num_experts,), jnp.float32).at[experts_NxK.reshape(-1)].add(1.0)
    f_E = counts_E / float(experts_NxK.size)
    p_E = jnp.mean(probs_NxE.astype(jnp.float32), axis=0)
    return float(num_experts) * jnp.sum(f_E * p_E)


class MoEExperts(nnx.Module):
    """E SwiGLU experts' weights, stacked on a leading expert axis, ``[in, out]`` per expert.

    Mixtral's names (transformers' ``MixtralSparseMoeBlock.experts``, one ``w1``/``w2``/``w3``
    per expert in its files): ``w1`` the gate projection ``[E, d, h]``, ``w3`` the up
    projection ``[E, d, h]``, ``w2`` the down projection ``[E, h, d]``. Stacked, so the
    grouped matmul (``jax.lax.ragged_dot``) reads them without copying.
    """

    def __init__(
        self,
        features: int,
        hidden_features: int,
        num_experts: int,
        *,
        param_dtype: Any,
        kernel_init: nnx.Initializer,
        out_init: nnx.Initializer,
        rngs: nnx.Rngs,
    ):
        e, d, h = num_experts, features, hidden_features
        self.w1 = nnx.Param(kernel_init(rngs.params(), (e, d, h), param_dtype))
        self.w2 = nnx.Param(out_init(rngs.params(), (e, h, d), param_dtype))
        self.w3 = nnx.Param(kernel_init(rngs.params(), (e, d, h), param_dtype))


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts: ``y = sum_{e in topk(x)} g_e(x) * expert_e(x)``.

    For each token ``x`` (compute dtype ``c``)::

        p = softmax(gate(x))                      (the logits in router_dtype, p in fp32)
        experts, g = top_k(p); g = g / sum(g)     (the k gates sum to 1, as in Mixtral)
        expert_e(x) = (silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]     (in c)
        y = c(sum_k g_k * expert_{experts_k}(x))  (combined in fp32)

    The variables take Mixtral's names, so this is also ``rudax.models``' Mixtral block:
    ``gate`` the router (``[d, E]``), ``experts.w1``/``w3``/``w2`` the stacked gate, up and
    down projections (``MoEExperts``). Every variable is an ``nnx.Param``, so
    ``ShardingContext.module`` shards the whole layer.

    Args:
      features: d, the input and output size, > 0.
      hidden_features: h, each expert's hidden size, > 0.
      num_experts: E, >= 1.
      top_k: experts per token, in ``[1, E]``.
      impl: ``"auto"``, ``"ragged"`` or ``"dense"`` (see the module docstring).
      dtype: compute dtype of the experts; None for the input's.
      param_dtype: storage dtype of every weight.
      router_dtype: the dtype the router's logits are computed in. fp32 by default: the
        softmax and the top-k choice are where bf16 rounding would flip which expert a token
        goes to; Mixtral (transformers) computes them in the compute dtype.
      kernel_init: initializer of the router, ``w1`` and ``w3``.
      out_init: initializer of ``w2``.
      rngs: the ``nnx.Rngs`` whose ``params`` stream draws the weights.

    Returns:
      A module; calling it on ``x[..., d]`` returns ``(y[..., d], aux)`` with ``aux`` the fp32
      ``load_balancing_loss`` of this call's tokens. ``route`` returns the statistics that
      loss is made of instead, over the real tokens of packed rows.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from rudax.layers import MoE
      >>> moe = MoE(8, 16, 4, top_k=2, rngs=nnx.Rngs(0))
      >>> y, aux = moe(jnp.ones((2, 3, 8)))
      >>> y.shape, aux.dtype, moe.experts.w1.shape
      ((2, 3, 8), dtype('float32'), (4, 8, 16))

    References:
      Shazeer et al., `Outrageously Large Neural Networks
      <https://arxiv.org/abs/1701.06538>`_, 2017; Jiang et al., `Mixtral of Experts
      <https://arxiv.org/abs/2401.04088>`_, 2024; Gale et al., `MegaBlocks
      <https://arxiv.org/abs/2211.15841>`_, 2022 (dropless).
    """

    IMPLS: ClassVar[tuple[str, ...]] = IMPLS

    def __init__(
        self,
        features: int,
        hidden_features: int,
        num_experts: int,
        *,
        top_k: int,
        impl: str = "auto",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        router_dtype: Any = jnp.float32,
        kernel_init: nnx.Initializer = DEFAULT_INIT,
        out_init: nnx.Initializer = DEFAULT_INIT,
        rngs: nnx.Rngs,
    ):
        check_positive_int("features", features)
        check_positive_int("hidden_features", hidden_features)
        check_positive_int("num_experts", num_experts)
        check_positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts={num_experts}, got {top_k=}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl=}")
        self.dtype = float_dtype("dtype", dtype)
        param_dtype = float_dtype("param_dtype", param_dtype, allow_none=False)
        router_dtype = float_dtype("router_dtype", router_dtype, allow_none=False)
        self.features, self.hidden_features = features, hidden_features
        self.num_experts, self.top_k, self.impl = num_experts, top_k, impl
        self.gate = Linear(
            features,
            num_experts,
            use_bias=False,
            dtype=router_dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            rngs=rngs,
        )
        self.experts = MoEExperts(
            features,
            hidden_features,
            num_experts,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            out_init=out_init,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, probs_NxE, experts_NxK = self._experts(x)
        return y, load_balancing_loss(probs_NxE, experts_NxK)

    def route(
        self, x: jax.Array, *, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """``(y, (fraction_E, probability_E))``: the output and the router's statistics.

        Over the real tokens (``segment_ids != 0``; every token without them, as
        transformers excludes masked tokens): ``fraction_E`` the fraction of tokens routed
        to each expert, summed over the k choices (so it sums to k), ``probability_E`` the
        mean router probability of each expert. A model pools them over its layers into
        Mixtral's balancing loss (``rudax.models``).
        """
        y, probs_NxE, experts_NxK = self._experts(x)
        n_tokens = probs_NxE.shape[0]
        real_N = (
            jnp.ones((n_tokens,), jnp.float32)
            if segment_ids is None
            else (segment_ids.reshape(n_tokens) != 0).astype(jnp.float32)
        )
        n = jnp.maximum(jnp.sum(real_N), 1.0)
        chosen_NxE = jnp.sum(jax.nn.one_hot(experts_NxK, self.num_experts), axis=1)
        fraction_E = jnp.einsum("ne,n->e", chosen_NxE, real_N) / n
        probability_E = jnp.einsum("ne,n->e", probs_NxE, real_N) / n
        return y, (fraction_E, probability_E)

    def _experts(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        x = jnp.asarray(x)
        _check_input(x, self.features)
        c = x.dtype if self.dtype is None else self.dtype
        x_NxD = x.reshape(-1, self.features).astype(c)
        probs_NxE = jax.nn.softmax(self.gate(x_NxD).astype(jnp.float32), axis=-1)
        w = self.experts
        weights = [v[...].astype(c) for v in (w.w1, w.w3, w.w2)]
        y_NxD, experts_NxK = routed_experts(
            x_NxD, probs_NxE, *weights, top_k=self.top_k, impl=self.impl
        )
        y = y_NxD.astype(c).reshape((*x.shape[:-1], self.features))
        return y, probs_NxE, experts_NxK


def routed_experts(
    x_NxD: jax.Array,
    probs_NxE: jax.Array,
    w_gate_ExDxH: jax.Array,
    w_up_ExDxH: jax.Array,
    w_down_ExHxD: jax.Array,
    *,
    top_k: int,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Each token through its ``top_k`` most probable SwiGLU experts, gates renormalized.

    ``MoE``'s core (also ``rudax.models``' Mixtral block), for a router of one's own::

        experts, g = top_k(probs); g = g / sum(g)
        y = sum_k g_k * (silu(x @ w_gate[e_k]) * (x @ w_up[e_k])) @ w_down[e_k]

    Args:
      x_NxD: the tokens, in the experts' compute dtype.
      probs_NxE: the router's probabilities (fp32).
      w_gate_ExDxH, w_up_ExDxH, w_down_ExHxD: the stacked expert weights, in ``x``'s dtype.
      top_k: experts per token.
      impl: ``"auto"``, ``"ragged"`` or ``"dense"`` (module docstring).

    Returns:
      ``(y_NxD, experts_NxK)``: the combined output in fp32 and the chosen experts.
    """
    gates_NxK, experts_NxK = jax.lax.top_k(probs_NxE, top_k)
    gates_NxK = gates_NxK / jnp.sum(gates_NxK, axis=-1, keepdims=True)
    if impl == "auto":
        impl = "dense" if jax.default_backend() == "cpu" else "ragged"
    run = _ragged_experts if impl == "ragged" else _dense_experts
    y_NxD = run(x_NxD, experts_NxK, gates_NxK, w_gate_ExDxH, w_up_ExDxH, w_down_ExHxD)
    return y_NxD, experts_NxK


def _check_input(x: jax.Array, features: int) -> None:
    """x must be a floating array whose last axis is the layer's input size."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"MoE expects a floating input, got x.dtype={x.dtype}")
    if x.ndim == 0 or x.shape[-1] != features:
        raise ValueError(f"MoE expects x.shape[-1] == {features}, got x.shape={x.shape}")


def _ragged_experts(x_NxD, experts_NxK, gates_NxK, w_gate, w_up, w_down) -> jax.Array:
    """Dropless grouped matmuls over the assignments sorted by expert (see the module doc)."""
    n, k = experts_NxK.shape
    num_experts = w_gate.shape[0]
    flat_M = experts_NxK.reshape(-1)  # M = N * K assignments, token-major
    order_M = jnp.argsort(flat_M, stable=True)
    x_MxD = x_NxD[order_M // k]
    sizes_E = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)
    h_MxH = silu_mul(
        jax.lax.ragged_dot(x_MxD, w_gate, sizes_E), jax.lax.ragged_dot(x_MxD, w_up, sizes_E)
    )
    out_MxD = jax.lax.ragged_dot(h_MxH, w_down, sizes_E)
    out_NxKxD = jnp.zeros_like(out_MxD).at[order_M].set(out_MxD).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", out_NxKxD.astype(jnp.float32), gates_NxK)


def _dense_experts(x_NxD, experts_NxK, gates_NxK, w_gate, w_up, w_down) -> jax.Array:
    """Every expert on every token; the gate of an expert a token did not pick is exactly 0."""
    num_experts = w_gate.shape[0]
    h_NxExH = silu_mul(
        jnp.einsum("nd,edh->neh", x_NxD, w_gate), jnp.einsum("nd,edh->neh", x_NxD, w_up)
    )
    out_NxExD = jnp.einsum("neh,ehd->ned", h_NxExH, w_down)
    onehot_NxKxE = jax.nn.one_hot(experts_NxK, num_experts, dtype=jnp.float32)
    combine_NxE = jnp.einsum("nke,nk->ne", onehot_NxKxE, gates_NxK)
    return jnp.einsum("ned,ne->nd", out_NxExD.astype(jnp.float32), combine_NxE)
