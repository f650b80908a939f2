"""The catalog of bad inputs to rudax.kernels: each is a clear error naming what to fix.

Kernels are called with arrays whose shapes and dtypes decide the compiled program, so every
mismatch is caught at trace time, before a Pallas kernel could read out of bounds or a jnp
broadcast could pair the wrong elements. The fused AdamW kernel's cases are in
``tests/optim/test_bad_inputs.py``, beside the optimizer that calls it.
"""

import jax
import jax.numpy as jnp

import rudax.kernels as rk
from tests._catalog import Bad, catalog

x = jnp.ones((2, 4))
scale = jnp.ones(4)

CASES = [
    Bad(
        "rms-norm-scale-features",
        lambda: rk.rms_norm(x, jnp.ones(5)),
        ValueError,
        r"scale must have shape \(features,\) = \(4,\) for x\.shape=\(2, 4\), got "
        r"scale\.shape=\(5,\)",
    ),
    Bad(
        "rms-norm-scale-broadcastable",
        lambda: rk.rms_norm(x, jnp.ones((1, 4))),
        ValueError,
        r"scale must have shape \(features,\) = \(4,\) .* got scale\.shape=\(1, 4\)",
    ),
    Bad(
        "rms-norm-scale-dtype",
        lambda: rk.rms_norm(x, scale.astype(jnp.bfloat16)),
        TypeError,
        r"scale must have x's dtype \(float32\) or float32, got scale\.dtype=bfloat16",
    ),
    Bad(
        "rms-norm-int-x",
        lambda: rk.rms_norm(x.astype(jnp.int32), scale),
        TypeError,
        r"x must be a floating array, got dtype=int32",
    ),
    Bad(
        "rms-norm-empty-feature-axis",
        lambda: rk.rms_norm(jnp.ones((2, 0)), jnp.ones(0)),
        ValueError,
        r"x must have a non-empty last \(feature\) axis, got x\.shape=\(2, 0\)",
    ),
    Bad(
        "rms-norm-negative-epsilon",
        lambda: rk.rms_norm(x, scale, epsilon=-1.0),
        ValueError,
        r"epsilon must be a finite number > 0, got epsilon=-1\.0",
    ),
    Bad(
        "rms-norm-traced-epsilon",
        lambda: jax.jit(lambda e: rk.rms_norm(x, scale, epsilon=e))(1e-6),
        TypeError,
        r"epsilon must be a real number, got epsilon=.*Tracer",
    ),
    Bad(
        "rms-norm-unknown-impl",
        lambda: rk.rms_norm(x, scale, impl="gpu"),
        ValueError,
        r"impl must be one of \('auto', 'pallas', 'xla'\), got impl='gpu'",
    ),
    Bad(
        "rms-norm-interpret-int",
        lambda: rk.rms_norm(x, scale, interpret=1),
        TypeError,
        r"interpret must be a bool, got interpret=1",
    ),
    Bad(
        "rms-norm-block-of-another-kernel",
        lambda: rk.rms_norm(x, scale, block=rk.SiluMulBlock()),
        TypeError,
        r"block must be a rudax\.kernels\.RowBlock or None, got block=SiluMulBlock",
    ),
    Bad(
        "layer-norm-bias-features",
        lambda: rk.layer_norm(x, scale, jnp.ones(3)),
        ValueError,
        r"bias must have shape \(features,\) = \(4,\) .* got bias\.shape=\(3,\)",
    ),
    Bad(
        "layer-norm-bias-dtype",
        lambda: rk.layer_norm(x, scale, jnp.ones(4, jnp.float16)),
        TypeError,
        r"bias must have x's dtype \(float32\) or float32, got bias\.dtype=float16",
    ),
    Bad(
        "layer-norm-nan-epsilon",
        lambda: rk.layer_norm(x, scale, None, epsilon=float("nan")),
        ValueError,
        r"epsilon must be a finite number > 0, got epsilon=nan",
    ),
    Bad(
        "silu-mul-shapes",
        lambda: rk.silu_mul(x, jnp.ones((2, 5))),
        ValueError,
        r"gate and up must have the same shape, got gate\.shape=\(2, 4\), up\.shape=\(2, 5\)",
    ),
    Bad(
        "silu-mul-broadcastable",
        lambda: rk.silu_mul(jnp.ones((1, 4)), x),
        ValueError,
        r"gate and up must have the same shape, got gate\.shape=\(1, 4\), up\.shape=\(2, 4\)",
    ),
    Bad(
        "silu-mul-dtypes",
        lambda: rk.silu_mul(x, x.astype(jnp.bfloat16)),
        TypeError,
        r"gate and up must have the same dtype, got gate\.dtype=float32, up\.dtype=bfloat16",
    ),
    Bad(
        "silu-mul-int",
        lambda: rk.silu_mul(x.astype(jnp.int32), x.astype(jnp.int32)),
        TypeError,
        r"gate and up must have a floating dtype, got gate\.dtype=int32",
    ),
    Bad(
        "row-block-not-power-of-two",
        lambda: rk.RowBlock(rows=3),
        ValueError,
        r"rows must be a positive power of two, got rows=3",
    ),
    Bad(
        "silu-mul-block-not-power-of-two",
        lambda: rk.SiluMulBlock(size=3),
        ValueError,
        r"size must be a positive power of two, got size=3",
    ),
    Bad(
        "global-norm-int-gradient",
        lambda: rk.global_norm_and_finite([jnp.ones(3, jnp.int32)]),
        TypeError,
        r"gradient \[0\] must have a floating dtype, got dtype=int32",
    ),
    Bad(
        "global-norm-hierarchical-int",
        lambda: rk.global_norm_and_finite([x], hierarchical=1),
        TypeError,
        r"hierarchical must be a bool, got hierarchical=1",
    ),
    # issue 29: a block this large came back as zeros (its reciprocal is subnormal)
    Bad(
        "nf4-magnitude-with-a-subnormal-reciprocal",
        lambda: rk.nf4_quantize(jnp.zeros((2, 64)).at[1, 3].set(1e38)),
        ValueError,
        r"w's block 1 \(flat indices 64 to 127\) holds a magnitude of 1e\+38",
    ),
]

test_bad_input = catalog(CASES)
