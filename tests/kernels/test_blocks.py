"""rudax.kernels._blocks: every block dataclass and every op's ``block`` argument fail alike."""

import jax.numpy as jnp
import pytest

import rudax.kernels as rk

# Each block class with one of its power-of-two fields.
BLOCKS = [
    (rk.AdamWBlock, "size"),
    (rk.GlobalNormBlock, "max_partials"),
    (rk.NF4MatmulBlock, "block_k"),
    (rk.RowBlock, "rows"),
    (rk.SiluMulBlock, "num_warps"),
]


@pytest.mark.parametrize("block_type, field", BLOCKS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize(
    "value, error, message",
    [
        (6, ValueError, "must be a positive power of two, got {field}=6"),
        (0, ValueError, "must be a positive power of two, got {field}=0"),
        (4.0, TypeError, "must be an int, got {field}=4.0"),
        (True, TypeError, "must be an int, got {field}=True"),
    ],
)
def test_block_fields_fail_alike(block_type, field, value, error, message):
    with pytest.raises(error) as info:
        block_type(**{field: value})
    assert str(info.value) == f"{field} " + message.format(field=field)


@pytest.mark.parametrize(
    "op, args",
    [
        (rk.rms_norm, (jnp.ones((2, 4)), jnp.ones(4))),
        (rk.silu_mul, (jnp.ones(4), jnp.ones(4))),
        (rk.global_norm_and_finite, ({"g": jnp.ones(4)},)),
        (rk.nf4_matmul, (jnp.ones((2, 64)), rk.nf4_quantize(jnp.ones((4, 64))))),
    ],
    ids=["rms_norm", "silu_mul", "global_norm", "nf4_matmul"],
)
def test_wrong_block_type_names_the_expected_one(op, args):
    with pytest.raises(TypeError, match=r"block must be a rudax\.kernels\.\w+Block or None"):
        op(*args, block=rk.AdamWBlock(), impl="xla")
