"""QLoRA under FSDP: the packed NF4 base sharded like a frozen parameter (FSDP-QLoRA). On 8
simulated devices, ShardingContext.module of LoRALinear layers over NF4Linear bases and of
bare NF4Linear layers computes the one-device outputs and adapter gradients, and gathers the
codes and absmax bit for bit, never cast to the compute dtype.

The reference is the unsharded model on one device, with the sum of the ranks' local losses
written as one loss over the whole batch (tests/sharding/_fsdp_blocks.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

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

# q, v: 256 weights; up, down: 320 = 5 blocks of 64, whose 5 absmax codes over 8 ranks leave
# three ranks with padding only; the offset is a scalar (one element, seven ranks padding).
D, H = 16, 20
ADAPTED = ("q_proj", "v_proj", "down")

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")


def _model():
    model = two_blocks(D, H)
    names = rl.apply_lora(
        model,
        list(ADAPTED),
        rank=2,
        alpha=4.0,
        quantize_base="nf4",
        quantize_untargeted=True,
        rngs=nnx.Rngs(2),
    )
    assert len(names) == 6
    for i, block in enumerate(model["layers"]):
        assert isinstance(block.up, rl.NF4Linear)
        for j, name in enumerate(ADAPTED):  # B as after training
            lora = getattr(block, name)
            assert isinstance(lora.base, rl.NF4Linear)
            lora.lora_b[...] = normal(lora.lora_b.shape, 10 * i + j)
    return model


def _bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def _shard(model, ctx, compute_dtype=None):
    for block in model["layers"]:
        for name in ADAPTED:
            setattr(block, name, ctx.lora(getattr(block, name), compute_dtype=compute_dtype))
        block.up = ctx.module(block.up, compute_dtype=compute_dtype)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_sharded_qlora_gives_the_one_device_outputs_and_adapter_gradients(kind):
    mesh = make_mesh(kind)
    ref = _model()
    model = _model()
    _shard(model, rs.ShardingContext(mesh, AX))
    # The variable types survive sharding: the packed base is Quantized, sharded flat.
    _, quantized, _ = nnx.split(model, rl.Quantized, ...)
    flat = [v for _, v in nnx.to_flat_state(quantized)]
    assert len(flat) == 4 * 8  # codes, absmax codes, scales, offset of 8 layers
    assert {type(v) for v in flat} == {rl.Quantized}
    assert {v.get_value().dtype for v in flat} == {np.dtype(np.uint8), np.dtype(np.float32)}
    assert all(isinstance(v.get_value(), rs.ShardedParameter) for v in flat)

    y, y_ref, got, expected, _ = outputs_and_adapter_grads(ref, model, mesh, D)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    # Each adapter's gradient, reduce-scattered to its shards, unshards to the one-device one.
    assert sorted(got) == sorted(expected) and len(got) == 12
    for path, value in expected.items():
        scale = np.abs(np.asarray(value)).max()
        assert scale > 0, path
        # fp32 sums taken in another order (per rank, then the reduce-scatter).
        np.testing.assert_allclose(
            got[path], value, rtol=1e-5, atol=1e-6 * scale, err_msg=str(path)
        )


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_quantized_storage_is_gathered_bitwise_without_the_compute_dtype(kind):
    mesh = make_mesh(kind)
    ref = _model()
    model = _model()
    _shard(model, rs.ShardingContext(mesh, AX), compute_dtype=jnp.bfloat16)
    block = model["layers"][1]
    modules = {"down": block.down, "up": block.up}
    graph, state = nnx.split(nnx.Dict(modules))

    def gather(state):
        layers = nnx.merge(graph, state)
        out = {}
        for name, sharded in layers.items():
            g = sharded.gathered()
            base = g.base if isinstance(g, rl.LoRALinear) else g
            out[name] = {
                "codes": base.codes[...],
                "absmax_codes": base.absmax_codes[...],
                "absmax_scales": base.absmax_scales[...],
                "absmax_offset": base.absmax_offset[...],
                "bias": base.bias[...],
            }
            if isinstance(g, rl.LoRALinear):
                out[name]["lora_a"] = g.lora_a[...]
        return jax.tree.map(lambda a: a[None], out)  # each rank's copy

    got = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))(state)
    ref_block = ref["layers"][1]
    for name, ref_layer in (("down", ref_block.down.base), ("up", ref_block.up)):
        for field in ("codes", "absmax_codes", "absmax_scales", "absmax_offset"):
            want = np.asarray(getattr(ref_layer, field)[...])
            have = np.asarray(got[name][field])
            assert have.dtype == want.dtype and have.shape == (N, *want.shape), (name, field)
            for r in range(N):  # every rank has the whole value, bit for bit
                np.testing.assert_array_equal(
                    _bits(have[r]), _bits(want), err_msg=f"{name}.{field}"
                )
        # Floating Frozen and LoRAParam values do take the compute dtype.
        assert got[name]["bias"].dtype == jnp.bfloat16
    assert got["down"]["lora_a"].dtype == jnp.bfloat16


def test_parameter_takes_quantized_integer_storage_and_refuses_it_elsewhere():
    ctx = rs.ShardingContext(make_mesh("auto"), AX)
    codes = rl.Quantized(jnp.arange(10, dtype=jnp.uint8))
    sharded = ctx.parameter(codes)
    assert type(sharded) is rl.Quantized
    value = sharded.get_value()
    assert value.dtype == np.uint8 and value.logical_shape == (10,)
    np.testing.assert_array_equal(value.unshard(), np.arange(10, dtype=np.uint8))
    assert ctx.parameter(codes) is sharded  # one per variable
    with pytest.raises(TypeError, match=r"p must hold a floating array, got Frozen"):
        ctx.parameter(rl.Frozen(jnp.ones(3, jnp.uint8)))
    with pytest.raises(TypeError, match=r"nnx\.Param, rudax\.layers\.Frozen or rudax\.layers\.Q"):
        ctx.parameter(nnx.BatchStat(jnp.ones(3)))
