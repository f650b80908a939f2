"""LoRA: a frozen Linear plus a trainable low-rank update, scale * dropout(x) @ A @ B."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from rudax._validation import check_positive, check_positive_int, float_dtype
from rudax.layers._dropout import Dropout
from rudax.layers._frozen import freeze
from rudax.layers._linear import Linear
from rudax.layers._matmul import rows_matmul
from rudax.layers._nf4_linear import NF4Linear
from rudax.layers._validation import check_features, check_rate

_SCALE_RULES = ("alpha/rank", "alpha/sqrt(rank)")

# peft's A init, torch's kaiming_uniform_(a=sqrt(5)): U(±sqrt(3 * (1/3) / in)) = U(±1/sqrt(in)).
_DEFAULT_A_INIT = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix: an ``nnx.Param`` that filters can tell from the other parameters.

    ``LoRALinear`` stores ``lora_a`` and ``lora_b`` as ``LoRAParam``. Being an ``nnx.Param``,
    it is trained by default (``nnx.grad``, ``nnx.Optimizer``) and converted by
    ``rudax.layers.to_dtype``; being its own type, ``nnx.state(model, LoRAParam)`` and
    ``nnx.split(model, LoRAParam, ...)`` select exactly the adapters, leaving the model's
    other trainable parameters (a norm's scale, an unadapted layer) out.

    Example:
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> lora = rl.LoRALinear(rl.Linear(4, 3, rngs=nnx.Rngs(0)), 2, alpha=2.0, rngs=nnx.Rngs(1))
      >>> model = nnx.Dict(lora=lora, norm=rl.RMSNorm(3, rngs=nnx.Rngs(2)))
      >>> sorted(nnx.state(model, rl.LoRAParam)["lora"].keys())
      ['lora_a', 'lora_b']
      >>> sorted(nnx.state(model, nnx.Param).keys())
      ['lora', 'norm']
    """


