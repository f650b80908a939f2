"""Every optimizer under the moment-dtype rule of rudax/optim/_precision.py, on bf16 parameters.

Buffers are stored in ``moment_dtype`` (None: the parameter's bf16), each update is computed in
the wider of the gradient's dtype and the buffer dtype, and returned in bf16. The reference is
the same optimizer run in fp32 on the fp32 values of the same inputs, its update rounded to bf16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.optim as ro
from tests.optim._harness import assert_bf16_update

# factory(moment_dtype), and the number of buffers it keeps for the harness's four leaves
# (a (5, 3) matrix, a vector, a scalar, a 3-D array).
OPTIMIZERS = {
    "sgd": (lambda md: ro.sgd(0.1, 0.9, nesterov=True, weight_decay=0.1, moment_dtype=md), 4),
    "adam": (lambda md: ro.adam(0.1, weight_decay=0.1, moment_dtype=md), 2 * 4),
    "adamw": (lambda md: ro.adamw(0.1, weight_decay=0.1, moment_dtype=md), 2 * 4),
    "adagrad": (
        lambda md: ro.adagrad(0.1, lr_decay=0.1, weight_decay=0.1, moment_dtype=md),
        4,
    ),
    "rmsprop": (
        lambda md: ro.rmsprop(0.01, momentum=0.9, centered=True, weight_decay=0.1, moment_dtype=md),
        3 * 4,
    ),
    "adan": (lambda md: ro.adan(0.01, weight_decay=0.1, moment_dtype=md), 4 * 4),
    # Newton-Schulz in fp32, so that its own dtype (a separate option) does not blur the check.
    # Muon's momentum for the matrix, AdamW's two moments for the other three leaves.
    "muon": (lambda md: ro.muon(0.02, ns_dtype=jnp.float32, moment_dtype=md), 1 + 2 * 3),
}

# (b) and (c) compute in fp32 from the same fp32 values as the reference, so the first updates
# agree before their one rounding to bf16: within one bf16 ulp (2**-7 relative), the margin for
# two fp32 programs that XLA may fuse differently. (a) computes in bf16: each of the handful of
# roundings on the way (weight decay, moments, root, division, learning rate) is at most half
# an ulp of an intermediate, so the update is within about four bf16 ulps (2**-5) of the
# reference, or of the leaf's largest value where intermediates cancel (g + wd p) or mix a
# matrix's rows (Newton-Schulz).
CASES = {
    "a-bf16-grads-bf16-moments": (
        jnp.bfloat16,
        None,
        jnp.bfloat16,
        dict(rtol=2**-5, leaf_atol=2**-5),
    ),
    "b-bf16-grads-fp32-moments": (jnp.bfloat16, jnp.float32, jnp.float32, dict(rtol=2**-7)),
    "c-fp32-grads-bf16-moments": (jnp.float32, None, jnp.bfloat16, dict(rtol=2**-7)),
}


def fp32_reference(factory):
    """The first update of the optimizer run in fp32 on the fp32 values of the inputs."""

    def expected(params, grads):
        tx = factory(None)
        params, grads = (jax.tree.map(jnp.asarray, t) for t in (params, grads))
        updates, _ = tx.update(grads, tx.init(params), params)
        return jax.tree.map(np.asarray, updates)

    return expected


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_moment_dtype_rule_on_bf16_params(name, case):
    factory, num_buffers = OPTIMIZERS[name]
    grad_dtype, moment_dtype, buffer_dtype, tolerance = CASES[case]
    assert_bf16_update(
        factory(moment_dtype),
        fp32_reference(factory),
        grad_dtype=grad_dtype,
        buffer_dtype=buffer_dtype,
        num_buffers=num_buffers,
        **tolerance,
    )
