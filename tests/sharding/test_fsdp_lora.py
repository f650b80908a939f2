"""LoRA from rudax.layers.apply_lora under FSDP: ShardingContext.module(lora_linear) on 8
simulated devices computes the one-device outputs and adapter gradients.

The reference is the unsharded model on one device, with the sum of the ranks' local losses
written as one loss over the whole batch.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
import rudax.sharding as rs
from tests.layers._random import normal
from tests.sharding._fsdp_blocks import (
    AX,
    N,
    make_mesh,
    outputs_and_adapter_grads,
    two_blocks,
)

D, H = 6, 10

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")


def _model():
    model = two_blocks(D, H)
    names = rl.apply_lora(model, ["q_proj", "v_proj", "down"], rank=2, alpha=4.0, rngs=nnx.Rngs(2))
    assert len(names) == 6
    for i, (_, lora) in enumerate(sorted(_loras(model).items())):  # B as after training
        lora.lora_b[...] = normal(lora.lora_b.shape, i)
    return model


def _loras(model):
    return {p: m for p, m in nnx.iter_graph(model) if isinstance(m, rl.LoRALinear)}


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_sharded_lora_layers_give_the_one_device_outputs_and_adapter_gradients(kind):
    mesh = make_mesh(kind)
    ref = _model()
    model = _model()
    ctx = rs.ShardingContext(mesh, AX)
    for block in model["layers"]:
        for name in ("q_proj", "v_proj", "down"):
            setattr(block, name, ctx.module(getattr(block, name)))
        block.up = ctx.linear(block.up)
    # The variable types survive sharding: LoRAParam still selects exactly the adapters.
    _, adapters, _ = nnx.split(model, rl.LoRAParam, ...)
    flat = [v for _, v in nnx.to_flat_state(adapters)]
    assert len(flat) == 12 and {type(v) for v in flat} == {rl.LoRAParam}
    assert all(isinstance(v.get_value(), rs.ShardedParameter) for v in flat)

    y, y_ref, got, expected, rows = outputs_and_adapter_grads(ref, model, mesh, D)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    # Each adapter's gradient, reduce-scattered to its shards, unshards to the one-device one.
    assert sorted(got) == sorted(expected)
    for path, value in expected.items():
        scale = np.abs(np.asarray(value)).max()
        assert scale > 0, path  # B non-zero, so A learns too
        # fp32 sums over the batch's 2N*3 = 48 rows of terms of size ~scale, taken in another
        # order (per rank, then the reduce-scatter): each side is within n*u*sum|terms| of the
        # exact sum (u = 2**-24), so the two within 2*n*u*scale, relative to the terms and not
        # to a cancelling result. Measured: up to 2.1e-6 * scale, on an AVX-512 CPU whose
        # XLA dots sum in yet another order (the bound: 5.7e-6).
        np.testing.assert_allclose(
            got[path], value, rtol=1e-5, atol=2 * rows * 2**-24 * scale, err_msg=str(path)
        )