class LoRALinear(nnx.Module):
    """A frozen ``Linear`` plus a trainable low-rank adapter: ``y = base(x) + s * d(x) @ A @ B``.

    With ``c`` the compute dtype (``dtype``, or ``x.dtype`` when it is None) and ``d`` dropout
    on the adapter's input only::

        y = c(base(x)) + ((c(d(x)) @ c(A)) * s) @ c(B)
        s = alpha / rank               (scale_rule="alpha/rank", LoRA and peft's default)
        s = alpha / sqrt(rank)         (scale_rule="alpha/sqrt(rank)", rsLoRA)

    ``A`` is ``[in, rank]`` and ``B`` ``[rank, out]``, both ``rudax.layers.LoRAParam``. ``A`` is
    drawn from U(±1/sqrt(in)) as peft does (torch's ``kaiming_uniform_`` with ``a=sqrt(5)``,
    flax's ``he_uniform`` differs) and ``B`` is zero, so a fresh adapter leaves the base's
    output unchanged.

    The base is frozen in place: its ``nnx.Param`` variables (kernel, bias) are re-tagged as
    ``rudax.layers.Frozen`` (same arrays, no copy), so ``nnx.Param`` selects only A and B (and
    the other trainable parameters of a model), and ``LoRAParam`` selects the adapters only.
    A ``rudax.layers.NF4Linear`` base (QLoRA) is taken as it is: its storage is
    ``rudax.layers.Quantized`` and its bias ``Frozen`` already, and the adapter's math is the
    same, with ``base(x)`` its dequantize-matmul::

        graphdef, trainable, rest = nnx.split(model, nnx.Param, ...)   # A, B (+ other Params)
        graphdef, adapters, rest = nnx.split(model, rl.LoRAParam, ...)  # A, B only
        grads = nnx.grad(loss_fn)(model)       # wrt=nnx.Param by default: no base gradients
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    ``adapter_enabled`` (True when built) switches the adapter: with it False the layer is
    its base alone, ``y = c(base(x))``, as peft's ``disable_adapter()`` makes it. Nothing of
    the adapter is computed then (the output is the base's bit for bit, A and B get an exact
    zero gradient, dropout draws no key). It is a plain Python attribute, so it is part of the
    module's ``nnx.GraphDef``: static under ``nnx.jit`` (each setting compiles its own
    program), and two graph definitions split from one model, one with it off, merge with
    the same state. ``rudax.layers.adapters_disabled`` switches every adapter of a model.

    Args:
      base: the ``rudax.layers.Linear`` or ``flax.nnx.Linear`` to adapt (both store the kernel
        ``[in, out]``), modified in place as above, or a ``rudax.layers.NF4Linear``, not
        modified; called as it is (its own dtype rules).
      rank: the adapter's rank, > 0.
      alpha: the scale's numerator, > 0.
      dropout: dropout rate on the adapter's input, in [0, 1); ``train()``/``eval()`` and the
        call's ``deterministic`` switch it as for ``Dropout``.
      scale_rule: ``"alpha/rank"`` or ``"alpha/sqrt(rank)"``.
      dtype: compute and output dtype; None for the input's dtype.
      param_dtype: storage dtype of A and B (independent of the base's).
      a_init: initializer of A, shape ``[in, rank]``.
      rngs: an ``nnx.Rngs``; its ``params`` stream draws A, its ``dropout`` stream (or
        ``default``) the dropout masks when ``dropout > 0``.

    Returns:
      A module; calling it on ``x[..., in]`` returns ``y[..., out]`` in the compute dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> lora = rl.LoRALinear(rl.Linear(8, 4, rngs=nnx.Rngs(0)), 2, alpha=4.0, rngs=nnx.Rngs(1))
      >>> sorted(nnx.state(lora, nnx.Param).keys()), type(lora.base.kernel).__name__
      (['lora_a', 'lora_b'], 'Frozen')
      >>> type(lora.lora_a).__name__, lora.scale
      ('LoRAParam', 2.0)
      >>> lora(jnp.ones((3, 8))).shape
      (3, 4)

    References:
      Hu et al., `LoRA: Low-Rank Adaptation of Large Language Models
      <https://arxiv.org/abs/2106.09685>`_, 2021. Kalajdzievski, `A Rank Stabilization Scaling
      Factor for Fine-Tuning with LoRA <https://arxiv.org/abs/2312.03732>`_, 2023.
    """

    def __init__(
        self,
        base: Linear | nnx.Linear | NF4Linear,
        rank: int,
        *,
        alpha: float,
        dropout: float = 0.0,
        scale_rule: str = "alpha/rank",
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        a_init: nnx.Initializer = _DEFAULT_A_INIT,
        rngs: nnx.Rngs,
    ):
        if not isinstance(base, Linear | nnx.Linear | NF4Linear):
            raise TypeError(
                f"base must be a rudax.layers.Linear or a flax.nnx.Linear (or a "
                f"rudax.layers.NF4Linear), got {type(base).__name__}: {base=}"
            )
        check_positive_int("rank", rank)
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}: {rngs=}")
        alpha = check_positive("alpha", alpha, accept="concrete")
        dropout = check_rate("dropout", dropout)
        if scale_rule not in _SCALE_RULES:
            raise ValueError(f"scale_rule must be one of {_SCALE_RULES}, got {scale_rule=}")
        self.dtype = float_dtype("dtype", dtype)
        param_dtype = float_dtype("param_dtype", param_dtype, allow_none=False)
        self.rank = rank
        # alpha and the rule are kept (not only their quotient) for PEFT's adapter_config.json.
        self.alpha = alpha
        self.scale_rule = scale_rule
        self.scale = alpha / rank if scale_rule == "alpha/rank" else alpha / math.sqrt(rank)
        self.in_features = base.in_features
        self.out_features = base.out_features
        # Everything that can fail (a bad rngs included) runs before the base is re-tagged, so
        # a failed construction leaves the caller's layer as it was.
        lora_a = a_init(rngs.params(), (base.in_features, rank), param_dtype)
        self.dropout = Dropout(dropout, rngs=rngs if dropout > 0.0 else None)
        self.lora_a = LoRAParam(lora_a)
        self.lora_b = LoRAParam(jnp.zeros((rank, base.out_features), param_dtype))
        freeze(base)  # an NF4Linear has no nnx.Param: nothing to re-tag
        self.base = base
        # Static (part of the graphdef), not a Variable: the call branches on it in Python, so
        # a disabled adapter is absent from the traced program rather than multiplied by 0.
        self.adapter_enabled = True

    def __call__(self, x: ArrayLike, *, deterministic: bool | None = None) -> jax.Array:
        x = jnp.asarray(x)
        check_features("LoRALinear", x, self.in_features)
        dtype = x.dtype if self.dtype is None else self.dtype
        if not self.adapter_enabled:
            # peft's disable_adapter: the base alone. Dropout is skipped too, so its RNG count
            # does not advance: a reference pass leaves the policy pass's masks as they are
            # without it, and the base's output is not changed by a single bit.
            return self.base(x).astype(dtype)
        h = self.dropout(x, deterministic=deterministic).astype(dtype)
        # Scaling the rank-sized intermediate costs rank, not out, multiplies per row.
        low_rank = rows_matmul(h, self.lora_a[...].astype(dtype)) * self.scale
        return self.base(x).astype(dtype) + rows_matmul(low_rank, self.lora_b[...].astype(dtype))
