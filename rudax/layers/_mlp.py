"""GatedMLP: down(activation(gate(x)) * up(x)), SwiGLU through the fused silu_mul kernel."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from rudax._validation import check_bool, check_impl, check_positive_int, float_dtype
from rudax.kernels import silu_mul
from rudax.layers._linear import DEFAULT_KERNEL_INIT, Linear
from rudax.layers._validation import check_features


class GatedMLP(nnx.Module):
    """A gated feed-forward block: ``y = down(act(gate(x)) * up(x))``, SwiGLU by default.

    ``gate_proj`` and ``up_proj`` are ``Linear(features, hidden_features)``, ``down_proj`` is
    ``Linear(hidden_features, features)``, all computing in ``dtype`` (None: the input's);
    their names are transformers' (``LlamaMLP``'s), so LoRA targets and checkpoint names
    carry over, and ``rudax.models``' Llama MLP is this layer::

        h = silu(x @ W_gate) * (x @ W_up)       (activation=jax.nn.silu, the default)
        h = act(x @ W_gate) * (x @ W_up)        (any other activation)
        y = h @ W_down

    With ``jax.nn.silu`` (``jax.nn.swish`` is the same function) the product runs through
    ``rudax.kernels.silu_mul``: by default its exact XLA path (faster on an H200 than its
    Pallas kernel), and a backward that saves ``gate`` and ``up`` only. Other activations
    are plain jnp and ignore ``impl``. Without biases by default, as in LLaMA.

    Args:
      features: size of the input and output last axis, > 0.
      hidden_features: size of the hidden axis, > 0.
      activation: the gate's activation, a callable; ``jax.nn.silu`` for SwiGLU.
      use_bias: whether the three projections have biases.
      dtype: compute and output dtype; None for the input's dtype.
      param_dtype: storage dtype of the projections.
      kernel_init: initializer of the three kernels (flax's LeCun normal by default).
      impl: ``"auto"``, ``"pallas"`` or ``"xla"``, passed to ``rudax.kernels.silu_mul``.
      interpret: run the Pallas kernel in interpret mode (tests on CPU).
      rngs: the ``nnx.Rngs`` whose ``params`` stream draws the kernels.

    Returns:
      A module; calling it on ``x[..., features]`` returns ``y[..., features]`` in the compute
      dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> mlp = rl.GatedMLP(8, 16, rngs=nnx.Rngs(0))
      >>> mlp(jnp.ones((2, 8), jnp.bfloat16)).dtype
      dtype(bfloat16)

    References:
      Shazeer, `GLU Variants Improve Transformer <https://arxiv.org/abs/2002.05202>`_, 2020.
    """

    def __init__(
        self,
        features: int,
        hidden_features: int,
        *,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
        use_bias: bool = False,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        kernel_init: nnx.Initializer = DEFAULT_KERNEL_INIT,
        impl: str = "auto",
        interpret: bool = False,
        rngs: nnx.Rngs,
    ):
        check_positive_int("features", features)
        check_positive_int("hidden_features", hidden_features)
        if not callable(activation):
            raise TypeError(f"activation must be callable, got {activation=}")
        check_bool("use_bias", use_bias)
        dtype = float_dtype("dtype", dtype)
        check_impl(impl)
        check_bool("interpret", interpret)
        self.features = features
        self.hidden_features = hidden_features
        self.activation = activation
        self.impl = impl
        self.interpret = interpret
        linear = lambda n_in, n_out: Linear(
            n_in,
            n_out,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            rngs=rngs,
        )
        self.gate_proj = linear(features, hidden_features)
        self.up_proj = linear(features, hidden_features)
        self.down_proj = linear(hidden_features, features)

    def __call__(self, x: ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        check_features("GatedMLP", x, self.features)
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation is jax.nn.silu:
            h = silu_mul(gate, up, impl=self.impl, interpret=self.interpret)
        else:
            h = self.activation(gate) * up
        return self.down_proj(h)
