"""rudax._validation: the argument checks shared by rudax.optim, rudax.layers and rudax.kernels.

The messages are pinned to the letter: each subpackage's users saw them before the checks were
shared, and a wording that only one subpackage used (``>= 0`` against ``>= 0.0``, "or None")
is kept by a parameter, not unified away.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rudax import _validation


def test_scalar_checks():
    _validation.check_in_range("b1", 0.5, 0.0, 1.0)
    _validation.check_in_range("lr", np.float32(0.0), 0.0)
    with pytest.raises(ValueError, match=r"b1 must be in \[0.0, 1.0\), got b1=1.0"):
        _validation.check_in_range("b1", 1.0, 0.0, 1.0)
    with pytest.raises(TypeError, match="must be a scalar"):
        _validation.check_in_range("lr", np.ones(2), 0.0)
    assert _validation.check_positive("epsilon", 1, accept="static") == 1.0
    with pytest.raises(TypeError, match="epsilon=array"):
        _validation.check_positive("epsilon", np.float32(1e-6)[None], accept="static")
    with pytest.raises(ValueError, match="impl must be one of"):
        _validation.check_impl("gpu")
    with pytest.raises(TypeError, match="interpret=1"):
        _validation.check_bool("interpret", 1)


def _call(check, *args, **kwargs):
    return lambda: check(*args, **kwargs)


V = _validation
ERRORS = [
    # Bounds read as the call site gives them.
    (
        _call(V.check_non_negative, "eps", -1.0),
        ValueError,
        "eps must be a finite number >= 0, got eps=-1.0",
    ),
    (
        _call(V.check_in_range, "lr", -1.0, 0.0),
        ValueError,
        "lr must be a finite number >= 0.0, got lr=-1.0",
    ),
    (_call(V.check_positive, "g", 0), ValueError, "g must be a finite number > 0, got g=0"),
    (
        _call(V.check_in_range, "f", 1.0, 1.0, float("inf"), low_inclusive=False),
        ValueError,
        "f must be in (1.0, inf), got f=1.0",
    ),
    (
        _call(V.check_in_range, "d", 1.5, 0.0, 1.0, high_inclusive=True),
        ValueError,
        "d must be in [0.0, 1.0], got d=1.5",
    ),
    (_call(V.check_finite, "x", float("nan")), ValueError, "x must be finite, got x=nan"),
    # The three kinds of scalar.
    (_call(V.check_positive, "a", "1"), TypeError, "a must be a real number, got a='1'"),
    (_call(V.check_positive, "a", True), TypeError, "a must be a real number, got a=True"),
    (
        _call(V.check_positive, "a", np.ones(2)),
        TypeError,
        "a must be a scalar, got shape (2,): a=array([1., 1.])",
    ),
    (
        _call(V.check_positive, "a", np.ones(2), accept="concrete"),
        TypeError,
        "a must be a concrete scalar, got a=array([1., 1.])",
    ),
    (
        _call(V.check_positive, "a", np.array(1.0), accept="static"),
        TypeError,
        "a must be a real number, got a=array(1.)",
    ),
    # Ints, flags, impl.
    (_call(V.check_positive_int, "n", 2.0), TypeError, "n must be an int, got n=2.0"),
    (_call(V.check_positive_int, "n", 0), ValueError, "n must be a positive int, got n=0"),
    (
        _call(V.check_power_of_two, "size", 6),
        ValueError,
        "size must be a positive power of two, got size=6",
    ),
    (
        _call(V.check_bool, "flag", np.True_, allow_numpy=False),
        TypeError,
        "flag must be a bool, got flag=np.True_",
    ),
    (
        _call(V.check_impl, np.array("xla")),
        ValueError,
        "impl must be one of ('auto', 'pallas', 'xla'), got impl=array('xla', dtype='<U3')",
    ),
    # Dtypes: rudax.optim's wording names None, rudax.layers' does not.
    (
        _call(V.float_dtype, "dt", jnp.int32, none_in_message=True),
        TypeError,
        "dt must be a floating dtype or None, got dt=<class 'jax.numpy.int32'>",
    ),
    (
        _call(V.float_dtype, "dt", "nonsense"),
        TypeError,
        "dt must be a floating dtype, got dt='nonsense'",
    ),
    (
        _call(V.float_dtype, "dt", None, allow_none=False),
        TypeError,
        "dt must be a floating dtype, got dt=None",
    ),
    # Leaves, by path.
    (
        _call(V.check_floating_leaves, "gradient", {"a": [jnp.ones(1), jnp.ones(1, jnp.int32)]}),
        TypeError,
        "gradient ['a'][1] must have a floating dtype, got dtype=int32",
    ),
]


@pytest.mark.parametrize("call, error, message", ERRORS, ids=range(len(ERRORS)))
def test_messages(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message


def test_values_returned_and_tracers():
    assert V.check_positive("e", np.float32(0.5), accept="concrete") == 0.5
    assert V.check_bool("flag", np.True_) is None
    assert V.float_dtype("dt", "bfloat16") == jnp.bfloat16 and V.float_dtype("dt", None) is None
    leaves = V.check_floating_leaves("p", {"b": jnp.ones(2), "a": 1.0})
    assert leaves[0] == 1.0 and leaves[1].shape == (2,)
    assert (
        jnp.dtype(jnp.bfloat16) in V.STORAGE_DTYPES and jnp.dtype(jnp.int8) not in V.STORAGE_DTYPES
    )

    seen = []

    def f(x):
        seen.append(V.check_positive("lr", x))  # a traced hyperparameter passes unchecked
        with pytest.raises(TypeError, match="lr must be a concrete scalar"):
            V.check_positive("lr", x, accept="concrete")
        with pytest.raises(TypeError, match="lr must be a real number"):
            V.check_positive("lr", x, accept="static")
        return x

    jax.jit(f)(-1.0)
    assert seen == [None]


def test_power_of_two_fields_names_the_first_bad_field():
    @dataclasses.dataclass(frozen=True)
    class Block:
        size: int = 4
        num_warps: int = 2

        def __post_init__(self):
            V.check_power_of_two_fields(self)

    Block()
    with pytest.raises(
        ValueError, match="num_warps must be a positive power of two, got num_warps=3"
    ):
        Block(num_warps=3)
    with pytest.raises(TypeError, match="size must be an int, got size=True"):
        Block(size=True, num_warps=3)
