"""rudax.kernels._checks: one set of argument checks, the same errors from every op and block."""

import jax.numpy as jnp
import numpy as np
import pytest

import rudax.kernels as rk
from rudax.kernels import _checks

# Each block class with one of its power-of-two fields.
BLOCKS = [
    (rk.AdamWBlock, "size"),
    (rk.GlobalNormBlock, "max_partials"),
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
    ],
    ids=["rms_norm", "silu_mul", "global_norm"],
)
def test_wrong_block_type_names_the_expected_one(op, args):
    with pytest.raises(TypeError, match=r"block must be a rudax\.kernels\.\w+Block or None"):
        op(*args, block=rk.AdamWBlock(), impl="xla")


def test_scalar_checks():
    _checks.check_range("b1", 0.5, 0.0, 1.0)
    _checks.check_range("lr", np.float32(0.0), 0.0)
    with pytest.raises(ValueError, match=r"b1 must be in \[0.0, 1.0\), got b1=1.0"):
        _checks.check_range("b1", 1.0, 0.0, 1.0)
    with pytest.raises(TypeError, match="must be a scalar"):
        _checks.check_range("lr", np.ones(2), 0.0)
    assert _checks.check_static_positive("epsilon", 1) == 1.0
    with pytest.raises(TypeError, match="epsilon=array"):
        _checks.check_static_positive("epsilon", np.float32(1e-6)[None])
    with pytest.raises(ValueError, match="impl must be one of"):
        _checks.check_impl("gpu")
    with pytest.raises(TypeError, match="interpret=1"):
        _checks.check_bool("interpret", 1)
