"""assert_bitwise_equal: the one comparison every checkpoint test makes of a restored tree."""

import jax
import numpy as np


def assert_bitwise_equal(a, b):
    """Same tree structure; each array leaf of the same dtype, shape and bytes; Python leaves
    (caller state kept in the JSON metadata) of the same type and value."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, str | int | float | bool) and not isinstance(x, np.generic):
            assert type(x) is type(y) and x == y
            continue
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()
